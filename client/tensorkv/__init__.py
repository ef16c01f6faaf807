"""tensorkv: MXNet's KVStore without MXNet.

>>> import numpy as np, tensorkv
>>> kv = tensorkv.create('local')
>>> kv.init(3, np.ones((2, 3)) * 2)
>>> kv.push(3, [np.ones((2, 3))] * 4)
>>> print(kv.pull(3))
[[4. 4. 4.]
 [4. 4. 4.]]
"""
from . import optimizer
from .errors import (
    DeadlineExceededError, DtypeMismatchError, FailedPreconditionError, InternalError,
    InvalidArgumentError, InvalidTensorError, KeyExistsError, KeyNotFoundError, KeyTypeError,
    KVStoreError, PermissionDeniedError, RoundAbortedError, ServerUnavailableError, ShapeMismatchError,
    UnauthenticatedError,
)
from .kvstore import KVStore

__version__ = "0.1.0"

EMBEDDED_TYPES = ("local", "device")
DIST_TYPES = ("dist_sync", "dist_async")


def create(name="local", **kwargs):
    """Create a KVStore.

    - ``'local'``: embedded in this process, values in host memory; no server, no network.
    - ``'device'``: embedded, values on the GPU when CuPy sees one (else as 'local').
    - ``'dist_sync'`` / ``'dist_async'``: a client of one or more tensorkv servers, given
      by ``servers=`` (a comma-separated string or a list) or ``TENSORKV_SERVERS``.

    >>> kv = tensorkv.create('local')
    >>> kv.type
    'local'
    """
    if name in EMBEDDED_TYPES:
        from .local import LocalStore
        return LocalStore(name, **kwargs)
    if name in DIST_TYPES:
        from .dist import DistStore
        return DistStore(name, **kwargs)
    raise InvalidArgumentError(
        f"unknown KVStore type {name!r}; use one of {', '.join(EMBEDDED_TYPES + DIST_TYPES)}"
    )


__all__ = [
    "create", "KVStore", "optimizer", "KVStoreError", "InvalidArgumentError", "InvalidTensorError",
    "ShapeMismatchError", "DtypeMismatchError", "KeyTypeError", "KeyNotFoundError", "KeyExistsError",
    "FailedPreconditionError", "RoundAbortedError", "ServerUnavailableError", "DeadlineExceededError",
    "InternalError", "UnauthenticatedError", "PermissionDeniedError",
]
