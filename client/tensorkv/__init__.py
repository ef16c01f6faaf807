"""tensorkv: MXNet's KVStore without MXNet.

>>> import numpy as np, tensorkv
>>> kv = tensorkv.create('local')
>>> kv.init(3, np.ones((2, 3)) * 2)
>>> kv.push(3, [np.ones((2, 3))] * 4)
>>> print(kv.pull(3))
[[4. 4. 4.]
 [4. 4. 4.]]
"""
from __future__ import annotations

import os as _os
from typing import Any as _Any

# Not gRPC's own INFO lines (a failed TLS handshake: "I1128 ... ssl_transport_security.cc] Handshake
# failed ...") on a worker's stderr beside the error that says it, unless the user chose a
# verbosity: gRPC reads it when it is first imported, which the modules below do.
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from . import lr_scheduler, optimizer  # noqa: E402
from .config import ClientConfig  # noqa: E402
from .errors import (
    DeadlineExceededError, DtypeMismatchError, FailedPreconditionError, InternalError,
    InvalidArgumentError, InvalidTensorError, KeyExistsError, KeyNotFoundError, KeyTypeError,
    KVStoreError, PermissionDeniedError, ResourceExhaustedError, RoundAbortedError, ServerUnavailableError,
    ShapeMismatchError, UnauthenticatedError,
)
from .stores.kvstore import KVStore
from .stores.trainer import Trainer
from .update.rowsparse import row_sparse

__version__ = "0.1.0"

EMBEDDED_TYPES = ("local", "device")
DIST_TYPES = ("dist_sync", "dist_async")
# MXNet's other names of the same stores (MXNet scripts pass them): where MXNet places its
# update or sum differs between them, the store does not.
ALIASES = {"local_update_cpu": "local", "local_allreduce_cpu": "local", "local_allreduce_device": "device",
           "dist_sync_device": "dist_sync", "dist_device_sync": "dist_sync",
           "dist": "dist_sync"}  # MXNet's store is async only when its name has "_async"


def create(name: str = "local", **kwargs: _Any) -> KVStore:
    """Create a KVStore.

    - ``'local'``: embedded in this process, values in host memory; no server, no network.
    - ``'device'``: embedded, values on the GPU when CuPy sees one (else as 'local').
    - ``'dist_sync'`` / ``'dist_async'``: a client of one or more tensorkv servers, given
      by ``servers=`` (a comma-separated string or a list) or ``TENSORKV_SERVERS``.

    The workers registered together on a server make a *run*, which ends when all of them
    have closed their stores. ``if_exists=`` (else ``TENSORKV_IF_EXISTS``) says what a new
    run does with the keys an earlier run left on a server: ``'fail'`` (the default): their
    ``init`` raises KeyExistsError and changes nothing; ``'resume'``: ``init`` keeps the
    stored values, and the optimizer and its states stay, so training continues from them;
    ``'replace'``: the earlier run's keys, optimizer and states are dropped before the new
    run's first ``init``, as on a new server. Every worker of a run passes the same.
    ``job=`` (else ``TENSORKV_JOB``, which ``tensorkv-launch`` sets) names the job: a server
    then refuses another job's workers while a run is registered, and a worker process of
    the job restarted together with a server rejoins the run the server restored from its
    snapshot, whatever its ``if_exists`` (with 'replace' it would otherwise start afresh).

    Every setting of a dist store is a field of :class:`ClientConfig` (docs/reference.md lists
    them): a keyword argument above, else ``config=ClientConfig(...)``'s field, else its
    ``TENSORKV_*`` variable, read here (never at import), else its default.

    MXNet's other names of these (``'local_update_cpu'``, ``'local_allreduce_cpu'``,
    ``'local_allreduce_device'``, ``'dist_sync_device'``, ``'dist_device_sync'``, and
    ``'dist'``, which MXNet runs as ``'dist_sync'``) make the store they stand for (ALIASES);
    ``kv.type`` is the name given, as in MXNet.

    >>> import tensorkv
    >>> kv = tensorkv.create('local')
    >>> kv.type
    'local'
    >>> tensorkv.create('local_update_cpu').type
    'local_update_cpu'
    """
    kind = ALIASES.get(name, name)
    if kind in EMBEDDED_TYPES:
        from .stores.local import LocalStore
        store: KVStore = LocalStore(kind, **kwargs)
    elif kind in DIST_TYPES:
        from .stores.dist import DistStore
        store = DistStore(kind, **kwargs)
    else:
        raise InvalidArgumentError(
            f"unknown KVStore type {name!r}; use one of {', '.join(EMBEDDED_TYPES + DIST_TYPES)} "
            f"(or MXNet's {', '.join(ALIASES)})")
    store._type = name
    return store


def reset(servers: str | list[str] | None = None, **options: _Any) -> int:
    """Drop everything the servers hold (keys, optimizer, states), as if they had just
    started; the number of keys dropped. A server where a run is registered (some worker
    has not closed its store) refuses with FailedPreconditionError naming its ranks, and
    the servers after it in ``servers`` (or ``TENSORKV_SERVERS``) are left as they are. So
    does a server that restored a snapshot taken while a run was going on, as long as that
    run's workers can come back to it, unless ``force=True``.
    ``timeout=`` bounds each server's answer (seconds, default 10). ``tls_ca=``,
    ``tls_cert=``, ``tls_key=`` and ``token=`` (else ``TENSORKV_TLS_CA``,
    ``TENSORKV_TLS_CERT``, ``TENSORKV_TLS_KEY``, ``TENSORKV_TOKEN``) are the credentials, as
    for :func:`create`.

    This needs running servers, so the example is not run:

    >>> tensorkv.reset('127.0.0.1:50051,127.0.0.1:50052')   # doctest: +SKIP
    3
    """
    from .stores.dist import reset as reset_servers
    return reset_servers(servers, **options)


__all__ = [
    "create", "reset", "row_sparse", "ClientConfig", "KVStore", "Trainer", "optimizer", "lr_scheduler", "KVStoreError", "InvalidArgumentError",
    "InvalidTensorError", "ShapeMismatchError", "DtypeMismatchError", "KeyTypeError", "KeyNotFoundError",
    "KeyExistsError", "FailedPreconditionError", "RoundAbortedError", "ServerUnavailableError",
    "DeadlineExceededError", "ResourceExhaustedError", "InternalError", "UnauthenticatedError",
    "PermissionDeniedError",
]
