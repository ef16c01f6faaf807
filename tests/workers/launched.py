"""A worker started by tensorkv-launch that stays running: it starts a child of its own,
writes '<its pid> <child pid>' to DIR/worker<rank>.pids, then with 'fail' rank 1 exits 3
once every worker has written its file; otherwise every worker sleeps."""
import os
import subprocess
import sys
import time
from pathlib import Path

directory, mode = Path(sys.argv[1]), sys.argv[2]
rank, num_workers = int(os.environ["TENSORKV_RANK"]), int(os.environ["TENSORKV_NUM_WORKERS"])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
(directory / f"worker{rank}.tmp").write_text(f"{os.getpid()} {child.pid}")
(directory / f"worker{rank}.tmp").rename(directory / f"worker{rank}.pids")
print("started", rank, os.environ["TENSORKV_JOB"], flush=True)
deadline = time.monotonic() + 60
while mode == "fail" and rank == 1 and time.monotonic() < deadline:
    if len(list(directory.glob("worker*.pids"))) == num_workers:
        sys.exit(3)
    time.sleep(0.05)
time.sleep(120)
