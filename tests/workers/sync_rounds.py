"""A dist_sync worker: ROUNDS rounds of push/pull on one key, a list of keys, several
devices and a scalar, each value checked against the sum over all workers."""
import sys

import numpy as np

import tensorkv

rounds = int(sys.argv[1])
kv = tensorkv.create("dist_sync")
n, rank = kv.num_workers, kv.rank
total = n * (n + 1) // 2  # sum of rank + 1 over all ranks
shape = (2, 3)
# Every worker calls init; rank 0's value is the one stored.
kv.init([3, 5, 7, 9], [np.full(shape, 7.0 if rank == 0 else 100.0 + rank, np.float32),
                       np.zeros(4), np.zeros(4), np.zeros((), np.int64)])
a = np.zeros(shape, np.float32)
kv.pull(3, out=a)
assert (a == 7).all(), a
for t in range(1, rounds + 1):
    kv.push(3, np.full(shape, (rank + 1) * t, np.float32))
    kv.pull(3, out=a)
    assert (a == total * t).all(), (t, a)
    kv.push([5, 7], [[np.full(4, rank + 1.0)] * 2, np.full(4, float(t))])
    v5, v7 = kv.pull([5, 7])
    assert (v5 == 2 * total).all() and (v7 == n * t).all(), (t, v5, v7)
    value = np.array(rank * t, np.int64)
    kv.pushpull(9, value)  # pulls back into value, as MXNet's
    assert value == t * n * (n - 1) // 2, (t, value)
kv.barrier()
print("ok", rank)
