"""The ways a call's values travel on a Session stream, one class each: in the messages
(:class:`Inline`), through the session's shared-memory region (:class:`SharedMemory`), on its
data channel (:class:`DataChannel`), packed in one buffer (:class:`Packed`), and for GPU
values through a region pinned on both ends (gpu_routes.PinnedSharedMemory) or device to device
through CUDA IPC (gpu_routes.CudaIpc); :func:`choose` picks one for a :class:`Call`, by the
thresholds beside it.

A route is what :meth:`tensorkv.transport.session.Session.call` needs of a call: ``shm_bytes`` (the
size of the region it needs, 0: none), ``data_channel`` (whether its bytes use the data
channel), ``layout`` (the packed.Layout to register on the stream, or None), ``answer_bytes``
(the longest answer it can have), the request it builds (:meth:`request`), the answer it
reads (:meth:`answer`), and what is kept to send it again when it goes without waiting for
its answer (:meth:`kept`); ``gpu``, the session's gpu.Gpu where the route copies GPU values
(else None: the session first waits for copies of earlier calls still running); and for the
CUDA routes ``pinned`` (whether it wants the region pinned) and ``exports`` (the device
allocations the session must open first, gpu.Export). A new way to travel is one class (here,
or in gpu_routes for GPU values) and one line in :func:`choose`.

GPU values (a CuPy array, DeviceBFloat16 or torch CUDA tensor pushed, or as the out array of
a pulled value) that a route does not move itself go through the host in the session's small
pinned buffer (tensorkv.cuda.Gpu): one copy from the device per pushed value, one
into the device per pulled value that is whole on the server (from the buffer the value was
received into), and at most one synchronization per call.

A ``part`` is the list [(position, Item)] of the values of one call that go to one server
(a key, or its slice); for a pull, [(position, key)]. ``outs`` are the caller's out arrays
by position: a pulled value goes straight into ``outs[position][0]`` where that is a NumPy
array of its dtype and shape.
"""
import dataclasses
import math

import numpy as np

from .. import config
from ..backend import device_memory, on_gpu, shape_dtype
from ..errors import InternalError
from ..v1 import kvstore_pb2, tensor_pb2
from ..wire import packed
from ..wire.codec import Item, StreamDecoder, encode_stream, following
from ..wire.protobuf import key_fields
from ..wire.shm import HEADER_BYTES, Placement, aligned
from ..wire.status import error_from_code, status_code
from . import datachan, shm

PACKED_KINDS = ("push", "pull", "pushpull")
# The layouts a worker keeps per server (Layouts).
MAX_KNOWN_LAYOUTS = 4 * packed.MAX_LAYOUTS
_ONE_MESSAGE = 1 << 62
# The Session op of each kind of call that may travel on a Session stream.
SESSION_OPS = {"init": kvstore_pb2.SESSION_OP_INIT, "push": kvstore_pb2.SESSION_OP_PUSH,
               "pull": kvstore_pb2.SESSION_OP_PULL, "pushpull": kvstore_pb2.SESSION_OP_PUSH_PULL,
               "row_sparse_pull": kvstore_pb2.SESSION_OP_ROW_SPARSE_PULL, "barrier": kvstore_pb2.SESSION_OP_BARRIER}
_PULLS = (kvstore_pb2.SESSION_OP_PULL, kvstore_pb2.SESSION_OP_PUSH_PULL, kvstore_pb2.SESSION_OP_ROW_SPARSE_PULL)


@dataclasses.dataclass(slots=True)
class Call:
    """One call to one server, as its route carries it."""
    kind: str  # names the call in errors: 'push', 'pull', ... (see status.transport_error)
    part: list = ()  # [(position, Item)], or for a pull of keys [(position, key)]
    _: dataclasses.KW_ONLY
    outs: list = None  # the caller's out arrays, by position
    keys: list = None  # a pull's keys (its part's)
    sizes: list = None  # the bytes pulled: for a pull of keys when all are known, or of row ids
    shapes: list = None  # a pull's [(shape, dtype)] when each is known and whole on this server
    pulled: list = None  # a pull's [(full shape, dtype, slice or None)] on this server when each is known
    wait_only: bool = False  # an init that only waits for the key's value
    sequence: int = 0  # PushRequest.sequence
    pull_sequence: int = 0  # PullRequest.pull_sequence
    values: bytes = None  # the packed values of a packed push (a fused list)
    targets: list = None  # the arrays a packed pull receives into (a fused list)
    log: object = None  # a push's replay.PushLog where it may go without waiting for its answer
    undo: object = None  # what to run should a push sent without waiting fail
    caller: dict = None  # rank and incarnation of this attempt (set by ServerConn)


@dataclasses.dataclass(frozen=True, slots=True)
class Thresholds:
    """The sizes :func:`choose` goes by, a session's (from its store's ClientConfig)."""
    # Calls whose values (per server) take at most this many bytes in the messages use the
    # Session stream (ClientConfig.chunk_bytes).
    session_max_bytes: int = config.default("chunk_bytes")
    # With shared memory, values of at least this many bytes travel through the region.
    shm_min_bytes: int = config.default("shm_min_bytes")
    # With a data channel, values of at least this many bytes travel on it.
    datachan_min_bytes: int = config.default("datachan_min_bytes")

    @classmethod
    def of(cls, settings):
        """The thresholds of ``settings`` (a resolved ClientConfig)."""
        return cls(settings.chunk_bytes, settings.shm_min_bytes, settings.datachan_min_bytes)


def choose(session, call, layout=None):
    """The route of ``call`` on ``session``: packed when it has a ``layout``; else, for a call
    that moves GPU values, through CUDA IPC or a pinned region where the session may have them;
    else through shared memory when the session may have a region, on the data channel when it
    may have one, in the messages otherwise (by ``session.thresholds``). None when the call does
    not fit a session (its values in the messages take more than ``session_max_bytes``): the
    caller makes a plain RPC."""
    if layout is not None:
        return Packed(session, call, layout)
    limits = session.thresholds
    gpu = session.gpu  # None where CuPy sees no CUDA device: then no value is looked at
    if gpu is not None and not on_device(call):
        gpu = None
    if gpu is not None and session.ipc_possible:
        route = gpu_routes.CudaIpc(session, call, limits)
    elif gpu is not None and session.pinned_possible:
        route = gpu_routes.PinnedSharedMemory(session, call, limits)
    elif session.shm_possible:
        route = SharedMemory(session.address, call, limits.session_max_bytes, limits.shm_min_bytes, gpu)
    elif session.channel_possible:
        route = DataChannel(session.address, call, limits.session_max_bytes, limits.datachan_min_bytes, gpu)
    else:
        route = Inline(session.address, call, limits.session_max_bytes, gpu=gpu)
    return route if route.fits else None


def on_device(call):
    """Whether ``call`` moves a GPU value: one it pushes, or the out array of one it pulls."""
    if call.keys is None and not call.wait_only and any(on_gpu(item.array) for _, item in call.part):
        return True
    outs = call.outs
    return outs is not None and any(on_gpu(outs[position][0]) for position, _ in call.part)


class Inline:
    """Every value in the SessionRequest and SessionResponse messages. The base of the routes
    that move a call's large values elsewhere (those of ``min_bytes`` or more): it measures
    them (``in_bytes``, and ``use_output`` for a pull's answer) and builds the messages. A
    call whose values in the messages take more than ``max_bytes`` does not fit."""

    shm_bytes = 0
    data_channel = False
    layout = None
    pinned = False
    exports = ()

    def __init__(self, address, call, max_bytes, min_bytes=None, gpu=None):
        self.address, self.call, self.min_bytes, self.max_bytes = address, call, min_bytes, max_bytes
        self.op = SESSION_OPS[call.kind]
        self.pulls = self.op in _PULLS
        self.answer_bytes = datachan.MAX_ANSWER_BYTES if self.pulls else datachan.ANSWER_ROOM
        self.items = [item for _, item in call.part] if call.keys is None else None
        self.in_bytes = self.out_bytes = 0
        self.fits = self._measure(min_bytes is not None, min_bytes or 0)
        self.use_output = min_bytes is not None and self.pulls and self.out_bytes >= min_bytes
        # The session's gpu.Gpu for a call that moves GPU values; then the Copies of the call,
        # and its pulled values for GPU out arrays: {part index: (DeviceMemory, out array, its
        # dtype, pulled shape, slice)}, and those received on the host first: {part index:
        # (host array in the pinned buffer, its address)}.
        self.gpu, self.copies = gpu, None
        self.targets = _gpu_targets(call) if gpu is not None and self.pulls else {}
        self.proxies = {}

    def _measure(self, offload, min_bytes):
        """Set ``in_bytes`` (the aligned bytes of the values that leave the messages) and
        ``out_bytes`` (of the values pulled, where some may leave them); whether the call fits
        a session."""
        call = self.call
        if call.keys is not None:
            sizes = call.sizes
            if (sizes is None or sum(sizes) > self.max_bytes) and not offload:
                return False
            if not offload:  # no output area: every value travels in the messages
                return True
            if sizes is None:
                self.out_bytes = shm.MIN_REGION_BYTES
            else:
                # Values that all travel inline need no output area (one copy on each side
                # either way, without a placement per value).
                self.out_bytes = sum(aligned(b) for b in sizes) if max(sizes, default=0) >= min_bytes else 0
            return True
        inline = 0
        if not call.wait_only:
            for item in self.items:
                nbytes = item.array.nbytes
                if offload and nbytes >= min_bytes:
                    self.in_bytes += aligned(nbytes)
                else:
                    inline += nbytes
        if inline > self.max_bytes:
            return False
        if self.pulls:
            pulled = [_pulled_nbytes(item) for item in self.items] if call.sizes is None else call.sizes
            if sum(pulled) > self.max_bytes and not offload:
                return False
            if offload and max(pulled, default=0) >= min_bytes:
                self.out_bytes = sum(aligned(nbytes) for nbytes in pulled)
        return True

    def request(self, call_id, timeout_ms, region, channel):
        """(serialized SessionRequest, the arrays whose bytes follow it on the data channel)."""
        call = self.call
        fields = dict(id=call_id, op=self.op, timeout_ms=timeout_ms, sequence=call.sequence,
                      pull_sequence=call.pull_sequence, **call.caller)
        if call.wait_only:
            fields["wait_only"] = True
        if self.gpu is not None:
            self._stage(region)
        if self.use_output:
            self._output(fields, region, channel)
        if call.keys is not None:
            self._copied()
            return kvstore_pb2.SessionRequest(**fields).SerializeToString() + key_fields(call.keys), ()
        sent, arrays = self._offload(region, channel) if self.in_bytes else (self.items, ())
        self._copied()
        return encode_stream(kvstore_pb2.SessionRequest, sent, fields, chunk_bytes=_ONE_MESSAGE,
                             with_data=not call.wait_only)[0], arrays

    def _stage(self, region):
        """Start the call's copies (``self.copies``): the pushed GPU values that the route does
        not move itself (:meth:`_direct`) copied into the session's pinned buffer, where
        ``self.items`` then has them; room there for the pulled values for GPU out arrays that
        come to the host first (``self.proxies``: whole ones that do not :meth:`_land`)."""
        gpu, call = self.gpu, self.call
        self.copies = gpu.copies()
        staged = []  # (index, DeviceMemory) of the pushed values copied into the pinned buffer
        if self.items is not None and not call.wait_only:
            for index, item in enumerate(self.items):
                memory = device_memory(item.array) if on_gpu(item.array) else None
                if memory is not None and not self._direct(index, memory, region):
                    staged.append((index, memory))
        proxied = [(index, target) for index, target in self.targets.items()
                   if target[4] is None and not self._land(index, target, region)]
        gpu.reserve(sum(aligned(memory.nbytes) for _, memory in staged)
                    + sum(aligned(target[0].nbytes) for _, target in proxied))
        for index, memory in staged:
            item = self.items[index]
            view, ptr = gpu.take(memory.nbytes)
            self.copies.to_host(memory, ptr)
            self.items[index] = Item(item.key, view.view(shape_dtype(item.array)[1]).reshape(item.array.shape),
                                     item.shape, item.slice, two_bit=item.two_bit)
        for index, (memory, _, dtype, shape, _) in proxied:
            view, ptr = gpu.take(memory.nbytes)
            self.proxies[index] = (view.view(dtype).reshape(shape), ptr)

    def _direct(self, index, memory, region):
        """Whether the route moves the pushed GPU value ``self.items[index]`` (at ``memory``)
        itself, not through the pinned buffer."""
        return False

    def _land(self, index, target, region):
        """Whether the pulled value of part index ``index`` for a GPU out array (``target``, of
        ``self.targets``) is written where the route names (SessionRequest.outputs)."""
        return False

    def _copied(self):
        """Wait once for what the call copied to the host, and for earlier calls' copies still
        reading the buffer or the region, before the request goes."""
        if self.copies is not None:
            self.gpu.wait(self.copies)

    def _output(self, fields, region, channel):
        """Name where the pulled values of ``min_bytes`` or more go (``fields`` of the request)."""

    def _offload(self, region, channel):
        """(the items the request carries, the arrays that follow it) for values that leave it."""
        return self.items, ()

    def answer(self, call_id, data, region, channel):
        """The items of the serialized SessionResponse ``data`` (values that follow on ``channel``
        read from it, those in ``region`` copied out). A value for a GPU out array is copied
        there (:meth:`_resolve`, or from its proxy), and its item's array is the out array."""
        call = self.call
        outs = call.outs
        if self.proxies:
            outs = list(outs)
            for index, (proxy, _) in self.proxies.items():
                outs[call.part[index][0]] = [proxy]
        decoder = make_decoder(kvstore_pb2.SessionResponse, call.part, outs, resolve=self._resolve(region),
                               channel=channel is not None)
        try:
            decoder.feed(data)
            check_answer(decoder.first, call_id, call.kind, self.address)
            items = decoder.finish()
            if decoder.frames.incoming:
                channel.receive(decoder.frames.incoming)
            decoder.remember()
            if self.copies is not None:
                self._deliver(items)
            return items
        finally:
            if self.copies is not None:  # the copies queued, even by an answer that failed, run on
                self.gpu.record(self.copies)

    def _resolve(self, region):
        """The ``resolve(region_id, offset, length)`` of the answer's references."""
        return region.resolve if region is not None else None

    def _deliver(self, items):
        """Copy the values received in proxies into their GPU out arrays (queued on their
        streams: the next call waits for them before the pinned buffer is written again)."""
        for index, (proxy, ptr) in self.proxies.items():
            if index < len(items) and np.may_share_memory(items[index].array, proxy):
                memory, out = self.targets[index][:2]
                self.copies.to_device(ptr, memory)
                items[index].array = out

    def kept(self, request):
        """What sends this push again, when it may go without waiting for its answer (the
        serialized ``request``, which holds its values); None when it must wait."""
        return request

    def keys(self):
        """The keys of the values it pushes."""
        return [item.key for item in self.items]


class SharedMemory(Inline):
    """Values of ``min_bytes`` or more written into the session's shared-memory region, only
    their references in the request; a pull names the region as its output area, and the
    values the server writes there are copied out. A region the server refuses leaves them in
    the messages."""

    def __init__(self, address, call, max_bytes, min_bytes, gpu=None):
        super().__init__(address, call, max_bytes, min_bytes, gpu)
        if self.in_bytes or self.use_output:
            self.shm_bytes = max(self.in_bytes, self.out_bytes if self.use_output else 0)

    def _output(self, fields, region, channel):
        if region is not None:
            fields["output"] = tensor_pb2.SharedMemoryRef(region_id=region.id, offset=HEADER_BYTES,
                                                         length=region.capacity)

    def _offload(self, region, channel):
        if region is None:
            return self.items, ()
        self._copied()  # GPU values staged in the pinned buffer are read from there
        placement, min_bytes = Placement(region.buffer, region.id, HEADER_BYTES), self.min_bytes
        return [placement.put(item) or item if item.array.nbytes >= min_bytes else item for item in self.items], ()

    def kept(self, request):
        # Values in the region change with the next call: such a push waits.
        return None if self.in_bytes else request


class DataChannel(Inline):
    """Values of ``min_bytes`` or more on the session's data channel, after the request, and
    pulled ones of as many bytes after the answer, straight into ``outs`` where they fit."""

    def __init__(self, address, call, max_bytes, min_bytes, gpu=None):
        super().__init__(address, call, max_bytes, min_bytes, gpu)
        self.data_channel = self.in_bytes > 0 or self.use_output

    def _output(self, fields, region, channel):
        if channel is not None:
            fields["data_channel_min_bytes"] = self.min_bytes

    def _offload(self, region, channel):
        return (self.items, ()) if channel is None else following(self.items, self.min_bytes)

    def kept(self, request):
        if not self.in_bytes:
            return request
        # Values that follow the request are kept to send again when they are the push's own
        # (2-bit codes); the caller's own arrays may change once push returns: then it waits.
        return self.items if all(item.owned for item in self.items) else None


class Packed:
    """The values of ``layout`` (a list the stream registered: tensorkv.wire.packed) in one buffer
    on the session's data channel: a push sends their bytes after the request; a pull receives
    each value straight into its array of ``targets``. Only where calls go on the channel."""

    shm_bytes = 0
    data_channel = True
    answer_bytes = datachan.ANSWER_ROOM
    pinned = False
    exports = ()
    gpu = None

    def __init__(self, session, call, layout):
        self.address, self.call, self.layout = session.address, call, layout
        self.layout_ids = session.layout_ids
        self.op = SESSION_OPS[call.kind]
        self.values = call.values
        if self.values is None and call.kind != "pull":
            self.values = layout.pack([item.array for _, item in call.part])
        self.targets = call.targets
        if self.targets is None and call.kind != "push":
            self.targets = _targets(layout, call.part, call.outs)

    def request(self, call_id, timeout_ms, region, channel):
        call = self.call
        request = kvstore_pb2.SessionRequest(
            id=call_id, op=self.op, timeout_ms=timeout_ms, sequence=call.sequence, pull_sequence=call.pull_sequence,
            layout_id=self.layout_ids[self.layout], **call.caller)
        return request.SerializeToString(), () if self.values is None else (np.frombuffer(self.values, np.uint8),)

    def answer(self, call_id, data, region, channel):
        """The Items pulled ([] for a push)."""
        response = kvstore_pb2.SessionResponse.FromString(data)
        check_answer(response, call_id, self.call.kind, self.address)
        if self.targets is None:
            return []
        if response.packed_bytes != self.layout.nbytes:
            raise InternalError(f"server {self.address} answered {response.packed_bytes} packed bytes for "
                                f"a layout of {self.layout.nbytes}")
        channel.receive(self.targets)
        return [Item(key, value) for key, value in zip(self.layout.keys, self.targets)]

    def kept(self, request):
        # The request does not hold the values: they are kept to send again.
        return (self.layout, self.values) if self.op == kvstore_pb2.SESSION_OP_PUSH else None

    def keys(self):
        return self.layout.keys


class Layouts:
    """The packed layouts of the calls to one server: whether a list of values packs (at least
    ``min_values`` of them, distinct keys, one dtype that is not big-endian, each value under
    ``max_value_bytes``, on a session whose calls go on the data channel), and the same
    packed.Layout for the same list, MAX_KNOWN_LAYOUTS of them at most (each is registered
    again on a new stream; the lists seen once that many are known travel as entries)."""

    def __init__(self, min_values, max_value_bytes):
        self.min_values, self.max_value_bytes = max(min_values, 1), max_value_bytes
        self._known = {}  # packed.signature -> packed.Layout

    def of_call(self, session, call):
        """The Layout of the values of ``call``'s part (or, for a pull, of its keys with their
        shapes) when they pack; else None."""
        keys, shapes = call.keys, call.shapes
        if keys is None:
            items = [item for _, item in call.part]
            for item in items:
                array = item.array
                if type(array) is not np.ndarray or item.slice is not None or item.two_bit is not None \
                        or not array.flags.c_contiguous:
                    return None
            keys, shapes = [item.key for item in items], [(item.shape, item.array.dtype) for item in items]
        return self.of(session, keys, shapes) if shapes is not None else None

    def of(self, session, keys, shapes):
        """The Layout of ``keys`` whose whole values have ``shapes`` [(shape, dtype)] when they pack
        on ``session`` (None: sessions off); else None."""
        if len(keys) < self.min_values or session is None or not session.calls_on_channel:
            return None
        dtype = shapes[0][1]
        if dtype.byteorder == ">" or len(set(keys)) < len(keys) or any(
                value_dtype != dtype or math.prod(shape) * dtype.itemsize >= self.max_value_bytes
                for shape, value_dtype in shapes):
            return None
        signature = packed.signature(keys, [shape for shape, _ in shapes], dtype)
        layout = self._known.get(signature)
        if layout is None:
            if len(self._known) >= MAX_KNOWN_LAYOUTS:
                return None
            layout = self._known[signature] = packed.Layout(*signature)
        return layout


def check_answer(response, call_id, kind, address):
    """Raise the error that the SessionResponse ``response`` of a ``kind`` call carries, or
    InternalError when it answers another call than ``call_id``."""
    if response.code:
        error = error_from_code(status_code(response.code), response.message, response.error_class or None,
                                address, kind)
        error.answered = True  # by the server: see session.Session
        raise error
    if response.id != call_id:
        raise InternalError(f"server {address} answered session call {response.id}, not {call_id}")


def receivable(target, dtype, shape):
    """Whether a pulled value of ``dtype`` and full ``shape`` may be received straight into
    ``target``, the caller's out array."""
    return type(target) is np.ndarray and target.dtype == dtype and target.shape == tuple(shape) \
        and target.flags.c_contiguous and target.flags.writeable


def _targets(layout, part, outs):
    """The arrays that the values of ``layout`` are pulled into: the out array of each
    (``outs[position][0]`` of its (position, key) in ``part``) where it is :func:`receivable`,
    else a new array."""
    targets = []
    for (position, _), shape in zip(part, layout.shapes):
        target = outs[position][0] if outs is not None else None
        targets.append(target if receivable(target, layout.dtype, shape) else np.empty(shape, layout.dtype))
    return targets


def _pulled_layouts(call):
    """[(full shape, dtype, slice or None)] of the values a pull or push-pull of ``call`` gets
    back, by part index; None where they are not known (a pull of keys not seen yet)."""
    if call.keys is None:
        if call.kind != "pushpull":
            return None
        return [(item.shape, np.dtype(np.float32) if item.two_bit is not None else shape_dtype(item.array)[1],
                 item.slice) for _, item in call.part]
    if call.pulled is not None:
        return call.pulled
    if call.shapes is not None:
        return [(shape, dtype, None) for shape, dtype in call.shapes]
    return None


def _gpu_targets(call):
    """{part index: (DeviceMemory, out array, dtype, pulled shape, slice)} of the values that a
    pull or push-pull of ``call`` gets back whose out array is a contiguous GPU array of their
    key's dtype and full shape: the memory of the value's bytes there (of its slice, for a
    slice); the pulled shape is the value's, or (slice length,)."""
    layouts = _pulled_layouts(call) if call.outs is not None else None
    if layouts is None:
        return {}
    targets = {}
    for index, ((position, _), (shape, dtype, where)) in enumerate(zip(call.part, layouts)):
        out = call.outs[position][0]
        memory = device_memory(out) if on_gpu(out) else None
        if memory is None or shape_dtype(out) != (tuple(shape), dtype):
            continue
        if where is None:
            targets[index] = (memory, out, dtype, tuple(shape), None)
        else:
            targets[index] = (memory.at(where[0] * dtype.itemsize, (where[1] - where[0]) * dtype.itemsize), out, dtype,
                              (where[1] - where[0],), where)
    return targets


def _pulled_nbytes(item):
    """The bytes of the value that a pushpull of ``item`` pulls back: its array's, or for 2-bit
    codes those of the float32 elements they stand for."""
    if item.two_bit is None:
        return item.array.nbytes
    return 4 * (math.prod(item.shape) if item.slice is None else item.slice[1] - item.slice[0])


def make_decoder(message_type, part, outs, resolve=None, channel=False):
    """A StreamDecoder of responses of ``message_type`` that puts the values of ``part``
    [(position, Item or key)] straight into their ``outs[position][0]`` where that is a NumPy
    array of the right dtype and shape."""
    if outs is None:
        destination = None
    else:
        # (asked key, out array that may receive its value straight, or None) by entry index
        expected = []
        for position, asked in part:
            target = outs[position][0]
            writable = type(target) is np.ndarray and target.flags.c_contiguous and target.flags.writeable
            expected.append((asked.key if isinstance(asked, Item) else asked, target if writable else None))

        def destination(index, key, dtype, shape, slice):
            if index >= len(expected):
                return None
            asked, target = expected[index]
            if target is None or asked != key or target.dtype != dtype or target.shape != shape:
                return None
            return target if slice is None else target.reshape(-1)[slice[0]:slice[1]]
    return StreamDecoder(message_type, "frame", destination=destination, resolve=resolve, copy_refs=True,
                         channel=channel)


# The GPU routes subclass SharedMemory: imported once this module has it, whichever is imported first.
from . import gpu_routes  # noqa: E402
