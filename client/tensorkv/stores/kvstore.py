"""The user-facing KVStore API, shared by the embedded and the remote stores.

The many call forms of MXNet's API (one key or a list, one array or a list per key, ``out``
or a return value) become lists of (key, [arrays]) pairs (``tensorkv.stores.arguments``);
the store types implement ``_init``, ``_push``, ``_pull`` and friends on those lists.

Every example below makes the store it uses; those of a dist store need running servers
and are marked ``# doctest: +SKIP``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from os import PathLike
from typing import Any, Union

from ..backend import shape_dtype, to_host, write_into
from ..errors import DtypeMismatchError, FailedPreconditionError, InvalidArgumentError, ShapeMismatchError, key_repr
from ..optimizer import Optimizer, check as check_optimizer
from ..update.rowsparse import RowSparse
from .arguments import (
    check_same, check_writable, deliver, init_items, pull_targets, push_pairs, row_sparse_targets, write_rows,
)

# A value: a NumPy, CuPy or torch array, or anything with ``__array__`` / ``__dlpack__``
# (typed loosely so that tensorkv imports neither CuPy nor torch).
ArrayLike = Any
# A key, or a list of keys (int and str keys are not mixed in one store).
Key = Union[int, str]
Keys = Union[Key, Sequence[Key]]
# One array per key, or a list of arrays (one per device) per key; a list of those for a list of keys.
Values = Union[ArrayLike, Sequence[ArrayLike], Sequence[Sequence[ArrayLike]]]
# ``updater(key, input, stored)``, which updates ``stored`` in place.
UpdaterFunction = Callable[[Key, ArrayLike, ArrayLike], None]


class KVStore:
    """A key-value store for data-parallel training, with MXNet's KVStore API.

    Create one with :func:`tensorkv.create`. Keys are int or str; values are arrays
    (NumPy, CuPy, torch, or anything with ``__array__`` / ``__dlpack__``).

    >>> import numpy as np, tensorkv
    >>> kv = tensorkv.create('local')
    >>> kv.init(3, np.ones((2, 3)) * 2)
    >>> a = np.zeros((2, 3))
    >>> kv.pull(3, out=a)
    >>> print(a)
    [[2. 2. 2.]
     [2. 2. 2.]]
    """

    # The capability of :meth:`is_capable` that MXNet names (its KVStoreBase.OPTIMIZER).
    OPTIMIZER = "optimizer"

    def __init__(self, name: str) -> None:
        self._type = name
        self._closed = False

    # ---- properties -------------------------------------------------------------------

    @property
    def type(self) -> str:
        """The type this store was created with: 'local', 'device', 'dist_sync' or 'dist_async'
        (or the MXNet name given, ``tensorkv.ALIASES``).

        >>> import tensorkv
        >>> tensorkv.create('local_allreduce_cpu').type
        'local_allreduce_cpu'
        """
        return self._type

    @property
    def rank(self) -> int:
        """This worker's rank, 0 <= rank < num_workers.

        >>> import tensorkv
        >>> tensorkv.create('local').rank
        0
        """
        return 0

    @property
    def num_workers(self) -> int:
        """The number of workers.

        >>> import tensorkv
        >>> tensorkv.create('local').num_workers
        1
        """
        return 1

    # ---- data -------------------------------------------------------------------------

    def init(self, key: Keys, value: Values) -> None:
        """Initialize one key or a list of keys, once each.

        Parameters
        ----------
        key : str, int, or sequence of str or int
            The key or keys; a store holds int keys or str keys, not both.
        value : array, or sequence of arrays
            One array per key: its shape and dtype are the key's from now on.

        >>> import numpy as np, tensorkv
        >>> kv = tensorkv.create('local')
        >>> # init a single key-value pair
        >>> kv.init('w', np.zeros(4, dtype=np.float32))
        >>> # init a list of key-value pairs
        >>> kv.init(['a', 'b'], [np.ones(2), np.full(2, 3.0)])
        >>> print(kv.pull('b'))
        [3. 3.]
        >>> kv.init('w', np.zeros(4, dtype=np.float32))
        Traceback (most recent call last):
        ...
        tensorkv.errors.KeyExistsError: key 'w' is already initialized
        """
        self._check_open()
        self._init(init_items(key, value))

    def push(self, key: Keys, value: Values, priority: int = 0) -> None:
        """Push values into one key or a list of keys.

        A list of arrays for one key (one per device) is summed first; the sum then goes
        through the updater (by default it is assigned).

        In the dist stores, a small push of keys this worker has initialized or pulled is
        checked here and sent without waiting for the server's answer, as MXNet's push is
        queued; an error only the server can see (a round aborted, a lease lost, a limit) is
        then raised by the next call to that server, naming the push, which changed nothing.

        Parameters
        ----------
        key : str, int, or sequence of str or int
            The key or keys.
        value : array, sequence of arrays, or sequence of those
            For one key, an array or a list of arrays (one per device) of the key's shape
            and dtype; for a list of keys, one of those per key. Row-sparse values
            (:func:`tensorkv.row_sparse`) go in a call of their own.
        priority : int
            Accepted for MXNet's API; calls are not reordered.

        >>> import numpy as np, tensorkv
        >>> kv = tensorkv.create('local')
        >>> kv.init('w', np.zeros(4, dtype=np.float32))
        >>> # push a single key-value pair: without an updater the value is assigned
        >>> kv.push('w', np.ones(4, dtype=np.float32) * 8)
        >>> print(kv.pull('w'))
        [8. 8. 8. 8.]
        >>> # aggregate the values of four devices, then push
        >>> kv.push('w', [np.ones(4, dtype=np.float32)] * 4)
        >>> print(kv.pull('w'))
        [4. 4. 4. 4.]
        >>> # push a list of keys
        >>> kv.init(['a', 'b'], [np.zeros(2), np.zeros(2)])
        >>> kv.push(['a', 'b'], [np.ones(2), [np.ones(2), np.ones(2)]])
        >>> print(kv.pull('b'))
        [2. 2.]
        """
        self._check_open()
        pairs = push_pairs(key, value)
        sparse = [isinstance(array, RowSparse) for _, arrays in pairs for array in arrays]
        if not any(sparse):
            self._push(pairs)
        elif all(sparse):
            self._push_rows(pairs)
        else:
            raise InvalidArgumentError("push: row-sparse and dense values cannot be mixed in one call; "
                                       "push them in separate calls")

    def row_sparse_pull(self, key: Keys, out: Values | None = None, priority: int = 0,
                        row_ids: Any = None) -> Any:
        """Pull only the rows ``row_ids`` (along the first axis) of one key or a list of keys.

        ``row_ids`` may repeat and be in any order. Each ``out`` array has shape
        ``(len(row_ids),) + shape[1:]`` and receives the rows in the order asked, or has the
        key's whole shape and receives those rows in place (its other rows are left as they
        are). ``out`` may be a list (one array per device): ``row_ids`` is then one array for
        all of them or a list with one per array. For a list of keys, ``out`` and ``row_ids``
        are lists with one entry per key. With ``out=None`` the rows are returned. Only the
        rows asked for travel; a row id out of range raises InvalidArgumentError naming the
        key and the id, before any ``out`` is written.

        >>> import numpy as np, tensorkv
        >>> kv = tensorkv.create('local')
        >>> kv.init('emb', np.arange(12, dtype=np.float32).reshape(6, 2))
        >>> kv.row_sparse_pull('emb', row_ids=[4, 0, 4])
        array([[8., 9.],
               [0., 1.],
               [8., 9.]], dtype=float32)
        >>> # rows into an out array of the whole shape: the others are left as they are
        >>> whole = np.full((6, 2), -1, dtype=np.float32)
        >>> kv.row_sparse_pull('emb', out=whole, row_ids=[1])
        >>> print(whole[:3])
        [[-1. -1.]
         [ 2.  3.]
         [-1. -1.]]
        """
        self._check_open()
        requests, deliveries = row_sparse_targets(key, out, row_ids)
        for position, target in deliveries or ():
            check_writable(requests[position][0], [target])
        # The first out array of each request may receive its rows straight from the wire.
        results = self._row_sparse_pull(requests, {} if deliveries is None else dict(reversed(deliveries)))
        if deliveries is None:
            rows = [to_host(rows) if getattr(rows, "flags", None) is None or rows.flags.writeable else rows.copy()
                    for _, rows in results]
            return rows if isinstance(key, (list, tuple)) else rows[0]
        writes = []
        for position, target in deliveries:
            (k, ids), (shape, rows) = requests[position], results[position]
            target_shape, dtype = shape_dtype(target)
            if dtype != rows.dtype:
                raise DtypeMismatchError(f"key {key_repr(k)}: out array of dtype {dtype} does not match the stored "
                                         f"dtype {rows.dtype}")
            if target_shape not in (tuple(rows.shape), tuple(shape)):
                raise ShapeMismatchError(
                    f"key {key_repr(k)}: out array of shape {target_shape} holds neither the {len(ids)} rows asked "
                    f"{tuple(rows.shape)} nor the whole value {tuple(shape)}")
            writes.append((target, None if target_shape == tuple(rows.shape) else ids, rows))
        for target, ids, rows in writes:
            if ids is None:
                if rows is not target:  # else pulled straight into it
                    write_into(target, rows)
            else:
                write_rows(target, ids, rows)
        return None

    def pull(self, key: Keys, out: Values | None = None, priority: int = 0, ignore_sparse: bool = True) -> Any:
        """Pull values of one key or a list of keys.

        With ``out`` (an array, or a list of arrays that each get the value) the values are
        written in place and None is returned; with ``out=None`` new NumPy arrays are
        returned (a list of them for a list of keys).

        Parameters
        ----------
        key : str, int, or sequence of str or int
            The key or keys.
        out : array, sequence of arrays, or sequence of those, optional
            Where the values go, each of the key's shape and dtype: checked before any is
            written.
        priority : int
            Accepted for MXNet's API.
        ignore_sparse : bool
            Accepted for MXNet's API: every stored value is dense.

        >>> import numpy as np, tensorkv
        >>> kv = tensorkv.create('local')
        >>> kv.init('w', np.full(4, 4, dtype=np.float32))
        >>> # pull a single key into an array
        >>> a = np.zeros(4, dtype=np.float32)
        >>> kv.pull('w', out=a)
        >>> print(a)
        [4. 4. 4. 4.]
        >>> # pull into several arrays (one per device)
        >>> b = [np.zeros(4, dtype=np.float32) for _ in range(2)]
        >>> kv.pull('w', out=b)
        >>> print(b[1])
        [4. 4. 4. 4.]
        >>> # return the value
        >>> kv.pull('w')
        array([4., 4., 4., 4.], dtype=float32)
        >>> # a list of keys
        >>> kv.init('v', np.arange(2))
        >>> kv.pull(['w', 'v'])
        [array([4., 4., 4., 4.], dtype=float32), array([0, 1])]
        """
        self._check_open()
        keys, outs = pull_targets(key, out)
        values = self._pull(keys, fresh=outs is None, outs=outs)
        return deliver(key, keys, outs, values)

    def pushpull(self, key: Keys, value: Values, out: Values | None = None, priority: int = 0) -> None:
        """Push, then pull the same keys, in one call (one round trip on a server).

        As in MXNet, ``out=None`` pulls the result back into ``value`` itself.

        >>> import numpy as np, tensorkv
        >>> kv = tensorkv.create('local')
        >>> kv.init('w', np.zeros(4, dtype=np.float32))
        >>> # push the sum of two devices' values, pull it back into both
        >>> g = [np.ones(4, dtype=np.float32), np.full(4, 2, dtype=np.float32)]
        >>> kv.pushpull('w', g)
        >>> print(g[0], g[1])
        [3. 3. 3. 3.] [3. 3. 3. 3.]
        >>> # or into ``out``
        >>> out = np.zeros(4, dtype=np.float32)
        >>> kv.pushpull('w', np.ones(4, dtype=np.float32), out=out)
        >>> print(out)
        [1. 1. 1. 1.]
        """
        self._check_open()
        pairs = push_pairs(key, value)
        if any(isinstance(array, RowSparse) for _, arrays in pairs for array in arrays):
            raise InvalidArgumentError("pushpull takes dense values: push a row-sparse value, then row_sparse_pull")
        keys, outs = pull_targets(key, value if out is None else out)
        for (k, arrays), targets in zip(pairs, outs):
            shape, dtype = shape_dtype(arrays[0])
            check_same(k, targets, "out array of", shape, dtype)
            check_writable(k, targets)
        values = self._pushpull(pairs, fresh=False, outs=outs)
        deliver(key, keys, outs, values)

    def broadcast(self, key: Keys, value: Values, out: Values | None = None, priority: int = 0) -> Any:
        """Initialize keys with ``value``, then pull them into ``out`` (or return them).

        >>> import numpy as np, tensorkv
        >>> kv = tensorkv.create('local')
        >>> kv.broadcast('b', np.full(2, 7, dtype=np.int32))
        array([7, 7], dtype=int32)
        >>> out = [np.zeros(3), np.zeros(3)]
        >>> kv.broadcast('c', np.ones(3), out=out)
        >>> print(out[1])
        [1. 1. 1.]
        """
        self._check_open()
        items = init_items(key, value)
        keys, outs = pull_targets(key, out)
        if outs is not None:
            for item, targets in zip(items, outs):
                check_same(item.key, targets, "out array of", *shape_dtype(item.array))
                check_writable(item.key, targets)
        self._init(items)
        return self.pull(key, out=out)

    # ---- updaters -----------------------------------------------------------------------

    def set_updater(self, updater: UpdaterFunction) -> None:
        """Set ``updater(key, input, stored)``, which updates ``stored`` in place on push.

        >>> import numpy as np, tensorkv
        >>> kv = tensorkv.create('local')
        >>> kv.init(3, np.ones(2))
        >>> def update(key, input, stored):
        ...     stored += input * 2
        >>> kv.set_updater(update)
        >>> kv.push(3, np.ones(2))
        >>> print(kv.pull(3))
        [3. 3.]
        """
        self._check_open()
        self._set_updater(updater)

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Apply ``optimizer`` (see :mod:`tensorkv.optimizer`) to every push from now on.

        As in MXNet, this starts afresh: every key's optimizer states (momentum, Adam's
        moments) and update counts start from zero again, and so does an ``lr_scheduler``'s
        count (on a server, an optimizer equal to the installed one, as every worker of a
        job sends, keeps it as it is). To change only the learning rate, keeping states and
        counts, use :meth:`set_learning_rate`.

        >>> import numpy as np, tensorkv
        >>> kv = tensorkv.create('local')
        >>> kv.init('w', np.ones(2, dtype=np.float32))
        >>> kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=0.1, momentum=0.9))
        >>> kv.push('w', np.ones(2, dtype=np.float32))
        >>> print(kv.pull('w'))
        [0.9 0.9]
        """
        self._check_open()
        self._set_optimizer(check_optimizer(optimizer, "set_optimizer"))

    def set_learning_rate(self, lr: float) -> None:
        """Make ``lr`` the learning rate of the optimizer's updates from now on (on every
        server of a dist store); its states and update counts stay.

        Raises FailedPreconditionError before ``set_optimizer``, and when the optimizer has an
        ``lr_scheduler`` (as MXNet's ``Optimizer.set_learning_rate``). In ``dist_sync`` call it
        at the same point on every worker (or between rounds on one).

        >>> import numpy as np, tensorkv
        >>> kv = tensorkv.create('local')
        >>> kv.init('w', np.ones(2, dtype=np.float32))
        >>> kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=0.1))
        >>> kv.set_learning_rate(0.5)
        >>> kv.push('w', np.ones(2, dtype=np.float32))
        >>> print(kv.pull('w'))
        [0.5 0.5]
        """
        self._check_open()
        self._set_learning_rate(lr)

    def save_optimizer_states(self, fname: str | PathLike[str], dump_optimizer: bool = False) -> None:
        """Save the optimizer's per-key states to ``fname``, with the optimizer itself (its name
        and hyper-parameters) whatever ``dump_optimizer`` says: a NumPy archive, no pickle.

        >>> import os, tempfile, numpy as np, tensorkv
        >>> kv = tensorkv.create('local')
        >>> kv.init('w', np.ones(2, dtype=np.float32))
        >>> kv.set_optimizer(tensorkv.optimizer.Adam(learning_rate=0.01))
        >>> kv.push('w', np.ones(2, dtype=np.float32))
        >>> fname = os.path.join(tempfile.mkdtemp(), 'states')
        >>> kv.save_optimizer_states(fname)
        >>> other = tensorkv.create('local')
        >>> other.init('w', kv.pull('w'))
        >>> other.load_optimizer_states(fname)   # Adam with its moments, as saved
        """
        self._check_open()
        self._save_optimizer_states(fname)

    def load_optimizer_states(self, fname: str | PathLike[str]) -> None:
        """Install the optimizer and the per-key states saved by :meth:`save_optimizer_states`
        (as MXNet does for states saved with their optimizer). Every key of the file must be
        initialized here with the shape it had; nothing changes when one is not.

        >>> import os, tempfile, numpy as np, tensorkv
        >>> kv = tensorkv.create('local')
        >>> kv.init('w', np.ones(2, dtype=np.float32))
        >>> kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=0.1, momentum=0.9))
        >>> kv.push('w', np.ones(2, dtype=np.float32))
        >>> fname = os.path.join(tempfile.mkdtemp(), 'states')
        >>> kv.save_optimizer_states(fname)
        >>> tensorkv.create('local').load_optimizer_states(fname)   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        tensorkv.errors.KeyNotFoundError: ... holds states of key 'w', which has not been initialized
        """
        self._check_open()
        self._load_optimizer_states(fname)

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress every later push as MXNet's '2bit' gradient compression does:
        ``compression_params`` is ``{'type': '2bit', 'threshold': t}`` (``t`` > 0; 0.5 when
        left out).

        On a dist store each push (the sum of the worker's arrays for a key) is added to a
        residual this worker keeps per key; elements where it reached ``t`` travel as
        ``+t``, where it reached ``-t`` as ``-t``, the others as 0, in 2 bits each (16 times
        fewer bytes than float32), and what was sent is taken off the residual. The servers
        merge those values as any push; pulls stay exact. float32 values only. A 'device'
        store compresses each array of a pushed list with a residual of its own before the
        sum, and a 'local' store raises FailedPreconditionError, as MXNet's do. An unknown
        type, a threshold <= 0 or another parameter raise InvalidArgumentError. See
        docs/reference.md.

        >>> import numpy as np, tensorkv
        >>> kv = tensorkv.create('device')
        >>> kv.init(0, np.zeros(4, dtype=np.float32))
        >>> kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
        >>> kv.push(0, np.array([0.7, -0.6, 0.2, 0], dtype=np.float32))
        >>> print(kv.pull(0))
        [ 0.5 -0.5  0.   0. ]
        """
        self._check_open()
        self._set_gradient_compression(compression_params)

    def is_capable(self, capability: str) -> bool:
        """Whether this store has ``capability``, as MXNet's ``is_capable``: the one capability
        MXNet names is ``KVStore.OPTIMIZER`` ('optimizer', any case), which every tensorkv
        store has. Any other name raises InvalidArgumentError (a ValueError, as MXNet's).

        >>> import tensorkv
        >>> tensorkv.create('local').is_capable(tensorkv.KVStore.OPTIMIZER)
        True
        """
        if str(capability).lower() == self.OPTIMIZER:
            return True
        raise InvalidArgumentError(f"Unknown capability: {capability!r}; the capability MXNet names is "
                                   f"{self.OPTIMIZER!r} (KVStore.OPTIMIZER)")

    def barrier(self) -> None:
        """Return once every worker has called barrier().

        >>> import tensorkv
        >>> kv = tensorkv.create('dist_sync', servers='127.0.0.1:50051')   # doctest: +SKIP
        >>> kv.barrier()   # every worker waits here for the others  # doctest: +SKIP
        """
        self._check_open()
        self._barrier()

    # ---- life cycle -------------------------------------------------------------------

    def close(self) -> None:
        """Release the store's resources; further calls raise FailedPreconditionError.

        >>> import numpy as np, tensorkv
        >>> with tensorkv.create('local') as kv:
        ...     kv.init(1, np.zeros(2))
        >>> kv.pull(1)
        Traceback (most recent call last):
        ...
        tensorkv.errors.FailedPreconditionError: this 'local' KVStore is closed
        """
        self._closed = True

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self):
        if self._closed:
            raise FailedPreconditionError(f"this {self._type!r} KVStore is closed")
