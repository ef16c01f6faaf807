"""The TENSORKV_* environment variables the client reads: a value that is not of its kind is
an InvalidArgumentError naming the variable and the value, read when a store is created
(against a real server), never when tensorkv is imported."""
import pytest

import tensorkv
from tensorkv.wire import allocator

from cluster import Cluster


@pytest.fixture(scope="module")
def cluster():
    with Cluster(num_workers=1) as started:
        yield started


@pytest.mark.parametrize("name, value, words", [
    ("TENSORKV_RANK", "abc", "TENSORKV_RANK='abc' is not a whole number"),
    ("TENSORKV_RANK", "-1", "TENSORKV_RANK=-1 is below its least value, 0"),
    ("TENSORKV_NUM_WORKERS", "2.5", "TENSORKV_NUM_WORKERS='2.5' is not a whole number"),
    ("TENSORKV_NUM_WORKERS", "0", "TENSORKV_NUM_WORKERS=0 is below its least value, 1"),
    ("TENSORKV_BIGARRAY_BOUND", "1e6", "TENSORKV_BIGARRAY_BOUND='1e6' is not a whole number"),
    ("TENSORKV_NO_SESSION", "maybe", "TENSORKV_NO_SESSION='maybe' is neither true"),
    ("TENSORKV_TRANSPORT", "udp", "unknown TENSORKV_TRANSPORT 'udp'; use one of 'auto', 'tcp', 'grpc'"),
    ("TENSORKV_IF_EXISTS", "keep", "unknown TENSORKV_IF_EXISTS 'keep'; use one of 'fail', 'resume', 'replace'"),
    ("TENSORKV_CHUNK_BYTES", "1MiB", "TENSORKV_CHUNK_BYTES='1MiB' is not a whole number"),
    ("TENSORKV_CHUNK_BYTES", "0", "TENSORKV_CHUNK_BYTES=0 is below its least value, 1"),
    ("TENSORKV_SHM_MIN_BYTES", "16k", "TENSORKV_SHM_MIN_BYTES='16k' is not a whole number"),
    ("TENSORKV_DATACHAN_MIN_BYTES", "x", "TENSORKV_DATACHAN_MIN_BYTES='x' is not a whole number"),
    ("TENSORKV_PACK_MIN_VALUES", "-3", "TENSORKV_PACK_MIN_VALUES=-3 is below its least value, 0"),
])
def test_a_bad_variable_read_by_create_is_named_with_its_value(cluster, monkeypatch, name, value, words):
    monkeypatch.setenv(name, value)
    with pytest.raises(tensorkv.InvalidArgumentError) as caught:
        tensorkv.create("dist_sync", servers=cluster.addresses)
    assert words in str(caught.value)


@pytest.mark.parametrize("options, words", [
    ({"rank": "abc"}, "rank='abc' is not a whole number"),
    ({"rank": -1}, "rank=-1 is below its least value, 0"),
    ({"num_workers": 1.5}, "num_workers=1.5 is not a whole number"),
    ({"bigarray_bound": 0}, "bigarray_bound=0 is below its least value, 1"),
])
def test_the_same_keyword_arguments_are_checked_alike(cluster, options, words):
    """rank='abc' raised a bare ValueError too."""
    with pytest.raises(tensorkv.InvalidArgumentError) as caught:
        tensorkv.create("dist_sync", servers=cluster.addresses, **options)
    assert words in str(caught.value)


@pytest.mark.parametrize("value, sessions", [("false", True), ("0", True), ("", True), ("yes", False),
                                             ("1", False)])
def test_no_session_reads_true_and_false_words(cluster, monkeypatch, value, sessions):
    """TENSORKV_NO_SESSION=false leaves sessions on (any value but '' and '0' turned them off)."""
    monkeypatch.setenv("TENSORKV_NO_SESSION", value)
    with tensorkv.create("dist_sync", servers=cluster.addresses, if_exists="replace") as kv:
        assert (kv._sessions is not None) == sessions


def test_no_malloc_tuning_reads_true_and_false_words(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv("TENSORKV_NO_MALLOC_TUNING", "true")
    assert not allocator.wanted()
    monkeypatch.setenv("TENSORKV_NO_MALLOC_TUNING", "sometimes")
    with pytest.raises(tensorkv.InvalidArgumentError, match="TENSORKV_NO_MALLOC_TUNING='sometimes' is neither"):
        allocator.wanted()

