"""One entry of a tensor stream as both ends check it: the wire dtypes, keys (int or str),
shapes, the :class:`Item` a stream carries and the :class:`Header` of an Entry read off the
wire (validated before anything is allocated or stored).
"""
import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import InvalidArgumentError, InvalidTensorError, KeyTypeError, ResourceExhaustedError, key_repr
from ..v1 import tensor_pb2

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

def wire_dtype(dtype, key=None):
    """The wire enum value of a NumPy dtype, or InvalidTensorError (naming ``key``, when
    given) if it has none."""
    dtype = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        whose = "" if key is None else f"key {key_repr(key)}: "
        raise InvalidTensorError(
            f"{whose}dtype {dtype} is not supported; use one of {', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        ) from None


def numpy_dtype(wire):
    """The NumPy dtype of a wire enum value, or InvalidTensorError if it is unknown."""
    try:
        return _TO_NUMPY[wire]
    except KeyError:
        name = "DTYPE_UNSPECIFIED" if wire == tensor_pb2.DTYPE_UNSPECIFIED else str(wire)
        raise InvalidTensorError(f"unknown wire dtype {name}") from None


# ---- keys ---------------------------------------------------------------------------

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def check_key(key):
    """The key as a plain int or str; KeyTypeError for anything else (bool included)."""
    kind = type(key)
    if kind is str:
        return key
    if kind is int and _INT64_MIN <= key <= _INT64_MAX:
        return key
    if isinstance(key, str):
        return key
    if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
        if not _INT64_MIN <= key <= _INT64_MAX:
            raise KeyTypeError(f"int key {key} does not fit in 64 bits")
        return int(key)
    raise KeyTypeError(f"key {key_repr(key)} has type {type(key).__name__}; keys are int or str")


def check_key_bytes(key, max_key_bytes):
    """The bytes ``key`` takes against a server's key limit (UTF-8 of a str; 0 for an int);
    InvalidArgumentError when that is more than ``max_key_bytes``."""
    size = len(key.encode()) if type(key) is str else 0
    if size > max_key_bytes:
        raise InvalidArgumentError(f"key {key_repr(key)} takes {size} bytes of UTF-8; this server's limit is "
                                   f"{max_key_bytes} bytes (--max-key-bytes)")
    return size


def check_key_count(keys, max_keys):
    """ResourceExhaustedError when the list ``keys`` of one call is longer than a server's
    ``max_keys`` (--max-keys-per-call)."""
    if len(keys) > max_keys:
        raise too_many_keys(keys[max_keys], max_keys)


def too_many_keys(key, max_keys):
    """The ResourceExhaustedError of a call whose key ``key`` is one more than ``max_keys``."""
    return ResourceExhaustedError(f"key {key_repr(key)} is key {max_keys + 1} of this call; this server's limit is "
                                  f"{max_keys} keys per call (--max-keys-per-call)")


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
    count = math.prod(shape)
    # NumPy refuses a shape whose nonzero dimensions times the item size (at most 16 bytes)
    # pass 2**63 bytes even when a zero dimension leaves no elements (larger counts meet the
    # server's --max-value-bytes).
    if count == 0 and math.prod(d for d in shape if d) >= 1 << 59:
        raise InvalidTensorError(f"shape {shape} has no elements, and more than any array can hold along its "
                                 "other dimensions")
    return shape, count


# ---- entries -------------------------------------------------------------------------

@dataclasses.dataclass(eq=False, slots=True)
class Item:
    """One keyed array of a stream; ``slice`` is (begin, end) over the flattened value or None.

    ``shape`` is the key's full shape (None: the array's); ``array`` holds the whole value, or
    the slice's elements as a 1-D array when ``slice`` is set; or, when ``two_bit`` is a
    threshold, the packed 2-bit codes of those float32 elements (tensorkv.update.compression).
    """

    key: int | str
    array: Any
    shape: tuple | None = None
    slice: tuple | None = None
    # True for a receive buffer the decoder allocated: its holder may keep and modify it.
    owned: bool = False
    # (region id, offset, length) when the bytes travel in shared memory: the encoder then
    # sends the reference instead of the data (see tensorkv.wire.shm.Placement).
    ref: tuple | None = None
    # True when the bytes travel on the data channel: the encoder sends the entry without them.
    follows: bool = False
    two_bit: float | None = None

    def __post_init__(self):
        self.shape = tuple(self.array.shape) if self.shape is None else tuple(self.shape)

    def __repr__(self):
        return f"Item(key={self.key!r}, shape={self.shape}, dtype={self.array.dtype}, slice={self.slice})"


class Header:
    """The validated metadata of one Entry: key, dtype, full shape, slice and byte count."""

    def __init__(self, entry, max_bytes, max_key_bytes):
        self.key = check_key(get_key(entry.key))
        self.key_bytes = check_key_bytes(self.key, max_key_bytes)
        self.dtype = numpy_dtype(entry.tensor.dtype)
        self.shape, size = check_shape(entry.tensor.shape)
        self.slice = None
        if entry.HasField("slice"):
            begin, end = entry.slice.begin, entry.slice.end
            if not 0 <= begin <= end <= size:
                raise InvalidTensorError(
                    f"key {key_repr(self.key)}: slice [{begin}, {end}) is outside a value of {size} elements "
                    f"(shape {self.shape})"
                )
            self.slice, size = (begin, end), end - begin
        self.ref = None
        if entry.HasField("shm"):
            self.ref = (entry.shm.region_id, entry.shm.offset, entry.shm.length)
        self.follows = entry.channel.length if entry.HasField("channel") else None
        if self.ref is not None and self.follows is not None:
            raise InvalidTensorError(f"key {key_repr(self.key)}: an entry is in shared memory or on the data channel, "
                                     "not both")
        self.two_bit = None
        if entry.HasField("two_bit"):
            self._two_bit_codes(entry.two_bit.threshold, size)
        else:
            self.data_shape = self.shape if self.slice is None else (size,)
            self.nbytes = size * self.dtype.itemsize
        self._check_nbytes(max_bytes)

    def _two_bit_codes(self, threshold, size):
        """The entry's bytes are the packed 2-bit codes of its ``size`` float32 elements: read
        as that many uint8 bytes."""
        if self.dtype != np.float32:
            raise InvalidTensorError(f"key {key_repr(self.key)}: 2-bit codes stand for float32 values, the entry's "
                                     f"dtype is {self.dtype}")
        if not (threshold > 0 and math.isfinite(threshold)):
            raise InvalidTensorError(f"key {key_repr(self.key)}: 2-bit threshold {threshold} is not > 0 and finite")
        self.two_bit, self.dtype = threshold, np.dtype(np.uint8)
        self.nbytes = -(-size // 4)
        self.data_shape = (self.nbytes,)

    def check_limits(self, max_bytes, max_key_bytes):
        """InvalidArgumentError when the key, ResourceExhaustedError when the value, is over a decoder's limits."""
        check_key_bytes(self.key, max_key_bytes)
        self._check_nbytes(max_bytes)

    def _check_nbytes(self, max_bytes):
        if self.nbytes > max_bytes:
            raise ResourceExhaustedError(
                f"key {key_repr(self.key)}: a value of shape {self.shape} and dtype {self.dtype} takes {self.nbytes} "
                f"bytes; this server's limit is {max_bytes} bytes per value (--max-value-bytes)")

    def item(self, flat, owned=False):
        array = flat if flat.shape == self.data_shape else flat.reshape(self.data_shape)
        return Item(self.key, array, self.shape, self.slice, owned, two_bit=self.two_bit)

    def no_data(self):
        """A read-only array of the entry's dtype and shape that takes no memory, for an entry
        without data (Init's wait_only: the shapes and dtypes are checked, nothing is stored)."""
        return np.broadcast_to(np.zeros((), self.dtype), self.data_shape)
