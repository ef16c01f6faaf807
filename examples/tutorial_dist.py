"""MXNet's KVStore tutorial (as examples/tutorial.py) against a tensorkv server.

Start a server first (``make server``, or ``tensorkv-server --port 50051 --num-workers 1``)
and point at it with ``TENSORKV_SERVERS=127.0.0.1:50051``; ``make run-dist`` does both.
Two lines differ from the embedded tutorial: the store is ``'dist_sync'``, and the Python
updater ``stored += input * 2``, which cannot travel to a server, becomes the declarative
``SGD(learning_rate=-2.0)``: ``weight -= lr * grad`` is the same update, run on the
server (so its "update on key" lines are not printed here). Every value printed is the
embedded tutorial's.
"""
import numpy as np

import tensorkv

# Initialization
kv = tensorkv.create('dist_sync')  # a client of the servers in TENSORKV_SERVERS
shape = (2, 3)
kv.init(3, np.ones(shape, np.float32) * 2)
a = np.zeros(shape, np.float32)
kv.pull(3, out=a)
print(a)

# Push, Aggregate, and Update
kv.push(3, np.ones(shape, np.float32) * 8)
kv.pull(3, out=a)  # pull out the value
print(a)

contexts = range(4)  # four devices: one array on each
b = [np.ones(shape, np.float32) for ctx in contexts]
kv.push(3, b)
kv.pull(3, out=a)
print(a)

# The tutorial's updater, stored += input * 2, as an optimizer that runs on the server.
kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=-2.0))
kv.pull(3, out=a)
print(a)

kv.push(3, np.ones(shape, np.float32))
kv.pull(3, out=a)
print(a)

# Pull
b = [np.ones(shape, np.float32) for ctx in contexts]
kv.pull(3, out=b)
print(b[1])

# Handle a List of Key-Value Pairs: a single device
keys = [5, 7, 9]
kv.init(keys, [np.ones(shape, np.float32)] * len(keys))
kv.push(keys, [np.ones(shape, np.float32)] * len(keys))
b = [np.zeros(shape, np.float32)] * len(keys)
kv.pull(keys, out=b)
print(b[1])

# Multiple devices
b = [[np.ones(shape, np.float32) for ctx in contexts]] * len(keys)
kv.push(keys, b)
kv.pull(keys, out=b)
print(b[1][1])
kv.close()
