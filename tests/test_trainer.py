"""tensorkv.Trainer: the weights after N steps equal the same steps done by hand, on the
embedded store and in a real two-worker dist_sync job (NumPy arrays, and a torch model where
torch is installed: `make test` installs none)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorkv

from cluster import ROOT, WORKER_TIMEOUT, Cluster, check_workers, stop

LEARNING_RATE, MOMENTUM, LOWER_RATE = 0.1, 0.9, 0.05  # as in tests/workers/trainer_linear.py
SHAPES = {"w": (3, 4), "b": (4,)}


def sgd_by_hand(weights, moms, grads, lr):
    """SGD with momentum in float32, as MXNet's sgd_mom_update with wd=0 and rescale_grad=1."""
    for name, grad in grads.items():
        moms[name] = np.float32(MOMENTUM) * moms[name] - np.float32(lr) * grad
        weights[name] = weights[name] + moms[name]


def fixed_grads(step):
    return {name: (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) - step) * (0.5 + step)
            for name, shape in SHAPES.items()}


def initial_weights():
    return {name: np.linspace(-1, 1, np.prod(shape), dtype=np.float32).reshape(shape) for name, shape in SHAPES.items()}


def train_locally(steps, batch_size, lower_at=None):
    """(the Trainer's weights, the weights by hand) after ``steps`` steps on a 'local' store."""
    params, expected = initial_weights(), initial_weights()
    moms = {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
    with tensorkv.create("local") as kv:
        trainer = tensorkv.Trainer(params, kv, tensorkv.optimizer.SGD(learning_rate=LEARNING_RATE, momentum=MOMENTUM))
        for step in range(1, steps + 1):
            if step == lower_at:
                trainer.set_learning_rate(LOWER_RATE)
            trainer.step(batch_size, grads=fixed_grads(step))
            lr = LOWER_RATE if lower_at is not None and step >= lower_at else LEARNING_RATE
            sgd_by_hand(expected, moms, {n: g * np.float32(1 / batch_size) for n, g in fixed_grads(step).items()}, lr)
        assert trainer.learning_rate == lr
    return params, expected


def test_numpy_params_on_local_equal_sgd_with_momentum_by_hand():
    params, expected = train_locally(steps=5, batch_size=np.int64(4))
    for name in SHAPES:
        np.testing.assert_array_equal(params[name], expected[name])


def test_set_learning_rate_keeps_momentum():
    params, expected = train_locally(steps=6, batch_size=1, lower_at=4)
    for name in SHAPES:
        np.testing.assert_array_equal(params[name], expected[name])


def test_the_first_step_initializes_every_key_and_optimizer_none_uses_the_stores():
    with tensorkv.create("local") as kv:
        kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
        params = {"w": np.ones(2, np.float32), "frozen": np.full(2, 7, np.float32)}
        trainer = tensorkv.Trainer(params, kv)
        with pytest.raises(tensorkv.FailedPreconditionError, match="learning rate is unknown"):
            trainer.learning_rate
        trainer.step(grads={"w": np.ones(2, np.float32)}, ignore_stale_grad=True)
        assert params["w"].tolist() == [0, 0] and kv.pull("frozen").tolist() == [7, 7]


@pytest.mark.parametrize("call, error, match", [
    (lambda t: t.step(), tensorkv.FailedPreconditionError, r"parameter 'w' has no gradient: its .grad is None"),
    (lambda t: t.step(grads={"w": np.ones(2, np.float32)}), tensorkv.FailedPreconditionError,
     r"parameter 'b' has no gradient: grads has none for it; step\(ignore_stale_grad=True\)"),
    (lambda t: t.step(grads={"w": np.ones(2, np.float32), "b": np.ones(1, np.float32), "c": np.ones(1)}),
     tensorkv.InvalidArgumentError, r"grads has 'c', which this Trainer does not train"),
    (lambda t: t.step(0, grads={}), tensorkv.InvalidArgumentError, "batch_size must be a positive number, got 0"),
])
def test_bad_steps_are_refused_and_initialize_nothing(call, error, match):
    with tensorkv.create("local") as kv:
        trainer = tensorkv.Trainer({"w": np.ones(2, np.float32), "b": np.ones(1, np.float32)}, kv)
        with pytest.raises(error, match=match):
            call(trainer)
        with pytest.raises(tensorkv.KeyNotFoundError):
            kv.pull("w")


@pytest.mark.parametrize("params, match", [
    ({}, "at least one parameter"),
    ([("w", np.ones(2)), ("w", np.ones(2))], "parameter name 'w' is given twice"),
    ({"w": [1, 2]}, "parameter 'w': a list is not an array"),
    ([(3, np.ones(2))], "with str names"),
])
def test_bad_params_are_refused(params, match):
    with tensorkv.create("local") as kv, pytest.raises(tensorkv.InvalidArgumentError, match=match):
        tensorkv.Trainer(params, kv)


def linear_data(path):
    """Each rank's shard (x, y) and initial values (different on each rank: rank 0's win)."""
    rng = np.random.default_rng(18)
    arrays = {}
    for rank in range(2):
        arrays[f"x{rank}"] = rng.standard_normal((16, 8)).astype(np.float32)
        arrays[f"y{rank}"] = rng.standard_normal(16).astype(np.float32)
        arrays[f"weight{rank}"] = rng.standard_normal((1, 8)).astype(np.float32)
        arrays[f"bias{rank}"] = rng.standard_normal(1).astype(np.float32)
    np.savez(path, **arrays)
    return arrays


def linear_by_hand(data, steps, lower_at):
    """The job by hand: each rank's gradient of 0.5 * mean(error ** 2) at its own weights (its
    initial ones in step 1), averaged over the 2 ranks, then SGD with momentum."""
    local = [{"weight": data[f"weight{r}"], "bias": data[f"bias{r}"]} for r in range(2)]
    stored = dict(local[0])
    moms = {name: np.zeros_like(value) for name, value in stored.items()}
    for step in range(1, steps + 1):
        summed = {"weight": 0, "bias": 0}
        for rank, params in enumerate(local):
            x, y = data[f"x{rank}"], data[f"y{rank}"]
            error = x @ params["weight"][0] + params["bias"][0] - y
            summed["weight"] = summed["weight"] + (error @ x / len(y))[None, :] * np.float32(0.5)
            summed["bias"] = summed["bias"] + np.array([error.mean()], np.float32) * np.float32(0.5)
        sgd_by_hand(stored, moms, summed, LOWER_RATE if step >= lower_at else LEARNING_RATE)
        local = [stored, stored]
    return stored


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_two_dist_sync_workers_train_to_the_weights_by_hand(framework, tmp_path):
    if framework == "torch":
        pytest.importorskip("torch")
    data = linear_data(tmp_path / "data.npz")
    steps, lower_at = 6, 4
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        outs = check_workers(cluster.run_workers("trainer_linear", framework, tmp_path / "data.npz", steps, lower_at))
    first, second = (json.loads(out) for out in outs)
    assert first == second  # both workers pulled the same stored weights
    expected = linear_by_hand(data, steps, lower_at)
    for name, value in expected.items():
        np.testing.assert_allclose(np.array(first[name], np.float32), value, rtol=1e-5, atol=1e-6)


def test_torch_parameters_train_in_place_frozen_ones_are_skipped_and_unused_ones_refused():
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 1))
    model[0].bias.requires_grad_(False)
    before = [param.detach().clone() for param in model.parameters()]
    with tensorkv.create("local") as kv:
        trainer = tensorkv.Trainer(model.parameters(), kv, tensorkv.optimizer.SGD(learning_rate=1.0))
        model(torch.ones(3, 4)).sum().backward()
        grads = [None if param.grad is None else param.grad.clone() for param in model.parameters()]
        trainer.step()
        for param, old, grad in zip(model.parameters(), before, grads):
            assert torch.equal(param.detach(), old if grad is None else old - grad)
        assert model[1].weight.requires_grad and model[1].weight.is_leaf
        assert kv.pull("1").tolist() == before[1].tolist()  # the frozen bias, named by its position
        model.zero_grad()  # .grad None again: no backward since
        with pytest.raises(tensorkv.FailedPreconditionError, match="parameter '0' has no gradient"):
            trainer.step()


def test_the_torch_example_trains_two_workers_to_the_same_weights():
    pytest.importorskip("torch")
    launch = Path(sys.executable).with_name("tensorkv-launch")
    process = subprocess.Popen([str(launch), "-n", "2", "-s", "1", sys.executable, "examples/train_torch.py"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = process.communicate(timeout=WORKER_TIMEOUT)
    finally:
        stop(process)  # SIGTERM: the launcher stops the server and workers it started
    assert process.returncode == 0, out
    done = re.findall(r"^\[worker \d\] rank \d done: (.*)$", out, re.MULTILINE)
    assert len(done) == 2 and done[0] == done[1], out
    for rank in range(2):
        losses = [float(loss) for loss in re.findall(rf"^\[worker {rank}\] .* loss (\S+)$", out, re.MULTILINE)]
        assert len(losses) == 5 and losses[-1] < losses[0] / 100, out
