"""A dist_sync worker of the robustness suite: SGD with learning rate 1 on the servers over
KEYS (the last one larger than bigarray_bound, so sliced over every server), every element
starting at 1000; each round pushes a gradient of 1 everywhere, the small keys in one list
call (packed: tensorkv.wire.packed, from 4 values per server; fused from round 2: tensorkv.stores.fusion)
and the large one in another, and pulls them all (in even rounds the small ones in one call
into arrays of their own, fused). After each round it
checks the pulled values against 1000 - num_workers x round (exit 3 on a mismatch: an update
lost or applied twice) and prints "round T"; at the end {"weights": [each key's value]}.
argv: rounds; 'check' or 'nocheck' (a server restart loses rounds, so values are then
checked by the test); the seconds each round computes (sleeps) after its pull."""
import json
import sys
import time

import os

import numpy as np

os.environ.setdefault("TENSORKV_PACK_MIN_VALUES", "4")
import tensorkv  # noqa: E402 (its stores read TENSORKV_PACK_MIN_VALUES when created)

KEYS = {"a": 4, "b": 4, **{f"p{i}": 2 for i in range(12)}, "big": 16}
SMALL = [key for key in KEYS if key != "big"]
rounds, check, compute = int(sys.argv[1]), sys.argv[2] == "check", float(sys.argv[3])
with tensorkv.create("dist_sync", bigarray_bound=8, timeout=60) as kv:
    kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
    kv.init(list(KEYS), [np.full(size, 1000, np.float32) for size in KEYS.values()])
    for t in range(1, rounds + 1):
        kv.push(SMALL, [np.ones(KEYS[key], np.float32) for key in SMALL])
        kv.push("big", np.ones(KEYS["big"], np.float32))
        if t % 2:
            weights = kv.pull(list(KEYS))
        else:  # the small keys into arrays of their own: fused after round 1 (tensorkv.stores.fusion)
            outs = [np.empty(KEYS[key], np.float32) for key in SMALL]
            kv.pull(SMALL, out=outs)
            weights = outs + [kv.pull("big")]
        expected = 1000 - kv.num_workers * t
        if check and any((w != expected).any() for w in weights):
            sys.exit(f"round {t}: pulled {[w.tolist() for w in weights]}, expected every element {expected}")
        print("round", t, flush=True)
        time.sleep(compute)
    print(json.dumps({"weights": [w.tolist() for w in weights]}))
