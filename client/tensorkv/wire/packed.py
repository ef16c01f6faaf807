"""Packed layouts (tensor fusion): a list of keys that a worker pushes and pulls together,
call after call, moves as one buffer instead of one wire entry per key.

A :class:`Layout` is the keys, their shapes and their one dtype, in order; the buffer is
each value's bytes back to back, with no padding (``tensorkv.v1.PackedLayout``). A worker
registers a layout once on its Session stream and then names it by id in its pushes and
pulls; the values travel on the data channel as one buffer. Both sides cut the buffer into
the values with :meth:`Layout.views`, and build it with :meth:`Layout.pack`: per key that
is one slice of an array, against the dozens of Python steps of encoding and decoding an
entry. The server checks the values as it checks entries: a layout says only where each
value's bytes are.

>>> layout = Layout(["a", "b"], [(2,), (1, 2)], np.float32)
>>> buffer = layout.pack([np.array([1, 2], np.float32), np.array([[3, 4]], np.float32)])
>>> layout.nbytes, [view.tolist() for view in layout.views(buffer)]
(16, [[1.0, 2.0], [[3.0, 4.0]]])
"""
import math

import numpy as np

from ..errors import InvalidArgumentError, ResourceExhaustedError, key_repr
from ..v1 import kvstore_pb2
from .codec import check_key, check_key_bytes, check_key_count, check_shape, get_key, numpy_dtype, set_key, wire_dtype

# Layouts one Session stream may hold: a worker has a few lists (its parameters, perhaps
# grouped), not one per call.
MAX_LAYOUTS = 64


class Layout:
    """``keys`` (distinct), each with its value's shape of ``shapes``, all of ``dtype``."""

    __slots__ = ("keys", "shapes", "dtype", "bounds", "nbytes", "_flat")

    def __init__(self, keys, shapes, dtype):
        self.keys = list(keys)
        self.shapes = [tuple(shape) for shape in shapes]
        self.dtype = np.dtype(dtype)
        counts = [math.prod(shape) for shape in self.shapes]
        starts = [0]
        for count in counts:
            starts.append(starts[-1] + count)
        self.bounds = list(zip(starts, starts[1:]))  # elements of each value in the buffer
        self.nbytes = starts[-1] * self.dtype.itemsize
        self._flat = all(len(shape) == 1 for shape in self.shapes)  # no reshape needed

    def views(self, buffer):
        """The values in ``buffer`` (a uint8 array or bytes of :attr:`nbytes`), as arrays of their
        shapes that share its memory (read-only over bytes)."""
        flat = np.frombuffer(buffer, self.dtype)
        if self._flat:
            return [flat[start:end] for start, end in self.bounds]
        return [flat[start:end].reshape(shape) for (start, end), shape in zip(self.bounds, self.shapes)]

    def pack(self, arrays):
        """The buffer (bytes) of ``arrays``, C-contiguous arrays of the layout's shapes and dtype."""
        return b"".join(arrays)

    def message(self):
        """The ``tensorkv.v1.PackedLayout`` of this layout."""
        message = kvstore_pb2.PackedLayout(dtype=wire_dtype(self.dtype))
        for key, shape in zip(self.keys, self.shapes):
            value = message.values.add(shape=shape)
            set_key(value.key, key)
        return message

    @classmethod
    def from_message(cls, message, limits):
        """The layout of a ``tensorkv.v1.PackedLayout``, checked against a server's ``limits``
        (tensorkv_server.limits.Limits): InvalidArgumentError naming what is wrong."""
        if not message.values:
            raise InvalidArgumentError("a packed layout with no values")
        keys = [check_key(get_key(value.key)) for value in message.values]
        check_key_count(keys, limits.max_keys_per_call)
        if len({type(key) for key in keys}) > 1:
            raise InvalidArgumentError("a packed layout mixes int and str keys")
        seen = set()
        for key in keys:
            check_key_bytes(key, limits.max_key_bytes)
            if key in seen:
                raise InvalidArgumentError(f"key {key_repr(key)} appears twice in a packed layout")
            seen.add(key)
        dtype = numpy_dtype(message.dtype)
        shapes = [check_shape(value.shape)[0] for value in message.values]
        layout = cls(keys, shapes, dtype)
        for key, shape, (start, end) in zip(keys, shapes, layout.bounds):
            if (end - start) * dtype.itemsize > limits.max_value_bytes:
                raise ResourceExhaustedError(
                    f"key {key_repr(key)}: a value of shape {shape} and dtype {dtype} takes "
                    f"{(end - start) * dtype.itemsize} bytes; this server's limit is {limits.max_value_bytes} bytes "
                    f"per value (--max-value-bytes)")
        if limits.max_inflight_bytes is not None and layout.nbytes > limits.max_inflight_bytes:
            raise ResourceExhaustedError(f"a packed layout of {layout.nbytes} bytes; this server takes at most "
                                         f"{limits.max_inflight_bytes} bytes per call (--max-inflight-bytes)")
        return layout


def signature(keys, shapes, dtype):
    """What identifies a layout: equal for the same keys, shapes and dtype in the same order."""
    return tuple(keys), tuple(shapes), np.dtype(dtype)


class Layouts:
    """The layouts registered on one Session stream (on the server), by id (1, 2, ...)."""

    def __init__(self):
        self._by_id = {}

    def register(self, message, limits):
        """The id of the new layout of the ``tensorkv.v1.PackedLayout`` ``message``."""
        if len(self._by_id) >= MAX_LAYOUTS:
            raise ResourceExhaustedError(f"this stream holds {MAX_LAYOUTS} packed layouts already, the most it may")
        layout = Layout.from_message(message, limits)
        layout_id = len(self._by_id) + 1
        self._by_id[layout_id] = layout
        return layout_id

    def get(self, layout_id):
        try:
            return self._by_id[layout_id]
        except KeyError:
            raise InvalidArgumentError(f"packed layout {layout_id} is not registered on this stream") from None
