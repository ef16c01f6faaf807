"""dist_sync, for a server with --round-timeout above argv[1]: both ranks init 'w', then
rank 1 makes no call for argv[1] seconds (a long computation, its Session stream open) while
rank 0 pushes and waits in pull() for it; each pushes rank + 1 and prints what it pulls."""
import json
import sys
import time

import numpy as np

import tensorkv

idle = float(sys.argv[1])
with tensorkv.create("dist_sync", timeout=idle + 200) as kv:
    kv.init("w", np.zeros(4, np.float32))
    if kv.rank == 1:
        time.sleep(idle)
    kv.push("w", np.full(4, kv.rank + 1, np.float32))
    print(json.dumps({"rank": kv.rank, "pulled": kv.pull("w").tolist()}))
