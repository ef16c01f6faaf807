"""dist_sync: push, say so, then wait in pull for a worker that never comes; the server
is stopped meanwhile and the pull must fail with ServerUnavailableError once it has tried
to reconnect for its timeout (5 s)."""
import numpy as np

import tensorkv

kv = tensorkv.create("dist_sync", rank=0, timeout=5)
kv.init(1, np.ones(2))
kv.push(1, np.ones(2))
print("pushed", flush=True)
try:
    kv.pull(1)
except tensorkv.ServerUnavailableError as error:
    print("unavailable:", error, flush=True)
