"""A dist_sync worker for several servers: many keys of many shapes and dtypes, and one
2,000,000-element value split in slices over the servers; every value checked."""
import numpy as np

import tensorkv

kv = tensorkv.create("dist_sync")
n, rank = kv.num_workers, kv.rank
keys = list(range(200))
shapes = [(k % 7 + 1, k % 5 + 1) for k in keys]
dtypes = [np.float32, np.float64, np.int32, np.float16]
values = [np.full(s, k, dtypes[k % 4]) for k, s in zip(keys, shapes)]
big = np.arange(2_000_000, dtype=np.float32)
kv.init(keys + [1000], values + [big])
assert all((v == k).all() for k, v in zip(keys, kv.pull(keys)))
assert np.array_equal(kv.pull(1000), big)
for t in (1, 2):
    kv.push(keys + [1000], [v * (rank + t) for v in values] + [big * (rank + t)])
    factor = n * (n - 1) // 2 + n * t
    pulled = kv.pull(keys + [1000])
    for k, v, want in zip(keys, pulled, values):
        assert v.dtype == want.dtype and (v == want * factor).all(), (k, v)
    assert np.array_equal(pulled[-1], big * factor)
    out = np.zeros_like(big)
    kv.pull(1000, out=out)
    assert np.array_equal(out, big * factor)
print("ok", rank)
