"""The update engine: stored values, merging of pushes and the updater, over one array
namespace (NumPy, or CuPy on a GPU).

The embedded stores and the server both keep their values in an :class:`Engine`, so the
CPU tests run the same code as a GPU server. Every method that changes state validates
all of its input first: a call that raises leaves every value as it was.
"""
import ml_dtypes
import numpy as np

from .backend import shape_dtype, to_namespace
from .codec import check_key, wire_dtype
from .errors import (
    DtypeMismatchError, InvalidTensorError, KeyExistsError, KeyNotFoundError, KeyTypeError, ShapeMismatchError,
)

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
# Low-precision dtypes whose sums are accumulated in float32.
_WIDENED = {_BFLOAT16}


class Stored:
    """One key's value: ``array`` (namespace xp) holds the whole value of ``shape``, or only
    the elements ``slice`` = (begin, end) of it, flattened, on a server holding one slice."""

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

    >>> from tensorkv.codec import Item
    >>> engine = Engine()
    >>> engine.init([Item('w', np.zeros(2))])
    >>> engine.push([('w', [np.ones(2), np.ones(2)])])
    >>> print(engine.pull(['w'])[0])
    [2. 2.]
    """

    def __init__(self, xp=np):
        self.xp = xp
        self.updater = None
        self._values = {}
        self._key_type = None  # int or str, fixed by the first key stored

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
            raise KeyNotFoundError(f"key {key!r} has not been initialized") from None

    # ---- validation -----------------------------------------------------------------

    def check_keys(self, keys):
        """Normalize keys and check they are all int or all str, as the store's keys are."""
        keys = [check_key(k) for k in keys]
        kinds = {type(k) for k in keys} | ({self._key_type} if self._key_type else set())
        if len(kinds) > 1:
            held = f"the store holds {self._key_type.__name__} keys; " if self._key_type else ""
            raise KeyTypeError(f"{held}int and str keys cannot be mixed: {keys!r}")
        return keys

    def check_new(self, items):
        """Check that ``items`` (codec.Item) may be initialized: new, distinct keys of the store's
        kind, with a dtype the wire and this engine's namespace support."""
        keys = self.check_keys([item.key for item in items])
        seen = set()
        for key, item in zip(keys, items):
            if key in self._values:
                raise KeyExistsError(f"key {key!r} is already initialized")
            if key in seen:
                raise KeyExistsError(f"key {key!r} appears twice in one init")
            seen.add(key)
            _, dtype = shape_dtype(item.array)
            try:
                wire_dtype(dtype)
            except InvalidTensorError as error:
                raise InvalidTensorError(f"key {key!r}: {error}") from None
            if dtype == _BFLOAT16 and self.xp is not np:
                raise InvalidTensorError(f"key {key!r}: bfloat16 values cannot live on the GPU, CuPy has no bfloat16")

    def check_value(self, key, value, shape=None, slice=None, verb="pushed"):
        """Check ``value`` agrees with the stored dtype and shape (and slice) of ``key``."""
        stored = self.get(key)
        if type(value) is np.ndarray:
            data_shape, dtype = value.shape, value.dtype
        else:
            data_shape, dtype = shape_dtype(value)
        full_shape = data_shape if shape is None else tuple(shape)
        if dtype != stored.array.dtype:
            raise DtypeMismatchError(
                f"key {key!r}: {verb} dtype {dtype} does not match the stored dtype {stored.array.dtype}"
            )
        if full_shape != stored.shape or slice != stored.slice or data_shape != tuple(stored.array.shape):
            where = "" if slice == stored.slice else f" (slice {slice}, stored slice {stored.slice})"
            raise ShapeMismatchError(
                f"key {key!r}: {verb} shape {full_shape} does not match the stored shape {stored.shape}{where}"
            )
        return stored

    # ---- changes ----------------------------------------------------------------------

    def init(self, items):
        """Store the values of ``items`` (codec.Item), all or none."""
        self.check_new(items)
        for item in items:
            array = self.xp.array(to_namespace(item.array, self.xp), copy=True)
            self._values[check_key(item.key)] = Stored(array, item.shape, item.slice)
            self._key_type = type(check_key(item.key))

    def accumulate(self, total, value, owned=False):
        """``total + value`` for merging pushes, in place when ``total`` is not None.

        The first value is copied (widened to float32 for bfloat16), so the caller's
        arrays are never modified; an ``owned`` value (a receive buffer nobody else holds)
        becomes the total itself when no copy is needed.
        """
        value = to_namespace(value, self.xp)
        if total is None and owned and value.dtype not in _WIDENED and type(value) is np.ndarray \
                and self.xp is np and value.flags.writeable and value.flags.c_contiguous:
            return value
        if total is None:
            dtype = np.float32 if value.dtype in _WIDENED else value.dtype
            return self.xp.array(value, dtype=dtype, copy=True)
        total += value
        return total

    def apply(self, key, merged):
        """Merge ``merged`` into ``key`` through the updater, or assign it when there is none."""
        stored = self.get(key).array
        if merged.dtype != stored.dtype:
            merged = merged.astype(stored.dtype)
        if self.updater is None:
            stored[...] = merged
        else:
            self.updater(key, merged, stored)

    def push(self, pairs):
        """Merge each (key, [values]) pair into its key: sum the list, then apply. All or none.

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
        for key, values in grouped.items():
            self.apply(key, self.merge(values))

    def merge(self, values):
        """The sum of ``values``; a single value is passed through without a copy."""
        if len(values) == 1:
            value = values[0]
            if self.xp is np and type(value) is np.ndarray and value.dtype.byteorder != ">" \
                    and value.flags.c_contiguous:
                return value
            return to_namespace(value, self.xp)
        total = None
        for value in values:
            total = self.accumulate(total, value)
        return total

    def pull(self, keys):
        """The stored arrays of ``keys`` (not copies); KeyNotFoundError before any is returned."""
        keys = self.check_keys(keys)
        return [self.get(key).array for key in keys]
