"""The wire codec: arrays <-> ``tensorkv.v1`` Tensor, Key and TensorFrame messages.

This is the only place that knows how a tensor is laid out on the wire. The hot paths
(Init, Push, Pull, PushPull on both sides) use :func:`encode_messages` and
:class:`StreamDecoder`, which write and read the serialized request and response messages
by hand: the tensor bytes are copied once into each outgoing message and once out of each
incoming one, straight into their destination, never through protobuf objects. The
messages are exactly what the generated classes would produce and parse, so clients in
other languages use plain generated stubs. :func:`encode_frames` and :class:`FrameDecoder`
work on ``TensorFrame`` objects (optimizer states, and the fallback for frames that are
not hand-decodable).

Shared memory: an Entry may carry a ``shm`` reference (region id, offset, length) in
place of its data; the bytes at that place of a registered region are laid out exactly as
``tensor.data`` would be. :class:`Placement` writes arrays into a region (one copy) and
returns items that carry such references; the decoders resolve references through a
``resolve(region_id, offset, length)`` callable that bounds-checks them.

Data channel: an Entry may instead say that its bytes follow on the Session's raw-TCP data
channel (``channel``). :func:`following` marks the items to send that way; a decoder made
with ``channel=True`` gives each such entry its receive buffer (the caller's array or a new
one) and lists those buffers, in entry order, in ``incoming`` for the caller to fill from
the socket.
"""
import math
import struct

import ml_dtypes
import numpy as np

from ..backend import DeviceBytes, shape_dtype, to_host
from ..errors import (
    InvalidArgumentError, InvalidTensorError, KeyTypeError, ResourceExhaustedError, key_repr, no_memory,
)
from google.protobuf.message import DecodeError

from ..v1 import tensor_pb2
from ..words import plural

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
# Payload bytes per stream message when a caller gives none; chosen by measurement (see
# docs/transport.md). A worker's is ClientConfig.chunk_bytes; the server's __main__ sets this
# one from TENSORKV_CHUNK_BYTES.
CHUNK_BYTES = 1 << 20


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


# ---- streams of frames --------------------------------------------------------------

class Item:
    """One keyed array of a stream; ``slice`` is (begin, end) over the flattened value or None.

    ``shape`` is the key's full shape; ``array`` holds the whole value, or the slice's
    elements as a 1-D array when ``slice`` is set; or, when ``two_bit`` is a threshold, the
    packed 2-bit codes of those float32 elements (tensorkv.update.compression).
    """

    __slots__ = ("key", "array", "shape", "slice", "owned", "ref", "follows", "two_bit")

    def __init__(self, key, array, shape=None, slice=None, owned=False, ref=None, follows=False, two_bit=None):
        self.key = key
        self.array = array
        self.shape = tuple(array.shape) if shape is None else tuple(shape)
        self.slice = slice
        # True for a receive buffer the decoder allocated: its holder may keep and modify it.
        self.owned = owned
        # (region id, offset, length) when the bytes travel in shared memory: the encoder
        # then sends the reference instead of the data (see Placement).
        self.ref = ref
        # True when the bytes travel on the data channel: the encoder sends the entry without them.
        self.follows = follows
        self.two_bit = two_bit

    def __repr__(self):
        return f"Item(key={self.key!r}, shape={self.shape}, dtype={self.array.dtype}, slice={self.slice})"


def encode_frames(items, chunk_bytes=None, with_data=True):
    """Yield ``TensorFrame`` messages carrying ``items`` (an iterable of :class:`Item`).

    Small tensors share a frame; a tensor larger than what is left of the frame's budget
    continues in ``more`` frames of ``chunk_bytes`` each. With ``with_data=False`` only
    keys, dtypes and shapes travel (Init's wait_only). ``chunk_bytes`` None: CHUNK_BYTES.
    """
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    frame = tensor_pb2.TensorFrame()
    budget = chunk_bytes
    for item in items:
        entry = frame.entries.add()
        set_key(entry.key, item.key)
        entry.tensor.dtype = wire_dtype(item.array.dtype, item.key)
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
    raises InvalidTensorError before anything is stored, and a str key of more than
    ``max_key_bytes`` bytes InvalidArgumentError. A server's limits (None: none) raise
    ResourceExhaustedError before anything is allocated: a value of more than ``max_bytes``
    bytes, more than ``max_keys`` entries, or more than ``max_call_bytes`` bytes of values
    received with the call (not those in shared memory). Call :meth:`remember` once the
    call succeeded.
    """

    def __init__(self, max_bytes=None, with_data=True, destination=None, resolve=None,
                 copy_refs=False, channel=False, staging=None, max_key_bytes=None, max_keys=None,
                 max_call_bytes=None, two_bit=False, empty=None):
        self.max_bytes = math.inf if max_bytes is None else max_bytes
        self.max_key_bytes = math.inf if max_key_bytes is None else max_key_bytes
        self.max_keys = math.inf if max_keys is None else max_keys
        self.max_call_bytes = math.inf if max_call_bytes is None else max_call_bytes
        self._call_bytes = 0  # bytes of the values received so far
        self.with_data = with_data
        # resolve(region_id, offset, length): the uint8 array of a shared-memory reference,
        # bounds-checked (InvalidTensorError otherwise); None: references are rejected.
        self.resolve = resolve
        # True: referenced bytes are copied out (into the destination or a new array), for
        # a region that is reused by the next call; False: items are views of the region.
        self.copy_refs = copy_refs
        # destination(index, key, dtype, shape, slice) for the index-th entry of the stream: a
        # writable C-contiguous array of that dtype that holds exactly the entry's elements
        # (the whole value, or the slice's), to receive its bytes; or None for a new array.
        self.destination = destination
        # empty(nbytes): a new uint8 array to receive an entry's bytes into where there is no
        # destination (a server's allocator.Buffers.empty; np.empty by default).
        self.empty = empty or (lambda nbytes: np.empty(nbytes, np.uint8))
        # Whether entries may say that their bytes follow on the data channel; the uint8
        # buffers that receive those bytes, in entry order.
        self.channel = channel
        self.incoming = []
        # Whether entries may carry 2-bit codes (pushes to a server): elsewhere they are refused.
        self.two_bit = two_bit
        # staging(key, dtype, data_shape, nbytes) for an entry whose bytes continue in later
        # frames: a receiver that takes them chunk by chunk (``receiver[start:end] = uint8
        # array``) and gives the finished value with ``receiver.view(dtype)`` (a GPU server
        # copies each chunk on to the device as it arrives); None: a host buffer.
        self.staging = staging
        self._count = 0  # entries seen
        self._pending = None  # (item, buffer, bytes filled)
        # (entry bytes up to the end of its key, what _KNOWN_ENTRIES keeps for it) of the
        # entries read by the generated class, for :meth:`remember`.
        self._learned = []

    def remember(self):
        """Let later decoders read the entries of this stream by hand (_KNOWN_ENTRIES). Call it
        once the call that sent them succeeded: nothing of a refused call is kept."""
        for start, known in self._learned:
            prefix, header, _ = known
            _KNOWN_ENTRIES.put(start, known, len(start) + len(prefix) + header.key_bytes)
        self._learned.clear()

    def feed(self, frame):
        done = []
        if frame.more:
            done.extend(self._continue(frame.more))
        for i, entry in enumerate(frame.entries):
            if self._pending is not None:
                header, _, filled, _ = self._pending
                raise InvalidTensorError(
                    f"key {key_repr(header.key)}: a new entry arrived after {filled} of {header.nbytes} bytes "
                    "of the previous one"
                )
            header = _Header(entry, self.max_bytes, self.max_key_bytes)
            self._check_two_bit(header)
            self._call_bytes = self._admit(header, self._count, self._call_bytes)
            index, self._count = self._count, self._count + 1
            data = entry.tensor.data
            if header.follows is not None:
                done.append(self._following(index, header, len(data)))
            elif header.ref is not None:
                done.append(self._referenced(index, header, len(data)))
            elif not self.with_data:
                done.append(header.item(header.no_data()))
            elif len(data) == header.nbytes:
                done.append(header.item(np.frombuffer(data, dtype=header.dtype)))
            elif len(data) < header.nbytes and i == len(frame.entries) - 1:
                buffer, owned = self._receiver(index, header)
                buffer[:len(data)] = np.frombuffer(data, dtype=np.uint8)
                self._pending = (header, buffer, len(data), owned)
            else:
                raise InvalidTensorError(
                    f"key {key_repr(header.key)}: tensor of shape {header.shape} and dtype {header.dtype} "
                    f"needs {header.nbytes} bytes, got {len(data)}"
                )
        return done

    def feed_bytes(self, data, start, end):
        """The items completed by the serialized TensorFrame ``data[start:end]``, read by hand;
        None (and nothing changed) when the frame is laid out in a way that needs the
        generated class: then call :meth:`feed` with the parsed frame."""
        if start == end:
            return []
        tag, pos = _read_varint(data, start)
        if tag == 2 << 3 | _LEN:
            length, pos = _read_varint(data, pos)
            if pos + length != end or length == 0:
                return None
            return self._continue(memoryview(data)[pos:end])
        if self._pending is not None:
            return None
        done, pos, count, with_data, call_bytes = [], start, self._count, self.with_data, self._call_bytes
        known, max_bytes, max_key_bytes = _KNOWN_ENTRIES, self.max_bytes, self.max_key_bytes
        while pos < end:
            entry_start = pos
            if data[pos] != _ENTRY_TAG:
                return None
            # Entry and key lengths are short varints: read one or two bytes inline.
            byte = data[pos + 1]
            if byte < 0x80:
                length, body = byte, pos + 2
            elif data[pos + 2] < 0x80:
                length, body = (byte & 0x7F) | data[pos + 2] << 7, pos + 3
            else:
                length, body = _read_varint(data, pos + 1)
            entry_end = body + length
            if entry_end > end or body >= entry_end or data[body] != 1 << 3 | _LEN:
                return None
            key_length = data[body + 1]
            if key_length < 0x80:
                key_start = body + 2
            else:
                key_length, key_start = _read_varint(data, body + 1)
            found = known.get(data[entry_start:key_start + key_length])
            if found is not None and data.startswith(found[0], entry_start):
                prefix, header, data_len = found
                source, data_start = data, entry_start + len(prefix)
                if header.nbytes > max_bytes or header.key_bytes > max_key_bytes:  # learned under other limits
                    header.check_limits(max_bytes, max_key_bytes)
            else:
                entry = _parse_entry(data[body:entry_end])
                header = _Header(entry, max_bytes, max_key_bytes)
                source, data_start = entry.tensor.data, 0
                data_len = len(source)
                prefix = _build_prefix(header.key, entry.tensor.dtype, header.shape, header.slice, data_len,
                                       header.ref, header.follows, header.two_bit)
                if entry_start + len(prefix) + data_len == entry_end and data.startswith(prefix, entry_start):
                    self._learned.append((data[entry_start:key_start + key_length], (prefix, header, data_len)))
            pos = entry_end
            self._check_two_bit(header)
            call_bytes = self._admit(header, count, call_bytes)
            if header.follows is not None:
                done.append(self._following(count, header, data_len))
            elif header.ref is not None:
                done.append(self._referenced(count, header, data_len))
            elif not with_data:
                done.append(header.item(header.no_data()))
            elif data_len == header.nbytes:
                flat = np.frombuffer(source, header.dtype, header.nbytes // header.dtype.itemsize, data_start)
                target = None
                if self.destination is not None and header.slice is None:
                    target = self.destination(count, header.key, header.dtype, header.shape, None)
                if target is None:
                    done.append(header.item(flat))
                else:  # straight into the caller's array (one copy, as a view would take later)
                    target.reshape(-1)[...] = flat
                    done.append(Item(header.key, target, header.shape))
            elif data_len < header.nbytes and pos == end:
                buffer, owned = self._receiver(count, header)
                buffer[:data_len] = np.frombuffer(source, np.uint8, data_len, data_start)
                self._pending = (header, buffer, data_len, owned)
            elif data_len < header.nbytes and _only_more_follows(data, pos, end):
                return None
            else:
                raise InvalidTensorError(
                    f"key {key_repr(header.key)}: tensor of shape {header.shape} and dtype {header.dtype} "
                    f"needs {header.nbytes} bytes, got {data_len}")
            count += 1
        self._count, self._call_bytes = count, call_bytes
        return done

    def _check_two_bit(self, header):
        if header.two_bit is not None and not self.two_bit:
            raise InvalidTensorError(f"key {key_repr(header.key)}: 2-bit compressed codes are only valid in a push")

    def _admit(self, header, index, call_bytes):
        """The bytes of the call's values received with the index-th entry, ``header``, after
        ``call_bytes`` before it; ResourceExhaustedError over max_keys or max_call_bytes."""
        if index >= self.max_keys:
            raise too_many_keys(header.key, self.max_keys)
        # Values in shared memory are not received; those on the data channel are, even in a
        # request whose values go unused (an Init that only waits).
        if header.ref is not None or (not self.with_data and header.follows is None):
            return call_bytes
        call_bytes += header.nbytes
        if call_bytes > self.max_call_bytes:
            raise ResourceExhaustedError(
                f"key {key_repr(header.key)}: its value brings the values received in this call to {call_bytes} "
                f"bytes; this server's limit is {self.max_call_bytes} bytes per call (--max-inflight-bytes)")
        return call_bytes

    def _referenced(self, index, header, data_len):
        """The item of an entry whose bytes are in shared memory (``header.ref``)."""
        if data_len:
            raise InvalidTensorError(f"key {key_repr(header.key)}: an entry with a shared-memory reference carries "
                                     f"{data_len} bytes of data too")
        region_id, offset, length = header.ref
        if length != header.nbytes:
            raise InvalidTensorError(
                f"key {key_repr(header.key)}: tensor of shape {header.shape} and dtype {header.dtype} needs "
                f"{header.nbytes} bytes, the shared-memory reference has {length}")
        if self.resolve is None:
            raise InvalidTensorError(f"key {key_repr(header.key)}: shared-memory references are only valid on the "
                                     "Session stream that registered the region")
        source = self.resolve(region_id, offset, length)
        if not self.copy_refs or isinstance(source, DeviceBytes):  # GPU memory: the value is where it was named
            return header.item(source.view(header.dtype))
        buffer, owned = self._buffer(index, header)
        buffer[:] = source
        return header.item(buffer.view(header.dtype), owned)

    def _following(self, index, header, data_len):
        """The item of an entry whose bytes follow on the data channel: its receive buffer,
        listed in :attr:`incoming` (filled by the caller)."""
        if not self.channel:
            raise InvalidTensorError(f"key {key_repr(header.key)}: data-channel entries are only valid on a Session "
                                     "stream with a data channel")
        if data_len or header.follows != header.nbytes:
            raise InvalidTensorError(
                f"key {key_repr(header.key)}: tensor of shape {header.shape} and dtype {header.dtype} needs "
                f"{header.nbytes} bytes on the data channel; the entry says {header.follows} and carries "
                f"{data_len} bytes of data")
        buffer, owned = self._buffer(index, header)
        self.incoming.append(buffer)
        return header.item(buffer.view(header.dtype), owned)

    def _receiver(self, index, header):
        """Where the bytes of an entry that continues in later frames go, and whether it is owned."""
        if self.staging is not None and self.destination is None:
            try:
                receiver = self.staging(header.key, header.dtype, header.data_shape, header.nbytes)
            except MemoryError:
                raise no_memory(header.key, header.shape, header.dtype, header.nbytes) from None
            if receiver is not None:
                return receiver, True
        return self._buffer(index, header)

    def _buffer(self, index, header):
        """The uint8 view of the array that receives an entry's bytes, chunk after chunk."""
        array = None
        if self.destination is not None:
            array = self.destination(index, header.key, header.dtype, header.shape, header.slice)
        if array is None:
            try:
                return self.empty(header.nbytes), True
            except MemoryError:
                raise no_memory(header.key, header.shape, header.dtype, header.nbytes) from None
        return array.reshape(-1).view(np.uint8), False

    def finish(self):
        if self._pending is not None:
            header, _, filled, _ = self._pending
            raise InvalidTensorError(
                f"key {key_repr(header.key)}: stream ended after {filled} of {header.nbytes} bytes"
            )

    def _continue(self, more):
        if self._pending is None:
            raise InvalidTensorError(f"{len(more)} continuation bytes arrived with no incomplete entry")
        header, buffer, filled, owned = self._pending
        end = filled + len(more)
        if end > header.nbytes:
            raise InvalidTensorError(
                f"key {key_repr(header.key)}: {end} bytes sent for a tensor of {header.nbytes} bytes")
        buffer[filled:end] = np.frombuffer(more, dtype=np.uint8)
        if end < header.nbytes:
            self._pending = (header, buffer, end, owned)
            return []
        self._pending = None
        return [header.item(buffer.view(header.dtype), owned)]


# ---- hand-made messages ---------------------------------------------------------------
#
# Every streamed message of the service is `<scalar fields> <frame field: TensorFrame>`;
# TensorFrame is `entries = 1` (Entry) and `more = 2` (bytes). The encoder writes an Entry
# as key (1), slice (3), tensor (2) with the tensor's data last, so that the bytes before
# the data depend only on (key, dtype, shape, slice, byte count) and are cached. Field order
# is free in protobuf: the generated parsers read these messages as they read their own.

_LEN, _VARINT, _FIXED32 = 2, 0, 5
_SMALL_VARINTS = []


def _varint(value):
    """The protobuf varint of an int64 (negative values as 10-byte two's complement)."""
    if 0 <= value < len(_SMALL_VARINTS):
        return _SMALL_VARINTS[value]
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL_VARINTS.extend(_varint(i) for i in range(1 << 14))


def _tag(field, wire_type):
    return _varint(field << 3 | wire_type)


def _field(field, body):
    """A length-delimited field: tag, length, body."""
    return _tag(field, _LEN) + _varint(len(body)) + body


class _Cache(dict):
    """A dict of encodings, emptied when what it holds passes ``budget`` bytes: however many
    and however long the keys its process meets, it holds at most that much."""

    # Bytes counted for each entry on top of the bytes of its keys and encodings: the
    # Python objects that hold them.
    ENTRY_OVERHEAD = 512

    def __init__(self, budget):
        super().__init__()
        self.budget, self.used = budget, 0

    def put(self, key, value, nbytes):
        """``self[key] = value``, counting ``nbytes`` (those of the keys and bytes it holds)."""
        nbytes += self.ENTRY_OVERHEAD
        if self.used + nbytes > self.budget:
            self.clear()
            self.used = 0
        if nbytes <= self.budget:
            self[key] = value
            self.used += nbytes


_CACHE_BYTES = 32 << 20  # for each of the three caches
_ENTRY_PREFIXES = _Cache(_CACHE_BYTES)


def _entry_prefix(key, wire, shape, slice, data_len, ref=None, follows=None, two_bit=None):
    """:func:`_build_prefix`, cached."""
    cache_key = (type(key), key, wire, shape, slice, data_len, ref, follows, two_bit)
    prefix = _ENTRY_PREFIXES.get(cache_key)
    if prefix is None:
        prefix = _build_prefix(key, wire, shape, slice, data_len, ref, follows, two_bit)
        _ENTRY_PREFIXES.put(cache_key, prefix, len(prefix) + (len(key) if type(key) is str else 0))
    return prefix


def _build_prefix(key, wire, shape, slice, data_len, ref=None, follows=None, two_bit=None):
    """The bytes of a frame's ``entries`` field up to the tensor's data (``data_len`` bytes
    follow), with the shared-memory reference ``ref`` (region id, offset, length) if any, or
    the byte count ``follows`` of a value sent on the data channel, and the threshold
    ``two_bit`` of 2-bit codes."""
    if isinstance(key, str):
        key_body = _field(2, key.encode())
    else:
        key_body = _tag(1, _VARINT) + _varint(key)
    slice_part = b""
    if slice is not None:
        begin, end = slice
        slice_part = _field(3, (_tag(1, _VARINT) + _varint(begin) if begin else b"")
                            + (_tag(2, _VARINT) + _varint(end) if end else b""))
    if ref is not None:
        slice_part += _field(4, b"".join(_tag(n, _VARINT) + _varint(v) for n, v in zip((1, 2, 3), ref) if v))
    if follows is not None:
        slice_part += _field(5, _tag(1, _VARINT) + _varint(follows) if follows else b"")
    if two_bit is not None:
        slice_part += _field(60, _tag(1, _FIXED32) + struct.pack("<f", two_bit))
    tensor = _tag(1, _VARINT) + _varint(wire)
    if shape:
        tensor += _field(2, b"".join(_varint(d) for d in shape))
    if data_len:
        tensor += _tag(3, _LEN) + _varint(data_len)
    before_data = _field(1, key_body) + slice_part + _tag(2, _LEN) + _varint(len(tensor) + data_len) + tensor
    return _tag(1, _LEN) + _varint(len(before_data) + data_len) + before_data


_KEY_FIELDS = _Cache(_CACHE_BYTES)


def key_fields(keys, field=6):
    """The serialized ``repeated Key`` field number ``field`` (6: SessionRequest.keys) holding
    ``keys`` (checked int or str keys), from bytes cached per key; the generated parser reads
    it as it reads its own."""
    cache = _KEY_FIELDS
    pieces = []
    for key in keys:
        piece = cache.get((field, type(key), key))
        if piece is None:
            body = _field(2, key.encode()) if isinstance(key, str) else _tag(1, _VARINT) + _varint(key)
            piece = _field(field, body)
            cache.put((field, type(key), key), piece, len(piece) + (len(key) if type(key) is str else 0))
        pieces.append(piece)
    return b"".join(pieces)


def _message(head, frame_field, pieces, size):
    """One serialized message: ``head`` (its other fields), then the frame of ``pieces``."""
    return b"".join([head, _tag(frame_field, _LEN), _varint(size), *pieces])


_MORE_TAG = _tag(2, _LEN)


def encode_messages(items, frame_field, head=b"", chunk_bytes=None, with_data=True, count_field=None):
    """The serialized messages (bytes) of a stream that carries ``items`` (:class:`Item`).

    Every message is ``head`` (the serialized scalar fields of the first message, e.g.
    ``PushRequest(rank=r).SerializeToString()``; later messages leave them unset) followed by
    field ``frame_field`` holding one TensorFrame. Tensors that fit share a frame, up to
    ``chunk_bytes`` of data; a larger one travels as a metadata-only Entry (data empty) at the
    end of a frame, then in continuation frames that carry ``chunk_bytes`` each in ``more``.
    Each byte of tensor data is copied once, into the message that carries it. With
    ``with_data=False`` only keys, dtypes and shapes travel (Init's wait_only). A stream of
    several messages says how many in the first one's varint field ``count_field``, when
    given (e.g. PushRequest.messages), so that a receiver can tell a stream cut short.
    ``chunk_bytes`` None: CHUNK_BYTES.
    """
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    frames, pieces, size, budget = [], [], 0, chunk_bytes  # frames: [(pieces of a frame's body, its size)]
    for item in items:
        two_bit = item.two_bit
        if two_bit is not None:  # codes of float32 values
            wire = tensor_pb2.DTYPE_FLOAT32
        else:
            wire = _TO_WIRE.get(item.array.dtype) if type(item.array) is np.ndarray else None
            if wire is None:
                wire = wire_dtype(shape_dtype(item.array)[1], item.key)
        if not with_data or item.ref is not None or item.follows:
            ref, follows = (item.ref, item.array.nbytes if item.follows else None) if with_data else (None, None)
            prefix = _entry_prefix(item.key, wire, item.shape, item.slice, 0, ref, follows, two_bit)
            pieces.append(prefix)
            size += len(prefix)
            continue
        array = item.array
        if type(array) is not np.ndarray or not array.flags.c_contiguous or array.dtype.byteorder == ">":
            array = to_host(array)
        nbytes = array.nbytes
        if nbytes <= chunk_bytes:
            if nbytes > budget and pieces:
                frames.append((pieces, size))
                pieces, size, budget = [], 0, chunk_bytes
            prefix = _entry_prefix(item.key, wire, item.shape, item.slice, nbytes, two_bit=two_bit)
            pieces += (prefix, array)  # b"".join reads a C-contiguous array's bytes as they are
            size += len(prefix) + nbytes
            budget -= nbytes
            continue
        data = array.reshape(-1).view(np.uint8)
        prefix = _entry_prefix(item.key, wire, item.shape, item.slice, 0, two_bit=two_bit)
        pieces.append(prefix)
        frames.append((pieces, size + len(prefix)))
        pieces, size, budget = [], 0, chunk_bytes
        for start in range(0, nbytes, chunk_bytes):
            chunk = data[start:start + chunk_bytes]
            more = _MORE_TAG + _varint(len(chunk))
            frames.append(([more, chunk], len(more) + len(chunk)))
    if pieces or not frames:
        frames.append((pieces, size))
    if count_field is not None and len(frames) > 1:
        head += _tag(count_field, _VARINT) + _varint(len(frames))
    return [_message(head if index == 0 else b"", frame_field, body, size)
            for index, (body, size) in enumerate(frames)]


def encode_stream(message_class, items, fields=None, chunk_bytes=None, with_data=True):
    """The serialized ``message_class`` messages (Init, Push or PushPull requests, Pull or
    PushPull responses) that carry ``items``, with the scalar ``fields`` set in the first (and
    the number of messages, in a request stream of several: its field ``messages``)."""
    head = message_class(**fields).SerializeToString() if fields else b""
    by_name = message_class.DESCRIPTOR.fields_by_name
    count = by_name["messages"].number if "messages" in by_name else None
    return encode_messages(items, by_name["frame"].number, head, chunk_bytes, with_data, count)


def _read_varint(data, pos):
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise IndexError
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def parse(message_class, data, error_class=InvalidTensorError):
    """``message_class.FromString(data)``, with a malformed message as ``error_class`` (an
    InvalidArgumentError; InvalidTensorError for the messages of tensor streams)."""
    try:
        return message_class.FromString(data)
    except DecodeError as error:
        raise error_class(f"malformed {message_class.__name__}: {error}") from None


def _split_message(data, frame_number):
    """(bytes of the scalar fields, start, end of the frame's body) of a serialized message
    with one frame field and scalar (varint) fields; None for any other layout."""
    try:
        pos, end, frame, head = 0, len(data), None, []
        while pos < end:
            start = pos
            tag, pos = _read_varint(data, pos)
            if tag & 7 == _VARINT:
                _, pos = _read_varint(data, pos)
                head.append(data[start:pos])
            elif tag == frame_number << 3 | _LEN and frame is None:
                length, pos = _read_varint(data, pos)
                frame, pos = (pos, pos + length), pos + length
            else:
                return None
        if pos != end:
            return None
        if frame is None:
            frame = (end, end)
        return b"".join(head), frame[0], frame[1]
    except IndexError:
        return None


# (bytes of an entry up to the end of its key) -> (its bytes up to its data, _Header,
# data bytes), learned from entries that were parsed and validated by the generated class
# and laid out as _build_prefix lays them out, in calls that succeeded (FrameDecoder.remember).
_KNOWN_ENTRIES = _Cache(_CACHE_BYTES)
_ENTRY_TAG = 1 << 3 | _LEN


class StreamDecoder:
    """Decodes the serialized messages (bytes) of a stream of ``message_class``, whose field
    ``frame_field`` (a name) is a TensorFrame, into :class:`Item` values.

    The first message is parsed with the generated class (:attr:`first` holds it, for its
    scalar fields); later pure continuations are read by hand and their bytes written
    straight into the receiving array (``destination``, see :class:`FrameDecoder`). Anything
    else a conforming sender may produce is parsed with the generated class.
    ``with_data(first)`` says whether the stream carries data (Init's wait_only does not).
    Call :meth:`remember` once the call succeeded.
    """

    def __init__(self, message_class, frame_field, max_bytes=None, destination=None, with_data=None, resolve=None,
                 copy_refs=False, channel=False, staging=None, max_key_bytes=None, max_keys=None, max_call_bytes=None,
                 two_bit=False, empty=None):
        self.message_class = message_class
        self.frame_name = frame_field
        self.frame_number = message_class.DESCRIPTOR.fields_by_name[frame_field].number
        self.first = None
        self.items = []
        self.count = 0  # messages fed
        self._counted = "messages" in message_class.DESCRIPTOR.fields_by_name  # the stream says how many
        self._with_data = with_data
        self.frames = FrameDecoder(max_bytes, destination=destination, resolve=resolve, copy_refs=copy_refs,
                                   channel=channel, staging=staging, max_key_bytes=max_key_bytes, max_keys=max_keys,
                                   max_call_bytes=max_call_bytes, two_bit=two_bit, empty=empty)

    def feed(self, data):
        """Decode one message; the items it completed are appended to :attr:`items`."""
        self.count += 1
        split = _split_message(data, self.frame_number)
        if split is not None:
            head, start, end = split
            first = self.first
            if first is None:
                first = parse(self.message_class, head)
                if self._with_data is not None:
                    self.frames.with_data = self._with_data(first)
            listed = len(self.frames.incoming)
            try:
                done = self.frames.feed_bytes(data, start, end)
            except IndexError:  # cut short inside an entry: the generated parser says how
                done = None
            if done is None:  # read again below: forget the channel buffers listed so far
                del self.frames.incoming[listed:]
            else:
                self.first = first
                self.items += done
                return
        message = parse(self.message_class, data)
        if self.first is None:
            self.first = message
            if self._with_data is not None:
                self.frames.with_data = self._with_data(message)
        self.items += self.frames.feed(getattr(message, self.frame_name))

    def finish(self):
        """The items of the whole stream; InvalidTensorError if one was left incomplete, or if
        the stream ended before the number of messages its first one announced (``messages``:
        gRPC ends a request stream whose client's connection broke as if it had finished)."""
        announced = self.first.messages if self._counted and self.first is not None else 0
        if announced and self.count != announced:
            raise InvalidTensorError(f"the stream ended after {plural(self.count, 'message')} of the {announced} its "
                                     "first one announced: it was cut short")
        self.frames.finish()
        return self.items

    def remember(self):
        """See :meth:`FrameDecoder.remember`."""
        self.frames.remember()


def _parse_entry(data):
    try:
        return tensor_pb2.Entry.FromString(data)
    except DecodeError as error:
        raise InvalidTensorError(f"malformed Entry: {error}") from None


def _only_more_follows(data, pos, end):
    """Whether data[pos:end] is one ``more`` field (a frame serialized entries first)."""
    try:
        tag, pos = _read_varint(data, pos)
        length, pos = _read_varint(data, pos)
        return tag == 2 << 3 | _LEN and pos + length == end
    except IndexError:
        return False


class _Header:
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


# ---- shared memory ----------------------------------------------------------------------

# Offsets of values in a region are multiples of this (cache lines; every dtype's alignment).
SHM_ALIGN = 64


def aligned(nbytes):
    """``nbytes`` rounded up to SHM_ALIGN."""
    return -(-nbytes // SHM_ALIGN) * SHM_ALIGN


def check_ref(size, offset, length, what="reference"):
    """InvalidTensorError unless [offset, offset + length) lies inside a region of ``size`` bytes."""
    if offset < 0 or length < 0 or offset + length > size:
        raise InvalidTensorError(
            f"shared-memory {what} [{offset}, {offset + length}) is outside its region of {size} bytes")


class Placement:
    """Writes values into [start, end) of a shared-memory region (``buffer``, a uint8 array of
    the whole region), one after the other at aligned offsets: :meth:`put` returns the item
    that references them, or None when the value does not fit."""

    def __init__(self, buffer, region_id, start=0, end=None):
        end = len(buffer) if end is None else end
        check_ref(len(buffer), start, end - start, "area")
        self.buffer, self.region_id, self.next, self.end = buffer, region_id, start, end

    def put(self, item):
        array = item.array
        nbytes = array.nbytes
        offset = self.next
        if offset + nbytes > self.end:
            return None
        if type(array) is not np.ndarray:
            array = to_host(array)
        dtype = numpy_dtype(wire_dtype(array.dtype, item.key))  # little-endian, as on the wire
        np.copyto(self.buffer[offset:offset + nbytes].view(dtype).reshape(array.shape), array, casting="equiv")
        self.next = offset + aligned(nbytes)
        return Item(item.key, array, item.shape, item.slice, ref=(self.region_id, offset, nbytes), two_bit=item.two_bit)

    def place(self, items):
        """``items`` with those that fit moved into the region (the others, and those already
        in shared memory, unchanged)."""
        return [item if item.ref is not None else self.put(item) or item for item in items]


# ---- data channel -----------------------------------------------------------------------

def following(items, min_bytes):
    """(``items`` with those of at least ``min_bytes`` marked to follow on the data channel,
    the host arrays whose bytes follow, in entry order). Each is C-contiguous and
    little-endian, laid out as ``tensor.data``."""
    sent, arrays = [], []
    for item in items:
        if item.array.nbytes < min_bytes:
            sent.append(item)
            continue
        array = to_host(item.array)
        sent.append(Item(item.key, array, item.shape, item.slice, follows=True, two_bit=item.two_bit))
        arrays.append(array)
    return sent, arrays
