"""The KVStoreService handlers: decode the request, call the :class:`~.rounds.Coordinator`,
encode the answer. Errors become statuses in :func:`tensorkv.status.translate_errors`, which
:func:`add_to_server` wraps around each handler.

The streams of tensors (Init, Push and PushPull requests, Pull and PushPull responses)
reach and leave the handlers as serialized bytes, decoded and encoded by
:mod:`tensorkv.codec` without protobuf objects for the tensor bytes; :func:`add_to_server`
registers the handlers with those (de)serializers. The wire is the proto's either way.
"""
import asyncio
import logging
import secrets

import grpc
import numpy as np
from google.protobuf.message_factory import GetMessageClass

from tensorkv import __version__, allocator, codec, packed, rowsparse_wire, states_wire
from tensorkv.backend import on_gpu
from tensorkv.engine import dtype_mismatch
from tensorkv.errors import (
    DeadlineExceededError, FailedPreconditionError, InternalError, InvalidArgumentError, KVStoreError,
    ResourceExhaustedError, ShapeMismatchError, key_repr,
)
from tensorkv.rowsparse import RowSparse
from tensorkv.status import error_status, translate_errors
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc
from tensorkv.words import plural, size

from . import budget, datachan, logs, metrics, progress, shm
from .deadline import within
from .limits import Limits, max_call_bytes
from .membership import FAIL, MAX_EARLIER_INCARNATIONS, MAX_JOB_BYTES, REPLACE, RESUME
from .security import READ_ONLY_CALL
from .staging import Staging
from .streams import OpenStreams

log = logging.getLogger(__name__)
_MODES = {"sync": kvstore_pb2.MODE_SYNC, "async": kvstore_pb2.MODE_ASYNC}
_IF_EXISTS = {FAIL: kvstore_pb2.IF_EXISTS_FAIL, RESUME: kvstore_pb2.IF_EXISTS_RESUME,
              REPLACE: kvstore_pb2.IF_EXISTS_REPLACE}
_IF_EXISTS_BY_VALUE = {value: name for name, value in _IF_EXISTS.items()} | {kvstore_pb2.IF_EXISTS_UNSPECIFIED: FAIL}
_SERVICE = kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"]
# Methods whose requests, or responses, the handlers see as bytes.
RAW_REQUESTS = {"Init", "Push", "PushPull", "Session"}
RAW_RESPONSES = {"Pull", "PushPull", "Session", "ReadKey"}
# A session's answer is one message, however large.
_ONE_MESSAGE = 1 << 62
_OPS_WITHOUT_VALUES = {kvstore_pb2.SESSION_OP_REGISTER_REGION, kvstore_pb2.SESSION_OP_UNREGISTER_REGION,
                       kvstore_pb2.SESSION_OP_OPEN_DATA_CHANNEL, kvstore_pb2.SESSION_OP_REGISTER_LAYOUT,
                       kvstore_pb2.SESSION_OP_BARRIER}
# The ops that may name a packed layout (SessionRequest.layout_id), and those of them that pull.
_PACKED_OPS = {kvstore_pb2.SESSION_OP_PUSH, kvstore_pb2.SESSION_OP_PULL, kvstore_pb2.SESSION_OP_PUSH_PULL}
_PACKED_PULLS = {kvstore_pb2.SESSION_OP_PULL, kvstore_pb2.SESSION_OP_PUSH_PULL}
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}  # status number -> its name, for metrics
# Copies of a row-sparse answer's rows and ids that the server may hold at once: the rows, the
# answer message, its serialized bytes.
ROW_ANSWER_COPIES = 3
# Copies of a Pull or PushPull answer's values held at once: our messages, and gRPC's of them.
_GRPC_ANSWER_COPIES = 2


def _ms(seconds):
    return round(seconds * 1000)


def _row_ids(item):
    """The row ids that an entry of a SESSION_OP_ROW_SPARSE_PULL call carries."""
    if item.slice is not None or item.two_bit is not None:
        raise InvalidArgumentError(f"key {key_repr(item.key)}: a row-sparse pull's entry carries row ids, not a "
                                   f"slice or 2-bit codes")
    return item.array


def _responses(items):
    """The serialized PullResponse (= PushPullResponse) messages of ``items``, all encoded
    before the caller's next await, so that they hold the values of this moment."""
    messages = codec.encode_messages(items, kvstore_pb2.PullResponse.DESCRIPTOR.fields_by_name["frame"].number)
    metrics.sent("grpc", sum(map(len, messages)))
    return messages


class _Outgoing:
    """Arrays that follow a response on the data channel, the answer's own (a packed pull's buffer)."""

    def __init__(self, arrays, timeout):
        self.arrays, self.timeout = arrays, timeout

    def release(self):
        self.arrays = None


class _Lent(_Outgoing):
    """Stored arrays that follow a response on the data channel, sent as they are: lent to the
    answer (Engine.lend) until :meth:`release`, so that the engine changes copies of them
    meanwhile instead of the bytes in flight."""

    def __init__(self, engine, arrays, timeout):
        super().__init__(arrays, timeout)
        self.engine = engine
        engine.lend(arrays)

    def release(self):
        if self.arrays is not None:
            self.engine.give_back(self.arrays)
        super().release()


def _packable(layout, items):
    """The arrays of the pulled ``items`` (host arrays of whole values), checked to be as
    ``layout`` says before they are packed into its buffer."""
    arrays = []
    for item, shape in zip(items, layout.shapes):
        array = item.array
        if array.dtype != layout.dtype:
            raise dtype_mismatch(item.key, "pulled (in a packed list)", layout.dtype, array.dtype)
        if item.shape != shape or item.slice is not None:
            where = "" if item.slice is None else f" (this server holds the slice {item.slice})"
            raise ShapeMismatchError(f"key {key_repr(item.key)}: the packed list says shape {shape}, the stored "
                                     f"shape is {item.shape}{where}")
        arrays.append(array if array.flags.c_contiguous else np.ascontiguousarray(array))
    return arrays


def add_to_server(service, server, descriptor=_SERVICE):
    """Register ``service``, the handlers of the service ``descriptor``, on ``server`` as the
    generated code would, except that every
    request arrives as bytes: the tensor streams (RAW_REQUESTS) reach their handlers so, the
    other requests are parsed here (:func:`_parser`), and the tensor streams of RAW_RESPONSES
    leave as bytes. Each handler is wrapped in :func:`tensorkv.status.translate_errors`."""
    factories = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for method in descriptor.methods:
        response = GetMessageClass(method.output_type)
        parse = None if method.name in RAW_REQUESTS else _parser(method)
        handlers[method.name] = factories[method.client_streaming, method.server_streaming](
            translate_errors(getattr(service, method.name), parse),
            response_serializer=None if method.name in RAW_RESPONSES else response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))


def _parser(method):
    """``parse(request, context)``: the request message, or for a request stream the async
    iterator of messages, of ``method`` (a MethodDescriptor) from its bytes. A malformed message
    raises InvalidArgumentError and is logged in one line naming the method and the peer
    (gRPC's own deserializer answers UNKNOWN or INTERNAL and logs a traceback)."""
    message_class = GetMessageClass(method.input_type)

    def parse(data, context):
        try:
            return codec.parse(message_class, data, InvalidArgumentError)
        except InvalidArgumentError as error:
            log.warning("%s from %s refused: %s", method.name, context.peer(), error)
            raise

    async def parse_stream(requests, context):
        async for data in requests:
            yield parse(data, context)

    return parse_stream if method.client_streaming else parse


class KVStoreService(kvstore_pb2_grpc.KVStoreServiceServicer):
    def __init__(self, coordinator, shared_memory=True, data_port=None, limits=Limits(), snapshots=None):
        self.coordinator = coordinator
        # The Session streams, ended by the server's stop (streams.OpenStreams.end).
        self.streams = OpenStreams()
        # The snapshot.Snapshots of --state-dir, or None; and this process's random id.
        self.snapshots = snapshots
        self.server_id = secrets.randbits(64)
        # What one request may carry (--max-key-bytes, --max-value-bytes, ...).
        self.limits = limits
        # The server-wide budget of bytes in flight (--max-inflight-bytes): see budget.py.
        self.budget = budget.Budget(limits.max_inflight_bytes, limits.progress_timeout)
        # Whether Session streams may register shared-memory regions (--no-shared-memory).
        self.shared_memory = shared_memory and shm.available()
        # The datachan.DataPort that binds data channels to Session streams, or None.
        self.data_port = data_port
        # Pinned buffers and a CUDA stream between the wire and a GPU engine, or None.
        xp = coordinator.engine.xp
        self.staging = Staging(xp) if xp is not np else None
        # Receive buffers of 32 MiB or more, used again once nothing refers to them (as many
        # bytes kept as glibc is told to keep of freed memory, and no more than the budget: a
        # call's buffers are made before it waits for room, and would all be kept).
        self.buffers = allocator.Buffers(min(allocator.SERVER_TRIM_THRESHOLD,
                                             limits.max_inflight_bytes or allocator.SERVER_TRIM_THRESHOLD))

    def _decoder(self, message_class, **options):
        """A decoder of a stream of serialized ``message_class`` (see codec.StreamDecoder) within
        this server's limits; values that span several messages go to the GPU's staging. Entries may
        carry 2-bit codes (the coordinator takes them in pushes only)."""
        limits = self.limits
        return codec.StreamDecoder(message_class, "frame", max_bytes=limits.max_value_bytes,
                                   max_key_bytes=limits.max_key_bytes, max_keys=limits.max_keys_per_call,
                                   max_call_bytes=limits.max_inflight_bytes, two_bit=True, empty=self.buffers.empty,
                                   staging=self.staging.receiver if self.staging else None, **options)

    async def _apply(self, requests, context, message_class, call, with_data=None):
        """``await call(first request, items)`` for a stream of serialized ``message_class``; None
        for an empty stream. ``with_data(first)`` says whether the frames carry data (Init's
        wait_only does not)."""
        decoder = self._decoder(message_class, with_data=with_data)
        held = budget.hold(self.budget.charge(0))  # counted as they come, given back once merged
        try:
            async for data in self.budget.paced(requests, held, context.peer()):
                metrics.received("grpc", len(data))
                decoder.feed(data)
            items = decoder.finish()
            if decoder.first is None:
                return None
            result = await call(decoder.first, items)
        finally:
            held.release()
        decoder.remember()
        return result

    async def _answer_room(self, items, timeout, what, copies=1, applied=False):
        """The budget's Reservation (see budget.py) for an answer that carries the values of
        ``items``, held ``copies`` times at once (gRPC's own copy of our messages: 2; at most
        the whole budget, as one value over it is refused already). The answer of a call whose
        push was ``applied`` is counted at once, past the budget if need be: refused then, the
        call would fail after changing the values, and a worker that tried it again would push
        twice (its request's bytes, as many, were given back just before)."""
        nbytes = sum(item.array.nbytes for item in items)
        if copies > 1 and self.budget.total is not None:
            nbytes = max(nbytes, min(copies * nbytes, self.budget.total))
        if applied:
            return self.budget.charge(nbytes)
        return await self.budget.reserve(nbytes, timeout, what)

    def _keys(self, request):
        """The keys of a Pull or Session request; InvalidArgumentError for one over --max-key-bytes,
        ResourceExhaustedError for more than --max-keys-per-call."""
        keys = [codec.get_key(key) for key in request.keys]
        codec.check_key_count(keys, self.limits.max_keys_per_call)
        for key in keys:
            codec.check_key_bytes(key, self.limits.max_key_bytes)
        return keys

    def _host(self, items):
        """``items`` with values on the GPU copied to the host through pinned memory."""
        if self.staging is None:
            return items
        return [codec.Item(item.key, self.staging.download(item.array), item.shape, item.slice)
                if on_gpu(item.array) else item for item in items]

    async def Register(self, request, context):
        logs.PEER.set(context.peer())
        if_exists = _IF_EXISTS_BY_VALUE.get(request.if_exists)
        if if_exists is None:
            raise InvalidArgumentError(f"unknown if_exists value {request.if_exists}")
        if len(request.job.encode()) > MAX_JOB_BYTES:
            raise InvalidArgumentError(f"job {request.job[:40]!r}... is {len(request.job.encode())} bytes long; "
                                       f"at most {MAX_JOB_BYTES}")
        rank, incarnation = self.coordinator.register(
            request.rank if request.HasField("rank") else None, if_exists,
            request.previous_incarnation if request.HasField("previous_incarnation") else None, request.request_id,
            request.job, request.earlier_incarnations[-MAX_EARLIER_INCARNATIONS:], request.bigarray_bound)
        return kvstore_pb2.RegisterResponse(rank=rank, num_workers=self.coordinator.num_workers,
                                            mode=_MODES[self.coordinator.mode], incarnation=incarnation,
                                            lease_ttl_ms=_ms(self.coordinator.members.lease_timeout))

    async def Unregister(self, request, context):
        logs.PEER.set(context.peer())
        self.coordinator.unregister(request.rank, request.incarnation)
        return kvstore_pb2.UnregisterResponse()

    async def KeepAlive(self, request, context):
        ttl = self.coordinator.members.renew(request.rank, request.incarnation)
        return kvstore_pb2.KeepAliveResponse(ttl_ms=_ms(ttl))

    async def Info(self, request, context):
        info = self.coordinator.info()
        workers = [kvstore_pb2.WorkerLease(rank=rank, incarnation=incarnation, ms_since_renewal=_ms(since))
                   for rank, incarnation, since in info.pop("leases")]
        return kvstore_pb2.InfoResponse(
            mode=_MODES[info.pop("mode")], version=__version__, shared_memory=self.shared_memory,
            data_port=self.data_port.advertised if self.data_port else 0,
            if_exists=_IF_EXISTS.get(info.pop("if_exists"), kvstore_pb2.IF_EXISTS_UNSPECIFIED),
            lease_ttl_ms=_ms(info.pop("lease_timeout")), workers=workers, server_id=self.server_id,
            snapshots=self.snapshots is not None, **_snapshot_info(self.snapshots), **info)

    async def Init(self, request_iterator, context):
        await self._apply(request_iterator, context, kvstore_pb2.InitRequest,
                          lambda first, items: self.coordinator.init(
                              first.rank, first.incarnation, items, first.wait_only, first.sequence),
                          with_data=lambda first: not first.wait_only)
        return kvstore_pb2.InitResponse()

    async def Push(self, request_iterator, context):
        await self._apply(request_iterator, context, kvstore_pb2.PushRequest,
                          lambda first, items: self.coordinator.push(first.rank, first.incarnation, items,
                                                                     first.sequence))
        return kvstore_pb2.PushResponse()

    async def Pull(self, request, context):
        if READ_ONLY_CALL.get():  # no rank: a rank's own pull hears of its aborted rounds, not a reader's
            items = [self.coordinator.read(key) for key in self._keys(request)]
        else:
            items = await self.coordinator.pull(request.rank, request.incarnation, self._keys(request),
                                                request.pull_sequence)
        held = await self._answer_room(items, context.time_remaining(), f"a pull of {plural(len(items), 'value')}",
                                       _GRPC_ANSWER_COPIES)
        try:
            await progress.write_all(context, _responses(self._host(items)), self.limits.progress_timeout,
                                     "the answer of a pull")
        finally:
            held.release()

    async def RowSparsePull(self, request, context):
        requests = []
        for entry in request.keys:
            key = codec.get_key(entry.key)
            codec.check_key_bytes(key, self.limits.max_key_bytes)
            requests.append((key, np.array(entry.row_ids, np.int64)))
        codec.check_key_count([key for key, _ in requests], self.limits.max_keys_per_call)
        try:
            results = await self._pull_rows(request, requests, context.time_remaining())
            response = kvstore_pb2.RowSparsePullResponse()
            for (key, row_ids), (shape, rows) in zip(requests, results):
                rowsparse_wire.set_value(response.values.add(), key, shape, row_ids, rows)
            return response
        finally:
            budget.release_held()

    async def _pull_rows(self, request, requests, timeout):
        """Coordinator.pull_rows of ``requests`` [(key, row ids)] for ``request`` (a RowSparsePull
        or Session request). Ids may repeat, so a short request can ask for any number of rows:
        the bytes the answer holds in flight are counted from the request first, refused
        (RESOURCE_EXHAUSTED) when they would pass the whole budget (--max-inflight-bytes), and
        reserved once the round is over, before the rows are copied; the call then holds that
        reservation (budget.hold) until its answer is sent."""
        engine, values, rows = self.coordinator.engine, 0, 0
        for key, ids in requests:
            rows += len(ids)
            if key in engine:  # else pull_rows names it
                stored = engine.get(key)
                values += len(ids) * (stored.array.nbytes // max(stored.shape[0] if stored.shape else 1, 1))
        held, total = ROW_ANSWER_COPIES * (values + rows * 8), self.budget.total
        what = f"a row-sparse pull of {plural(rows, 'row')}"
        if total is not None and held > total:
            raise ResourceExhaustedError(
                f"{what} would answer {size(values)} of values, which with their row ids hold {size(held)} in flight "
                f"while the answer is built and sent; this server's budget for bytes in flight is {size(total)} "
                f"(--max-inflight-bytes)")

        async def reserve():
            budget.release_held()  # the request's
            budget.hold(await self.budget.reserve(held, timeout, what))

        return await self.coordinator.pull_rows(request.rank, request.incarnation, requests, request.pull_sequence,
                                                reserve)

    async def RowSparsePush(self, request, context):
        items = []
        for value in request.values:
            key, shape, row_ids, rows = rowsparse_wire.get_value(value, self.limits.max_key_bytes)
            items.append(codec.Item(key, RowSparse(rows, row_ids, shape)))
        codec.check_key_count([item.key for item in items], self.limits.max_keys_per_call)
        # Read whole by gRPC already: counted at once, as a Session message is (past the budget if need be).
        budget.hold(self.budget.charge_within(request.ByteSize(), "a row-sparse push"))
        try:
            await self.coordinator.push(request.rank, request.incarnation, items, request.sequence)
        finally:
            budget.release_held()
        return kvstore_pb2.RowSparsePushResponse()

    async def PushPull(self, request_iterator, context):
        items = await self._apply(request_iterator, context, kvstore_pb2.PushPullRequest,
                                  lambda first, items: self.coordinator.pushpull(
                                      first.rank, first.incarnation, items, first.sequence))
        if items is not None:
            held = await self._answer_room(items, context.time_remaining(),
                                           f"a push-pull of {plural(len(items), 'value')}", _GRPC_ANSWER_COPIES, True)
            try:
                await progress.write_all(context, _responses(self._host(items)), self.limits.progress_timeout,
                                         "the answer of a push-pull")
            finally:
                held.release()

    async def Session(self, request_iterator, context):
        # The shared-memory regions and the data channel of this stream: released when it
        # ends, however it ends.
        regions = shm.Regions(context.peer())
        channel = datachan.StreamChannel(self.data_port, context.peer(), self.streams) if self.data_port else None
        layouts = packed.Layouts()
        self.streams.opened()
        try:
            async for data in self._requests(request_iterator):
                metrics.received("grpc", len(data))
                budget.hold(self.budget.charge(len(data)))  # read already; the call's answer holds what it reserves
                try:
                    response, outgoing, close = await self._session_call(data, regions, channel, layouts)
                    if close:
                        channel.close()
                    metrics.sent("grpc", len(response))
                    try:
                        yield response
                    except BaseException:
                        if outgoing is not None:
                            outgoing.release()
                        raise
                    if outgoing is not None:
                        await self._send_after(channel, outgoing)
                finally:
                    budget.release_held()
        finally:
            try:
                if channel is not None and self.streams.ending:  # its calls on the channel end at their next boundary
                    await channel.calls_ended()
            finally:  # also when gRPC's stop cancels that wait
                if channel is not None:
                    channel.close()
                regions.close()
                self.streams.closed()

    async def _requests(self, requests):
        """The requests of a stream, until the server stops (OpenStreams.next_call)."""
        requests = aiter(requests)
        while True:
            try:
                request = await self.streams.next_call(lambda: anext(requests))
            except StopAsyncIteration:
                return
            yield request

    async def _session_call(self, data, regions, channel, layouts, on_channel=False):
        """(the serialized SessionResponse to one serialized SessionRequest, None or (buffer
        to send on the data channel after it, as an _Outgoing), whether the data channel
        is out of step and must close once the response is sent). ``layouts``: the stream's
        packed.Layouts. ``on_channel``: the request came framed on the data channel
        (datachan.StreamChannel.serve_calls)."""
        decoder = self._decoder(kvstore_pb2.SessionRequest, resolve=metrics.counting_shm(regions.resolve),
                                with_data=lambda first: not first.wait_only, channel=channel is not None)
        call_id, uses_channel = 0, True  # until the request says otherwise
        in_step = False  # whether the bytes the request announced on the channel were all read
        try:
            decoder.feed(data)
            items = decoder.finish()
            request = decoder.first
            call_id = request.id
            incoming = decoder.frames.incoming
            layout = self._layout(request, items, layouts, channel) if request.layout_id else None
            if layout is not None and request.op != kvstore_pb2.SESSION_OP_PULL:
                incoming = [self.buffers.empty(layout.nbytes)]  # the packed values follow the request
            uses_channel = bool(incoming or request.data_channel_min_bytes or layout)
            in_step = not incoming
            if request.op in _OPS_WITHOUT_VALUES and items:  # bytes it announced would stay unread on the channel
                raise InvalidArgumentError(f"session op {kvstore_pb2.SessionOp.Name(request.op)} takes no values; the "
                                           f"request carries {plural(len(items), 'value')}")
            if uses_channel and not on_channel and channel is not None and channel.takes_calls:
                raise FailedPreconditionError("this stream's calls that move bytes on the data channel must come on "
                                              "the channel (SessionResponse.calls_on_channel)")
            if request.op in (kvstore_pb2.SESSION_OP_REGISTER_REGION, kvstore_pb2.SESSION_OP_UNREGISTER_REGION):
                return self._region_call(request, regions), None, False
            if request.op == kvstore_pb2.SESSION_OP_OPEN_DATA_CHANNEL:
                if on_channel:
                    raise FailedPreconditionError("a data channel is opened on the Session stream, not on a channel")
                return self._open_channel(request, regions, channel, layouts), None, False
            if request.op == kvstore_pb2.SESSION_OP_REGISTER_LAYOUT:
                if channel is None:
                    raise FailedPreconditionError("packed layouts move on the data channel; this server has none "
                                                  "(--no-data-channel)")
                return kvstore_pb2.SessionResponse(
                    id=call_id, layout_id=layouts.register(request.layout, self.limits)).SerializeToString(), None, False
            # Checked before anything changes; written after the work, before any other await.
            output = regions.placement(request.output) if request.HasField("output") else None
            if request.data_channel_min_bytes and (channel is None or not channel.bound):
                raise FailedPreconditionError("data_channel_min_bytes asks for values on the data channel, but no "
                                              "data channel is bound to this stream (open one, connect with its token)")
            timeout = request.timeout_ms / 1000 if request.timeout_ms else None
            if incoming:  # the bytes first, so that the channel stays in step whatever the work does
                budget.release_held()  # the request's, reserved again with the values: never one held while waiting
                nbytes = len(data) + sum(buffer.nbytes for buffer in incoming)
                budget.hold(await self.budget.reserve(
                    min(nbytes, self.budget.total or nbytes), timeout,
                    f"a call of {plural(len(incoming), 'value')} on the data channel"))
                await channel.receive(incoming, timeout)
                metrics.received("datachan", sum(buffer.nbytes for buffer in incoming))
                in_step = True
            if layout is not None:
                # Not owned: a stored value that became a view of the buffer would keep all of it.
                items = [codec.Item(key, value) for key, value in zip(layout.keys, layout.views(incoming[0]))] \
                    if incoming else []
            work = self._session_work(request, items, layout)
            if timeout is not None:
                try:
                    items = await within(work, timeout)
                except asyncio.TimeoutError:
                    raise DeadlineExceededError(f"the call took longer than its {request.timeout_ms} ms") from None
            else:
                items = await work
            decoder.remember()
            if request.op != kvstore_pb2.SESSION_OP_ROW_SPARSE_PULL:  # (which reserved its answer in _pull_rows)
                budget.release_held()  # the request's values are merged
                if items and output is None:
                    budget.hold(await self._answer_room(items, timeout, f"the answer of {plural(len(items), 'value')}",
                                                        applied=request.op == kvstore_pb2.SESSION_OP_PUSH_PULL))
            items = self._host(items)
            if output is not None:
                items = output.place(items)
                metrics.sent("shm", sum(item.array.nbytes for item in items if item.ref))
            outgoing = None
            if layout is not None and request.op in _PACKED_PULLS:
                values = layout.pack(_packable(layout, items))
                outgoing = _Outgoing([np.frombuffer(values, np.uint8)], timeout)
                return kvstore_pb2.SessionResponse(id=call_id, packed_bytes=len(values)).SerializeToString(), \
                    outgoing, False
            if request.data_channel_min_bytes:
                items, arrays = codec.following(items, request.data_channel_min_bytes)
                if arrays:
                    outgoing = _Lent(self.coordinator.engine, arrays, timeout)
            response = codec.encode_stream(kvstore_pb2.SessionResponse, items, {"id": call_id},
                                           chunk_bytes=_ONE_MESSAGE)[0]
            return response, outgoing, False
        except Exception as error:
            # The stream of bytes may be out of step: start afresh. Calls framed on the channel
            # keep it when every byte the request announced was read (no answer bytes follow an error).
            close = uses_channel and channel is not None and not (on_channel and in_step)
            code, message, error_class = error_status(error)
            metrics.session_error(_CODE_NAMES[code])
            return kvstore_pb2.SessionResponse(
                id=call_id, code=code, message=message, error_class=error_class).SerializeToString(), None, close

    @staticmethod
    async def _send_after(channel, outgoing):
        """Send the values (an _Outgoing) that follow a response; a failure closes the channel (the
        client's call fails on its side)."""
        try:
            await channel.send(outgoing.arrays, outgoing.timeout)
            metrics.sent("datachan", sum(array.nbytes for array in outgoing.arrays))
        except progress.StalledError:  # logged by the channel, at most once a minute
            pass
        except KVStoreError as error:
            log.warning("data channel of %s: %s", channel.peer, error)
        finally:
            outgoing.release()

    def _open_channel(self, request, regions, channel, layouts):
        if channel is None:
            raise FailedPreconditionError("this server has no data channel (--no-data-channel)")
        token = channel.open()
        if request.calls_on_channel:
            channel.serve_calls(lambda data: self._channel_call(data, regions, channel, layouts),
                                lambda outgoing: self._send_after(channel, outgoing), self._max_call_bytes(),
                                self.budget)
        return kvstore_pb2.SessionResponse(id=request.id, data_token=token,
                                           calls_on_channel=request.calls_on_channel).SerializeToString()

    def _max_call_bytes(self):
        """The longest call a data channel reads (limits.max_call_bytes)."""
        return max_call_bytes(self.limits) or _ONE_MESSAGE

    async def _channel_call(self, data, regions, channel, layouts):
        metrics.received("datachan", len(data))
        response, outgoing, close = await self._session_call(data, regions, channel, layouts, on_channel=True)
        metrics.sent("datachan", len(response))
        return response, outgoing, close

    def _region_call(self, request, regions):
        if request.op == kvstore_pb2.SESSION_OP_UNREGISTER_REGION:
            regions.unregister(request.region_id)
            return kvstore_pb2.SessionResponse(id=request.id).SerializeToString()
        if not self.shared_memory:
            raise FailedPreconditionError("shared memory is off on this server")
        region_id = regions.register(request.region)
        return kvstore_pb2.SessionResponse(id=request.id, region_id=region_id).SerializeToString()

    def _layout(self, request, items, layouts, channel):
        """The packed.Layout that ``request`` names (SessionRequest.layout_id), checked to fit the call."""
        layout = layouts.get(request.layout_id)
        if request.op not in _PACKED_OPS:
            raise InvalidArgumentError(f"session op {kvstore_pb2.SessionOp.Name(request.op)} takes no packed layout")
        if items or request.keys or request.HasField("output") or request.data_channel_min_bytes:
            raise InvalidArgumentError("a call with a packed layout carries its values packed on the data channel: "
                                       "no frame, keys, output area or data_channel_min_bytes")
        if channel is None or not channel.bound:
            raise FailedPreconditionError("a packed layout's values move on the data channel, but no data channel "
                                          "is bound to this stream (open one, connect with its token)")
        return layout

    async def _session_work(self, request, items, layout=None):
        if request.op == kvstore_pb2.SESSION_OP_PUSH:
            await self.coordinator.push(request.rank, request.incarnation, items, request.sequence)
            return []
        if request.op == kvstore_pb2.SESSION_OP_PULL:
            keys = layout.keys if layout is not None else self._keys(request)
            return await self.coordinator.pull(request.rank, request.incarnation, keys, request.pull_sequence)
        if request.op == kvstore_pb2.SESSION_OP_PUSH_PULL:
            return await self.coordinator.pushpull(request.rank, request.incarnation, items, request.sequence)
        if request.op == kvstore_pb2.SESSION_OP_INIT:
            await self.coordinator.init(request.rank, request.incarnation, items, request.wait_only, request.sequence)
            return []
        if request.op == kvstore_pb2.SESSION_OP_BARRIER:
            await self.coordinator.barrier(request.rank, request.incarnation)
            return []
        if request.op == kvstore_pb2.SESSION_OP_ROW_SPARSE_PULL:
            requests = [(item.key, _row_ids(item)) for item in items]
            results = await self._pull_rows(request, requests, request.timeout_ms / 1000 or None)
            return [codec.Item(key, rows) for (key, _), (_, rows) in zip(requests, results)]
        raise InvalidArgumentError(f"unknown session op {request.op}")

    async def SetUpdater(self, request_iterator, context):
        optimizer, key_states = states_wire.from_messages([r async for r in request_iterator])
        if optimizer is None:
            raise InvalidArgumentError("SetUpdater names no optimizer")
        self.coordinator.set_optimizer(optimizer, key_states)
        return kvstore_pb2.SetUpdaterResponse(multipliers=len(optimizer.lr_mult) + len(optimizer.wd_mult))

    async def GetOptimizerStates(self, request, context):
        optimizer, key_states = self.coordinator.optimizer_states()
        for message in states_wire.to_messages(kvstore_pb2.GetOptimizerStatesResponse, optimizer, key_states):
            yield message

    async def SetLearningRate(self, request, context):
        self.coordinator.set_learning_rate(request.learning_rate)
        return kvstore_pb2.SetLearningRateResponse()

    async def Reset(self, request, context):
        return kvstore_pb2.ResetResponse(num_keys=self.coordinator.reset(request.force))

    async def Snapshot(self, request, context):
        if self.snapshots is None:
            raise FailedPreconditionError("this server has no --state-dir: it cannot take snapshots")
        try:
            name, num_keys, run = await self.snapshots.take()
        except OSError as error:  # take logged it, with the file's path
            raise InternalError(f"the snapshot could not be written: {error.strerror or error} (the server's log "
                                "names the file)") from None
        return kvstore_pb2.SnapshotResponse(file_name=name, num_keys=num_keys, run=run)

    async def Barrier(self, request, context):
        await self.coordinator.barrier(request.rank, request.incarnation)
        return kvstore_pb2.BarrierResponse()


def _snapshot_info(snapshots):
    """The InfoResponse fields of ``snapshots`` (None: no --state-dir)."""
    if snapshots is None:
        return {}
    return dict(restored_from=snapshots.restored_from, restored_round=snapshots.restored_round,
                last_snapshot=snapshots.last_written, last_snapshot_unix_ms=int(snapshots.last_written_time * 1000),
                failed_snapshots=snapshots.failures, snapshot_error=snapshots.last_error)
