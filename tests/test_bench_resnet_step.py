"""bench/resnet_step.py (the ResNet-50 rows of `make bench-gpu`) on the CPU: the plain-torch
model is torchvision's resnet50 parameter for parameter, every Trainer step is checked
against torch's SGD, and the CPU smoke run gives every row against a real CPU server.
Skipped where torch is not installed (`make test` installs none)."""
import sys

import pytest

import tensorkv

from cluster import ROOT

torch = pytest.importorskip("torch")
sys.path.insert(0, str(ROOT / "bench"))

import resnet_step  # noqa: E402  (bench/resnet_step.py)
from gpu_routes import started_server  # noqa: E402
from resnet50 import ResNet50  # noqa: E402
from run import CheckError  # noqa: E402


def test_the_plain_torch_resnet50_has_torchvisions_161_tensors_of_25_557_032_floats():
    resnet_step.check_parameters(ResNet50())
    with pytest.raises(CheckError, match=r"at #159: \[\('fc.weight', \(10, 2048\)\)\] where \[\('fc.weight', "
                                         r"\(1000, 2048\)\)\]"):
        resnet_step.check_parameters(ResNet50(classes=10))


def shadow_of_three_steps(optimizer):
    """The worst distance of 3 Trainer steps of a small model from torch's SGD fed the same
    gradients (resnet_step.Shadow)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    images, labels = torch.randn(32, 8), torch.randint(0, 4, (32,))
    with tensorkv.create("local") as kv:
        trainer = tensorkv.Trainer(model.named_parameters(), kv, optimizer)
        shadow = resnet_step.Shadow(torch, model, "a small model")
        for step in range(3):
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            trainer.step()
            shadow.check(step)
    return shadow.worst


def test_each_trainer_step_is_checked_against_torchs_sgd_fed_the_same_gradients():
    sgd = tensorkv.optimizer.SGD
    assert shadow_of_three_steps(sgd(learning_rate=resnet_step.LR, momentum=resnet_step.MOMENTUM)) < 1e-4
    with pytest.raises(CheckError, match=r"a small model: parameter '0.weight' \[16, 8\] after step 0 is"):
        shadow_of_three_steps(sgd(learning_rate=1.1 * resnet_step.LR, momentum=resnet_step.MOMENTUM))
    with pytest.raises(CheckError, match=r"after step 1 is .* from torch's SGD fed the same gradients"):
        shadow_of_three_steps(sgd(learning_rate=resnet_step.LR, momentum=0.0))  # the first step is the same


def test_goals_are_judged_on_a_gpu_by_the_route_a_row_took():
    def rows():
        return [{"row": resnet_step.LOCAL, "route": None, "ms": 40.0},
                {"row": "ipc", "route": "CUDA IPC", "ms": 47.0},
                {"row": "pinned", "route": "pinned shared memory", "ms": 66.0},
                {"row": "tcp", "route": "tcp", "ms": 80.0}]
    on_gpu = rows()
    resnet_step.judge(on_gpu, "cuda")
    assert [(row["x_local"], row["goal"], row["goal_met"]) for row in on_gpu] == [
        (1.0, None, None), (1.175, 1.2, True), (1.65, 1.6, False), (2.0, None, None)]
    on_cpu = rows()
    resnet_step.judge(on_cpu, "cpu")
    assert [row["goal"] for row in on_cpu] == [None] * 4
    without_local = rows()[1:]
    resnet_step.judge(without_local, "cuda")
    assert [(row["x_local"], row["goal"]) for row in without_local] == [(None, None)] * 3


def test_the_cpu_smoke_run_times_every_row_and_checks_every_trainer_step(tmp_path, monkeypatch):
    monkeypatch.setitem(resnet_step.SIZES, "cpu", (2, 32, 1, 1))  # the smallest run: 2 steps a row
    said = []
    with started_server("cpu", str(tmp_path)) as address:
        result = resnet_step.measure(torch, "cpu", address, "cpu", said.append, lambda what, fn: fn())
    rows = {row["row"]: row for row in result["rows"]}
    assert list(rows) == [resnet_step.FORWARD_BACKWARD, resnet_step.LOCAL] + [r for r, _ in resnet_step.TRAINER_ROWS]
    assert all(row["ms"] > 0 and row["goal"] is None for row in rows.values())  # no goal off a GPU
    assert rows[resnet_step.LOCAL]["x_local"] == 1.0
    trainer_rows = [rows[r] for r, _ in resnet_step.TRAINER_ROWS]
    assert [row["route"] for row in trainer_rows] == ["shared memory", "shared memory", "tcp"]
    assert all(row["steps_checked"] == 2 and row["worst_vs_torch"] < resnet_step.RTOL for row in trainer_rows)
    table = "\n".join(resnet_step.markdown(result))
    assert "| Trainer.step(), transport='tcp' | tcp |" in table and "batch 2 x 3 x 32 x 32" in table
    assert len(said) == 1 + len(rows)
