"""tensorkv.ClientConfig: every worker setting is one field, filled when a store is created
(never at import) by its argument, else its TENSORKV_* variable, else its default; a bad value
names the argument or the variable; docs/reference.md's table lists exactly its fields."""
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorkv
from tensorkv import ClientConfig, config

from cluster import Cluster

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"
TIMEOUT = 60.0

# field: (an argument, what it gives, a variable's text, what it gives)
FILLS = {
    "servers": ("h1:1, h2:2", ["h1:1", "h2:2"], "v1:50051", ["v1:50051"]),
    "rank": (3, 3, " 4 ", 4),
    "num_workers": (2, 2, "5", 5),
    "timeout": (30, 30.0, "45.5", 45.5),
    "connect_timeout": (3, 3.0, "7", 7.0),
    "transport": ("tcp", "tcp", "grpc", "grpc"),
    "session": (True, True, "yes", False),
    "tls_ca": ("/a/ca.pem", "/a/ca.pem", "/v/ca.pem", "/v/ca.pem"),
    "tls_cert": (Path("/a/cert.pem"), "/a/cert.pem", "/v/cert.pem", "/v/cert.pem"),
    "tls_key": ("/a/key.pem", "/a/key.pem", "/v/key.pem", "/v/key.pem"),
    "token": ("from-argument", "from-argument", "from-variable", "from-variable"),
    "job": ("train-1", "train-1", "train-2", "train-2"),
    "if_exists": ("resume", "resume", "replace", "replace"),
    "bigarray_bound": (10, 10, "20", 20),
    "chunk_bytes": (8, 8, "16", 16),
    "shm_min_bytes": (0, 0, "1", 1),
    "datachan_min_bytes": (1, 1, "2", 2),
    "pack_min_values": (4, 4, "5", 5),
    "malloc_tuning": (True, True, "on", False),
}

# field: (a bad argument, words of its error, a bad variable's text or None, words of its error)
# (a path, a token or a job from a variable is any text: what is wrong with it shows when it is used)
BAD = {
    "servers": ("nohost", "servers: 'nohost' is not a server address host:port: no port",
                "h:1,ftp://h:2", "TENSORKV_SERVERS: 'ftp://h:2' is not a server address host:port: drop the scheme"),
    "rank": ("abc", "rank='abc' is not a whole number", "abc", "TENSORKV_RANK='abc' is not a whole number"),
    "num_workers": (0, "num_workers=0 is below its least value, 1", "2.5",
                    "TENSORKV_NUM_WORKERS='2.5' is not a whole number"),
    "timeout": (-1, "timeout=-1 is not a number of seconds above 0", "soon", "TENSORKV_TIMEOUT='soon' is not a number"),
    "connect_timeout": ("10", "connect_timeout='10' is not a number", "0",
                        "TENSORKV_CONNECT_TIMEOUT=0.0 is not a number of seconds above 0"),
    "transport": ("udp", "unknown transport 'udp'; use one of 'auto', 'tcp', 'grpc'", "udp",
                  "unknown TENSORKV_TRANSPORT 'udp'"),
    "session": ("maybe", "session='maybe' is neither True nor False", "maybe", "TENSORKV_NO_SESSION='maybe' is neither"),
    "tls_ca": (3, "tls_ca=3 is not a string", None, None),
    "tls_cert": (b"cert", "tls_cert=b'cert' is not a string", None, None),
    "tls_key": (["key"], "tls_key=['key'] is not a string", None, None),
    "token": (123, "token=123 is not a string", None, None),
    "job": (7, "job=7 is not a string", None, None),
    "if_exists": ("keep", "unknown if_exists 'keep'", "Replace", "unknown TENSORKV_IF_EXISTS 'Replace'"),
    "bigarray_bound": (0, "bigarray_bound=0 is below its least value, 1", "1e6",
                       "TENSORKV_BIGARRAY_BOUND='1e6' is not a whole number"),
    "chunk_bytes": (0, "chunk_bytes=0 is below its least value, 1", "1MiB",
                    "TENSORKV_CHUNK_BYTES='1MiB' is not a whole number"),
    "shm_min_bytes": (-1, "shm_min_bytes=-1 is below its least value, 0", "16k",
                      "TENSORKV_SHM_MIN_BYTES='16k' is not a whole number"),
    "datachan_min_bytes": (1.5, "datachan_min_bytes=1.5 is not a whole number", "x",
                           "TENSORKV_DATACHAN_MIN_BYTES='x' is not a whole number"),
    "pack_min_values": (-3, "pack_min_values=-3 is below its least value, 0", "-3",
                        "TENSORKV_PACK_MIN_VALUES=-3 is below its least value, 0"),
    "malloc_tuning": ("no", "malloc_tuning='no' is neither True nor False", "sometimes",
                      "TENSORKV_NO_MALLOC_TUNING='sometimes' is neither"),
}

FIELD_NAMES = [field.name for field in dataclasses.fields(ClientConfig)]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No TENSORKV_* variable (nor GLIBC_TUNABLES) of the caller's reaches these tests."""
    for name in [config.variable(name) for name in FIELD_NAMES] + ["GLIBC_TUNABLES"]:
        monkeypatch.delenv(name, raising=False)


def test_the_cases_cover_every_field():
    assert set(FILLS) == set(BAD) == set(FIELD_NAMES)
    assert tensorkv.ClientConfig is ClientConfig and "ClientConfig" in tensorkv.__all__


@pytest.mark.parametrize("name", FIELD_NAMES)
def test_the_argument_else_the_variable_else_the_default_fills_each_field(monkeypatch, name):
    argument, from_argument, text, from_variable = FILLS[name]
    default = config.default(name)
    if name != "servers":  # required: no default
        assert getattr(ClientConfig(servers="h:1").resolved(), name) == default
    monkeypatch.setenv(config.variable(name), text)
    assert getattr(ClientConfig().resolved([name]), name) == from_variable
    given = ClientConfig(**{"servers": "h:1", name: argument})
    assert getattr(given.resolved(), name) == from_argument  # over the variable
    assert from_argument != from_variable


@pytest.mark.parametrize("name", FIELD_NAMES)
def test_a_bad_value_names_the_argument_or_the_variable(monkeypatch, name):
    argument, words, text, variable_words = BAD[name]
    with pytest.raises(tensorkv.InvalidArgumentError) as caught:
        ClientConfig(**{"servers": "h:1", name: argument}).resolved()
    assert words in str(caught.value)
    if text is not None:
        monkeypatch.setenv(config.variable(name), text)
        with pytest.raises(tensorkv.InvalidArgumentError) as caught:
            ClientConfig().resolved([name])
        assert variable_words in str(caught.value)


def test_the_token_stays_out_of_the_repr():
    assert "sesame" not in repr(ClientConfig(servers="h:1", token="sesame").resolved())


def test_importing_tensorkv_reads_no_variable():
    """Every variable bad: the import still succeeds (each was read at import by some module)."""
    bad = {config.variable(name): BAD[name][2] for name in FIELD_NAMES if BAD[name][2] is not None}
    done = subprocess.run([sys.executable, "-c", "import tensorkv, tensorkv.stores.dist, tensorkv.transport.routes, tensorkv.tools.ctl"],
                          env={**_environment(), **bad}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def cluster():
    with Cluster(num_workers=1) as started:
        yield started


def test_variables_set_after_import_are_used_by_the_store(cluster, monkeypatch):
    """TENSORKV_PACK_MIN_VALUES=3 set after `import tensorkv`: a list of 3 keys fuses (with the
    default, 16, it would not), so the store read it when it was created."""
    monkeypatch.setenv("TENSORKV_TRANSPORT", "tcp")
    monkeypatch.setenv("TENSORKV_PACK_MIN_VALUES", "3")
    monkeypatch.setenv("TENSORKV_CHUNK_BYTES", "4096")
    monkeypatch.setenv("TENSORKV_IF_EXISTS", "replace")
    keys = ["a", "b", "c"]
    with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=TIMEOUT) as kv:
        assert (kv._config.transport, kv._config.pack_min_values, kv._config.chunk_bytes) == ("tcp", 3, 4096)
        assert kv._sessions[0].thresholds.session_max_bytes == 4096
        kv.init(keys, [np.zeros(2, np.float32)] * 3)
        kv.push(keys, [np.ones(2, np.float32)] * 3)
        outs = [np.empty(2, np.float32) for _ in keys]
        kv.pull(keys, out=outs)
        assert kv._lists.get(keys) is not None
        assert [out.tolist() for out in outs] == [[1.0, 1.0]] * 3


def test_arguments_win_over_config_which_wins_over_variables(cluster, monkeypatch):
    monkeypatch.setenv("TENSORKV_TRANSPORT", "udp")  # bad: never read, the argument is given
    monkeypatch.setenv("TENSORKV_BIGARRAY_BOUND", "7")
    monkeypatch.setenv("TENSORKV_PACK_MIN_VALUES", "9")
    settings = ClientConfig(transport="tcp", bigarray_bound=100, if_exists="replace")
    with tensorkv.create("dist_sync", servers=cluster.addresses, transport="grpc", config=settings) as kv:
        assert (kv.transport, kv._config.bigarray_bound, kv._config.pack_min_values) == ("grpc", 100, 9)
    with pytest.raises(tensorkv.InvalidArgumentError, match="unknown TENSORKV_TRANSPORT 'udp'"):
        tensorkv.create("dist_sync", servers=cluster.addresses)
    with pytest.raises(tensorkv.InvalidArgumentError, match="config=.* is not a tensorkv.ClientConfig"):
        tensorkv.create("dist_sync", servers=cluster.addresses, transport="grpc", config={"rank": 0})


def test_the_reference_table_lists_exactly_the_fields():
    text = REFERENCE.read_text()
    start = text.index("Worker settings: the fields of `tensorkv.ClientConfig`")
    rows = re.findall(r"^\| `(\w+)` \| `(TENSORKV_\w+)", text[start:text.index("\n\n", text.index("| argument", start))],
                      re.MULTILINE)
    assert [name for name, _ in rows] == FIELD_NAMES
    assert [variable for _, variable in rows] == [config.variable(name) for name in FIELD_NAMES]


def _environment():
    import os
    return {k: v for k, v in os.environ.items() if not k.startswith("TENSORKV_")}


def test_chunk_bytes_bounds_the_optimizer_states_a_worker_sends(cluster):
    """chunk_bytes=4096: the SetUpdater messages carrying 40,000 bytes of optimizer states have
    frames of 4096 data bytes at most (and a header), and the server installs them (before, the
    states went in one 1 MiB frame whatever the setting: states_wire used codec's default). The
    messages are read on their way through the worker's stub; the server is real."""
    from tensorkv.wire.codec import Item
    from tensorkv.optimizer import SGD
    states = {"w": (3, [Item("w", np.arange(10_000, dtype=np.float32))])}
    settings = ClientConfig(chunk_bytes=4096, if_exists="replace")
    with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=TIMEOUT, config=settings) as kv:
        kv.init("w", np.zeros(10_000, np.float32))
        conn, sent = kv._conns[0], []
        real = conn.stub.SetUpdater

        def set_updater(messages, timeout):
            sent.extend(messages)
            return real(iter(sent), timeout=timeout)
        conn.stub.SetUpdater = set_updater
        conn.set_updater(SGD(momentum=0.9), states, "set_optimizer")
        assert len(sent) >= 10
        assert max(message.states.ByteSize() for message in sent) <= 4096 + 256
