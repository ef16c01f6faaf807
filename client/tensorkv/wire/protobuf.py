"""Protobuf's encoding, written and read by hand for the messages of tensor streams.

Every streamed message of the service is `<scalar fields> <frame field: TensorFrame>`;
TensorFrame is `entries = 1` (Entry) and `more = 2` (bytes). The encoder writes an Entry
as key (1), slice (3), tensor (2) with the tensor's data last, so that the bytes before
the data depend only on (key, dtype, shape, slice, byte count) and are cached. Field order
is free in protobuf: the generated parsers read these messages as they read their own.
"""
import struct

from google.protobuf.message import DecodeError

from ..errors import InvalidTensorError

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


def _entry_prefix(entry, wire, data_len, ref=None, follows=None):
    """:func:`_build_prefix`, cached."""
    key, two_bit = entry.key, entry.two_bit
    cache_key = (type(key), key, wire, entry.shape, entry.slice, data_len, ref, follows, two_bit)
    prefix = _ENTRY_PREFIXES.get(cache_key)
    if prefix is None:
        prefix = _build_prefix(entry, wire, data_len, ref, follows)
        _ENTRY_PREFIXES.put(cache_key, prefix, len(prefix) + (len(key) if type(key) is str else 0))
    return prefix


def _build_prefix(entry, wire, data_len, ref=None, follows=None):
    """The bytes of a frame's ``entries`` field up to the tensor's data (``data_len`` bytes
    follow) of ``entry`` (an Item or a Header: its key, full shape, slice and the threshold
    ``two_bit`` of 2-bit codes) with wire dtype ``wire``, with the shared-memory reference
    ``ref`` (region id, offset, length) if any, or the byte count ``follows`` of a value sent
    on the data channel."""
    key, shape, slice, two_bit = entry.key, entry.shape, entry.slice, entry.two_bit
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


# (bytes of an entry up to the end of its key) -> (its bytes up to its data, entries.Header,
# data bytes), learned from entries that were parsed and validated by the generated class
# and laid out as _build_prefix lays them out, in calls that succeeded (decoding.FrameDecoder.remember).
_KNOWN_ENTRIES = _Cache(_CACHE_BYTES)
_ENTRY_TAG = 1 << 3 | _LEN


def _only_more_follows(data, pos, end):
    """Whether data[pos:end] is one ``more`` field (a frame serialized entries first)."""
    try:
        tag, pos = _read_varint(data, pos)
        length, pos = _read_varint(data, pos)
        return tag == 2 << 3 | _LEN and pos + length == end
    except IndexError:
        return False
