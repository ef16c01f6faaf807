"""Decoding tensor streams into :class:`~tensorkv.wire.entries.Item` values, within a server's
limits: :class:`StreamDecoder` reads the serialized messages of a stream (by hand where it
can, straight into each value's destination), :class:`FrameDecoder` their TensorFrames.
"""
import dataclasses
import math
from collections.abc import Callable

import numpy as np
from google.protobuf.message import DecodeError

from ..backend import DeviceBytes
from ..errors import InvalidTensorError, ResourceExhaustedError, key_repr, no_memory
from ..v1 import tensor_pb2
from ..words import plural
from .entries import Header, Item, too_many_keys
from .protobuf import _ENTRY_TAG, _KNOWN_ENTRIES, _LEN, _build_prefix, _only_more_follows, _read_varint, _split_message, parse

_MORE_FIELD = 2 << 3 | _LEN  # TensorFrame.more's tag


@dataclasses.dataclass(frozen=True)
class Decoding:
    """The settings of a decoder, which :class:`FrameDecoder` and :class:`StreamDecoder` take as
    keyword arguments: a server's limits, and where the bytes of each entry go."""

    # A server's limits (None: none), each checked before anything is allocated or stored: a
    # value of more than max_bytes bytes and more than max_keys entries or max_call_bytes bytes
    # of values received with the call (not those in shared memory) raise
    # ResourceExhaustedError; a str key of more than max_key_bytes bytes InvalidArgumentError.
    max_bytes: int | None = None
    max_key_bytes: int | None = None
    max_keys: int | None = None
    max_call_bytes: int | None = None
    # Whether the entries carry their values (an Init that only waits sends shapes and dtypes).
    with_data: bool = True
    # destination(index, key, dtype, shape, slice) for the index-th entry of the stream: a
    # writable C-contiguous array of that dtype that holds exactly the entry's elements (the
    # whole value, or the slice's), to receive its bytes; or None for a new array.
    destination: Callable | None = None
    # resolve(region_id, offset, length): the uint8 array of a shared-memory reference,
    # bounds-checked (InvalidTensorError otherwise); None: references are rejected.
    resolve: Callable | None = None
    # True: referenced bytes are copied out (into the destination or a new array), for a
    # region that is reused by the next call; False: items are views of the region.
    copy_refs: bool = False
    # Whether entries may say that their bytes follow on the data channel.
    channel: bool = False
    # staging(key, dtype, data_shape, nbytes) for an entry whose bytes continue in later
    # frames: a receiver that takes them chunk by chunk (``receiver[start:end] = uint8
    # array``) and gives the finished value with ``receiver.view(dtype)`` (a GPU server copies
    # each chunk on to the device as it arrives); None: a host buffer.
    staging: Callable | None = None
    # Whether entries may carry 2-bit codes (pushes to a server): elsewhere they are refused.
    two_bit: bool = False
    # empty(nbytes): a new uint8 array to receive an entry's bytes into where there is no
    # destination (a server's allocator.Buffers.empty); None: np.empty.
    empty: Callable | None = None


class FrameDecoder:
    """Reassembles the :class:`Item` values of a stream of ``TensorFrame`` messages, with the
    settings of :class:`Decoding` given as keyword arguments.

    Feed it every frame in order; :meth:`feed` returns the items completed by that frame
    and :meth:`finish` checks that nothing was left incomplete. Every malformed input
    raises InvalidTensorError before anything is stored, and a value over a server's limits
    ResourceExhaustedError (a key, InvalidArgumentError) before anything is allocated.
    Call :meth:`remember` once the call succeeded.
    """

    def __init__(self, **settings):
        settings = Decoding(**settings)
        self.max_bytes = math.inf if settings.max_bytes is None else settings.max_bytes
        self.max_key_bytes = math.inf if settings.max_key_bytes is None else settings.max_key_bytes
        self.max_keys = math.inf if settings.max_keys is None else settings.max_keys
        self.max_call_bytes = math.inf if settings.max_call_bytes is None else settings.max_call_bytes
        self._call_bytes = 0  # bytes of the values received so far
        self.with_data = settings.with_data
        self.resolve = settings.resolve
        self.copy_refs = settings.copy_refs
        self.destination = settings.destination
        self.empty = settings.empty or (lambda nbytes: np.empty(nbytes, np.uint8))
        self.channel = settings.channel
        self.incoming = []  # the uint8 buffers that receive the bytes on the data channel, in entry order
        self.two_bit = settings.two_bit
        self.staging = settings.staging
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
            header = Header(entry, self.max_bytes, self.max_key_bytes)
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
        if tag == _MORE_FIELD:
            length, pos = _read_varint(data, pos)
            if pos + length != end or length == 0:
                return None
            return self._continue(memoryview(data)[pos:end])
        if self._pending is not None:
            return None
        done, pos, count, call_bytes = [], start, self._count, self._call_bytes
        while pos < end:
            read = self._read_entry(data, pos, end)
            if read is None:
                return None
            header, source, data_start, data_len, pos = read
            self._check_two_bit(header)
            call_bytes = self._admit(header, count, call_bytes)
            placed = self._placed(count, header, source, data_start, data_len, pos == end)
            if placed is None:
                if data_len < header.nbytes and _only_more_follows(data, pos, end):
                    return None
                raise InvalidTensorError(
                    f"key {key_repr(header.key)}: tensor of shape {header.shape} and dtype {header.dtype} "
                    f"needs {header.nbytes} bytes, got {data_len}")
            done += placed
            count += 1
        self._count, self._call_bytes = count, call_bytes
        return done

    def _read_entry(self, data, pos, end):
        """(its Header, the bytes its data is in, where it starts there, its length, where the
        entry ends) of the Entry at ``data[pos]``, learned or parsed; None when it is not laid
        out as the hand reader expects."""
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
        max_bytes, max_key_bytes = self.max_bytes, self.max_key_bytes
        found = _KNOWN_ENTRIES.get(data[entry_start:key_start + key_length])
        if found is not None and data.startswith(found[0], entry_start):
            prefix, header, data_len = found
            if header.nbytes > max_bytes or header.key_bytes > max_key_bytes:  # learned under other limits
                header.check_limits(max_bytes, max_key_bytes)
            return header, data, entry_start + len(prefix), data_len, entry_end
        entry = _parse_entry(data[body:entry_end])
        header = Header(entry, max_bytes, max_key_bytes)
        source = entry.tensor.data
        prefix = _build_prefix(header, entry.tensor.dtype, len(source), header.ref, header.follows)
        if entry_start + len(prefix) + len(source) == entry_end and data.startswith(prefix, entry_start):
            self._learned.append((data[entry_start:key_start + key_length], (prefix, header, len(source))))
        return header, source, 0, len(source), entry_end

    def _placed(self, index, header, source, data_start, data_len, last):
        """The items (one, or none for a value that continues in later frames) of the index-th
        entry, ``header``, whose ``data_len`` bytes of data are at ``data_start`` of ``source``;
        None for data that falls short of its value in an entry that is not the ``last``."""
        if header.follows is not None:
            return [self._following(index, header, data_len)]
        if header.ref is not None:
            return [self._referenced(index, header, data_len)]
        if not self.with_data:
            return [header.item(header.no_data())]
        if data_len == header.nbytes:
            flat = np.frombuffer(source, header.dtype, header.nbytes // header.dtype.itemsize, data_start)
            target = None
            if self.destination is not None and header.slice is None:
                target = self.destination(index, header.key, header.dtype, header.shape, None)
            if target is None:
                return [header.item(flat)]
            target.reshape(-1)[...] = flat  # straight into the caller's array (one copy, as a view would take later)
            return [Item(header.key, target, header.shape)]
        if data_len < header.nbytes and last:
            buffer, owned = self._receiver(index, header)
            buffer[:data_len] = np.frombuffer(source, np.uint8, data_len, data_start)
            self._pending = (header, buffer, data_len, owned)
            return []
        return None

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
        if offset % header.dtype.itemsize:  # a kernel reading a GPU value there would fail, and break its context
            raise InvalidTensorError(f"key {key_repr(header.key)}: a shared-memory reference at offset {offset}, "
                                     f"not a multiple of the {header.dtype.itemsize} bytes of {header.dtype}")
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


class StreamDecoder:
    """Decodes the serialized messages (bytes) of a stream of ``message_class``, whose field
    ``frame_field`` (a name) is a TensorFrame, into :class:`Item` values.

    The first message is parsed with the generated class (:attr:`first` holds it, for its
    scalar fields); later pure continuations are read by hand and their bytes written
    straight into the receiving array (``destination``, see :class:`Decoding`). Anything
    else a conforming sender may produce is parsed with the generated class.
    ``with_data(first)`` says whether the stream carries data (Init's wait_only does not); the
    other keyword arguments are the :class:`Decoding` settings of its frames.
    Call :meth:`remember` once the call succeeded.
    """

    def __init__(self, message_class, frame_field, with_data=None, **settings):
        self.message_class = message_class
        self.frame_name = frame_field
        self.frame_number = message_class.DESCRIPTOR.fields_by_name[frame_field].number
        self.first = None
        self.items = []
        self.count = 0  # messages fed
        self._counted = "messages" in message_class.DESCRIPTOR.fields_by_name  # the stream says how many
        self._with_data = with_data
        self.frames = FrameDecoder(**settings)

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
