"""A worker whose data channel announces a huge answer: its store on the servers of
TENSORKV_SERVERS (whose data port is a fake one, see test_datachan) makes the call argv[1]
('init' or 'pull') under an address-space limit of argv[2] MiB more than it holds, and
prints the error's class and message, then 'grew N' (bytes of VmHWM gained by the call)."""
import resource
import sys

import numpy as np

import tensorkv


def status(field):
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


call, room = sys.argv[1], int(sys.argv[2]) << 20
kv = tensorkv.create("dist_sync", transport="tcp")
# the call may not even reserve the announced length (on the code before, a MemoryError here
# stood for the GiBs it took)
resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + room, resource.getrlimit(resource.RLIMIT_AS)[1]))
before = status("VmHWM")
try:
    if call == "init":
        kv.init("w", np.ones(10, np.float32))
    else:
        kv.pull("w", out=np.empty(10, np.float32))
except Exception as error:  # what the test looks at
    print(type(error).__name__, error, flush=True)
print("grew", status("VmHWM") - before, flush=True)
