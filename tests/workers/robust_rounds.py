"""A dist_sync worker of the robustness suite: SGD with learning rate 1 on the servers over
KEYS (the last one larger than bigarray_bound, so sliced over every server), every element
starting at 1000; each round pushes a gradient of 1 everywhere and pulls. After each round it
checks the pulled values against 1000 - num_workers x round (exit 3 on a mismatch: an update
lost or applied twice) and prints "round T"; at the end {"weights": [each key's value]}.
argv: rounds; 'check' or 'nocheck' (a server restart loses rounds, so values are then
checked by the test); the seconds each round computes (sleeps) after its pull."""
import json
import sys
import time

import numpy as np

import tensorkv

KEYS = {"a": 4, "b": 4, "big": 16}
rounds, check, compute = int(sys.argv[1]), sys.argv[2] == "check", float(sys.argv[3])
with tensorkv.create("dist_sync", bigarray_bound=8, timeout=60) as kv:
    kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
    kv.init(list(KEYS), [np.full(size, 1000, np.float32) for size in KEYS.values()])
    for t in range(1, rounds + 1):
        kv.push(list(KEYS), [np.ones(size, np.float32) for size in KEYS.values()])
        weights = kv.pull(list(KEYS))
        expected = 1000 - kv.num_workers * t
        if check and any((w != expected).any() for w in weights):
            sys.exit(f"round {t}: pulled {[w.tolist() for w in weights]}, expected every element {expected}")
        print("round", t, flush=True)
        time.sleep(compute)
    print(json.dumps({"weights": [w.tolist() for w in weights]}))
