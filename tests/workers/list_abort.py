"""dist_sync, 2 workers, round timeout 2 s: rank 0 pushes the list [a, b, c], rank 1 only 'a'.
The round of 'a' completes; those of 'b' and 'c' (opened by the same push, which arms one
timer for them) abort, leaving their values as they were; later rounds of all three
complete, and a timer of an earlier round never aborts them."""
import time

import numpy as np

import tensorkv

KEYS = ["a", "b", "c"]
kv = tensorkv.create("dist_sync")
kv.init(KEYS, [np.ones(3, np.float32)] * 3)
if kv.rank == 0:
    kv.push(KEYS, [np.full(3, 5.0, np.float32)] * 3)
    assert (kv.pull("a") == 6).all()
    try:
        kv.pull(["b", "c"])
    except tensorkv.RoundAbortedError as error:
        print("aborted:", error)
    else:
        raise AssertionError("pull of b, c returned without rank 1's pushes")
    assert all((value == 1).all() for value in kv.pull(["b", "c"]))  # the round's pushes were discarded
else:
    kv.push("a", np.full(3, 1.0, np.float32))
    assert (kv.pull("a") == 6).all()
    time.sleep(3)  # past the round timeout: rank 0 has seen b and c abort
kv.barrier()
for step in range(3):
    kv.push(KEYS, [np.full(3, 10.0 * step + kv.rank, np.float32)] * 3)
    for value in kv.pull(KEYS):
        assert (value == 20.0 * step + 1).all(), (step, value)
    time.sleep(1.5)  # the next rounds open after the timeout of this one would have fired
print("ok", kv.rank)
