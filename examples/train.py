"""Data-parallel training with a tensorkv server: each worker fits the same linear model
to its own shard of the data, and the server sums their gradients and applies SGD.

Run two workers and one server together (tensorkv-launch sets TENSORKV_SERVERS,
TENSORKV_RANK and TENSORKV_NUM_WORKERS for each worker)::

    .venv/bin/tensorkv-launch -n 2 -s 1 .venv/bin/python examples/train.py

or start a server yourself (``make server SERVER_ARGS="--num-workers 2"``) and run this
file twice with ``TENSORKV_SERVERS=127.0.0.1:50051``.
"""
import numpy as np

import tensorkv

FEATURES, SAMPLES, STEPS = 8, 256, 100
TRUE_W = np.arange(1, FEATURES + 1, dtype=np.float32)

with tensorkv.create('dist_sync') as kv:        # the rank goes back to the server on exit
    rng = np.random.default_rng(kv.rank)       # this worker's shard of the data
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    y = x @ TRUE_W

    w = np.zeros(FEATURES, np.float32)
    kv.init('w', w)                            # every worker calls init; rank 0's value is stored
    kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=0.1, momentum=0.9,
                                            rescale_grad=1.0 / kv.num_workers))
    for step in range(STEPS):
        error = x @ w - y
        grad = x.T @ error / SAMPLES           # the gradient of half the mean squared error
        kv.push('w', grad)                     # summed over all workers, one SGD step per round
        kv.pull('w', out=w)                    # waits for the round, then holds the new weights
        if step % 20 == 19:
            print(f"rank {kv.rank} step {step + 1}: loss {0.5 * float(np.mean(error ** 2)):.6f}")
    print(f"rank {kv.rank} done: |w - true w| = {float(np.linalg.norm(w - TRUE_W)):.6f}")
