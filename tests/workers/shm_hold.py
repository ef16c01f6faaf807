"""A dist_sync worker that moves a 4 MiB value through shared memory, prints the name of its
region, then waits to be killed (its stdin closing ends it otherwise)."""
import sys

import numpy as np

import tensorkv

kv = tensorkv.create("dist_sync")
value = np.arange(1 << 20, dtype=np.float32)
kv.init(0, value)
kv.push(0, value * 2)
assert np.array_equal(kv.pull(0), value * 2)
region = kv._sessions[0].region
print(region.name if region is not None else "none", flush=True)
sys.stdin.read()
