"""dist_sync job for tests/test_ctl.py: keys 'weight' (60x50 float32, sliced over the servers
when TENSORKV_BIGARRAY_BOUND is below 3000) and 'bias' (4 float64), two rounds of pushes,
then the store stays open (the run registered) until the file argv[2] exists (60 s at most);
argv[1]/ready-RANK says the rounds are done."""
import sys
import time
from pathlib import Path

import numpy as np

import tensorkv

directory, stop = Path(sys.argv[1]), Path(sys.argv[2])
with tensorkv.create("dist_sync") as kv:
    kv.init(["weight", "bias"], [np.zeros((60, 50), np.float32), np.zeros(4)])
    for t in (1, 2):
        kv.push("weight", np.arange(3000, dtype=np.float32).reshape(60, 50) * (kv.rank + 1) / 7 - t)
        kv.push("bias", np.array([-1.5, 0.0, 2.0, 4.0]) * (kv.rank + t))
        kv.pull(["weight", "bias"])
    (directory / f"ready-{kv.rank}").touch()
    deadline = time.monotonic() + 60
    while not stop.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
