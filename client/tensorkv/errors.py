"""The error catalogue: every tensorkv error class and the gRPC status it travels as.

A server raises one of these; the RPC layer sends its ``code`` as the gRPC status, its
message as the status details and its class name in the trailing metadata entry
``tensorkv-error``. The client raises the same class again from that name, so a user
sees the same exception whether the store is embedded or remote.
"""

ERROR_METADATA_KEY = "tensorkv-error"


class KVStoreError(Exception):
    """Base class of every tensorkv error."""

    code = "UNKNOWN"


class InvalidArgumentError(KVStoreError, ValueError):
    """A malformed argument: wrong list lengths, an unknown optimizer parameter, ..."""

    code = "INVALID_ARGUMENT"


class InvalidTensorError(InvalidArgumentError):
    """A tensor that cannot be decoded: unknown dtype, wrong byte length, bad shape."""


class ShapeMismatchError(InvalidArgumentError):
    """A value whose shape differs from the key's stored shape."""


class DtypeMismatchError(InvalidArgumentError):
    """A value whose dtype differs from the key's stored dtype."""


class KeyTypeError(InvalidArgumentError, TypeError):
    """A key that is neither int nor str, or int and str keys mixed in one store."""


class KeyNotFoundError(KVStoreError, LookupError):
    """A push or pull of a key that was never initialized."""

    code = "NOT_FOUND"


class KeyExistsError(KVStoreError):
    """An init of a key that already exists."""

    code = "ALREADY_EXISTS"


class FailedPreconditionError(KVStoreError):
    """A call the store's state does not allow: a Python updater on a server, a taken rank."""

    code = "FAILED_PRECONDITION"


class RoundAbortedError(KVStoreError):
    """A sync round or barrier that timed out before every worker arrived."""

    code = "ABORTED"


class ServerUnavailableError(KVStoreError, ConnectionError):
    """A server that cannot be reached, or is shutting down."""

    code = "UNAVAILABLE"


class DeadlineExceededError(KVStoreError, TimeoutError):
    """A call that did not complete within its deadline."""

    code = "DEADLINE_EXCEEDED"


class ResourceExhaustedError(KVStoreError):
    """A call that needs more than the server has: memory for a value of its declared size."""

    code = "RESOURCE_EXHAUSTED"


class UnauthenticatedError(KVStoreError):
    """A call without valid credentials: no token or an unknown one, or a TLS handshake that
    failed (the message says which credential)."""

    code = "UNAUTHENTICATED"


class PermissionDeniedError(KVStoreError):
    """A call the credentials do not allow: a read-only token on a call that writes."""

    code = "PERMISSION_DENIED"


class InternalError(KVStoreError):
    """A bug on the server side; the message says what failed."""

    code = "INTERNAL"


CATALOGUE = {
    cls.__name__: cls
    for cls in (
        KVStoreError, InvalidArgumentError, InvalidTensorError, ShapeMismatchError,
        DtypeMismatchError, KeyTypeError, KeyNotFoundError, KeyExistsError,
        FailedPreconditionError, RoundAbortedError, ServerUnavailableError,
        DeadlineExceededError, ResourceExhaustedError, UnauthenticatedError, PermissionDeniedError,
        InternalError,
    )
}

# The class a status code maps to when the peer sent no class name (another language's server).
BY_CODE = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "NOT_FOUND": KeyNotFoundError,
    "ALREADY_EXISTS": KeyExistsError,
    "FAILED_PRECONDITION": FailedPreconditionError,
    "ABORTED": RoundAbortedError,
    "UNAVAILABLE": ServerUnavailableError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "RESOURCE_EXHAUSTED": ResourceExhaustedError,
    "UNAUTHENTICATED": UnauthenticatedError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "INTERNAL": InternalError,
}


# What a message shows of a str key, and of a list of keys: a key may be megabytes long and
# a list thousands of keys, and a status message must fit in gRPC's metadata.
SHOWN_KEY_CHARS = 100
SHOWN_KEYS = 10


def key_repr(key):
    """``repr(key)`` for a message, cut after SHOWN_KEY_CHARS characters (then with its length)."""
    if isinstance(key, str) and len(key) > SHOWN_KEY_CHARS:
        return f"{key[:SHOWN_KEY_CHARS]!r}... ({len(key)} characters)"
    return repr(key)


def keys_repr(keys):
    """``repr(keys)`` of a list of keys for a message: the first SHOWN_KEYS, each by :func:`key_repr`."""
    shown = ", ".join(map(key_repr, keys[:SHOWN_KEYS]))
    more = f", ... ({len(keys)} keys)" if len(keys) > SHOWN_KEYS else ""
    return f"[{shown}{more}]"


def no_memory(key, shape, dtype, nbytes):
    """The ResourceExhaustedError for a value of ``key`` that cannot be allocated."""
    return ResourceExhaustedError(
        f"key {key_repr(key)}: not enough memory for a value of shape {tuple(shape)} and dtype {dtype} "
        f"({nbytes} bytes)")


def error_from_status(code_name, message, class_name=None):
    """The KVStoreError to raise for a status received from a server."""
    cls = CATALOGUE.get(class_name) or BY_CODE.get(code_name, KVStoreError)
    return cls(message)
