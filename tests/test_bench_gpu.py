"""bench/gpu.py (`make bench-gpu`) where CUDA is hidden: it says in one line why the GPU rows
are skipped, still measures the CPU rows against a real server and checks their values; a
wrong value pulled fails a row; the ResNet-50 rows' table (bench/resnet_step.py) in gpu.md."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tensorkv

from cluster import ROOT, Cluster

sys.path.insert(0, str(ROOT / "bench"))

import gpu  # noqa: E402  (bench/gpu.py)
import resnet_step  # noqa: E402  (bench/resnet_step.py)
from run import CheckError  # noqa: E402  (bench/run.py)

# seconds the quick run gets on a loaded machine (9 to 25 s on 2 cores here): past its own
# limit (gpu.RUN_LIMIT), at which it stops its server by PID, so that none is left behind
RUN_TIMEOUT = gpu.RUN_LIMIT + 100.0


def test_quick_run_without_cuda_skips_the_gpu_rows_in_one_line_and_measures_the_cpu_rows(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "client"), str(ROOT / "server")])}
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--quick", "--out-dir", str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    skips = [line for line in result.stdout.splitlines() if "] GPU rows skipped: " in line]  # "[ 0.2 s] GPU..."
    assert len(skips) == 1 and "CPU-only mode" in skips[0], result.stdout
    assert "torch row skipped" not in result.stdout  # the one line covers every GPU row
    numbers = json.loads((tmp_path / "gpu-quick.json").read_text())
    assert "gpu" not in numbers and len(numbers["skipped"]) == 1 and skips[0].endswith(numbers["skipped"][0])
    assert list(numbers["limits_gbps"]) == ["host memcpy"]  # no GPU limit, no GPU number
    [row] = numbers["rows"]
    assert (row["row"], row["server"], row["worker"]) == ("NumPy worker -> CPU server", "CPU server", "numpy")
    assert set(row["ms"]) == {"16 floats", "4 MiB", "64 MiB"} and all(ms > 0 for ms in row["ms"].values())
    assert all(count >= 3 for count in row["pulls_checked"].values())
    assert row["x_four_pinned"] is None and row["x_device_copy"] is None
    [adam] = numbers["adam"]
    assert adam["row"] == "Adam 64 MiB: NumPy worker -> CPU server" and adam["steps_checked"] >= 3
    table = (tmp_path / "gpu-quick.md").read_text()
    assert table in result.stdout
    assert f"| NumPy worker -> CPU server | {row['route']} |" in table and row["route"] in ("shared memory", "tcp")
    assert "CuPy worker" not in table and "no GPU (CPU-only mode)" in table


def test_a_pulled_value_that_is_not_the_pushed_one_fails_the_row(tmp_path):
    # SGD set on the server: a pull returns the weight less the step, not the value pushed
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=60) as kv:
            kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=0.5))
            with pytest.raises(CheckError, match=r"numpy key 0 \(16 floats\) push\+pull #0: 16 of 16 values wrong"):
                gpu.round_trip_medians(kv, gpu.Values("numpy"), lambda size: 1, 0)


def test_the_bound_of_four_pinned_crossings():
    # a push and a pull of S bytes cross PCIe four times: at 50 GB/s each way, 4 S / 50 GB/s,
    # in which 2 S of payload move (counted both ways, as the rows are): 25 GB/s
    four, device = gpu.bounds({"pinned H2D": 50.0, "pinned D2H": 50.0, "device copy": 1400.0})
    assert four == pytest.approx(25.0) and device == 1400.0
    assert gpu.bounds({"host memcpy": 6.0}) == (None, None)
    assert np.isclose(gpu.bounds({"pinned H2D": 40.0, "pinned D2H": 60.0})[0], 1 / (1 / 40 + 1 / 60))


def test_the_resnet50_rows_land_in_gpu_md_with_their_ratios_and_goals():
    # made-up numbers of the shape resnet_step.measure() gives: the table's format alone
    rows = [{"row": resnet_step.FORWARD_BACKWARD, "route": None, "ms": 30.0},
            {"row": resnet_step.LOCAL, "route": None, "ms": 40.0},
            {"row": "Trainer.step(), same-host default", "route": "CUDA IPC", "ms": 50.0, "worst_vs_torch": 2e-6},
            {"row": "Trainer.step(), pinned shared memory", "route": "pinned shared memory", "ms": 60.0,
             "worst_vs_torch": 3e-6}]
    resnet_step.judge(rows, "cuda")
    resnet = {"device": "cuda", "batch": 64, "image": 224, "warmup_steps": 3, "timed_steps": 20, "lr": 0.01,
              "momentum": 0.9, "rows": rows}
    result = {"date": "d", "commit": "c", "machine": {"platform": "p", "cpus": 16, "cpu": "x", "python": "3",
                                                      "numpy": "2", "grpcio": "1"},
              "skipped": [], "failures": [], "limits_gbps": {}, "four_pinned_gbps": None, "rows": [], "adam": [],
              "resnet": resnet}
    table = gpu.markdown(result, "python bench/gpu.py")
    assert "batch 64 x 3 x 224 x 224" in table and "medians of 20 steps after 3" in table
    assert "| local step: torch.optim.SGD | — | 40.0 | 1.00 | — | — |" in table
    assert "| Trainer.step(), same-host default | CUDA IPC | 50.0 | 1.25 | <= 1.2x: not met | 2.0e-06 |" in table
    assert "| Trainer.step(), pinned shared memory | pinned shared memory | 60.0 | 1.50 | <= 1.6x: met | 3.0e-06 |" \
        in table
