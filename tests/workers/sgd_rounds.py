"""A dist_sync worker: SGD with momentum on the servers, one step per round; prints the
weight after every round, then rank 0 saves the optimizer states to argv[2]."""
import json
import sys

import numpy as np

import tensorkv

rounds, states_path = int(sys.argv[1]), sys.argv[2]
kv = tensorkv.create("dist_sync")
kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5))
kv.init("w", np.array([1, 2, 3, 4], np.float32))
weights = []
for t in range(1, rounds + 1):
    kv.push("w", np.array([1, -1, 2, 0.5], np.float32) * (kv.rank + t))
    weights.append(kv.pull("w").tolist())
kv.barrier()
if kv.rank == 0:
    kv.save_optimizer_states(states_path)
    kv.load_optimizer_states(states_path)
kv.barrier()
print(json.dumps(weights))
