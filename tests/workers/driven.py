"""A dist_sync worker driven line by line on stdin, for tests that choose when each worker
acts: it creates its store (rank from TENSORKV_RANK), inits 'w' (4 zeros, float32), sets
SGD(learning_rate=-1) (the server adds each round's sum to 'w') and prints "ready"; then for each line "push V" pushes V into every element of 'w' and prints
"pushed", "pull" prints "value V" (after checking that the 4 elements are equal), and
"close" closes the store and exits. A call that raises prints "error Class: message"."""
import sys

import numpy as np

import tensorkv

kv = tensorkv.create("dist_sync")
kv.init("w", np.zeros(4, np.float32))
kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=-1.0))
print("ready", flush=True)
for line in sys.stdin:
    command, *args = line.split()
    if command == "close":
        break
    try:
        if command == "push":
            kv.push("w", np.full(4, float(args[0]), np.float32))
            print("pushed", flush=True)
        else:
            value = kv.pull("w")
            assert (value == value[0]).all(), value
            print(f"value {value[0]:g}", flush=True)
    except tensorkv.KVStoreError as error:
        print(f"error {type(error).__name__}: {error}", flush=True)
kv.close()
