"""A worker of store type argv[1] ('dist_sync' or 'local'): SGD with momentum and the
lr_scheduler given as JSON {"name": ..., "params": {...}} in argv[3], for argv[2] rounds.
Each round pushes key 'w' and, every second round, key 'b' (whose own update count then
lags behind 'w''s); prints the values of both after every round as JSON."""
import json
import sys

import numpy as np

import tensorkv

store, rounds, spec = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
kv = tensorkv.create(store)
schedule = tensorkv.lr_scheduler.create(spec["name"], **spec["params"])
kv.set_optimizer(tensorkv.optimizer.SGD(momentum=0.5, lr_scheduler=schedule))
kv.init(["w", "b"], [np.array([1.0, -2.0, 0.5]), np.array([4.0])])
values = []
for t in range(1, rounds + 1):
    kv.push("w", np.array([1.0, 0.5, -2.0]) * (kv.rank + t))
    if t % 2 == 0:
        kv.push("b", np.array([1.0 + kv.rank]))
    w, b = kv.pull(["w", "b"])
    values.append([w.tolist(), b.tolist()])
kv.barrier()
print(json.dumps(values))
