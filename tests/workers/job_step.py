"""One worker of a job (TENSORKV_JOB, TENSORKV_IF_EXISTS): init 'w' to zeros, one step of SGD
at learning rate 1 with a gradient of ones, then print the value it pulls as JSON. With
argv[1] 'hold', it then prints "holding" and waits to be killed."""
import json
import sys
import time

import numpy as np

import tensorkv

kv = tensorkv.create("dist_sync")
kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
kv.init("w", np.zeros(4, np.float32))
kv.push("w", np.ones(4, np.float32))
print(json.dumps(kv.pull("w").tolist()), flush=True)
if sys.argv[1:] == ["hold"]:
    print("holding", flush=True)
    time.sleep(600)
kv.close()
