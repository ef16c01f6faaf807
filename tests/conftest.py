"""Options of the whole test suite (pytest reads them only from here, before collecting)."""


def pytest_addoption(parser):
    parser.addoption("--seeds", type=int, default=1,
                     help="run every robustness scenario (tests/robustness) with seeds 1..N (default 1)")
    parser.addoption("--seed", type=int, default=None, help="run every robustness scenario with this seed only")
