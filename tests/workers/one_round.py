"""A dist_sync worker with rank argv[1]: init 'w', push ones into one round, print the
value after it, then close the store (which gives the rank back)."""
import json
import sys

import numpy as np

import tensorkv

with tensorkv.create("dist_sync", rank=int(sys.argv[1])) as kv:
    kv.init("w", np.zeros(4, np.float32))
    kv.push("w", np.ones(4, np.float32))
    print(json.dumps(kv.pull("w").tolist()))
