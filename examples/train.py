"""Data-parallel training with a tensorkv server: each worker fits the same linear model
to its own shard of the data, and the server sums their gradients and applies SGD with
momentum (``--optimizer adam``: Adam).

Run two workers and one server together (tensorkv-launch sets TENSORKV_SERVERS,
TENSORKV_RANK and TENSORKV_NUM_WORKERS for each worker)::

    .venv/bin/tensorkv-launch -n 2 -s 1 .venv/bin/python examples/train.py

or start a server yourself (``make server SERVER_ARGS="--num-workers 2"``) and run this
file twice with ``TENSORKV_SERVERS=127.0.0.1:50051``.

``--steps N`` trains N rounds (default 100). Workers started again with
``TENSORKV_IF_EXISTS=resume`` go on with the run the servers hold (on the same servers, or
on those ``tensorkv reshard`` moved it to): ``init`` keeps its weights, which the pull after
it fetches, and ``set_optimizer`` of the same optimizer keeps its states.
``--fingerprint``: rank 0 ends with a SHA-256 of the weights and one of the optimizer states,
to compare runs bit for bit (``make cluster-reshard`` compares a moved run with one that was not).
"""
import argparse
import hashlib
import os
import tempfile

import numpy as np

import tensorkv

FEATURES, SAMPLES = 8, 256
TRUE_W = np.arange(1, FEATURES + 1, dtype=np.float32)

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=100, help="rounds to train (default 100)")
parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                    help="the servers' optimizer: SGD with momentum (default) or Adam")
parser.add_argument("--fingerprint", action="store_true", help="rank 0 prints a SHA-256 of the weights and states")
args = parser.parse_args()

with tensorkv.create('dist_sync') as kv:        # the rank goes back to the server on exit
    rng = np.random.default_rng(kv.rank)       # this worker's shard of the data
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    y = x @ TRUE_W

    w = np.zeros(FEATURES, np.float32)
    kv.init('w', w)                            # every worker calls init; rank 0's value is stored
    kv.pull('w', out=w)                        # that value (or a resumed run's weights) on every worker
    if args.optimizer == 'adam':
        optimizer = tensorkv.optimizer.Adam(learning_rate=0.1, rescale_grad=1.0 / kv.num_workers)
    else:
        optimizer = tensorkv.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=1.0 / kv.num_workers)
    kv.set_optimizer(optimizer)
    for step in range(args.steps):
        error = x @ w - y
        grad = x.T @ error / SAMPLES           # the gradient of half the mean squared error
        kv.push('w', grad)                     # summed over all workers, one optimizer step per round
        kv.pull('w', out=w)                    # waits for the round, then holds the new weights
        if step % 20 == 19:
            print(f"rank {kv.rank} step {step + 1}: loss {0.5 * float(np.mean(error ** 2)):.6f}")
    print(f"rank {kv.rank} done: |w - true w| = {float(np.linalg.norm(w - TRUE_W)):.6f}")
    if args.fingerprint and kv.rank == 0:
        with tempfile.TemporaryDirectory() as scratch:
            kv.save_optimizer_states(os.path.join(scratch, 'states'))
            with np.load(os.path.join(scratch, 'states')) as saved:   # an .npz archive, not its bytes (dated)
                states = hashlib.sha256(b''.join(saved[name].tobytes() for name in sorted(saved.files)))
        print(f"rank 0 fingerprint: weights {hashlib.sha256(w.tobytes()).hexdigest()} "
              f"optimizer states {states.hexdigest()}")
