"""A dist_async worker: pushes are applied as they arrive, without waiting for the others."""
import numpy as np

import tensorkv

kv = tensorkv.create("dist_async")
rank, other = kv.rank, 1 - kv.rank
kv.init([0, 1, 2], [np.zeros(3)] * 3)
for i in range(1, 6):
    kv.push(rank, np.full(3, 10.0 * rank + i))  # this rank's own key: assigned at once
    assert (kv.pull(rank) == 10 * rank + i).all()
kv.barrier()
assert (kv.pull(other) == 10 * other + 5).all()
# With an optimizer every push is one update: 2 workers x 3 pushes of 1 with lr 1.
kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
for _ in range(3):
    kv.push(2, np.ones(3))
kv.barrier()
assert (kv.pull(2) == -6).all(), kv.pull(2)
print("ok", rank)
