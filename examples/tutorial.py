"""MXNet's KVStore tutorial ("Distributed Key-Value Store"), run on tensorkv's embedded store.

Each step is the tutorial's, with NumPy arrays in place of NDArrays: ``mx.nd.ones(shape)``
becomes ``np.ones(shape, np.float32)`` and the four contexts become four arrays. It prints
what MXNet prints, line for line.
"""
import numpy as np

import tensorkv

# Initialization
kv = tensorkv.create('local')  # create a local kv store.
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


def update(key, input, stored):
    print("update on key: %d" % key)
    stored += input * 2


kv._set_updater(update)
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
