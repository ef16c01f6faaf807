"""The wire codec: arrays <-> ``tensorkv.v1`` Tensor, Key and TensorFrame messages.

This module is the codec's interface, and with its parts (``entries``: keys, dtypes, shapes
and :class:`Item`; ``protobuf``: the bytes written and read by hand; ``decoding``: the
decoders) the only place that knows how a tensor is laid out on the wire. The hot paths
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
``tensor.data`` would be. :class:`tensorkv.wire.shm.Placement` writes arrays into a region (one
copy) and returns items that carry such references; the decoders resolve references through a
``resolve(region_id, offset, length)`` callable that bounds-checks them.

Data channel: an Entry may instead say that its bytes follow on the Session's raw-TCP data
channel (``channel``). :func:`following` marks the items to send that way; a decoder made
with ``channel=True`` gives each such entry its receive buffer (the caller's array or a new
one) and lists those buffers, in entry order, in ``incoming`` for the caller to fill from
the socket.
"""
import numpy as np

from ..backend import shape_dtype, to_host
from ..v1 import tensor_pb2
from .decoding import FrameDecoder, StreamDecoder
from .entries import (
    _TO_WIRE, Item, check_key, check_key_bytes, check_key_count, check_shape, get_key, numpy_dtype, set_key, wire_dtype,
)
from .protobuf import _MORE_TAG, _VARINT, _entry_prefix, _message, _tag, _varint, parse

# The codec's interface, what both ends use (the names its parts hold are imported from here).
__all__ = [
    "CHUNK_BYTES", "FrameDecoder", "Item", "StreamDecoder", "check_key", "check_key_bytes", "check_key_count",
    "check_shape", "encode_frames", "encode_messages", "encode_stream", "following", "get_key", "numpy_dtype",
    "parse", "set_key", "wire_dtype",
]

# Payload bytes per stream message when a caller gives none; chosen by measurement (see
# docs/transport.md). A worker's is ClientConfig.chunk_bytes; the server's __main__ sets this
# one from TENSORKV_CHUNK_BYTES.
CHUNK_BYTES = 1 << 20


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
            prefix = _entry_prefix(item, wire, 0, ref, follows)
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
            prefix = _entry_prefix(item, wire, nbytes)
            pieces += (prefix, array)  # b"".join reads a C-contiguous array's bytes as they are
            size += len(prefix) + nbytes
            budget -= nbytes
            continue
        data = array.reshape(-1).view(np.uint8)
        prefix = _entry_prefix(item, wire, 0)
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
