"""A dist_sync worker for the server-wide budget of bytes in flight (test_limits): every
worker pushes, then pulls, a value of argv[1] MiB, argv[2] rounds, all at once (after a
barrier); each round's value is checked exactly."""
import sys

import numpy as np

import tensorkv

mib, rounds = int(sys.argv[1]), int(sys.argv[2])
kv = tensorkv.create("dist_sync", timeout=300)
n, rank = kv.num_workers, kv.rank
shape = (mib << 18,)  # float32
kv.init("w", np.zeros(shape, np.float32))
out = np.empty(shape, np.float32)
for round_ in range(1, rounds + 1):
    value = np.full(shape, rank + round_, np.float32)
    kv.barrier()  # every worker's push at once
    kv.push("w", value)
    kv.pull("w", out=out)
    want = n * (n - 1) // 2 + n * round_  # the sum of this round's pushes replaces the value
    assert (out == want).all(), (round_, out[:4], want)
kv.close()
print("ok", rank)
