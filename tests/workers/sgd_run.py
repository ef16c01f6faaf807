"""One worker of a dist_sync run: SGD with momentum on the servers over three keys (int or
str keys: argv[1]) for argv[2] rounds; the gradient of key i in round t is
(i + 1) * BASE * (rank + t). Prints {"weights": [each key's value]} after the last round,
or {"error": class name, "message": ...} when init raises a KVStoreError."""
import json
import sys

import numpy as np

import tensorkv

BASE = np.array([1, -1, 2, 0.5], np.float32)
kind, rounds = sys.argv[1], int(sys.argv[2])
keys = [0, 1, 2] if kind == "int" else ["a", "b", "c"]
with tensorkv.create("dist_sync") as kv:
    kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5))
    try:  # rank 0's values are stored; the others' must not be
        kv.init(keys, [np.arange(4, dtype=np.float32) + 10 * i if kv.rank == 0 else np.full(4, -7, np.float32)
                       for i in range(len(keys))])
    except tensorkv.KVStoreError as error:
        print(json.dumps({"error": type(error).__name__, "message": str(error)}))
        sys.exit(0)
    for t in range(1, rounds + 1):
        kv.push(keys, [(i + 1) * BASE * (kv.rank + t) for i in range(len(keys))])
        weights = kv.pull(keys)
    print(json.dumps({"weights": [w.tolist() for w in weights]}))
