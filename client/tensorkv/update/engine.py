"""The update engine: stored values, merging of pushes and the updater, over one array
namespace (NumPy, or CuPy on a GPU).

The embedded stores and the server both keep their values in an :class:`Engine`, so the
CPU tests run the same code as a GPU server: sums, assignments and optimizer steps are
:mod:`tensorkv.update.kernels` (one fused CUDA kernel each on CuPy, NumPy ufuncs on the host).
Every method that changes state validates all of its input first: a call that raises
leaves every value as it was.
"""
import contextlib

import numpy as np

from ..backend import BFLOAT16, DeviceBFloat16, empty, shape_dtype, to_namespace
from ..errors import (
    DtypeMismatchError, InvalidArgumentError, KeyExistsError, KeyNotFoundError, KeyTypeError,
    ShapeMismatchError, key_repr, keys_repr, no_memory,
)
from ..optimizer import Updater, keeps_master, state_array_bytes
from ..wire.codec import check_key, wire_dtype
from . import kernels
from .kernels import accumulator_dtype
from .rowsparse import RowSparse, Rows, canonical, check_like, check_row_ids, merge as merge_rows


def dtype_mismatch(key, verb, dtype, stored):
    """The DtypeMismatchError of a value of ``dtype`` ``verb`` ('pushed', ...) into a key
    stored as ``stored``, saying how to cast it: values are never converted silently."""
    module = "ml_dtypes" if stored == BFLOAT16 else "numpy"
    return DtypeMismatchError(f"key {key_repr(key)}: {verb} dtype {dtype} does not match the stored dtype {stored}; "
                              f"cast it with value.astype({module}.{stored}) (a torch tensor: value.to(torch.{stored}))")



def layout_mismatch(key, verb, shape, slice, stored_slice):
    """The message of a value of the stored shape that a worker splits over the servers otherwise
    than the one that initialized it: a setting that differs between the workers."""
    def held(where):
        return "the whole value" if where is None else f"its elements [{where[0]}, {where[1]})"
    return (f"key {key_repr(key)}: {verb} shape {shape} matches the stored shape, but this worker sends this server "
            f"{held(slice)} and it holds {held(stored_slice)}: the workers split values over the servers differently; "
            "give every worker the same TENSORKV_BIGARRAY_BOUND (bigarray_bound=; a value of more elements is split) "
            "and the same list of servers")

class Stored:
    """One key's value: ``array`` (namespace xp; a DeviceBFloat16 for bfloat16 on CuPy)
    holds the whole value of ``shape``, or only the elements ``slice`` = (begin, end) of it,
    flattened, on a server holding one slice."""

    __slots__ = ("array", "shape", "slice")

    def __init__(self, array, shape, slice=None):
        self.array = array
        self.shape = tuple(shape)
        self.slice = slice


class Engine:
    """Values by key and the updater that merges pushes into them.

    ``updater(key, merged, stored)`` updates ``stored`` in place; None means assign. An
    updater with a ``check(key, stored)`` method (:class:`tensorkv.optimizer.Updater`) has it
    called for every key of a push before any value changes.

    >>> from tensorkv.wire.codec import Item
    >>> engine = Engine()
    >>> engine.init([Item('w', np.zeros(2))])
    >>> engine.push([('w', [np.ones(2), np.ones(2)])])
    >>> print(engine.pull(['w'])[0])
    [2. 2.]
    """

    def __init__(self, xp=np):
        self.xp = xp
        # The GPU the values live on: calls run there whatever device is current in the caller.
        # The context of on_device(): the GPU, or on NumPy one reusable context that does nothing.
        self._device = xp.cuda.Device() if xp is not np else contextlib.nullcontext()
        # Values or keys changed this many times (with the updater: a server counts its changes
        # too), so that a snapshot can tell that nothing changed since the last.
        self.changes = 0
        self.updater = None
        self._values = {}
        self._lent = {}  # data address of a lent array -> times lent (see lend)
        self._key_type = None  # int or str, fixed by the first key stored
        # Bytes of the stored values, of one optimizer state array for each of them (see
        # optimizer.state_array_bytes), and of one for each float16 and bfloat16 value (its
        # master copy under multi_precision): what a server counts against its --max-memory.
        self.value_bytes = self.state_array_bytes = self.master_bytes = 0

    @property
    def key_type(self):
        """int or str, the type of every stored key (fixed by the first); None while empty."""
        return self._key_type

    def __contains__(self, key):
        return key in self._values

    def __len__(self):
        return len(self._values)

    def keys(self):
        return list(self._values)

    def get(self, key):
        """The :class:`Stored` value of ``key``; KeyNotFoundError if it was never initialized."""
        try:
            return self._values[key]
        except KeyError:
            raise KeyNotFoundError(f"key {key_repr(key)} has not been initialized") from None

    # ---- validation -----------------------------------------------------------------

    def check_keys(self, keys):
        """Normalize keys and check they are all int or all str, as the store's keys are."""
        keys = [check_key(k) for k in keys]
        kinds = {type(k) for k in keys} | ({self._key_type} if self._key_type else set())
        if len(kinds) > 1:
            held = f"the store holds {self._key_type.__name__} keys; " if self._key_type else ""
            raise KeyTypeError(f"{held}int and str keys cannot be mixed: {keys_repr(keys)}")
        return keys

    def check_new(self, items):
        """Check that ``items`` (codec.Item) may be initialized: new, distinct keys of the store's
        kind, with a dtype the wire and this engine's namespace support."""
        keys = self.check_keys([item.key for item in items])
        seen = set()
        for key, item in zip(keys, items):
            if key in self._values:
                raise KeyExistsError(f"key {key_repr(key)} is already initialized")
            if key in seen:
                raise KeyExistsError(f"key {key_repr(key)} appears twice in one init")
            seen.add(key)
            wire_dtype(shape_dtype(item.array)[1], key)

    def check_value(self, key, value, shape=None, slice=None, verb="pushed"):
        """Check ``value`` agrees with the stored dtype and shape (and slice) of ``key``; a
        RowSparse value, that its rows fit (:meth:`check_rows`)."""
        if isinstance(value, RowSparse):
            return self.check_rows(key, value)
        stored = self.get(key)
        if type(value) is np.ndarray:
            data_shape, dtype = value.shape, value.dtype
        else:
            data_shape, dtype = shape_dtype(value)
        full_shape = data_shape if shape is None else tuple(shape)
        if dtype != stored.array.dtype:
            raise dtype_mismatch(key, verb, dtype, stored.array.dtype)
        if full_shape == stored.shape and slice != stored.slice:
            raise ShapeMismatchError(layout_mismatch(key, verb, full_shape, slice, stored.slice))
        if full_shape != stored.shape or slice != stored.slice or data_shape != tuple(stored.array.shape):
            where = "" if slice == stored.slice else f" (slice {slice}, stored slice {stored.slice})"
            raise ShapeMismatchError(
                f"key {key_repr(key)}: {verb} shape {full_shape} does not match the stored shape {stored.shape}{where}"
            )
        return stored

    # ---- changes ----------------------------------------------------------------------

    def on_device(self):
        """A context that makes the engine's GPU current (nothing on NumPy)."""
        return self._device

    def _copy(self, value, dtype):
        """A new array of this namespace holding ``value`` converted to ``dtype``."""
        array = empty(self.xp, value.shape, dtype)
        kernels.sum_into(array, [value])
        return array

    def init(self, items):
        """Store the values of ``items`` (codec.Item), all or none."""
        self.changes += 1
        self.check_new(items)
        with self.on_device():
            arrays = [self._stored_copy(item) for item in items]
        for item, array in zip(items, arrays):
            key = check_key(item.key)
            self._values[key] = Stored(array, item.shape, item.slice)
            self._key_type = type(key)
            self.value_bytes += array.nbytes
            self.state_array_bytes += state_array_bytes(array)
            if keeps_master(array.dtype):
                self.master_bytes += state_array_bytes(array)

    def _stored_copy(self, item):
        """A copy of ``item``'s value in this namespace, or on NumPy an owned array itself (a
        buffer read for this engine); ResourceExhaustedError if it does not fit."""
        try:
            value = to_namespace(item.array, self.xp)
            if item.owned and self.xp is np and value.flags.c_contiguous and value.flags.writeable:
                return value
            return self._copy(value, value.dtype)
        except MemoryError:
            raise no_memory(item.key, item.shape, shape_dtype(item.array)[1], item.array.nbytes) from None

    def clear(self):
        """Forget every value, the updater and the key type, as a new engine."""
        self.changes += 1
        self._values.clear()
        self.updater = None
        self._key_type = None
        self.value_bytes = self.state_array_bytes = self.master_bytes = 0

    def accumulate(self, total, value, owned=False, key=None):
        """``total + value`` for merging pushes, in place when ``total`` is not None.

        The first value is copied into a new total (float32 for float16 and bfloat16), so
        the caller's arrays are never modified; an ``owned`` value (a receive buffer nobody
        else holds) becomes the total itself when no copy is needed. Row-sparse values of
        ``key`` are gathered into a RowSparse total, or added into a dense one.
        """
        if isinstance(value, RowSparse) or isinstance(total, RowSparse):
            return self._accumulate_rows(key, total, value)
        with self.on_device():
            value = to_namespace(value, self.xp)
            if total is None:
                dtype = accumulator_dtype(value.dtype)
                if owned and dtype == value.dtype and isinstance(value, self.xp.ndarray) \
                        and value.flags.c_contiguous and (self.xp is not np or value.flags.writeable):
                    return value  # a receive buffer (host, or device from the server's staging)
                total = self._copy(value, dtype)
            else:
                kernels.sum_into(total, [value], accumulate=True)
            return total

    def _accumulate_rows(self, key, total, value):
        if total is None:
            return value
        if isinstance(total, RowSparse) and isinstance(value, RowSparse):
            with self.on_device():
                data = self.xp.concatenate([to_namespace(total.data, self.xp), to_namespace(value.data, self.xp)])
            return RowSparse(data, np.concatenate([total.indices, value.indices]), total.shape)
        dense, rows = (total, value) if isinstance(value, RowSparse) else (value, total)
        return self.accumulate(self.accumulate(None, self._dense(key, rows)), dense)

    def _dense(self, key, value):
        """The RowSparse ``value`` laid out as ``key``'s stored array: its rows, zeros elsewhere."""
        stored = self.get(key)
        value = canonical(value)
        with self.on_device():
            dense = self.xp.zeros(stored.array.shape, accumulator_dtype(value.dtype))
            Rows(dense, stored.shape, stored.slice).scatter(value.indices, to_namespace(value.data, self.xp))
        return dense

    def apply(self, key, merged, owned=False):
        """Merge ``merged`` (a value or a sum from :meth:`merge`) into ``key`` through the
        updater, or assign it when there is none. Assigned, an ``owned`` value (an array nobody
        else holds) of the stored dtype and layout becomes the stored array itself."""
        self.changes += 1
        if isinstance(merged, RowSparse):
            self._apply_rows(key, canonical(merged))
            return
        value = self.get(key)
        with self.on_device():
            self._apply_dense(key, value, merged, owned)

    def _apply_dense(self, key, value, merged, owned):
        """:meth:`apply` of a dense ``merged`` to the Stored ``value`` of ``key``, on the engine's device."""
        if self.updater is None and type(merged) is type(value.array) is self.xp.ndarray \
                and merged.shape == value.array.shape:
            if owned and merged.dtype == value.array.dtype and merged.flags.c_contiguous:
                value.array = merged
            else:  # kernels.sum_into's copy of one value, without its per-call setup (once per key of a list)
                self.xp.copyto(self._writable(value), merged, casting="unsafe")
            return
        stored = self._writable(value)
        if self.updater is None:
            kernels.sum_into(stored, [merged])
        elif isinstance(self.updater, Updater):
            self.updater(key, merged, stored)  # a fused kernel reads the float32 sum as it is
        else:
            self._call_user_updater(key, merged, stored)

    def apply_each(self, items):
        """``apply(item.key, merge([item.array]), item.owned)`` for each codec.Item of ``items``
        (one pushed value per key), in one loop; with an optimizer, the values go to it
        together (Updater.update_each)."""
        self.changes += 1
        updates = []  # for an Updater: (key, value, stored array), updated together
        batch = isinstance(self.updater, Updater)
        with self.on_device():
            for item in items:
                value = self._values.get(item.key)
                array = item.array
                if batch and value is not None and type(array) is type(value.array) is self.xp.ndarray:
                    updates.append((item.key, self.merge([array]), self._writable(value)))
                    continue
                if updates:  # the updates before this one first: a schedule reads their counts
                    self.updater.update_each(updates)
                    updates = []
                if value is None or isinstance(array, RowSparse):
                    self.apply(item.key, self.merge([array]), item.owned)
                else:
                    self._apply_dense(item.key, value, self.merge([array]), item.owned)
            if updates:
                self.updater.update_each(updates)

    def _apply_rows(self, key, value):
        """Apply the canonical RowSparse ``value``: the optimizer updates its rows only (and
        their states: MXNet's lazy_update), or, one without a lazy update (LAMB, DCASGD), all
        of the value with the dense gradient; with no updater the value is assigned, as MXNet's
        KVStore stores a pushed row_sparse value (the other rows become zero); a Python
        updater gets it dense."""
        stored = self.get(key)
        with self.on_device():
            data = to_namespace(value.data, self.xp)
            self._writable(stored)
            if self.updater is None:
                stored.array[...] = 0
                Rows(stored.array, stored.shape, stored.slice).scatter(value.indices, data)
            elif isinstance(self.updater, Updater) and not self.updater.optimizer.lazy_update:
                self.updater(key, self._dense(key, value), stored.array)
            elif isinstance(self.updater, Updater):
                self.updater.update_rows(key, stored.array, stored.shape, stored.slice, value.indices, data)
            else:
                self._call_user_updater(key, self._dense(key, value), stored.array)

    def lend(self, arrays):
        """Mark the host arrays ``arrays`` (stored ones, or views of them) as read by someone
        until :meth:`give_back` (a server's answer on its way out): until then a change to the
        value they hold is written into a new array, so they stay as they are."""
        for array in arrays:
            address = array.ctypes.data
            self._lent[address] = self._lent.get(address, 0) + 1

    def give_back(self, arrays):
        for array in arrays:
            address = array.ctypes.data
            count = self._lent.pop(address) - 1
            if count:
                self._lent[address] = count

    def _writable(self, value):
        """The array of Stored ``value``, to change in place: a copy (which replaces it) when it is lent."""
        array = value.array
        if self._lent and type(array) is np.ndarray and array.ctypes.data in self._lent:
            value.array = array = array.copy()
        return array

    def _call_user_updater(self, key, merged, stored):
        """``updater(key, merged, stored)`` with both in the stored dtype; a bfloat16 value on
        the GPU is handed over in float32 (CuPy has none) and rounded back afterwards."""
        if isinstance(stored, DeviceBFloat16):
            wide = self._copy(stored, np.float32)
            grad = merged if merged.dtype == np.float32 else self._copy(merged, np.float32)
            self.updater(key, grad, wide)
            kernels.sum_into(stored, [wide])
            return
        if merged.dtype != stored.dtype:
            merged = self._copy(merged, stored.dtype)
        self.updater(key, merged, stored)

    def push(self, pairs):
        """Merge each (key, [values]) pair into its key: sum the list, then apply. All or none.
        The values of a key are all arrays, or all RowSparse.

        A key given several times in one call is merged once, over all of its values, as
        MXNet groups the pairs of a push by key.
        """
        keys = self.check_keys([key for key, _ in pairs])
        grouped = {}
        for key, (_, values) in zip(keys, pairs):
            grouped.setdefault(key, []).extend(values)
        check_updater = getattr(self.updater, "check", None)
        for key, values in grouped.items():
            for value in values:
                self.check_value(key, value)
            if check_updater is not None:
                check_updater(key, self.get(key).array)
        if self.updater is None or isinstance(self.updater, Updater):
            for key, values in grouped.items():
                self.apply(key, self.merge(values))
            return
        self._apply_all_or_none(grouped)

    def _apply_all_or_none(self, grouped):
        """:meth:`apply` of each (key: [values]) of ``grouped`` through a user's updater, which
        may raise after it changed some keys, or part of one: then every value is put back as
        it was, and the exception goes on."""
        with self.on_device():
            arrays = {key: self.get(key).array for key in grouped}
            saved = {key: self._copy(array, array.dtype) for key, array in arrays.items()}
        try:
            for key, values in grouped.items():
                self.apply(key, self.merge(values))
        except BaseException:
            for key, array in saved.items():
                self._values[key].array = array
            raise

    def merge(self, values):
        """The sum of ``values`` in one pass (float32 for float16 and bfloat16); a single
        value is passed through without a copy. Row-sparse values merge into one RowSparse."""
        value = values[0]
        if len(values) == 1 and self.xp is np and type(value) is np.ndarray and value.dtype.byteorder != ">" \
                and value.flags.c_contiguous:
            return value  # checked first: the common case, once per key of a list
        if isinstance(value, RowSparse):
            return merge_rows(None, values)
        with self.on_device():
            if len(values) == 1:
                return to_namespace(value, self.xp)
            arrays = [to_namespace(value, self.xp) for value in values]
            total = empty(self.xp, arrays[0].shape, accumulator_dtype(arrays[0].dtype))
            kernels.sum_into(total, arrays)
            return total

    def sum(self, values):
        """The sum of ``values`` in their own dtype (accumulated as :meth:`merge` does)."""
        merged = self.merge(values)
        if merged is values[0]:  # one value, passed through
            return merged
        dtype = shape_dtype(values[0])[1]
        if merged.dtype == dtype:
            return merged
        with self.on_device():
            return self._copy(merged, dtype)

    def check_rows(self, key, value):
        """Check the RowSparse ``value`` (full-width rows) may be pushed into ``key``."""
        stored = self.get(key)
        check_like(key, value, stored.shape, stored.array.dtype, "pushed")
        check_row_ids(key, value.indices, stored.shape[0])
        return stored

    def pull_rows(self, key, ids):
        """(the full shape of ``key``, a new array of its rows ``ids``): InvalidArgumentError
        naming the key and the first id out of range before anything is read."""
        stored = self.get(key)
        if not stored.shape:
            raise InvalidArgumentError(f"key {key_repr(key)}: a scalar value has no rows to pull")
        ids = check_row_ids(key, ids, stored.shape[0])
        with self.on_device():
            return stored.shape, Rows(stored.array, stored.shape, stored.slice).gather(ids)

    def pull(self, keys):
        """The stored arrays of ``keys`` (not copies); KeyNotFoundError before any is returned."""
        keys = self.check_keys(keys)
        return [self.get(key).array for key in keys]
