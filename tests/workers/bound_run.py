"""A dist_sync worker (rank and TENSORKV_BIGARRAY_BOUND from the environment): inits 'w', 40
zeros (float32), pushes ones and pulls it; prints "ok V" (its first element) or, when a call
raises, "error Class: message"."""
import numpy as np

import tensorkv

with tensorkv.create("dist_sync") as kv:
    try:
        kv.init("w", np.zeros(40, np.float32))
        kv.push("w", np.ones(40, np.float32))
        print(f"ok {kv.pull('w')[0]:g}", flush=True)
    except tensorkv.KVStoreError as error:
        print(f"error {type(error).__name__}: {error}", flush=True)
