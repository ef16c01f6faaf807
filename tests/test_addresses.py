"""Server addresses as users get them wrong, and servers that are not there or go away: each
fails with its own error, in words, within its bound."""
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tensorkv

from cluster import WAIT, Cluster, free_port, stop, wait_until

FAST = 2.0  # seconds a refused connection or an unknown host may take to fail


def create_timed(servers, **options):
    """(the error ``tensorkv.create`` raised, seconds it took)."""
    start = time.monotonic()
    with pytest.raises(tensorkv.KVStoreError) as caught:
        tensorkv.create("dist_sync", servers=servers, **options)
    return caught.value, time.monotonic() - start


@pytest.mark.parametrize("entry, why", [
    ("http://127.0.0.1:50051", "drop the scheme: write '127.0.0.1:50051'"),
    ("127.0.0.1", "no port: write e.g. '127.0.0.1:50051'"),
    ("127.0.0.1:5005l", "port '5005l' is not a number"),
    (":50051", "no host before the port"),
    ("127.0.0.1:0", "port 0 is not in 1..65535"),
    ("127.0.0.1:65536", "port 65536 is not in 1..65535"),
    ("::1:50051", "an IPv6 address goes in brackets: write '[::1]:50051'"),
    ("[::1]", "no port: write e.g. '[::1]:50051'"),
    ("[not-v6]:50051", "'not-v6' is not an IPv6 address"),
])
def test_a_malformed_address_is_refused_before_any_connection(monkeypatch, entry, why):
    error, _ = create_timed(["127.0.0.1:50051", entry])
    assert isinstance(error, tensorkv.InvalidArgumentError)
    assert str(error) == f"servers: {entry!r} is not a server address host:port: {why}"
    monkeypatch.setenv("TENSORKV_SERVERS", f"{entry},127.0.0.1:50051")
    error, _ = create_timed(None)
    assert isinstance(error, tensorkv.InvalidArgumentError) and str(error).startswith(f"TENSORKV_SERVERS: {entry!r}")


def test_ipv6_addresses_in_brackets_are_accepted():
    port = free_port()  # nothing listens there: the address passed the check and was tried
    error, _ = create_timed(f"[::1]:{port}")
    assert isinstance(error, tensorkv.ServerUnavailableError) and f"[::1]:{port}" in str(error)


@pytest.mark.parametrize("host, cause", [
    ("127.0.0.1", "cannot connect to server {address}: the connection was refused (nothing listens on that port)"),
    ("no-such-host.invalid", "cannot reach server {address}: host no-such-host.invalid is unknown "
                             "(its name does not resolve)"),
])
def test_nothing_listening_and_an_unknown_host_fail_fast_and_say_so(host, cause):
    address = f"{host}:{free_port()}"
    error, seconds = create_timed(address)
    assert isinstance(error, tensorkv.ServerUnavailableError)
    assert str(error) == cause.format(address=address) + f"; is tensorkv-server running on {address}?"
    assert seconds < FAST


def test_an_http_server_on_the_port_is_not_taken_for_a_tensorkv_server():
    port = free_port()
    http = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _listening(port), "the HTTP server")
        error, seconds = create_timed(f"127.0.0.1:{port}")
    finally:
        stop(http)
    assert isinstance(error, tensorkv.ServerUnavailableError)
    assert "something else answers there: not a tensorkv (gRPC) server" in str(error)
    assert seconds < FAST


def _listening(port):
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_silent_server_waits_for_the_connect_timeout(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster:
        server = cluster.processes[0]
        server.send_signal(signal.SIGSTOP)  # connections are accepted by the kernel, nothing answers
        try:
            error, _ = create_timed(cluster.addresses, connect_timeout=1)
        finally:
            server.send_signal(signal.SIGCONT)
    assert isinstance(error, tensorkv.ServerUnavailableError)
    assert str(error) == (f"server {cluster.addresses[0]} is unreachable: no answer within 1 s; "
                          f"is tensorkv-server running on {cluster.addresses[0]}?")


@pytest.mark.parametrize("kind, session, effect", [
    ("pull", True, "the pull changed nothing"),
    ("pull", False, "the pull changed nothing"),
    ("pushpull", True, "the pushpull may have been applied"),
])
def test_a_server_killed_during_a_call_is_named_with_what_the_call_may_have_done(tmp_path, kind, session, effect):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        kv = tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, session=session, timeout=2)
        try:
            kv.init("w", np.zeros(4, np.float32))
            kv.push("w", np.ones(4, np.float32))  # rank 1 never pushes: the round waits
            errors = []

            def wait_in_call():
                try:
                    kv.pull("w") if kind == "pull" else kv.pushpull("w", np.ones(4, np.float32))
                except tensorkv.KVStoreError as error:
                    errors.append(error)
            thread = threading.Thread(target=wait_in_call)
            thread.start()
            thread.join(0.5)
            assert thread.is_alive(), f"the {kind} did not wait for the round"
            cluster.kill(0)
            thread.join(WAIT)
            assert not thread.is_alive(), f"the {kind} did not fail within {WAIT} s"
        finally:
            kv.close()
    assert len(errors) == 1 and isinstance(errors[0], tensorkv.ServerUnavailableError), errors
    # what happened to the call, then why reconnecting for its timeout failed
    assert str(errors[0]).startswith(f"server {cluster.addresses[0]} closed the connection during the {kind} "
                                     f"(it may have crashed or been killed); {effect}; reconnecting for 2 s"), errors
