"""Tensor fusion on the worker: a list of keys pushed and pulled call after call is checked
key by key once, and after that as a whole.

The first push or pull of a list goes the general way: each key checked, each value summed
and placed on its server, the keys' shapes and dtypes learnt. Once that call succeeded, a
list whose keys are distinct, of one type and known, whose values are of one dtype, each
whole on its server and small enough to pack (ClientConfig: pack_min_values per server at
least, each under datachan_min_bytes), becomes a :class:`FusedList`: per server, the
positions of its keys and the packed.Layout they move in. A later push of the same list
with one C-contiguous NumPy array per key, of the known shapes and dtype, is checked in a
few passes over the whole list and sent as one buffer per server
(ServerConn.push_packed); a later pull into such arrays, writable, receives each server's
buffer straight into them (ServerConn.pull_packed). Anything else goes the general way,
which raises the errors.

>>> fused = FusedList(int, [(2,), (3,)], np.float32, [(0, [0, 1], None)])
>>> fused.matches([np.zeros(2, np.float32), np.zeros(3, np.float32)])
True
>>> fused.matches([np.zeros(2, np.float32), np.zeros(3, np.float64)])
False
"""
import operator

import numpy as np

# Lists a store keeps (fused or not): a worker has a few (its parameters, perhaps grouped);
# past this many, the one kept first makes room.
MAX_LISTS = 64

_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")
_flags = operator.attrgetter("flags")


class FusedList:
    """A list of keys of ``key_type``, their values of ``shapes`` and ``dtype``; ``parts``
    [(server index, the positions of its keys in the list, their packed.Layout)]."""

    __slots__ = ("key_type", "shapes", "dtype", "parts")

    def __init__(self, key_type, shapes, dtype, parts):
        self.key_type = key_type
        self.shapes = [tuple(shape) for shape in shapes]
        self.dtype = np.dtype(dtype)
        self.parts = parts

    def matches(self, arrays, writable=False):
        """Whether ``arrays`` (a list or tuple) hold one C-contiguous NumPy array per key, of its
        shape and the list's dtype (and writable, for a pull)."""
        if type(arrays) not in (list, tuple) or len(arrays) != len(self.shapes) \
                or set(map(type, arrays)) != {np.ndarray}:
            return False
        if list(map(_shape, arrays)) != self.shapes or set(map(_dtype, arrays)) != {self.dtype}:
            return False
        flags = list(map(_flags, arrays))
        return all(f.c_contiguous for f in flags) and (not writable or all(f.writeable for f in flags))

    def split(self, arrays):
        """{server index: (its Layout, its arrays of ``arrays``, in the layout's order)}."""
        if len(self.parts) == 1:
            index, _, layout = self.parts[0]
            return {index: (layout, arrays)}
        return {index: (layout, [arrays[position] for position in positions])
                for index, positions, layout in self.parts}


class FusedLists:
    """The FusedList of each list of keys a store has called, or None for one that does not
    fuse; up to MAX_LISTS lists. A list of fewer than ``min_values`` keys is not kept
    (ClientConfig.pack_min_values: it could not pack)."""

    def __init__(self, min_values):
        self._lists = {}
        self._min_values = min_values

    def get(self, keys):
        """The FusedList of ``keys``; None when it has none (or ``keys`` is not a list)."""
        if type(keys) not in (list, tuple):
            return None
        try:
            fused = self._lists.get(tuple(keys))
        except TypeError:  # an unhashable key: the general way names it
            return None
        # 1, 1.0 and True are one dict key: the keys' types must match too.
        if fused is None or set(map(type, keys)) != {fused.key_type}:
            return None
        return fused

    def learn(self, keys, fuse):
        """After a call of ``keys`` that succeeded: keep ``fuse(keys)`` (a FusedList, or None) as
        the list's, the first time; past MAX_LISTS, in the place of the list kept first. Only
        lists of plain ints or of strs are kept: the general way turns a NumPy integer key into
        an int, which hashes to another server, and ``1 == np.int64(1)`` as a dict key."""
        if type(keys) not in (list, tuple) or len(keys) < self._min_values \
                or set(map(type, keys)) not in ({int}, {str}):
            return
        signature = tuple(keys)
        if signature in self._lists:
            return
        if len(self._lists) >= MAX_LISTS:
            del self._lists[next(iter(self._lists))]
        self._lists[signature] = fuse(list(keys))
