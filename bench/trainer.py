"""The Trainer's rows of `make bench`: Trainer.step() next to one raw list push + pull.

A ResNet-50-sized parameter set (torchvision's resnet50: 161 float32 tensors, 25,557,032
floats, about 102 MB) on 'dist_sync' with one worker (this process) and a real server
process, over the TCP-only path (transport='tcp', as a client on another host), SGD with
momentum on the server. Rows, medians in ms, measured alternately in the same run on the
same store and keys:

  * raw: ``kv.push(keys, grads)`` then ``kv.pull(keys, out=weights)``;
  * ``trainer.step(grads=grads)`` (batch_size 1: the same two calls);
  * ``trainer.step(32, grads=grads)`` (each gradient scaled by 1/32 on the worker first).

The goal (issue 18): Trainer.step() within 10% of the raw push + pull. After the clock
stops, the weights the Trainer pulled are checked against a fresh pull: a mismatch fails
the bench with exit status 2. Writes <out-dir>/trainer.{json,md} (trainer-quick.* with
--quick: 3 repeats in place of 10).
"""
import os
import statistics
import sys
import time

import numpy as np

import tensorkv

import common
from run import server

GOAL = 1.10  # Trainer.step() / raw push + pull


def resnet50_shapes():
    """{name: shape} of torchvision's resnet50 parameters: convolutions, batch-norm scales
    and shifts, and the classifier."""
    shapes = {"conv1.weight": (64, 3, 7, 7), "bn1.weight": (64,), "bn1.bias": (64,)}
    channels = 64
    for layer, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for block in range(blocks):
            prefix = f"layer{layer}.{block}"
            convs = [(width, channels, 1, 1), (width, width, 3, 3), (4 * width, width, 1, 1)]
            for index, shape in enumerate(convs, start=1):
                shapes[f"{prefix}.conv{index}.weight"] = shape
                shapes[f"{prefix}.bn{index}.weight"] = shapes[f"{prefix}.bn{index}.bias"] = shape[:1]
            if block == 0:
                shapes[f"{prefix}.downsample.0.weight"] = (4 * width, channels, 1, 1)
                shapes[f"{prefix}.downsample.1.weight"] = shapes[f"{prefix}.downsample.1.bias"] = (4 * width,)
            channels = 4 * width
    shapes["fc.weight"], shapes["fc.bias"] = (1000, 2048), (1000,)
    return shapes


def measure(repeats, logdir):
    """{row: median seconds} and whether the pulled weights checked out."""
    shapes = resnet50_shapes()
    assert len(shapes) == 161 and sum(int(np.prod(s)) for s in shapes.values()) == 25_557_032
    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}
    grads = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}
    keys = list(shapes)
    with server(1, dict(os.environ), logdir) as address, \
            tensorkv.create("dist_sync", servers=address, rank=0, num_workers=1, transport="tcp") as kv:
        trainer = tensorkv.Trainer(weights, kv, tensorkv.optimizer.SGD(learning_rate=1e-4, momentum=0.9))
        trainer.step(grads=grads)  # the first step initializes the keys

        def raw():
            kv.push(keys, [grads[k] for k in keys])
            kv.pull(keys, out=[weights[k] for k in keys])

        rows = {"raw push + pull": raw, "Trainer.step()": lambda: trainer.step(grads=grads),
                "Trainer.step(32)": lambda: trainer.step(32, grads=grads)}
        times = {name: [] for name in rows}
        for _ in range(repeats + 1):  # the first round warms up
            for name, op in rows.items():
                start = time.perf_counter()
                op()
                times[name].append(time.perf_counter() - start)
        fresh = kv.pull(keys)
        ok = all(np.array_equal(weights[k], value) for k, value in zip(keys, fresh))
    return {name: statistics.median(values[1:]) for name, values in times.items()}, ok


def markdown(medians, command):
    raw = medians["raw push + pull"]
    lines = [f"`{command}`: 161 float32 tensors, 25,557,032 floats, dist_sync over TCP, 1 worker, medians; "
             f"goal: Trainer.step() <= {GOAL:.2f}x raw.", "", "| row | ms | x raw |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {seconds * 1e3:.1f} | {seconds / raw:.3f} |" for name, seconds in medians.items()]
    return "\n".join(lines) + "\n"


def main(argv=None):
    return common.run_ratio_bench(
        __doc__, argv, "trainer", measure, (3, 10), "the Trainer's weights differ from a fresh pull", markdown,
        lambda medians: medians["Trainer.step()"] / medians["raw push + pull"], GOAL, lambda ratio: ratio <= GOAL)


if __name__ == "__main__":
    sys.exit(main())
