"""The one place where tensorkv errors meet gRPC statuses, on both sides of the wire.

A server handler raises a :class:`~tensorkv.errors.KVStoreError`; :func:`translate_errors`
sends its ``code`` as the status, its message as the details and its class name in the
trailing metadata entry ``tensorkv-error``. A client turns a ``grpc.RpcError`` back into
the same class with :func:`error_from_rpc`.
"""
import functools
import inspect
import logging

import grpc

from .errors import (
    ERROR_METADATA_KEY, DeadlineExceededError, InternalError, KVStoreError, ServerUnavailableError,
    error_from_status,
)
from .v1 import kvstore_pb2, kvstore_pb2_grpc

log = logging.getLogger(__name__)

# Large tensors travel as chunked streams, so no message limit is needed; keepalive pings
# find dead peers during long waits for sync rounds.
_COMMON_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]
CHANNEL_OPTIONS = _COMMON_OPTIONS + [
    # unary-stream calls (Pull, and PushPull of one message) without a thread per call
    ("SingleThreadedUnaryStream", 1),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = _COMMON_OPTIONS + [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 20_000),
    ("grpc.http2.max_ping_strikes", 5),
]


# ---- server side ----------------------------------------------------------------------

async def _abort(context, error):
    if not isinstance(error, KVStoreError):
        log.exception("unexpected error in %s", context)
        error = InternalError(f"{type(error).__name__}: {error}")
    await context.abort(
        grpc.StatusCode[error.code], str(error),
        trailing_metadata=((ERROR_METADATA_KEY, type(error).__name__),),
    )


def translate_errors(method):
    """Decorate an async servicer method (coroutine or async generator) so that any error it
    raises reaches the client as a status: a KVStoreError as its own code, anything else as
    INTERNAL (and logged with its traceback)."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for response in method(self, request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as error:
                await _abort(context, error)
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await _abort(context, error)
    return unary


# ---- client side ----------------------------------------------------------------------

def error_from_rpc(error, address):
    """The KVStoreError to raise for the ``grpc.RpcError`` a call to ``address`` raised."""
    code, details = error.code(), error.details()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return ServerUnavailableError(f"server {address} is unavailable: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(f"server {address} did not answer within the deadline: {details}")
    class_name = dict(error.trailing_metadata() or ()).get(ERROR_METADATA_KEY)
    return error_from_status(code.name, details, class_name)


class Stub(kvstore_pb2_grpc.KVStoreServiceStub):
    """The generated stub, plus the tensor streams with bytes in and out (encoded and decoded
    by :mod:`tensorkv.codec`): ``init``, ``push`` and ``pushpull`` take the list of serialized
    request messages and make a unary call when there is only one, which is the same on the
    wire as a stream of one message and saves the thread that feeds a request stream."""

    _PATH = "/" + kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"].full_name + "/"

    def __init__(self, channel):
        super().__init__(channel)
        path = self._PATH
        self._init = (channel.unary_unary(path + "Init", response_deserializer=kvstore_pb2.InitResponse.FromString),
                      channel.stream_unary(path + "Init", response_deserializer=kvstore_pb2.InitResponse.FromString))
        self._push = (channel.unary_unary(path + "Push", response_deserializer=kvstore_pb2.PushResponse.FromString),
                      channel.stream_unary(path + "Push", response_deserializer=kvstore_pb2.PushResponse.FromString))
        self._pushpull = (channel.unary_stream(path + "PushPull"), channel.stream_stream(path + "PushPull"))
        self.pull_raw = channel.unary_stream(path + "Pull", request_serializer=kvstore_pb2.PullRequest.SerializeToString)

    @staticmethod
    def _send(calls, messages, timeout):
        if len(messages) == 1:
            return calls[0](messages[0], timeout=timeout)
        return calls[1](iter(messages), timeout=timeout)

    def init_raw(self, messages, timeout):
        return self._send(self._init, messages, timeout)

    def push_raw(self, messages, timeout):
        return self._send(self._push, messages, timeout)

    def pushpull_raw(self, messages, timeout):
        """The serialized PushPullResponse messages, as an iterator."""
        return self._send(self._pushpull, messages, timeout)
