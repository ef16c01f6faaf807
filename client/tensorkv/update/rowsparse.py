"""Row-sparse values: some rows (along the first axis) of a value, the others zero, as
MXNet's ``row_sparse`` NDArrays travel to and from its KVStore.

A :class:`RowSparse` is what a worker pushes (``tensorkv.row_sparse(data, indices,
shape)``) and what the stores merge; :class:`Rows` reads and writes the rows of one stored
array, which may be one slice of a large value held over several servers (elements
``[begin, end)`` of the value flattened). A row that a slice cuts travels in full width:
a server holding the slice reads (push) and writes (pull) only the elements in it.

>>> import numpy as np
>>> value = row_sparse(np.ones((2, 3)), [4, 1], (5, 3))
>>> print(value.todense()[:, 0])
[0. 1. 0. 0. 1.]
"""
import math

import numpy as np

from ..backend import array_module, shape_dtype, to_host
from ..errors import DtypeMismatchError, InvalidArgumentError, ShapeMismatchError, key_repr
from .kernels import accumulator_dtype


def check_row_ids(key, row_ids, num_rows=None):
    """``row_ids`` (an integer array, or a sequence of ints, or whole floats as MXNet's
    default NDArrays hold them) as a 1-D int64 NumPy array, each checked against ``num_rows``
    when it is known; InvalidArgumentError naming ``key`` (None: a row_sparse value being
    made) and the first bad id otherwise."""
    where = "row_sparse" if key is None else f"key {key_repr(key)}"
    ids = np.asarray(row_ids if isinstance(row_ids, (np.ndarray, list, tuple, range)) else to_host(row_ids))
    if ids.ndim != 1:
        raise InvalidArgumentError(f"{where}: row ids must be one-dimensional, got shape {ids.shape}")
    if ids.dtype.kind not in "iu" and ids.size:
        bad = next((value for value in ids.tolist() if isinstance(value, bool) or not (
            isinstance(value, int) or isinstance(value, float) and value.is_integer())), None)
        if bad is not None:
            raise InvalidArgumentError(f"{where}: row id {bad!r} is not an integer")
    ids = ids.astype(np.int64, copy=False)
    if num_rows is not None and ids.size:
        bad = ids[(ids < 0) | (ids >= num_rows)]
        if bad.size:
            raise InvalidArgumentError(
                f"{where}: row id {int(bad[0])} is out of range for a value of {num_rows} rows "
                f"(0 <= id < {num_rows})")
    return ids


class RowSparse:
    """Rows ``indices`` of a value of ``shape``: ``data[i]`` is row ``indices[i]``, every other
    row is zero. ``data`` has shape ``(len(indices),) + shape[1:]``."""

    __slots__ = ("data", "indices", "shape")

    def __init__(self, data, indices, shape):
        self.data = data
        self.indices = indices
        self.shape = tuple(shape)

    @property
    def dtype(self):
        return self.data.dtype

    def __repr__(self):
        return f"RowSparse(rows={self.indices.tolist()[:8]}{'...' if len(self.indices) > 8 else ''}, " \
               f"shape={self.shape}, dtype={self.dtype})"

    def todense(self):
        """The whole value as a NumPy array: the rows given, zeros elsewhere (duplicate rows summed)."""
        unique = canonical(self)
        dense = np.zeros(self.shape, unique.dtype)
        dense[unique.indices] = to_host(unique.data)
        return dense


def row_sparse(data, indices, shape):
    """A row-sparse value to push: row ``indices[i]`` of a value of ``shape`` is ``data[i]``,
    the other rows are zero (MXNet's ``row_sparse_array((data, indices), shape)``), for
    ``kv.push``. A row given twice counts as the sum of its two.

    >>> row_sparse(np.ones((2, 4), np.float32), [3, 17], (1000, 4))
    RowSparse(rows=[3, 17], shape=(1000, 4), dtype=float32)
    """
    shape = tuple(int(n) for n in shape)
    if not shape:
        raise InvalidArgumentError("a row-sparse value needs a shape with at least one axis (its rows)")
    if not (hasattr(data, "shape") and hasattr(data, "dtype")):
        data = np.asarray(data)
    ids = check_row_ids(None, indices, shape[0])
    data_shape, _ = shape_dtype(data)
    if data_shape != (len(ids),) + shape[1:]:
        raise ShapeMismatchError(f"row_sparse: data of shape {data_shape} does not hold {len(ids)} rows of a value "
                                 f"of shape {shape}: expected {(len(ids),) + shape[1:]}")
    return RowSparse(data, ids, shape)


def canonical(value):
    """``value`` with distinct indices, ascending, the rows of an index given twice summed (in
    the accumulator dtype: float32 for float16 and bfloat16); ``value`` itself when its
    indices are already so."""
    ids = value.indices
    if ids.size < 2 or bool((ids[1:] > ids[:-1]).all()):
        return value
    unique, inverse = np.unique(ids, return_inverse=True)
    xp = array_module(value.data)
    data = xp.zeros((len(unique),) + tuple(value.data.shape[1:]), accumulator_dtype(value.dtype))
    xp.add.at(data, xp.asarray(inverse), value.data)
    return RowSparse(data, unique, value.shape)


def merge(key, values):
    """One canonical RowSparse, the sum of ``values`` (RowSparse of one shape and dtype)."""
    first = values[0]
    for other in values[1:]:
        check_like(key, other, first.shape, first.dtype, "pushed")
    if len(values) == 1:
        return canonical(first)
    xp = array_module(first.data)
    return canonical(RowSparse(xp.concatenate([v.data for v in values]),
                               np.concatenate([v.indices for v in values]), first.shape))


def check_like(key, value, shape, dtype, verb):
    """Check a RowSparse ``value`` against the ``shape`` and ``dtype`` of ``key``."""
    if value.dtype != dtype:
        raise DtypeMismatchError(f"key {key_repr(key)}: {verb} dtype {value.dtype} does not match the stored "
                                 f"dtype {dtype}")
    if value.shape != tuple(shape):
        raise ShapeMismatchError(f"key {key_repr(key)}: {verb} row-sparse value of shape {value.shape} does not "
                                 f"match the stored shape {tuple(shape)}")


def touching(ids, width, slice):
    """The mask of ``ids`` whose rows (of ``width`` elements) have elements in ``slice``
    (begin, end) of the flattened value."""
    return (ids * width < slice[1]) & ((ids + 1) * width > slice[0])


def place(target, positions, ids, rows, slice=None):
    """Write full-width ``rows``, rows ``ids`` of a value, into rows ``positions`` of
    ``target`` (a NumPy array of rows): only their elements in ``slice`` (begin, end) of the
    flattened value, when given."""
    width = math.prod(target.shape[1:])
    target, rows = target.reshape(len(target), width), rows.reshape(len(ids), width)
    if slice is None:
        target[positions] = rows
        return
    lo = np.clip(slice[0] - ids * width, 0, width)
    hi = np.clip(slice[1] - ids * width, 0, width)
    whole = (lo == 0) & (hi == width)
    target[positions[whole]] = rows[whole]
    for i in np.flatnonzero(~whole):
        target[positions[i], lo[i]:hi[i]] = rows[i, lo[i]:hi[i]]


class Rows:
    """The rows of a stored ``array`` holding the whole value of ``shape`` (``slice`` None) or
    its elements ``slice`` = (begin, end), flattened."""

    def __init__(self, array, shape, slice=None):
        if not shape:
            raise InvalidArgumentError("a scalar value has no rows")
        self.shape = tuple(shape)
        self.width = math.prod(shape[1:])
        self.flat = array.reshape(-1)
        self.begin, self.end = slice if slice is not None else (0, math.prod(shape))
        # Rows wholly inside the slice, [first, last), as a 2-D view.
        width = max(self.width, 1)
        self.first = -(-self.begin // width)
        self.last = max(self.end // width, self.first)
        start = self.first * self.width - self.begin
        self.whole = self.flat[start:start + (self.last - self.first) * self.width].reshape(
            self.last - self.first, self.width)

    def _split(self, ids):
        """(mask of the ids of whole rows, [(i, lo, hi)] of the others: row ``ids[i]``'s
        elements [lo, hi) are in the slice)."""
        whole = (ids >= self.first) & (ids < self.last)
        cut = [(int(i), max(self.begin - int(ids[i]) * self.width, 0), min(self.end - int(ids[i]) * self.width,
                                                                          self.width))
               for i in np.flatnonzero(~whole)]
        return whole, cut

    def _at(self, row, lo, hi):
        start = row * self.width + lo - self.begin
        return self.flat[start:start + hi - lo]

    def gather(self, ids, dtype=None):
        """A new array ``(len(ids),) + shape[1:]`` of rows ``ids`` (they touch the slice): the
        elements outside the slice are zero."""
        xp = array_module(self.flat)
        whole, cut = self._split(ids)
        if whole.all() and dtype in (None, self.flat.dtype):  # one pass, into a new array
            return self.whole[xp.asarray(ids - self.first)].reshape((len(ids),) + self.shape[1:])
        rows = xp.zeros((len(ids), self.width), dtype or self.flat.dtype)
        rows[xp.asarray(whole)] = self.whole[xp.asarray(ids[whole] - self.first)]
        for i, lo, hi in cut:
            rows[i, lo:hi] = self._at(int(ids[i]), lo, hi)
        return rows.reshape((len(ids),) + self.shape[1:])

    def scatter(self, ids, rows):
        """Write ``rows`` (full width; distinct ``ids``) into the rows ``ids``, the elements in
        the slice only."""
        xp = array_module(self.flat)
        rows = rows.reshape(len(ids), self.width)
        whole, cut = self._split(ids)
        if whole.all():
            self.whole[xp.asarray(ids - self.first)] = rows
        else:
            self.whole[xp.asarray(ids[whole] - self.first)] = rows[xp.asarray(whole)]
        for i, lo, hi in cut:
            self._at(int(ids[i]), lo, hi)[...] = rows[i, lo:hi]
