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
        DeadlineExceededError, UnauthenticatedError, PermissionDeniedError, InternalError,
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
    "UNAUTHENTICATED": UnauthenticatedError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "INTERNAL": InternalError,
}


def error_from_status(code_name, message, class_name=None):
    """The KVStoreError to raise for a status received from a server."""
    cls = CATALOGUE.get(class_name) or BY_CODE.get(code_name, KVStoreError)
    return cls(message)
