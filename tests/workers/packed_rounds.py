"""A dist_sync worker: ROUNDS rounds of a list of COUNT small keys (1-D and 2-D, float32)
pushed in one call and pulled in one call (or one pushpull), which move packed in one buffer
(tensorkv.wire.packed) on TRANSPORT; SGD with momentum on the servers. Every value is checked
against MXNet's SGD formula, exactly (the numbers are dyadic: float32 holds them exactly);
prints whether the list was fused (tensorkv.stores.fusion: push then pull) and the number of packed
layouts each server's session holds."""
import sys

import numpy as np

import tensorkv

rounds, count, transport, call = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
kv = tensorkv.create("dist_sync", transport=transport)
n, rank = kv.num_workers, kv.rank
kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=0.5, momentum=0.5))
keys = [f"param{i}" for i in range(count)]
shapes = [(2, 3) if i % 3 == 0 else (5,) for i in range(count)]
initial = [np.full(shape, float(i), np.float32) for i, shape in enumerate(shapes)]
kv.init(keys, initial)
outs = [np.empty(shape, np.float32) for shape in shapes]
weight = [w.astype(np.float64) for w in initial]
momentum = [np.zeros(shape) for shape in shapes]
for t in range(1, rounds + 1):
    grads = [np.full(shape, (rank + 1) * t + i % 4, np.float32) for i, shape in enumerate(shapes)]
    if call == "pushpull":
        kv.pushpull(keys, grads, out=outs)
    else:
        kv.push(keys, grads)
        kv.pull(keys, out=outs)
    for i in range(count):
        # the servers sum the workers' gradients, then SGD: mom = 0.5 mom - 0.5 g; w += mom
        grad = sum((r + 1) * t + i % 4 for r in range(n))
        momentum[i] = 0.5 * momentum[i] - 0.5 * grad
        weight[i] = weight[i] + momentum[i]
        np.testing.assert_array_equal(outs[i], weight[i].astype(np.float32), err_msg=f"round {t}, {keys[i]}")
kv.barrier()
print("fused" if kv._lists.get(keys) is not None else "not fused", "layouts",
      *[len(session.layout_ids) for session in kv._sessions])
kv.close()
