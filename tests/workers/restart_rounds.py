"""A dist_sync worker that goes on through a server restart: SGD with learning rate 1 on the
servers over KEYS (the last one larger than bigarray_bound, so sliced over every server),
every element starting at 1000; each round pushes 1 everywhere, pulls, and computes for
COMPUTE seconds, for argv[1] rounds. Prints "round T" after each round, then {"weights":
[each key's value]}."""
import json
import sys
import time

import numpy as np

import tensorkv

KEYS = {"a": 4, "b": 4, "c": 4, "big": 16}
COMPUTE = 0.2
rounds = int(sys.argv[1])
with tensorkv.create("dist_sync", bigarray_bound=8, timeout=60) as kv:
    kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
    kv.init(list(KEYS), [np.full(size, 1000, np.float32) for size in KEYS.values()])
    for t in range(1, rounds + 1):
        kv.push(list(KEYS), [np.ones(size, np.float32) for size in KEYS.values()])
        weights = kv.pull(list(KEYS))
        print("round", t, flush=True)
        time.sleep(COMPUTE)
    print(json.dumps({"weights": [w.tolist() for w in weights]}))
