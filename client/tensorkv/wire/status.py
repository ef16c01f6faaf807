"""The one place where tensorkv errors meet gRPC statuses, on both sides of the wire.

A server handler raises a :class:`~tensorkv.errors.KVStoreError`; :func:`translate_errors`,
which wraps every handler as it is registered, sends its ``code`` as the status, its message
as the details and its class name in the trailing metadata entry ``tensorkv-error``. A
client turns a ``grpc.RpcError`` back into the same class with :func:`error_from_rpc`.
"""
import functools
import inspect
import logging

import grpc

from ..errors import (
    ERROR_METADATA_KEY, DeadlineExceededError, InternalError, KVStoreError, ResourceExhaustedError,
    ServerUnavailableError, error_from_status,
)

log = logging.getLogger(__name__)


# ---- server side ----------------------------------------------------------------------

def _as_kvstore_error(error, where):
    """``error`` as the KVStoreError a client gets: a MemoryError is RESOURCE_EXHAUSTED, anything
    else but a KVStoreError is INTERNAL (and logged with its traceback; the file an OSError
    names is left out of the message)."""
    if isinstance(error, KVStoreError):
        return error
    if isinstance(error, MemoryError):
        log.warning("out of memory in %s: %s", where, error)
        return ResourceExhaustedError(f"the server ran out of memory: {type(error).__name__}: {error}")
    log.exception("unexpected error in %s", where)
    if isinstance(error, OSError) and error.filename is not None:  # a place on the server: for its log only
        return InternalError(f"{type(error).__name__}: {error.strerror} (the server's log names the file)")
    return InternalError(f"{type(error).__name__}: {error}")


async def _abort(context, error, method):
    error = _as_kvstore_error(error, method)
    await context.abort(
        grpc.StatusCode[error.code], str(error),
        trailing_metadata=((ERROR_METADATA_KEY, type(error).__name__),),
    )


def translate_errors(handler, parse=None):
    """``handler`` (an async function or async generator function of (request, context), e.g.
    a bound servicer method) as a gRPC handler whose errors reach the client as statuses: a
    KVStoreError as its own code, a MemoryError as RESOURCE_EXHAUSTED, anything else
    as INTERNAL (and logged with its traceback).
    ``parse(request, context)``, when given, turns the request as gRPC delivers it (bytes, or
    an async iterator of them) into what ``handler`` receives, within that translation: a
    malformed request fails with its own status."""
    parse = parse or (lambda request, context: request)
    if inspect.isasyncgenfunction(handler):
        @functools.wraps(handler)
        async def stream(request, context):
            try:
                async for response in handler(parse(request, context), context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as error:
                await _abort(context, error, handler.__name__)
        return stream

    @functools.wraps(handler)
    async def unary(request, context):
        try:
            return await handler(parse(request, context), context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await _abort(context, error, handler.__name__)
    return unary


# ---- client side ----------------------------------------------------------------------

def error_from_rpc(error, address, kind):
    """The KVStoreError to raise for the ``grpc.RpcError`` that a ``kind`` call ('push',
    'pull', ...) to ``address`` raised."""
    class_name = dict(error.trailing_metadata() or ()).get(ERROR_METADATA_KEY)
    return error_from_code(error.code(), error.details(), class_name, address, kind)


def error_from_code(code, details, class_name, address, kind):
    """The KVStoreError for status ``code`` (a grpc.StatusCode) with ``details`` and the
    error class name the server sent (None if none) that a ``kind`` call got."""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        if class_name is None:  # made by the transport, not sent by a server
            return transport_error(details, address, kind)
        return ServerUnavailableError(f"server {address} is unavailable: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(f"server {address} did not answer within the deadline: {details}")
    return error_from_status(code.name, details, class_name)


# Calls that change nothing on a server: any other whose connection broke may have taken effect.
READ_ONLY_CALLS = frozenset({"info", "pull", "barrier", "save_optimizer_states"})

# The transport's words for a connection it could not make, and what they mean.
_CONNECT_FAILURES = (
    ("Connection refused", "the connection was refused (nothing listens on that port)"),
    ("Connection reset by peer", "the connection was reset (by the server, or by something between)"),
    ("HTTP/2", "something else answers there: not a tensorkv (gRPC) server"),
    ("http1", "something else answers there: an HTTP/1 server, not a tensorkv (gRPC) server"),
    ("Socket closed", "the peer closed the connection before answering: not a tensorkv (gRPC) server, "
                      "or one that is stopping"),
)


def transport_error(details, address, kind):
    """The ServerUnavailableError for a ``kind`` call whose connection to ``address`` could
    not be made or broke, in words instead of the transport's ``details``."""
    hint = f"is tensorkv-server running on {address}?"
    if "resolving" in details or "DNS resolution failed" in details:
        host = address.rsplit(":", 1)[0]
        return ServerUnavailableError(f"cannot reach server {address}: host {host} is unknown "
                                      f"(its name does not resolve); {hint}")
    if "failed to connect" in details:  # no connection: the call was not sent
        cause = next((words for text, words in _CONNECT_FAILURES if text in details),
                     details.rsplit(": ", 1)[-1].lower())  # the system's reason, e.g. "no route to host"
        return ServerUnavailableError(f"cannot connect to server {address}: {cause}; {hint}")
    effect = f"the {kind} changed nothing" if kind in READ_ONLY_CALLS else f"the {kind} may have been applied"
    return ServerUnavailableError(f"server {address} closed the connection during the {kind} "
                                  f"(it may have crashed or been killed); {effect}")


def connection_lost(error):
    """Whether the ``grpc.RpcError`` ``error`` is a connection that was made, then reset or
    closed by the peer (a server, or something between, accepted it and tore it down, before
    or after the HTTP/2 handshake), not refused (ECONNREFUSED: nothing listens). Both arrive
    as UNAVAILABLE; only the transport's words tell them apart. A reset may read as either
    ("Connection reset by peer", or "Socket closed" when it meets a write); a peer that closes
    may also be one that refuses this client's credentials (Security.diagnose tells)."""
    details = error.details() or ""
    return error.code() == grpc.StatusCode.UNAVAILABLE and (
        "Connection reset by peer" in details or "Socket closed" in details)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number):
    """The grpc.StatusCode of a status number (UNKNOWN for one it does not know)."""
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


def error_status(error):
    """(status number, message, class name) that a server sends for ``error`` (see
    :func:`_as_kvstore_error`)."""
    error = _as_kvstore_error(error, "a session call")
    return grpc.StatusCode[error.code].value[0], str(error), type(error).__name__
