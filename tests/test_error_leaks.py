"""What a server answers names none of its secrets and no place on it (issue 12): every error
path a caller can reach, provoked with raw calls against a real server with TLS, tokens and a
state directory, answers without a token, a shared-memory segment's name, a file path or an
address, in its message and in its error metadata."""
import fcntl
import os
import re
import socket
import ssl
import threading

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tensorkv.wire import shm
from tensorkv.wire.codec import Item, encode_stream
from tensorkv.wire.status import status_code
from tensorkv.transport.security import Security
from tensorkv.v1 import kvstore_pb2, maintenance_pb2, tensor_pb2
from tensorkv_server import datachan

from cluster import Cluster
from test_security import READ_ONLY_TOKEN, TOKEN, Pki
from test_wire import MALFORMED

SERVICES = [kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"],
            maintenance_pb2.DESCRIPTOR.services_by_name["MaintenanceService"]]
KVSTORE = {method.name: method for method in SERVICES[0].methods}
SEGMENT_NAME = "tensorkv-secret-segment"
# An absolute path under one of the usual top directories, as an OSError's text carries one.
ABSOLUTE_PATH = re.compile(r"(?<![\w.])/(?:tmp|proc|dev|home|root|var|etc|run|work|usr|opt|srv|mnt|sys)\b")


class Answers:
    """The (what was asked, status, message, error metadata) of every refusal collected."""

    def __init__(self):
        self.refusals = []

    def call(self, what, channel, method, request, metadata=()):
        """Call ``method`` (a MethodDescriptor) with the serialized ``request``; keep its refusal."""
        path = f"/{method.containing_service.full_name}/{method.name}"
        kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                (True, False): channel.stream_unary, (True, True): channel.stream_stream}
        call = kind[method.client_streaming, method.server_streaming](path)
        try:
            answer = call(iter([request]) if method.client_streaming else request, timeout=10, metadata=metadata)
            if method.server_streaming:
                list(answer)
        except grpc.RpcError as error:
            self.keep(what, error.code(), error.details(), error.trailing_metadata())
            return error.code()
        return grpc.StatusCode.OK

    def session(self, what, channel, requests):
        """The SessionResponses to ``requests`` on one Session stream; keeps each refusal."""
        stream = channel.stream_stream(f"/{SERVICES[0].full_name}/Session")
        data = [r if isinstance(r, bytes) else r.SerializeToString() for r in requests]
        answers = [kvstore_pb2.SessionResponse.FromString(a) for a in stream(iter(data), timeout=10)]
        for answer in answers:
            if answer.code:
                self.keep(f"{what}: call {answer.id}", status_code(answer.code), answer.message,
                          (("error_class", answer.error_class),))
        return answers

    def keep(self, what, code, message, metadata):
        assert code not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN), (what, code, message)
        texts = [message or ""] + [value if isinstance(value, str) else repr(value) for _, value in metadata or ()]
        self.refusals.append((what, code, texts))

    def leaks(self, secrets):
        """(what, the secret) for every refusal whose text holds one of ``secrets`` or a path."""
        found = []
        for what, _, texts in self.refusals:
            for text in texts:
                found += [(what, secret) for secret in secrets if secret in text]
                found += [(what, path) for path in ABSOLUTE_PATH.findall(text)]
        return found


@pytest.fixture
def secured(tmp_path):
    """A server with TLS, a read-write and a read-only token and a state directory whose first
    snapshot cannot be written (a directory where its file goes); (cluster, pki, state dir)."""
    pki = Pki(tmp_path / "pki")
    tokens, state = tmp_path / "tokens", tmp_path / "state"
    tokens.write_text(f"{TOKEN}\n{READ_ONLY_TOKEN} ro\n")
    (state / "snapshot-000000000001.tkv.part").mkdir(parents=True)
    with Cluster(tmp_path=tmp_path, security=Security(pki.ca_file),
                 server_args=[*pki.server_args(), "--token-file", str(tokens), "--state-dir", str(state)]) as cluster:
        yield cluster, pki, state


def _bearer(token):
    return (("authorization", f"Bearer {token}"),)


def _memfd(size, seals, token=bytes(shm.TOKEN_BYTES)):
    fd = os.memfd_create(SEGMENT_NAME, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    os.pwrite(fd, token, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _answer(port, context, data):
    """What the data port answers a connection (TLS with ``context`` unless None) that sends
    ``data``: its first byte, b"" when it closes the connection without a word."""
    with socket.create_connection(("127.0.0.1", port), 5) as sock:
        with (context.wrap_socket(sock, server_hostname="127.0.0.1") if context else sock) as conn:
            conn.settimeout(10)
            conn.sendall(data)
            try:
                return conn.recv(1)
            except (ConnectionResetError, ssl.SSLError):
                return b""


def _check_the_data_port(channel, port, context):
    """Present tokens to the data port while the Session stream that was given one is open."""
    done = threading.Event()

    def requests():
        yield kvstore_pb2.SessionRequest(id=1, op=kvstore_pb2.SESSION_OP_OPEN_DATA_CHANNEL).SerializeToString()
        done.wait(30)

    stream = channel.stream_stream(f"/{SERVICES[0].full_name}/Session")(requests(), timeout=30)
    try:
        token = kvstore_pb2.SessionResponse.FromString(next(stream)).data_token
        assert len(token) == 32
        assert _answer(port, context, bytes(32)) == b""  # a token never handed out
        assert _answer(port, None, token) == b""  # the right one, without TLS
        assert _answer(port, context, token) == datachan.ACK  # bound
        assert _answer(port, context, token) == b""  # used up
    finally:
        done.set()
        list(stream)
    return token


def _provoke_the_token_checks(answers, address, ca_file):
    with Security(ca_file).channel(address, ()) as anonymous:
        for service in SERVICES:
            for method in service.methods:
                for who, metadata in (("no token", ()), ("an unknown token", _bearer("not-a-token-0123456789")),
                                      ("a token without Bearer", (("authorization", TOKEN),)),
                                      ("the read-only token", _bearer(READ_ONLY_TOKEN))):
                    answers.call(f"{method.name} with {who}", anonymous, method, b"", metadata)
        with pytest.raises(grpc.RpcError) as refused:
            list(reflection_pb2_grpc.ServerReflectionStub(anonymous).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        answers.keep("reflection with no token", refused.value.code(), refused.value.details(),
                     refused.value.trailing_metadata())
        with pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(anonymous).Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
        answers.keep("health of an unknown service", refused.value.code(), refused.value.details(),
                     refused.value.trailing_metadata())


def _provoke_the_calls(answers, channel):
    """Malformed requests, bad ranks, unknown keys, bad optimizers, a refused snapshot, bad
    tensors: the rank 0 worker's (incarnation) after registering."""
    for service in SERVICES:
        for method in service.methods:
            if not (method.client_streaming and method.server_streaming):  # Session answers in-band
                answers.call(f"{method.name} malformed", channel, method, MALFORMED[0])
    register = KVSTORE["Register"]
    answers.call("Register rank 99", channel, register, kvstore_pb2.RegisterRequest(rank=99).SerializeToString())
    answers.call("Register if_exists 99", channel, register,
                 kvstore_pb2.RegisterRequest(if_exists=99).SerializeToString())
    registered = kvstore_pb2.RegisterResponse.FromString(
        channel.unary_unary(f"/{SERVICES[0].full_name}/Register")(
            kvstore_pb2.RegisterRequest(rank=0).SerializeToString(), timeout=10))
    rank = dict(rank=0, incarnation=registered.incarnation)
    missing = [tensor_pb2.Key(str_key="missing")]
    for name, request in (
            ("Pull", kvstore_pb2.PullRequest(keys=missing, **rank)),
            ("Pull", kvstore_pb2.PullRequest(keys=missing, rank=0, incarnation=registered.incarnation + 1)),
            ("Pull", kvstore_pb2.PullRequest(keys=[tensor_pb2.Key(str_key="k" * 100_000)], **rank)),
            ("Unregister", kvstore_pb2.UnregisterRequest(rank=0, incarnation=registered.incarnation + 1)),
            ("KeepAlive", kvstore_pb2.KeepAliveRequest(rank=5, incarnation=1)),
            ("Barrier", kvstore_pb2.BarrierRequest(rank=3)),
            ("SetLearningRate", kvstore_pb2.SetLearningRateRequest(learning_rate=0.1)),
            ("SetUpdater", kvstore_pb2.SetUpdaterRequest(optimizer=kvstore_pb2.Optimizer(name="nope"))),
            ("SetUpdater", kvstore_pb2.SetUpdaterRequest(optimizer=kvstore_pb2.Optimizer(
                name="sgd", params={"learning_rate": float("nan")}))),
            ("SetUpdater", kvstore_pb2.SetUpdaterRequest(optimizer=kvstore_pb2.Optimizer(
                name="sgd", params={"momentum": -1.0}))),
            ("SetUpdater", kvstore_pb2.SetUpdaterRequest()),
            ("Snapshot", kvstore_pb2.SnapshotRequest())):
        answers.call(f"{name} {request}"[:80], channel, KVSTORE[name], request.SerializeToString())
    read_key = SERVICES[1].methods_by_name["ReadKey"]
    answers.call("ReadKey missing", channel, read_key, maintenance_pb2.ReadKeyRequest(key=missing[0]).SerializeToString())
    for name, message_class, value in (("Init", kvstore_pb2.InitRequest, np.ones(3)),
                                       ("Init", kvstore_pb2.InitRequest, np.ones(3)),  # again: it exists
                                       ("Push", kvstore_pb2.PushRequest, np.ones(4)),  # another shape
                                       ("Push", kvstore_pb2.PushRequest, np.ones(3, np.int32)),  # another dtype
                                       ("PushPull", kvstore_pb2.PushPullRequest, np.ones(4))):
        request = encode_stream(message_class, [Item("w", value)], rank, chunk_bytes=1 << 62)[0]
        answers.call(f"{name} of w as {value.dtype}{list(value.shape)}", channel, KVSTORE[name], request)
    return rank


def _provoke_the_session(answers, channel, rank):
    """Bad shared-memory regions, unknown ops and regions, values asked on an unbound data
    channel, a malformed request."""
    size = shm.HEADER_BYTES + 4096
    with open(__file__, "rb") as regular:
        descriptors = {
            "a regular file": (regular.fileno(), size),
            "no descriptor": (1 << 20, size),
            "an unsealed memfd": (_memfd(size, 0), size),
            "a memfd of another size": (_memfd(size, shm.SEALS), size + 4096),
            "a memfd with another token": (_memfd(size, shm.SEALS, b"x" * shm.TOKEN_BYTES), size),
            "a region too small": (regular.fileno(), 1),
        }
        try:
            requests = [kvstore_pb2.SessionRequest(
                id=i, op=kvstore_pb2.SESSION_OP_REGISTER_REGION, region=kvstore_pb2.SharedMemoryRegion(
                    pid=os.getpid(), fd=fd, size=region_size, token=bytes(shm.TOKEN_BYTES)))
                for i, (fd, region_size) in enumerate(descriptors.values(), 1)]
            requests += [
                kvstore_pb2.SessionRequest(id=20, op=kvstore_pb2.SESSION_OP_REGISTER_REGION, region=kvstore_pb2.
                                           SharedMemoryRegion(pid=os.getpid(), fd=1, size=size, token=b"short")),
                kvstore_pb2.SessionRequest(id=21, op=99),
                kvstore_pb2.SessionRequest(id=22, op=kvstore_pb2.SESSION_OP_PULL, keys=[tensor_pb2.Key(str_key="w")],
                                           output=tensor_pb2.SharedMemoryRef(region_id=77, length=24), **rank),
                kvstore_pb2.SessionRequest(id=23, op=kvstore_pb2.SESSION_OP_PULL, keys=[tensor_pb2.Key(str_key="w")],
                                           data_channel_min_bytes=1, **rank),
                kvstore_pb2.SessionRequest(id=24, op=kvstore_pb2.SESSION_OP_UNREGISTER_REGION, region_id=77),
                MALFORMED[0]]
            answers.session("Session", channel, requests)
        finally:
            for fd, _ in list(descriptors.values())[2:5]:
                os.close(fd)


def test_no_refusal_names_a_secret_a_path_or_an_address(secured, tmp_path):
    cluster, pki, state = secured
    address = cluster.addresses[0]
    answers = Answers()
    _provoke_the_token_checks(answers, address, pki.ca_file)
    with Security(pki.ca_file, token=TOKEN).channel(address, ()) as channel:
        rank = _provoke_the_calls(answers, channel)
        _provoke_the_session(answers, channel, rank)
        info = kvstore_pb2.InfoResponse.FromString(channel.unary_unary(f"/{SERVICES[0].full_name}/Info")(
            kvstore_pb2.InfoRequest().SerializeToString(), timeout=10))
        data_token = _check_the_data_port(channel, info.data_port, Security(pki.ca_file).data_channel_context())
    codes = {code for _, code, _ in answers.refusals}
    assert {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS} <= codes
    assert any(what.startswith("Snapshot") for what, _, _ in answers.refusals)  # the write did fail
    port = address.rsplit(":", 1)[1]
    secrets = [TOKEN, READ_ONLY_TOKEN, data_token.hex(), str(tmp_path), os.path.realpath(tmp_path), str(state),
               pki.cert, pki.key, pki.ca_file, "snapshot-0", ".part", SEGMENT_NAME, "memfd:",
               "127.0.0.1", "localhost", "ipv4:", "ipv6:", "0.0.0.0", "[::", f":{port}", f":{info.data_port}"]
    assert answers.leaks(secrets) == []
    assert sorted(os.listdir(state)) == ["lock", "snapshot-000000000001.tkv.part"]  # and nothing was written
