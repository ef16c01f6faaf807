"""dist_sync with a worker that never pushes: rank 0 pushes and pulls and must get
RoundAbortedError; the stored value stays as it was; rank 1 only calls init."""
import numpy as np

import tensorkv

kv = tensorkv.create("dist_sync")
kv.init("x", np.ones(3))
if kv.rank == 0:
    kv.push("x", np.full(3, 5.0))
    try:
        kv.pull("x")
    except tensorkv.RoundAbortedError as error:
        print("aborted:", error)
    else:
        raise AssertionError("pull returned without the other worker")
    assert (kv.pull("x") == 1).all()  # the round's pushes were discarded
    try:
        kv.barrier()
    except tensorkv.RoundAbortedError as error:
        print("barrier:", error)
print("ok", kv.rank)
