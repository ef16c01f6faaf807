"""TLS, mutual TLS and tokens on real server processes, with certificates made in the test
(trustme): every refusal fails at once and says which credential is wrong."""
import asyncio
import contextlib
import datetime
import logging
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import tensorkv
from tensorkv.wire import datachan
from tensorkv.transport.security import Security
from tensorkv_server.datachan import HANDSHAKE_TIMEOUT, MAX_PENDING, TOKEN_BYTES
from tensorkv_server.security import RefusalLog
from tensorkv_server.server import MAX_CONCURRENT_STREAMS
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc, maintenance_pb2, tensor_pb2

from cluster import CALL, ROOT, WORKER_TIMEOUT, Cluster, check_workers, free_port, health, stop, wait_until
from test_datachan import _token
from test_metrics import scrape

SERVICE = kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"]
MAINTENANCE = maintenance_pb2.DESCRIPTOR.services_by_name["MaintenanceService"]
READ_ONLY = {"Info", "Pull", "GetOptimizerStates", "ListKeys", "ReadKey"}
TOKEN, READ_ONLY_TOKEN = "rw-token-0123456789abcdef", "ro-token-0123456789abcdef"
FAST = 5.0  # seconds within which a refused connection must fail (the connect timeout is 10 s)


class Pki:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as files in ``path``."""

    def __init__(self, path, server_not_after=None):
        path.mkdir(exist_ok=True)
        self.path, self.ca = path, trustme.CA()
        self.ca_file = self._write("ca.pem", self.ca.cert_pem.bytes())
        self.cert, self.key = self.issue("server", "127.0.0.1", "localhost", not_after=server_not_after)
        self.client_cert, self.client_key = self.issue("client", "worker@example")

    def issue(self, name, *identities, ca=None, not_after=None):
        leaf = (ca or self.ca).issue_cert(*identities, not_after=not_after)
        return (self._write(f"{name}.pem", b"".join(p.bytes() for p in leaf.cert_chain_pems)),
                self._write(f"{name}.key", leaf.private_key_pem.bytes()))

    def _write(self, name, data):
        file = self.path / name
        file.write_bytes(data)
        return str(file)

    def server_args(self, mutual=False):
        return ["--tls-cert", self.cert, "--tls-key", self.key, *(["--tls-client-ca", self.ca_file] if mutual else [])]

    def env(self, client_cert=True):
        env = {"TENSORKV_TLS_CA": self.ca_file}
        if client_cert:
            env.update(TENSORKV_TLS_CERT=self.client_cert, TENSORKV_TLS_KEY=self.client_key)
        return env


@pytest.fixture
def pki(tmp_path):
    return Pki(tmp_path)


def _fails_at_once(match, **kwargs):
    """The store raises UnauthenticatedError matching ``match`` well before the connect timeout."""
    start = time.monotonic()
    with pytest.raises(tensorkv.UnauthenticatedError, match=match):
        tensorkv.create("dist_sync", **kwargs)
    assert time.monotonic() - start < FAST


@pytest.mark.parametrize("mutual_with_token, transport, described", [
    (False, "auto", "TLS, no tokens"),
    (True, "tcp", "mutual TLS, tokens"),  # every credential, and the values on the TLS data channel
])
def test_tutorial_against_a_tls_server(mutual_with_token, transport, described, pki, tmp_path):
    expected = (ROOT / "tests" / "data" / "tutorial_expected.txt").read_text().splitlines(keepends=True)
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    server_args = [*pki.server_args(mutual=mutual_with_token), *(["--token-file", str(tokens)] if mutual_with_token else [])]
    env = {**pki.env(client_cert=mutual_with_token), "TENSORKV_TRANSPORT": transport}
    if mutual_with_token:
        env.update(TENSORKV_TOKEN=TOKEN, TENSORKV_DATACHAN_MIN_BYTES="1")
    security = Security(pki.ca_file, *((pki.client_cert, pki.client_key, TOKEN) if mutual_with_token else ()))
    with Cluster(tmp_path=tmp_path, server_args=server_args, security=security) as cluster:
        result = subprocess.run([sys.executable, str(ROOT / "examples" / "tutorial_dist.py")], env={**cluster.env, **env},
                                capture_output=True, text=True, timeout=WORKER_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "".join(line for line in expected if not line.startswith("update on key"))
    log = (tmp_path / "server0.log").read_text()
    assert described in log
    assert "data channel from" in log or not mutual_with_token


def test_sync_rounds_over_mutual_tls_with_a_token_and_the_data_channel(pki, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# workers\n{TOKEN}\n")
    security = Security(pki.ca_file, pki.client_cert, pki.client_key, TOKEN)
    env = {**pki.env(), "TENSORKV_TOKEN": TOKEN, "TENSORKV_TRANSPORT": "tcp", "TENSORKV_DATACHAN_MIN_BYTES": "1"}
    with Cluster(num_workers=2, tmp_path=tmp_path, security=security,
                 server_args=[*pki.server_args(mutual=True), "--token-file", str(tokens)]) as cluster:
        outs = check_workers(cluster.run_workers("sync_rounds", 3, env=env))
    assert sorted(outs) == ["ok 0\n", "ok 1\n"]
    log = (tmp_path / "server0.log").read_text()
    assert "mutual TLS, tokens" in log and log.count("data channel from") == 2  # one per worker


def test_values_over_a_tls_data_channel(pki, tmp_path):
    with Cluster(tmp_path=tmp_path, server_args=pki.server_args(), security=Security(pki.ca_file)) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp", tls_ca=pki.ca_file) as kv:
            for size in (10, 100_000, 3 << 20):
                value = np.arange(size, dtype=np.float32) % 1000
                kv.init(size, value)
                kv.push(size, value * 2)
                out = np.empty(size, np.float32)
                kv.pull(size, out=out)
                fused = np.empty(size, np.float32)
                kv.pushpull(size, value * 3, out=fused)
                assert np.array_equal(out, value * 2) and np.array_equal(fused, value * 3)
            keys = [1000 + i for i in range(20)]  # packed; fused from the second push (tensorkv.stores.fusion)
            kv.init(keys, [np.zeros(i + 1, np.float32) for i in range(20)])
            outs = [np.empty(i + 1, np.float32) for i in range(20)]
            for step in range(3):
                kv.push(keys, [np.full(i + 1, step + i, np.float32) for i in range(20)])
                kv.pull(keys, out=outs)
                assert all(np.array_equal(out, np.full(i + 1, step + i, np.float32)) for i, out in enumerate(outs))
            assert kv._lists.get(keys) is not None and kv._sessions[0].data_channel is not None


def _tls_data_port(pki, cluster):
    """The data port of a TLS server, and a client context that presents a client certificate."""
    with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp", tls_ca=pki.ca_file,
                         tls_cert=pki.client_cert, tls_key=pki.client_key) as kv:
        return kv._sessions[0].data_port, kv._security.data_channel_context()


def _closed_by_server(sock, within):
    """Whether the server closes ``sock`` within ``within`` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, ssl.SSLError):
        return True
    except socket.timeout:
        return False


def test_the_tls_data_port_refuses_strangers(pki, tmp_path):
    with Cluster(tmp_path=tmp_path, server_args=pki.server_args(mutual=True),
                 security=Security(pki.ca_file, pki.client_cert, pki.client_key)) as cluster:
        port, context = _tls_data_port(pki, cluster)
        with socket.create_connection(("127.0.0.1", port), 5) as plain:  # a token in plaintext
            plain.sendall(bytes(32))
            assert _closed_by_server(plain, FAST)
        anonymous = ssl.create_default_context(cafile=pki.ca_file)
        try:
            with anonymous.wrap_socket(socket.create_connection(("127.0.0.1", port), 5),
                                       server_hostname="127.0.0.1") as tls:
                tls.sendall(bytes(32))  # TLS 1.3: the missing certificate is refused after the handshake
                assert _closed_by_server(tls, FAST)
        except (ssl.SSLError, ConnectionError):
            pass  # refused within the handshake
        with context.wrap_socket(socket.create_connection(("127.0.0.1", port), 5), server_hostname="127.0.0.1") as tls:
            tls.sendall(bytes(32))  # a certificate, but no token the server gave
            assert _closed_by_server(tls, FAST)
        with context.wrap_socket(socket.create_connection(("127.0.0.1", port), 5), server_hostname="127.0.0.1") as idle:
            assert _closed_by_server(idle, HANDSHAKE_TIMEOUT + FAST)  # no token at all
    log = (tmp_path / "server0.log").read_text()
    assert log.count("data channel connection from") == 4 and "PEER_DID_NOT_RETURN_A_CERTIFICATE" in log, log


def test_a_token_gets_in_however_many_connections_wait_idle(tmp_path):
    """At most MAX_PENDING connections wait for their token, and a new one closes the oldest: a
    worker's connection gets in whatever idle ones hold the port (it was refused: 64 idle
    connections renewed every 4 s kept workers off the data channel)."""
    with Cluster(tmp_path=tmp_path) as cluster:
        address = cluster.addresses[0]
        with tensorkv.create("dist_sync", servers=address, transport="tcp") as kv:
            port = kv._sessions[0].data_port
        response, session = _token(address, port)
        idle = []
        try:
            idle = [socket.create_connection(("127.0.0.1", port), 5) for _ in range(MAX_PENDING + 8)]
            with socket.create_connection(("127.0.0.1", port), 5) as worker:
                worker.settimeout(WORKER_TIMEOUT)
                worker.sendall(response.data_token)
                assert worker.recv(1) == datachan.ACK
        finally:
            session.close()
            for sock in idle:
                sock.close()
    assert f"closed: {MAX_PENDING} newer connections came before its token" in (tmp_path / "server0.log").read_text()


def test_refused_data_connections_are_logged_once_per_interval(tmp_path):
    """200 connections with unknown tokens: one log line a minute (there was one per connection)."""
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp") as kv:
            port = kv._sessions[0].data_port
            for _ in range(200):
                with socket.create_connection(("127.0.0.1", port), 5) as junk:
                    junk.sendall(bytes(TOKEN_BYTES))
                    assert _closed_by_server(junk, WORKER_TIMEOUT)
            kv.init("w", np.ones(1 << 20, np.float32))  # the channel still binds
            assert kv._sessions[0].data_channel is not None
        log = (tmp_path / "server0.log").read_text()
    assert log.count("refused: unknown or used token") <= 2, log  # one a minute (REFUSAL_LOG_INTERVAL)


def test_tls_refusals_fail_at_once_and_say_why(pki, tmp_path):
    other = Pki(tmp_path / "other")
    with Cluster(tmp_path=tmp_path, server_args=pki.server_args(), security=Security(pki.ca_file)) as cluster:
        servers = cluster.addresses[0]
        _fails_at_once("uses TLS and this client does not", servers=servers)
        _fails_at_once("certificate is not trusted", servers=servers, tls_ca=other.ca_file)
        with tensorkv.create("dist_sync", servers=servers, tls_ca=pki.ca_file) as kv:
            kv.init(1, np.ones(2))
    with Cluster(tmp_path=tmp_path) as plaintext:
        _fails_at_once("does not use TLS", servers=plaintext.addresses[0], tls_ca=pki.ca_file)


def _utc_now():
    return datetime.datetime.now(datetime.timezone.utc)


def test_a_server_certificate_that_expires_while_serving_is_named(tmp_path):
    """An expired certificate is refused at start (below): here it expires once the server serves."""
    expiring = Pki(tmp_path, server_not_after=_utc_now() + datetime.timedelta(seconds=8))
    with Cluster(tmp_path=tmp_path, server_args=expiring.server_args(), security=Security(expiring.ca_file)) as cluster:
        time.sleep(max(0.0, (_not_after(expiring.cert) - _utc_now()).total_seconds() + 1))
        _fails_at_once("certificate has expired", servers=cluster.addresses[0], tls_ca=expiring.ca_file)


def _not_after(pem_file):
    """The notAfter of the first certificate of ``pem_file``."""
    return x509.load_pem_x509_certificate(open(pem_file, "rb").read()).not_valid_after_utc


def test_an_expired_server_certificate_refuses_to_start_naming_the_file_and_date(tmp_path):
    expired = Pki(tmp_path, server_not_after=_utc_now() - datetime.timedelta(days=1))
    result = subprocess.run(_server("--port", str(free_port()), *expired.server_args()), capture_output=True,
                            text=True, timeout=30)
    day = f"{_not_after(expired.cert):%Y-%m-%d %H:%M:%S} UTC"
    assert result.returncode == 2 and result.stderr == \
        f"tensorkv-server: --tls-cert {expired.cert} expired on {day}: renew it\n", result.stderr


def test_certificate_expiry_is_a_metric_and_a_warning_within_30_days(tmp_path):
    pki = Pki(tmp_path, server_not_after=_utc_now() + datetime.timedelta(days=10))
    port = free_port()
    security = Security(pki.ca_file, pki.client_cert, pki.client_key)
    with Cluster(tmp_path=tmp_path, server_args=[*pki.server_args(mutual=True), "--metrics-port", str(port)],
                 security=security):
        _, samples = scrape(port)
    expiry = "tensorkv_tls_certificate_expiry_timestamp_seconds"
    assert samples[(expiry, (("certificate", "server"),))] == _not_after(pki.cert).timestamp()
    assert samples[(expiry, (("certificate", "client_ca"),))] == _not_after(pki.ca_file).timestamp()
    day = f"{_not_after(pki.cert):%Y-%m-%d %H:%M:%S} UTC"
    log = (tmp_path / "server0.log").read_text()
    assert f"WARNING tensorkv_server.main: --tls-cert {pki.cert} expires on {day}, within 30 days" in log, log
    assert "--tls-client-ca" not in log, log  # the CA lasts until 3000


def _retired_ca_pem():
    """A CA certificate that expired yesterday, as PEM bytes."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "retired CA")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(_utc_now() - datetime.timedelta(days=400))
            .not_valid_after(_utc_now() - datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


def test_a_client_ca_bundle_that_still_holds_a_retired_ca_is_taken(pki, tmp_path):
    """--tls-client-ca of the current CA and one that expired (as during a CA rotation): the
    server starts, a worker with a certificate of the current CA gets in, and the metric says
    when the bundle's last CA expires (a review: one expired CA in the bundle stopped the server)."""
    bundle = tmp_path / "client-cas.pem"
    bundle.write_bytes(_retired_ca_pem() + open(pki.ca_file, "rb").read())
    port = free_port()
    server_args = [*pki.server_args(), "--tls-client-ca", str(bundle), "--metrics-port", str(port)]
    security = Security(pki.ca_file, pki.client_cert, pki.client_key)
    with Cluster(tmp_path=tmp_path, server_args=server_args, security=security) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, tls_ca=pki.ca_file, tls_cert=pki.client_cert,
                             tls_key=pki.client_key) as kv:
            kv.init(1, np.ones(2))
        _, samples = scrape(port)
    assert samples[("tensorkv_tls_certificate_expiry_timestamp_seconds", (("certificate", "client_ca"),))] == \
        _not_after(pki.ca_file).timestamp()


def test_a_rotation_to_an_expired_certificate_keeps_the_previous_one(pki, tmp_path):
    port = free_port()
    with Cluster(tmp_path=tmp_path, server_args=[*pki.server_args(), "--metrics-port", str(port)],
                 security=Security(pki.ca_file)) as cluster:
        expired = Pki(tmp_path / "expired", server_not_after=_utc_now() - datetime.timedelta(days=1))
        for source, target in ((expired.cert, pki.cert), (expired.key, pki.key)):
            os.replace(source, target)
        assert Security(pki.ca_file).diagnose(cluster.addresses[0]) is None  # a new connection: the previous pair
        assert Security(pki.ca_file).diagnose(cluster.addresses[0]) is None
        # and a new data-channel connection gets the previous pair too (it loaded the files as they were)
        data_port = _info(cluster.addresses[0], pki).data_port
        context = ssl.create_default_context(cafile=pki.ca_file)
        with socket.create_connection(("127.0.0.1", data_port), timeout=10) as sock, \
                context.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
            served = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).not_valid_after_utc
        assert served > _utc_now()  # not the expired one
        log = (tmp_path / "server0.log").read_text()
        assert f"--tls-cert {pki.cert} expired on" in log and "keeping the previous certificate" in log, log
        assert log.count("keeping the previous certificate") == 1, log  # once, not per connection
        _, samples = scrape(port)
    assert samples[("tensorkv_tls_certificate_expiry_timestamp_seconds", (("certificate", "server"),))] > time.time()


def _info(address, pki):
    with Security(pki.ca_file).channel(address, ()) as channel:
        return kvstore_pb2_grpc.KVStoreServiceStub(channel).Info(kvstore_pb2.InfoRequest(), timeout=10)


def test_mutual_tls_refuses_a_client_without_or_with_a_foreign_certificate(pki, tmp_path):
    stranger = trustme.CA()
    foreign_cert, foreign_key = pki.issue("foreign", "worker@example", ca=stranger)
    security = Security(pki.ca_file, pki.client_cert, pki.client_key)
    with Cluster(tmp_path=tmp_path, server_args=pki.server_args(mutual=True), security=security) as cluster:
        servers = cluster.addresses[0]
        _fails_at_once("requires a client certificate", servers=servers, tls_ca=pki.ca_file)
        _fails_at_once("refused this client.s certificate", servers=servers, tls_ca=pki.ca_file,
                       tls_cert=foreign_cert, tls_key=foreign_key)
        with tensorkv.create("dist_sync", servers=servers, tls_ca=pki.ca_file, tls_cert=pki.client_cert,
                             tls_key=pki.client_key):
            pass


def test_a_rotated_certificate_serves_new_connections(pki, tmp_path):
    with Cluster(tmp_path=tmp_path, server_args=pki.server_args(), security=Security(pki.ca_file)) as cluster:
        servers = cluster.addresses[0]
        with tensorkv.create("dist_sync", servers=servers, tls_ca=pki.ca_file) as kv:
            kv.init("w", np.ones(3))
            os.replace(pki.client_key, pki.key)  # a key that does not fit the certificate
            assert Security(pki.ca_file).diagnose(servers) is None  # a new connection: the previous pair
            assert "keeping the previous certificate" in (tmp_path / "server0.log").read_text()
            new = Pki(tmp_path / "new")
            for source, target in ((new.cert, pki.cert), (new.key, pki.key)):
                os.replace(source, target)  # as a secret volume swaps its files
            _fails_at_once("certificate is not trusted", servers=servers, tls_ca=pki.ca_file)
            assert health(servers, security=Security(new.ca_file)) == "SERVING"
            assert (kv.pull("w") == 1).all()  # the open connection keeps its session
        with tensorkv.create("dist_sync", servers=servers, tls_ca=new.ca_file) as kv:
            assert (kv.pull("w") == 1).all()


def _raw_call(channel, method, metadata, request=b""):
    """Call ``method`` of the service with the serialized ``request``; its status code and details."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    call = kind[method.client_streaming, method.server_streaming](path)
    request = iter([request]) if method.client_streaming else request
    try:
        result = call(request, timeout=CALL, metadata=metadata)
        if method.server_streaming:
            list(result)
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


@pytest.fixture(params=[False, True], ids=["", "metrics"])
def token_server(request, tmp_path):
    """A server with a read-write and a read-only token; and with --metrics-port, whose
    interceptor sees each call before the token check does."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# training jobs\n{TOKEN}\n\n{READ_ONLY_TOKEN} ro  # dashboards\n")
    metrics = ["--metrics-port", str(free_port())] if request.param else []
    with Cluster(tmp_path=tmp_path, server_args=["--token-file", str(tokens), *metrics]) as cluster:
        yield cluster.addresses[0]


def test_every_method_needs_a_token_and_read_only_tokens_only_read(token_server):
    refused = []
    with grpc.insecure_channel(token_server) as channel:
        for method in [*SERVICE.methods, *MAINTENANCE.methods]:
            for metadata, expected in (
                    ((), grpc.StatusCode.UNAUTHENTICATED),
                    ((("authorization", "Bearer not-a-token-0123456789"),), grpc.StatusCode.UNAUTHENTICATED),
                    ((("authorization", TOKEN),), grpc.StatusCode.UNAUTHENTICATED),  # no Bearer scheme
                    ((("authorization", f"Bearer {READ_ONLY_TOKEN}"),),
                     None if method.name in READ_ONLY else grpc.StatusCode.PERMISSION_DENIED)):
                code, details = _raw_call(channel, method, metadata)
                if expected is None:
                    assert code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), details
                else:
                    assert code == expected, (method.name, metadata, code, details)
                    refused.append(details)
        for details in refused:
            assert TOKEN not in details and READ_ONLY_TOKEN not in details and "/" not in details  # nor a path
        # health answers without a token; reflection, which lists the service, does not
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=CALL)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as error:
            list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=CALL))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_each_call_is_checked_whatever_the_calls_before_it(token_server):
    """The token decides each call: one call's answer is never reused for the next (the
    metrics interceptor once kept the first handler a method got, a refusal or not)."""
    rw, ro, none = (("authorization", f"Bearer {TOKEN}"),), (("authorization", f"Bearer {READ_ONLY_TOKEN}"),), ()
    reset = SERVICE.methods_by_name["Reset"]
    info = SERVICE.methods_by_name["Info"]
    request = kvstore_pb2.InfoRequest().SerializeToString()
    with grpc.insecure_channel(token_server) as channel:
        for method, request, turns in (
                (reset, b"", [(rw, grpc.StatusCode.OK), (none, grpc.StatusCode.UNAUTHENTICATED),
                              (ro, grpc.StatusCode.PERMISSION_DENIED), (rw, grpc.StatusCode.OK)]),
                (info, request, [(none, grpc.StatusCode.UNAUTHENTICATED), (ro, grpc.StatusCode.OK),
                                 (rw, grpc.StatusCode.OK), (none, grpc.StatusCode.UNAUTHENTICATED)])):
            for metadata, expected in turns:
                code, details = _raw_call(channel, method, metadata, request)
                assert code == expected, (method.name, metadata, code, details)


def test_refusals_do_not_tell_whether_a_key_exists(token_server):
    with tensorkv.create("dist_sync", servers=token_server, token=TOKEN) as kv:
        kv.init("present", np.ones(2))
        with grpc.insecure_channel(token_server) as channel:
            for metadata in ((), (("authorization", "Bearer not-a-token-0123456789"),)):
                answers = set()
                for key in ("present", "absent"):
                    request = kvstore_pb2.PullRequest(keys=[tensor_pb2.Key(str_key=key)]).SerializeToString()
                    answers.add(_raw_call(channel, SERVICE.methods_by_name["Pull"], metadata, request))
                assert len(answers) == 1 and answers.pop()[0] == grpc.StatusCode.UNAUTHENTICATED


def _values(answer):
    """The float32 values of the one entry of a PullResponse."""
    return np.frombuffer(answer.frame.entries[0].tensor.data, np.float32).tolist()


def test_a_read_only_token_pulls_as_no_rank(tmp_path):
    """Issue 31: a read-only caller that named rank 1 (and its incarnation, which Info shows) in a
    Pull took rank 1's place in its rounds: it consumed rank 1's RoundAbortedError, and rank 1's
    own next pull returned as if its push had been merged. A read-only token reads as no rank
    (the stored values now, as ReadKey), whatever rank its Pull names."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n{READ_ONLY_TOKEN} ro\n")
    reader = (("authorization", f"Bearer {READ_ONLY_TOKEN}"),)
    with Cluster(num_workers=2, round_timeout=1.0, tmp_path=tmp_path, server_args=["--token-file", str(tokens)]) \
            as cluster, grpc.insecure_channel(cluster.addresses[0]) as channel:
        stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
        with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, token=TOKEN) as kv0, \
                tensorkv.create("dist_sync", servers=cluster.addresses, rank=1, token=TOKEN) as kv1:
            kv0.init("w", np.zeros(4, np.float32))
            kv1.init("w", np.zeros(4, np.float32))
            kv1.push("w", np.ones(4, np.float32))  # round 1: rank 0 never joins, it aborts after 1 s
            wait_until(lambda: "round 1 aborted" in (tmp_path / "server0.log").read_text(), "round 1 aborted")
            incarnation = {lease.rank: lease.incarnation
                           for lease in stub.Info(kvstore_pb2.InfoRequest(), metadata=reader, timeout=5).workers}[1]
            request = kvstore_pb2.PullRequest(rank=1, incarnation=incarnation, keys=[tensor_pb2.Key(str_key="w")])
            [answer] = stub.Pull(request, metadata=reader, timeout=10)
            assert _values(answer) == [0.0] * 4
            with pytest.raises(tensorkv.RoundAbortedError, match="round 1 aborted after 1 s"):
                kv1.pull("w")  # rank 1 still hears that its push was not merged
            np.testing.assert_array_equal(kv0.pull("w"), np.zeros(4, np.float32))
            # nor does it wait for rank 1's open round, or take its place there: it reads the value
            # as it is (round 2 is left to abort too: a round that rank 0 completed would have to
            # do so within the 1 s round timeout, which a loaded machine need not meet)
            kv1.push("w", np.full(4, 3, np.float32))
            [answer] = stub.Pull(request, metadata=reader, timeout=10)
            assert _values(answer) == [0.0] * 4
            with pytest.raises(tensorkv.RoundAbortedError, match="aborted after 1 s"):
                kv1.pull("w")
            np.testing.assert_array_equal(kv0.pull("w"), np.zeros(4, np.float32))


def test_reset_reaches_a_server_with_tls_and_tokens_and_says_what_it_lacks(pki, tmp_path, monkeypatch):
    """tensorkv.reset() took no credentials and opened a plaintext channel: it could not reach
    such a server at all. It takes create()'s options and variables now."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n{READ_ONLY_TOKEN} ro\n")
    security = Security(pki.ca_file, pki.client_cert, pki.client_key, TOKEN)
    credentials = dict(tls_ca=pki.ca_file, tls_cert=pki.client_cert, tls_key=pki.client_key)
    with Cluster(tmp_path=tmp_path, security=security,
                 server_args=[*pki.server_args(mutual=True), "--token-file", str(tokens)]) as cluster:
        for keys in (["a", "b"], ["c"]):
            with tensorkv.create("dist_sync", servers=cluster.addresses, token=TOKEN, **credentials) as kv:
                kv.init(keys, [np.ones(2)] * len(keys))
            if keys == ["a", "b"]:
                assert tensorkv.reset(cluster.addresses, token=TOKEN, **credentials) == 2
        for variable, value in pki.env().items():
            monkeypatch.setenv(variable, value)
        with pytest.raises(tensorkv.UnauthenticatedError, match="this server requires a token"):
            tensorkv.reset(cluster.addresses)
        with pytest.raises(tensorkv.PermissionDeniedError, match="read-only token"):
            tensorkv.reset(cluster.addresses, token=READ_ONLY_TOKEN)
        monkeypatch.delenv("TENSORKV_TLS_CA")
        with pytest.raises(tensorkv.InvalidArgumentError, match="client certificate is for TLS"):
            tensorkv.reset(cluster.addresses, token=TOKEN)
        for variable in ("TENSORKV_TLS_CERT", "TENSORKV_TLS_KEY"):
            monkeypatch.delenv(variable)
        with pytest.raises(tensorkv.UnauthenticatedError, match="uses TLS and this client does not"):
            tensorkv.reset(cluster.addresses, token=TOKEN)
        for variable, value in {**pki.env(), "TENSORKV_TOKEN": TOKEN}.items():
            monkeypatch.setenv(variable, value)
        assert tensorkv.reset(cluster.addresses) == 1  # "c", with the variables alone


def test_a_store_with_a_token(token_server):
    with tensorkv.create("dist_sync", servers=token_server, token=TOKEN) as kv:
        kv.init(3, np.ones(4))
        kv.push(3, np.full(4, 2.0))
        assert (kv.pull(3) == 2).all()
    _fails_at_once("requires a token", servers=token_server)
    _fails_at_once("does not accept the token this call carries", servers=token_server,
                   token="not-a-token-0123456789")
    with pytest.raises(tensorkv.PermissionDeniedError, match="read-only token .* not Register"):
        tensorkv.create("dist_sync", servers=token_server, token=READ_ONLY_TOKEN)
    with pytest.raises(tensorkv.InvalidArgumentError, match="would cross the network in plaintext"):
        tensorkv.create("dist_sync", servers="192.0.2.1:50051", token=TOKEN)


def _server(*args):
    return [sys.executable, "-m", "tensorkv_server", "--device", "cpu", *args]


@pytest.mark.parametrize("args, says", [
    ([], "with neither TLS nor a token"),
    (["--token-file", "{tokens}"], "with tokens but no TLS"),
    # TLS alone authenticates no client (an ops probe wrote and read keys with neither a token nor a
    # client certificate on such a server)
    (["--tls-cert", "{pki.cert}", "--tls-key", "{pki.key}"], "with TLS but neither a token nor client certificates"),
])
def test_a_non_loopback_address_without_protection_is_refused(args, says, pki, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    args = [arg.format(tokens=tokens, pki=pki) for arg in args]
    result = subprocess.run(_server("--host", "0.0.0.0", "--port", str(free_port()), *args),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and result.stderr.count("\n") == 1 and says in result.stderr, result.stderr


def test_insecure_allows_a_non_loopback_address(tmp_path):
    port = free_port()
    with open(tmp_path / "server.log", "w+") as log:
        process = subprocess.Popen(_server("--host", "0.0.0.0", "--port", str(port), "--insecure"),
                                   stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: _serving(f"127.0.0.1:{port}"), "the insecure server serving")
        finally:
            assert stop(process) == 0


@pytest.mark.parametrize("args, says", [
    (["--tls-cert", "{pki.cert}"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "{pki.ca_file}"], "--tls-client-ca needs --tls-cert"),
    (["--tls-cert", "{pki.cert}", "--tls-key", "{pki.client_key}"],
     "--tls-key {pki.client_key} does not go with --tls-cert {pki.cert}: the key is not the certificate's"),
    (["--tls-cert", "{pki.key}", "--tls-key", "{pki.cert}"],  # was "[ssl] pem lib (_ssl.c:3905)"
     "--tls-cert {pki.key} holds a private key, not a PEM certificate (are --tls-cert and --tls-key swapped?)"),
    (["--tls-cert", "{pki.cert}", "--tls-key", "{pki.key}", "--tls-client-ca", "{tmp_path}/missing-ca.pem"],
     "--tls-client-ca {tmp_path}/missing-ca.pem: cannot read it: No such file or directory"),
    (["--tls-cert", "{pki.cert}", "--tls-key", "{pki.key}", "--tls-client-ca", "{pki.key}"],
     "--tls-client-ca {pki.key} holds a private key, not a PEM CA certificate"),
    (["--token-file", "{tmp_path}/missing"], "--token-file {tmp_path}/missing: cannot read it: No such file"),
    (["--token-file", "{tmp_path}/short"], "line 2: a token needs at least 16"),
    (["--token-file", "{tmp_path}/marked"], "line 1: expected 'TOKEN' or 'TOKEN ro'"),
    (["--token-file", "{tmp_path}/accented"], "line 1: a token needs at least 16 printable ASCII characters"),
])
def test_bad_security_options_are_refused_in_one_line(args, says, pki, tmp_path):
    (tmp_path / "short").write_text(f"{TOKEN}\nshort\n")
    (tmp_path / "accented").write_text("tökentökentökentöken\n")
    (tmp_path / "marked").write_text(f"{TOKEN} rw\n")
    args = [arg.format(pki=pki, tmp_path=tmp_path) for arg in args]
    says = says.format(pki=pki, tmp_path=tmp_path)
    result = subprocess.run(_server("--port", str(free_port()), *args), capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and says in result.stderr, result.stderr


def test_a_token_file_that_others_can_read_is_warned_about(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    for mode, warned in ((0o644, True), (0o640, False), (0o600, False)):
        tokens.chmod(mode)
        with Cluster(tmp_path=tmp_path, server_args=["--token-file", str(tokens)]):
            log = (tmp_path / "server0.log").read_text()
        assert (f"--token-file {tokens} can be read by every user of the host (mode 644): chmod o-rwx it" in log) \
            == warned, log


def test_refused_calls_are_logged_once_per_host_and_reason(tmp_path):
    """An operator sees who is refused and why, without a retrying client flooding the log
    (RefusalLog: the first line of each host and reason at once, then one a minute)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n{READ_ONLY_TOKEN} ro\n")
    tokens.chmod(0o600)
    reset, info = SERVICE.methods_by_name["Reset"], SERVICE.methods_by_name["Info"]
    with Cluster(tmp_path=tmp_path, server_args=["--token-file", str(tokens)]) as cluster, \
            grpc.insecure_channel(cluster.addresses[0]) as channel:
        for metadata, method, times in (((), info, 5), ((("authorization", "Bearer not-a-token-0123456789"),), info, 3),
                                        ((("authorization", f"Bearer {READ_ONLY_TOKEN}"),), reset, 2)):
            for _ in range(times):
                assert _raw_call(channel, method, metadata)[0] != grpc.StatusCode.OK
        assert _raw_call(channel, info, (("authorization", f"Bearer {TOKEN}"),),
                         kvstore_pb2.InfoRequest().SerializeToString())[0] == grpc.StatusCode.OK
        wait_until(lambda: "read-only token may not" in (tmp_path / "server0.log").read_text(), "the refusals logged")
    refusals = [line for line in (tmp_path / "server0.log").read_text().splitlines() if "refused (" in line]
    assert len(refusals) == 3, refusals
    missing, unknown, read_only = refusals
    assert "call to Info from ipv4:127.0.0.1:" in missing and "(UNAUTHENTICATED): this server requires a token" in missing
    assert "(UNAUTHENTICATED): this server does not accept the token this call carries" in unknown
    assert "call to Reset from ipv4:127.0.0.1:" in read_only and "(PERMISSION_DENIED)" in read_only
    assert not any(TOKEN in line or READ_ONLY_TOKEN in line or "not-a-token" in line for line in refusals)


def test_the_refusal_log_counts_what_it_held_back():
    now = [0.0]
    log = RefusalLog(interval=60.0, clock=lambda: now[0])
    with _captured("tensorkv_server.security") as records:
        for when in (0.0, 1.0, 2.0, 59.0, 61.0, 62.0):
            now[0] = when
            log.note("ipv4:10.0.0.7:5000", "Push", "this server requires a token", "UNAUTHENTICATED")
        log.note("ipv4:10.0.0.8:5000", "Push", "this server requires a token", "UNAUTHENTICATED")
    lines = [record.getMessage() for record in records]
    assert len(lines) == 3, lines
    assert lines[1].endswith("this server requires a token (3 more from this host since the last such line)")
    assert "10.0.0.8" in lines[2] and "more" not in lines[2]


@contextlib.contextmanager
def _captured(logger):
    """The log records ``logger`` emits inside the block."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    target = logging.getLogger(logger)
    target.addHandler(handler)
    try:
        yield records
    finally:
        target.removeHandler(handler)


def _serving(address):
    try:
        return health(address, timeout=1.0) == "SERVING"
    except grpc.RpcError:
        return False


@pytest.mark.parametrize("optimizer, says", [
    (kvstore_pb2.Optimizer(name="x" * 1_000_000), "unknown optimizer 'xxxx"),
    (kvstore_pb2.Optimizer(name="sgd", params={f"p{i:06d}": 1.0 for i in range(100_000)}),
     "has no parameter p000000, p000001, p000002, p000003, p000004 and 99995 more"),
])
def test_huge_optimizer_names_and_maps_are_refused_in_a_short_message(optimizer, says, tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster, grpc.insecure_channel(cluster.addresses[0]) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            kvstore_pb2_grpc.KVStoreServiceStub(channel).SetUpdater(
                iter([kvstore_pb2.SetUpdaterRequest(optimizer=optimizer)]), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in caught.value.details() and len(caught.value.details()) < 300, caught.value.details()[:300]
        info = kvstore_pb2_grpc.KVStoreServiceStub(channel).Info(kvstore_pb2.InfoRequest(), timeout=CALL)
        assert info.optimizer == ""  # nothing installed


def test_a_missing_tls_server_fails_at_once_and_a_started_one_serves(pki):
    """Nothing listening is a refused connection, said at once (issue 17), not a TLS failure."""
    port = free_port()
    start = time.monotonic()
    with pytest.raises(tensorkv.ServerUnavailableError, match="connection was refused"):
        tensorkv.create("dist_sync", servers=f"127.0.0.1:{port}", tls_ca=pki.ca_file, connect_timeout=120)
    assert time.monotonic() - start < 60  # at once, not after connect_timeout (a loaded machine is slow)
    process = subprocess.Popen(_server("--port", str(port), *pki.server_args()),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        Cluster._wait_serving(f"127.0.0.1:{port}", process, security=Security(pki.ca_file))
        with tensorkv.create("dist_sync", servers=f"127.0.0.1:{port}", tls_ca=pki.ca_file) as kv:
            assert kv.rank == 0
    finally:
        stop(process)


GRPC_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\]", re.MULTILINE)  # gRPC's C core's own log lines


def test_a_failed_handshake_shows_no_grpc_line_on_the_worker_or_the_server(pki, tmp_path):
    """A worker that does not trust the server's certificate: its stderr had gRPC's own
    "I1128 ... ssl_transport_security.cc:2563] Handshake failed ..." lines beside the error."""
    other = Pki(tmp_path / "other")
    script = ("import tensorkv\ntry:\n    tensorkv.create('dist_sync')\nexcept tensorkv.KVStoreError as error:\n"
              "    print(type(error).__name__)\n")
    env = {key: value for key, value in os.environ.items() if key != "GRPC_VERBOSITY"}
    with Cluster(tmp_path=tmp_path, server_args=pki.server_args(), security=Security(pki.ca_file)) as cluster:
        worker = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                                env={**env, "TENSORKV_SERVERS": cluster.addresses[0], "TENSORKV_TLS_CA": other.ca_file})
    assert worker.stdout == "UnauthenticatedError\n", worker.stdout + worker.stderr
    assert not GRPC_LINE.search(worker.stderr), worker.stderr
    log = (tmp_path / "server0.log").read_text()
    assert not GRPC_LINE.search(log), log


def test_a_missing_ca_file_is_named_with_its_setting(tmp_path):
    """It said only 'cannot read the tls_ca file: No such file or directory'."""
    missing = tmp_path / "ca.pem"
    with pytest.raises(tensorkv.InvalidArgumentError) as refused:
        tensorkv.create("dist_sync", servers="127.0.0.1:1", tls_ca=str(missing))
    assert str(refused.value) == \
        f"cannot read the tls_ca file {missing} (tls_ca= or TENSORKV_TLS_CA): No such file or directory"


def _peak(pid):
    """The peak resident memory of process ``pid`` so far, in bytes (VmHWM)."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


@pytest.mark.parametrize("metrics", [False, True], ids=["", "metrics"])
def test_calls_without_a_token_are_refused_before_their_bytes_are_read(pki, tmp_path, metrics):
    """Six concurrent token-less calls of 400 MB each: refused UNAUTHENTICATED, and the server
    does not take their bytes in (it read each whole request before the token check: 4.5 GB),
    with the metrics interceptor too (it sees the calls first)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    metrics = ["--metrics-port", str(free_port())] if metrics else []
    big = b"\x7a" + _varint(400 << 20) + bytes(400 << 20)  # field 15, bytes: one the server does not know
    with Cluster(tmp_path=tmp_path, server_args=[*pki.server_args(), "--token-file", str(tokens), *metrics],
                 security=Security(pki.ca_file)) as cluster:
        server = cluster.processes[0]
        before = _peak(server.pid)
        with Security(pki.ca_file).channel(cluster.addresses[0], [("grpc.max_send_message_length", -1)]) as channel:
            info = channel.unary_unary(f"/{SERVICE.full_name}/Info")
            results = []

            def call():
                try:
                    info(big, timeout=WORKER_TIMEOUT)
                    results.append(grpc.StatusCode.OK)
                except grpc.RpcError as error:
                    results.append(error.code())
            threads = [threading.Thread(target=call) for _ in range(6)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(WORKER_TIMEOUT)
            assert results == [grpc.StatusCode.UNAUTHENTICATED] * 6, results
            grew = _peak(server.pid) - before
            with tensorkv.create("dist_sync", servers=cluster.addresses[0], tls_ca=pki.ca_file, token=TOKEN) as kv:
                kv.init("w", np.ones(3))  # still serving
    assert grew < 1 << 30, f"the server grew by {grew >> 20} MiB for calls it refused"


def _varint(value):
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def test_calls_open_on_one_connection_are_bounded(tmp_path):
    """A connection holds at most MAX_CONCURRENT_STREAMS calls open: the next one waits until
    one ends (gRPC set no bound: any number of calls, each with its buffers)."""
    async def probe(address):
        async with grpc.aio.insecure_channel(address) as channel:
            session = channel.stream_stream(f"/{SERVICE.full_name}/Session")
            info = channel.unary_unary(f"/{SERVICE.full_name}/Info")
            calls = [session() for _ in range(MAX_CONCURRENT_STREAMS)]
            await asyncio.wait_for(asyncio.gather(*(call.wait_for_connection() for call in calls)), WORKER_TIMEOUT)
            with pytest.raises(grpc.aio.AioRpcError) as waited:
                await info(b"", timeout=3)
            calls.pop().cancel()
            await info(b"", timeout=WORKER_TIMEOUT)
            for call in calls:
                call.cancel()
            return waited.value.code()

    with Cluster(tmp_path=tmp_path) as cluster:
        assert asyncio.run(probe(cluster.addresses[0])) == grpc.StatusCode.DEADLINE_EXCEEDED
