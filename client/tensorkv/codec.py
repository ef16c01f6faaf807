"""The wire codec: arrays <-> ``tensorkv.v1`` Tensor, Key and TensorFrame messages.

This is the only place that knows how a tensor is laid out on the wire. Client and
server both encode with :func:`encode_frames` and decode with :class:`FrameDecoder`.
"""
import math

import ml_dtypes
import numpy as np

from .backend import to_host
from .errors import InvalidTensorError, KeyTypeError
from .v1 import tensor_pb2

# One entry per wire dtype: (enum value, little-endian NumPy dtype).
_WIRE_DTYPES = (
    (tensor_pb2.DTYPE_FLOAT16, np.dtype("<f2")),
    (tensor_pb2.DTYPE_BFLOAT16, np.dtype(ml_dtypes.bfloat16)),
    (tensor_pb2.DTYPE_FLOAT32, np.dtype("<f4")),
    (tensor_pb2.DTYPE_FLOAT64, np.dtype("<f8")),
    (tensor_pb2.DTYPE_INT8, np.dtype("i1")),
    (tensor_pb2.DTYPE_INT16, np.dtype("<i2")),
    (tensor_pb2.DTYPE_INT32, np.dtype("<i4")),
    (tensor_pb2.DTYPE_INT64, np.dtype("<i8")),
    (tensor_pb2.DTYPE_UINT8, np.dtype("u1")),
)
_TO_NUMPY = dict(_WIRE_DTYPES)
_TO_WIRE = {dt: wire for wire, dt in _WIRE_DTYPES}

SUPPORTED_DTYPES = tuple(dt for _, dt in _WIRE_DTYPES)
MAX_RANK = 32
# Bound on one decoded tensor; a server may lower it to what its memory holds.
MAX_TENSOR_BYTES = 1 << 40
# Payload bytes per stream message; chosen by measurement (see bench/).
CHUNK_BYTES = 1 << 20


def wire_dtype(dtype):
    """The wire enum value of a NumPy dtype, or InvalidTensorError if it has none."""
    dtype = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        raise InvalidTensorError(
            f"dtype {dtype} is not supported; use one of {', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        ) from None


def numpy_dtype(wire):
    """The NumPy dtype of a wire enum value, or InvalidTensorError if it is unknown."""
    try:
        return _TO_NUMPY[wire]
    except KeyError:
        name = "DTYPE_UNSPECIFIED" if wire == tensor_pb2.DTYPE_UNSPECIFIED else str(wire)
        raise InvalidTensorError(f"unknown wire dtype {name}") from None


def dtype_name(dtype):
    return str(np.dtype(dtype))


# ---- keys ---------------------------------------------------------------------------

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def check_key(key):
    """The key as a plain int or str; KeyTypeError for anything else (bool included)."""
    if isinstance(key, str):
        return key
    if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
        if not _INT64_MIN <= key <= _INT64_MAX:
            raise KeyTypeError(f"int key {key} does not fit in 64 bits")
        return int(key)
    raise KeyTypeError(f"key {key!r} has type {type(key).__name__}; keys are int or str")


def set_key(message, key):
    """Write ``key`` (int or str) into a ``tensorkv.v1.Key`` message."""
    if isinstance(key, str):
        message.str_key = key
    else:
        message.int_key = key


def get_key(message):
    """The int or str held by a ``tensorkv.v1.Key`` message."""
    kind = message.WhichOneof("kind")
    if kind is None:
        raise KeyTypeError("a Key message with neither int_key nor str_key set")
    return getattr(message, kind)


# ---- arrays -------------------------------------------------------------------------

def check_shape(shape):
    """Validate a wire shape; returns (shape tuple, element count)."""
    shape = tuple(int(d) for d in shape)
    if len(shape) > MAX_RANK:
        raise InvalidTensorError(f"shape {shape} has {len(shape)} dimensions; at most {MAX_RANK}")
    if any(d < 0 for d in shape):
        raise InvalidTensorError(f"shape {shape} has a negative dimension")
    return shape, math.prod(shape)


def to_tensor(value, message=None):
    """Encode an array as a whole ``tensorkv.v1.Tensor`` (one message, no streaming)."""
    array = to_host(value)
    message = tensor_pb2.Tensor() if message is None else message
    message.dtype = wire_dtype(array.dtype)
    message.shape[:] = array.shape
    message.data = array.tobytes()
    return message


def from_tensor(message, max_bytes=MAX_TENSOR_BYTES):
    """Decode a whole ``tensorkv.v1.Tensor`` into a read-only NumPy view of its bytes."""
    dtype = numpy_dtype(message.dtype)
    shape, size = check_shape(message.shape)
    expected = size * dtype.itemsize
    if expected > max_bytes:
        raise InvalidTensorError(f"shape {shape} of {dtype} needs {expected} bytes; the limit is {max_bytes}")
    if len(message.data) != expected:
        raise InvalidTensorError(
            f"tensor of shape {shape} and dtype {dtype} needs {expected} bytes, got {len(message.data)}"
        )
    return np.frombuffer(message.data, dtype=dtype).reshape(shape)


# ---- streams of frames --------------------------------------------------------------

class Item:
    """One keyed array of a stream; ``slice`` is (begin, end) over the flattened value or None.

    ``shape`` is the key's full shape; ``array`` holds the whole value, or the slice's
    elements as a 1-D array when ``slice`` is set.
    """

    __slots__ = ("key", "array", "shape", "slice")

    def __init__(self, key, array, shape=None, slice=None):
        self.key = key
        self.array = array
        self.shape = tuple(array.shape) if shape is None else tuple(shape)
        self.slice = slice

    def __repr__(self):
        return f"Item(key={self.key!r}, shape={self.shape}, dtype={self.array.dtype}, slice={self.slice})"


def encode_frames(items, chunk_bytes=CHUNK_BYTES, with_data=True):
    """Yield ``TensorFrame`` messages carrying ``items`` (an iterable of :class:`Item`).

    Small tensors share a frame; a tensor larger than what is left of the frame's budget
    continues in ``more`` frames of ``chunk_bytes`` each. With ``with_data=False`` only
    keys, dtypes and shapes travel (Init's wait_only).
    """
    frame = tensor_pb2.TensorFrame()
    budget = chunk_bytes
    for item in items:
        entry = frame.entries.add()
        set_key(entry.key, item.key)
        entry.tensor.dtype = wire_dtype(item.array.dtype)
        entry.tensor.shape[:] = item.shape
        if item.slice is not None:
            entry.slice.begin, entry.slice.end = item.slice
        if not with_data:
            continue
        data = to_host(item.array).reshape(-1).view(np.uint8)
        head = min(len(data), budget)
        entry.tensor.data = data[:head].tobytes()
        budget -= head
        if budget > 0:
            continue
        yield frame
        for start in range(head, len(data), chunk_bytes):
            yield tensor_pb2.TensorFrame(more=data[start:start + chunk_bytes].tobytes())
        frame = tensor_pb2.TensorFrame()
        budget = chunk_bytes
    if len(frame.entries) or not with_data:
        yield frame


class FrameDecoder:
    """Reassembles the :class:`Item` values of a stream of ``TensorFrame`` messages.

    Feed it every frame in order; :meth:`feed` returns the items completed by that frame
    and :meth:`finish` checks that nothing was left incomplete. Every malformed input
    raises InvalidTensorError before anything is stored.
    """

    def __init__(self, max_bytes=MAX_TENSOR_BYTES, with_data=True):
        self.max_bytes = max_bytes
        self.with_data = with_data
        self._pending = None  # (item, buffer, bytes filled)

    def feed(self, frame):
        done = []
        if frame.more:
            done.extend(self._continue(frame.more))
        for i, entry in enumerate(frame.entries):
            if self._pending is not None:
                header, _, filled = self._pending
                raise InvalidTensorError(
                    f"key {header.key!r}: a new entry arrived after {filled} of {header.nbytes} bytes "
                    "of the previous one"
                )
            header = _Header(entry, self.max_bytes)
            data = entry.tensor.data
            if not self.with_data:
                done.append(header.item(np.empty(header.data_shape, header.dtype)))
            elif len(data) == header.nbytes:
                done.append(header.item(np.frombuffer(data, dtype=header.dtype)))
            elif len(data) < header.nbytes and i == len(frame.entries) - 1:
                buffer = np.empty(header.nbytes, dtype=np.uint8)
                buffer[:len(data)] = np.frombuffer(data, dtype=np.uint8)
                self._pending = (header, buffer, len(data))
            else:
                raise InvalidTensorError(
                    f"key {header.key!r}: tensor of shape {header.shape} and dtype {header.dtype} "
                    f"needs {header.nbytes} bytes, got {len(data)}"
                )
        return done

    def finish(self):
        if self._pending is not None:
            header, _, filled = self._pending
            raise InvalidTensorError(
                f"key {header.key!r}: stream ended after {filled} of {header.nbytes} bytes"
            )

    def _continue(self, more):
        if self._pending is None:
            raise InvalidTensorError(f"{len(more)} continuation bytes arrived with no incomplete entry")
        header, buffer, filled = self._pending
        end = filled + len(more)
        if end > header.nbytes:
            raise InvalidTensorError(f"key {header.key!r}: {end} bytes sent for a tensor of {header.nbytes} bytes")
        buffer[filled:end] = np.frombuffer(more, dtype=np.uint8)
        if end < header.nbytes:
            self._pending = (header, buffer, end)
            return []
        self._pending = None
        return [header.item(buffer.view(header.dtype))]


class _Header:
    """The validated metadata of one Entry: key, dtype, full shape, slice and byte count."""

    def __init__(self, entry, max_bytes):
        self.key = check_key(get_key(entry.key))
        self.dtype = numpy_dtype(entry.tensor.dtype)
        self.shape, size = check_shape(entry.tensor.shape)
        self.slice = None
        if entry.HasField("slice"):
            begin, end = entry.slice.begin, entry.slice.end
            if not 0 <= begin <= end <= size:
                raise InvalidTensorError(
                    f"key {self.key!r}: slice [{begin}, {end}) is outside a value of {size} elements "
                    f"(shape {self.shape})"
                )
            self.slice, size = (begin, end), end - begin
        self.data_shape = self.shape if self.slice is None else (size,)
        self.nbytes = size * self.dtype.itemsize
        if self.nbytes > max_bytes:
            raise InvalidTensorError(
                f"key {self.key!r}: shape {self.shape} of {self.dtype} needs {self.nbytes} bytes; "
                f"the limit is {max_bytes}"
            )

    def item(self, flat):
        return Item(self.key, flat.reshape(self.data_shape), self.shape, self.slice)
