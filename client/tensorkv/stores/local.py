"""The embedded stores 'local' and 'device': an :class:`~tensorkv.update.engine.Engine` in this
process, no server, no network.

'local' keeps values in host memory (NumPy); 'device' keeps them on the GPU through CuPy
when CuPy sees one, else behaves as 'local'.

>>> import numpy as np, tensorkv
>>> with tensorkv.create('device') as kv:
...     kv.init('w', np.zeros(3, np.float32))
...     kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=0.5))
...     kv.push('w', [np.ones(3, np.float32), np.ones(3, np.float32)])
...     print(kv.pull('w'))
[-1. -1. -1.]
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..backend import host_copy, select, to_namespace
from ..errors import FailedPreconditionError, InvalidArgumentError, KeyNotFoundError, key_repr
from ..optimizer import Updater
from ..update import compression
from ..update.engine import Engine
from ..wire import states_file
from .kvstore import KVStore


class LocalStore(KVStore):
    """An embedded KVStore of type 'local' or 'device'; create it with :func:`tensorkv.create`.

    Calls are serialized by a lock, so threads may share one store.
    """

    def __init__(self, name: str, **kwargs: Any) -> None:
        if kwargs:
            raise InvalidArgumentError(f"a {name!r} KVStore takes no options, got {', '.join(sorted(kwargs))}")
        super().__init__(name)
        self._kind = name  # 'local' or 'device', whatever MXNet name kv.type shows (tensorkv.ALIASES)
        xp, self.device = select("auto") if name == "device" else (np, "cpu")
        self._engine = Engine(xp)
        self._lock = threading.RLock()
        self._compressor = None  # compression.Compressor once set_gradient_compression was called ('device')

    def __repr__(self):
        return f"<LocalStore type={self.type!r} device={self.device!r} keys={len(self._engine)}>"

    def _init(self, items):
        with self._lock:
            self._engine.init(items)

    def _push(self, pairs):
        with self._lock:
            pairs, residuals = self._compressed(pairs)
            self._engine.push(pairs)
            if residuals:
                self._compressor.keep(residuals)

    def _pull(self, keys, fresh, outs=None):
        with self._lock:
            values = self._engine.pull(keys)
            return [host_copy(value) for value in values] if fresh else values

    def _push_rows(self, pairs):
        self._push(pairs)  # the engine merges RowSparse values as it merges arrays

    def _row_sparse_pull(self, requests, outs=None):
        with self._lock:
            return [self._engine.pull_rows(key, ids) for key, ids in requests]

    def _pushpull(self, pairs, fresh, outs=None):
        with self._lock:
            self._push(pairs)
            return self._pull([key for key, _ in pairs], fresh)

    def _set_updater(self, updater):
        """Set ``updater(key, input, stored)``; MXNet's name for :meth:`set_updater`."""
        self._check_open()
        if not callable(updater):
            raise InvalidArgumentError(f"an updater must be callable, got {type(updater).__name__}")
        with self._lock:
            self._engine.updater = updater

    def _set_optimizer(self, optimizer):
        self._set_updater(Updater(optimizer))

    def _set_learning_rate(self, learning_rate):
        with self._lock:
            self._optimizer_updater().set_learning_rate(learning_rate)

    def _optimizer_updater(self):
        updater = self._engine.updater
        if not isinstance(updater, Updater):
            raise FailedPreconditionError("optimizer states exist only after set_optimizer()")
        return updater

    def _save_optimizer_states(self, fname):
        with self._lock:
            updater = self._optimizer_updater()
            states_file.save(fname, updater.optimizer, updater.get_states())

    def _load_optimizer_states(self, fname):
        optimizer, saved = states_file.load(fname)
        with self._lock:
            updater = Updater(optimizer)
            states = {}
            for key, (num_update, arrays) in saved.items():
                if key not in self._engine:
                    raise KeyNotFoundError(
                        f"{fname} holds states of key {key_repr(key)}, which has not been initialized")
                weight = self._engine.get(key).array
                states[key] = (num_update, updater.check_states(key, weight, arrays))
            updater.set_states(states)
            self._engine.updater = updater

    def _set_gradient_compression(self, compression_params):
        if self._kind == "local":
            raise FailedPreconditionError(
                "gradient compression is not supported for a 'local' KVStore (as in MXNet): use 'device' (each "
                "device's array compressed on its way to the sum) or a 'dist_sync' or 'dist_async' store")
        threshold = compression.parse(compression_params)
        with self._lock:
            if self._compressor is None:
                self._compressor = compression.Compressor(threshold)
            else:  # the residuals stay, as in MXNet
                self._compressor.threshold = threshold

    def _compressed(self, pairs):
        """(``pairs`` with each array replaced by the values of its 2-bit codes, {(key, device):
        residual} to keep once the push succeeded), as MXNet's 'device' store compresses each
        device's array (a residual per key and position in the key's list) before the sum."""
        if self._compressor is None:
            return pairs, {}
        compressed, residuals, devices = [], {}, {}
        for key, arrays in pairs:
            values = []
            for array in arrays:
                device = devices[key] = devices.get(key, -1) + 1
                array = to_namespace(array, self._engine.xp)
                (packed,), residuals[key, device] = self._compressor.codes(key, array, slot=(key, device))
                values.append(self._compressor.values(packed, array.shape))
            compressed.append((key, values))
        return compressed, residuals

    def _barrier(self):
        """One worker: nothing to wait for."""

    def close(self) -> None:
        with self._lock:
            self._engine = Engine(self._engine.xp)
            super().close()
