"""tensorkv.Trainer: the weights after N steps equal the same steps done by hand, on the
embedded store and in a real two-worker dist_sync job (NumPy arrays, and a torch model where
torch is installed: `make test` installs none); gluon's order of arguments, its
update_on_kvstore=False with allreduce_grads() and update(), and save_states() / load_states()."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorkv

from cluster import ROOT, WORKER_TIMEOUT, Cluster, check_workers, one_worker_store, stop

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


def first_order(params, kv):
    return tensorkv.Trainer(params, kv, tensorkv.optimizer.SGD(learning_rate=LEARNING_RATE, momentum=MOMENTUM))


def train_locally(steps, batch_size, lower_at=None, make=first_order):
    """(the Trainer's weights, the weights by hand) after ``steps`` steps on a 'local' store,
    the Trainer from ``make(params, kv)``."""
    params, expected = initial_weights(), initial_weights()
    moms = {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
    with tensorkv.create("local") as kv:
        trainer = make(params, kv)
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


SGD_PARAMS = {"learning_rate": LEARNING_RATE, "momentum": MOMENTUM}


@pytest.mark.parametrize("make", [
    lambda params, kv: tensorkv.Trainer(params, "sgd", SGD_PARAMS, kvstore=kv),
    lambda params, kv: tensorkv.Trainer(params, tensorkv.optimizer.SGD(**SGD_PARAMS), None, kv),
    lambda params, kv: tensorkv.Trainer(params, optimizer="SGD", optimizer_params=SGD_PARAMS, kvstore=kv),
    lambda params, kv: tensorkv.Trainer(params, "sgd", SGD_PARAMS, kvstore="local"),
    lambda params, kv: tensorkv.Trainer(params, kv, "sgd", SGD_PARAMS),
    lambda params, kv: tensorkv.Trainer(params, optimizer=tensorkv.optimizer.SGD(**SGD_PARAMS), kv=kv),
    lambda params, kv: tensorkv.Trainer(params, "sgd", SGD_PARAMS, kv, update_on_kvstore=False),
    lambda params, kv: tensorkv.Trainer(params, kv, tensorkv.optimizer.SGD(**SGD_PARAMS), update_on_kvstore=False),
], ids=["gluon", "gluon-positional", "gluon-keywords", "gluon-store-by-name", "first-with-a-name",
        "first-keywords", "gluon-update-here", "first-update-here"])
def test_gluons_order_of_arguments_trains_as_the_first_order(make):
    """gluon.Trainer(params, optimizer, optimizer_params, kvstore=...) and this Trainer's own
    order, with the optimizer in the store or (update_on_kvstore=False) run here."""
    params, expected = train_locally(steps=5, batch_size=2, lower_at=3, make=make)
    for name in SHAPES:
        np.testing.assert_allclose(params[name], expected[name], rtol=1e-6)


def test_allreduce_grads_then_update_lets_a_script_clip_the_summed_gradients():
    """gluon's allreduce_grads() sums the gradients over the workers in place; update() then
    runs the optimizer here, on the gradients as the script left them (clipped here)."""
    params, expected = initial_weights(), initial_weights()
    moms = {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
    with tensorkv.create("local") as kv:
        trainer = tensorkv.Trainer(params, "sgd", SGD_PARAMS, kv, update_on_kvstore=False)
        for step in range(1, 4):
            grads = fixed_grads(step)
            trainer.allreduce_grads(grads=grads)
            for grad in grads.values():
                np.clip(grad, -1.0, 1.0, out=grad)
            trainer.update(2, grads=grads)
            sgd_by_hand(expected, moms, {n: np.clip(g, -1, 1) * np.float32(0.5) for n, g in fixed_grads(step).items()},
                        LEARNING_RATE)
        assert trainer.optimizer.num_update == 3
        assert kv.pull("w").tolist() == fixed_grads(3)["w"].tolist()  # the store holds the last sum, not weights
    for name in SHAPES:
        np.testing.assert_array_equal(params[name], expected[name])


@pytest.mark.parametrize("make, error, words", [
    (lambda kv: tensorkv.Trainer({"w": np.ones(2)}, kv, tensorkv.optimizer.SGD()).allreduce_grads(grads={"w": np.ones(2)}),
     tensorkv.FailedPreconditionError, "allreduce_grads() is for a Trainer whose optimizer runs here: this one's runs "
                                       "in the store (update_on_kvstore); create it with update_on_kvstore=False"),
    (lambda kv: tensorkv.Trainer({"w": np.ones(2)}, "sgd", kvstore=kv).update(grads={"w": np.ones(2)}),
     tensorkv.FailedPreconditionError, "update() is for a Trainer whose optimizer runs here"),
    (lambda kv: tensorkv.Trainer({"w": np.ones(2)}, tensorkv.optimizer.SGD(), {"learning_rate": 0.1}, kv),
     tensorkv.InvalidArgumentError, "optimizer_params is for an optimizer given by name"),
    (lambda kv: tensorkv.Trainer({"w": np.ones(2)}, kv, update_on_kvstore=False),
     tensorkv.InvalidArgumentError, "update_on_kvstore=False runs the optimizer here: give one"),
    (lambda kv: tensorkv.Trainer({"w": np.ones(2)}, {"learning_rate": 0.1}, kvstore=kv),
     tensorkv.InvalidArgumentError, "its second argument, a dict, is neither a tensorkv KVStore nor an optimizer"),
    (lambda kv: tensorkv.Trainer({"w": np.ones(2)}, "sgd", kvstore=kv, batch_size=3),
     tensorkv.InvalidArgumentError, "got an unexpected keyword argument 'batch_size'"),
    (lambda kv: tensorkv.Trainer({"w": np.ones(2)}, "lbsgd", kvstore=kv),
     tensorkv.InvalidArgumentError, "unknown optimizer 'lbsgd'"),
])
def test_trainer_misuse_is_refused_with_what_to_do(make, error, words):
    with tensorkv.create("local") as kv:
        with pytest.raises(error) as caught:
            make(kv)
        assert words in str(caught.value)


def test_update_here_is_refused_on_dist_async_as_in_gluon(tmp_path):
    with Cluster(num_workers=1, mode="async", tmp_path=tmp_path) as cluster, \
            tensorkv.create("dist_async", servers=cluster.addresses) as kv:
        with pytest.raises(tensorkv.InvalidArgumentError, match="set update_on_kvstore=True when training in async"):
            tensorkv.Trainer({"w": np.ones(2)}, "sgd", kvstore=kv, update_on_kvstore=False)
        with pytest.raises(tensorkv.InvalidArgumentError, match="set update_on_kvstore=True when training in async"):
            tensorkv.Trainer({"w": np.ones(2)}, kv, "sgd", update_on_kvstore=False)
        kv.init("w", np.ones(2))  # the store given is left open


@pytest.mark.parametrize("kind", ["local", "dist_sync"])
@pytest.mark.parametrize("saver, loader", [(True, True), (False, False), (True, False), (False, True)],
                         ids=["store-store", "here-here", "store-here", "here-store"])
def test_save_states_and_load_states_continue_as_one_run(kind, saver, loader, tmp_path):
    """3 steps, save_states; a new Trainer (a new store) on the weights reached, made with
    another optimizer, load_states, 3 more steps: the weights of 6 steps in one run (the
    momentum and the optimizer came back). Either kind of Trainer reads the other's file."""
    fname = tmp_path / "trainer.states"
    params, expected = initial_weights(), initial_weights()
    moms = {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
    for step in range(1, 7):
        sgd_by_hand(expected, moms, fixed_grads(step), LEARNING_RATE)
    with one_worker_store(kind, tmp_path, if_exists="replace") as kv:
        trainer = tensorkv.Trainer(params, kv, tensorkv.optimizer.SGD(**SGD_PARAMS), update_on_kvstore=saver)
        for step in range(1, 4):
            trainer.step(grads=fixed_grads(step))
        trainer.save_states(fname)
    with one_worker_store(kind, tmp_path, if_exists="replace") as kv:
        trainer = tensorkv.Trainer(params, kv, tensorkv.optimizer.Adam(learning_rate=5.0), update_on_kvstore=loader)
        trainer.load_states(fname)
        assert (trainer.optimizer, trainer.learning_rate) == (tensorkv.optimizer.SGD(**SGD_PARAMS), LEARNING_RATE)
        for step in range(4, 7):
            trainer.step(grads=fixed_grads(step))
    for name in SHAPES:
        np.testing.assert_allclose(params[name], expected[name], rtol=1e-6)


def test_load_states_of_a_key_this_trainer_does_not_train_is_refused(tmp_path):
    fname = tmp_path / "trainer.states"
    with tensorkv.create("local") as kv:
        trainer = tensorkv.Trainer({"w": np.ones(2, np.float32)}, kv, tensorkv.optimizer.SGD(momentum=0.9))
        trainer.step(grads={"w": np.ones(2, np.float32)})
        trainer.save_states(fname)
    with tensorkv.create("local") as kv:
        trainer = tensorkv.Trainer({"v": np.ones(2, np.float32)}, "sgd", kvstore=kv, update_on_kvstore=False)
        with pytest.raises(tensorkv.KeyNotFoundError, match="holds states of key 'w', which this Trainer does not"):
            trainer.load_states(fname)
        assert trainer.optimizer == tensorkv.optimizer.SGD()


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


@pytest.mark.parametrize("framework", ["numpy", "numpy-gluon", "torch"])
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
