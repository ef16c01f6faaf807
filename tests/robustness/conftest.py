"""The robustness suite's seeds: ``make test`` runs each scenario with seed 1; ``make
robustness SEEDS=N`` with seeds 1..N (``--seeds N``, declared in tests/conftest.py), and ``make
robustness SEED=S`` replays one (``--seed S``). A failing scenario names its seed in its test id."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: cluster, faultproxy


def pytest_generate_tests(metafunc):
    if "seed" in metafunc.fixturenames:
        one = metafunc.config.getoption("--seed")
        seeds = [one] if one is not None else range(1, metafunc.config.getoption("--seeds") + 1)
        metafunc.parametrize("seed", seeds, ids=lambda seed: f"seed{seed}")
