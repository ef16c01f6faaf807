"""Creates a shared-memory Region and never registers it; argv[1]: 'exit' returns at once
without closing it (atexit must unlink it), 'wait' prints its name and waits to be killed
(the resource tracker must unlink it)."""
import sys

from tensorkv import shm

region = shm.Region(1 << 20)
print(region.name, flush=True)
if sys.argv[1] == "wait":
    sys.stdin.read()
