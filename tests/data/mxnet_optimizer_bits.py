"""Writes tests/data/mxnet_optimizer_bits.json: what MXNet 1.9.1's 'local' store holds after 8
pushes of fixed gradients through each optimizer below (float32, as hex). Run it with MXNet
installed (`make .venv-mxnet/.installed`, then `.venv-mxnet/bin/python` on this file); the test
(tests/test_optimizer.py) runs the same pushes through tensorkv and compares the bits."""
import json

import mxnet as mx
import numpy as np

CASES = [
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.1, "rescale_grad": 0.5, "clip_gradient": 2.0}),
    ("sgd", {"learning_rate": 0.1, "wd": 0.1}),
    ("sgd", {"learning_rate": 0.1, "wd": 0.1, "rescale_grad": 0.25}),
    ("sgd", {"learning_rate": 0.1, "wd": 0.1, "rescale_grad": 0.25, "clip_gradient": 0.3}),
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.1, "rescale_grad": 0.25}),
    ("nag", {"learning_rate": 0.1, "momentum": 0.0, "wd": 0.1, "rescale_grad": 0.25}),
    ("nag", {"learning_rate": 0.1, "momentum": 0.0, "wd": 0.1, "rescale_grad": 0.25, "clip_gradient": 0.3}),
    ("nag", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.1, "rescale_grad": 0.25}),
    ("adam", {"learning_rate": 0.01, "wd": 0.1, "rescale_grad": 0.5, "clip_gradient": 2.0}),
    ("adam", {"learning_rate": 0.01, "wd": 0.1, "rescale_grad": 0.25}),
    ("adam", {"learning_rate": 0.03, "wd": 0.1}),
    ("adagrad", {"learning_rate": 0.1, "wd": 0.1, "rescale_grad": 0.5}),
    ("adagrad", {"learning_rate": 0.1, "wd": 0.1, "rescale_grad": 0.25, "clip_gradient": 0.3}),
    ("adagrad", {"learning_rate": 0.1, "wd": 0.1, "eps": 1e-3}),
    ("rmsprop", {"learning_rate": 0.01, "wd": 0.1, "gamma1": 0.9}),
    ("rmsprop", {"learning_rate": 0.01, "wd": 0.1, "gamma1": 0.9, "rescale_grad": 0.25, "clip_gradient": 0.3}),
    ("rmsprop", {"learning_rate": 0.01, "wd": 0.1, "gamma1": 0.95, "rescale_grad": 0.25, "clip_weights": 0.5}),
    ("rmsprop", {"learning_rate": 0.01, "wd": 0.1, "gamma1": 0.95, "gamma2": 0.9, "centered": True,
                 "clip_weights": 5.0}),
    ("rmsprop", {"learning_rate": 0.01, "gamma1": 0.95, "gamma2": 0.9, "centered": True}),
    ("rmsprop", {"learning_rate": 0.01, "wd": 0.1, "gamma1": 0.8, "gamma2": 0.7, "centered": True,
                 "rescale_grad": 0.25, "clip_gradient": 0.3}),
    ("signum", {"learning_rate": 0.01, "momentum": 0.9, "wd": 0.1, "wd_lh": 0.01}),
    ("signum", {"learning_rate": 0.01, "momentum": 0.95, "wd": 0.1, "wd_lh": 0.01, "rescale_grad": 0.25,
                "clip_gradient": 0.3}),
    ("signum", {"learning_rate": 0.01, "momentum": 0.0, "wd": 0.1}),
]


def main():
    rng = np.random.RandomState(0)
    weight = rng.randn(5).astype(np.float32)
    grads = [rng.randn(5).astype(np.float32) for _ in range(8)]
    expected = []
    for name, params in CASES:
        kv = mx.kv.create("local")
        kv.set_optimizer(mx.optimizer.create(name, **params))
        kv.init(0, mx.nd.array(weight))
        for grad in grads:
            kv.push(0, mx.nd.array(grad))
        out = mx.nd.zeros(5)
        kv.pull(0, out=out)
        expected.append([float(x).hex() for x in out.asnumpy()])
    hexes = lambda array: [float(x).hex() for x in array]  # noqa: E731
    print(json.dumps({"mxnet": mx.__version__, "weight": hexes(weight), "grads": [hexes(g) for g in grads],
                      "cases": [{"name": name, "params": params, "expected": bits}
                                for (name, params), bits in zip(CASES, expected)]}, indent=1))


if __name__ == "__main__":
    main()
