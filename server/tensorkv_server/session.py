"""The server's side of the Session stream: each serialized SessionRequest, on the stream or
framed on its data channel (datachan.StreamChannel.serve_calls), answered by one
SessionResponse, with the values that follow it on the data channel.

A stream holds its shared-memory regions, its data channel and its packed layouts until it
ends. The ops that move no values (regions, the channel's opening, layouts) are answered
here; the others run on the :class:`~.rounds.Coordinator` through the service's decoder and
budget (:class:`~.service.KVStoreService`), so a call checks, counts and fails as the same
call of the unary RPCs does. A failed call is answered with its status in the response; the
stream goes on.
"""
import asyncio
import logging

import grpc
import numpy as np

from tensorkv.backend import to_host
from tensorkv.wire import codec, packed
from tensorkv.update.engine import dtype_mismatch
from tensorkv.errors import (
    DeadlineExceededError, FailedPreconditionError, InvalidArgumentError, KVStoreError, ShapeMismatchError, key_repr,
)
from tensorkv.wire.status import error_status
from tensorkv.v1 import kvstore_pb2
from tensorkv.words import plural

from . import budget, datachan, metrics, progress, shm
from .deadline import within
from .limits import max_call_bytes

log = logging.getLogger(__name__)
# A session's answer is one message, however large.
_ONE_MESSAGE = 1 << 62
_REGION_OPS = {kvstore_pb2.SESSION_OP_REGISTER_REGION, kvstore_pb2.SESSION_OP_UNREGISTER_REGION,
               kvstore_pb2.SESSION_OP_REGISTER_CUDA_BUFFER}
# The ops about the stream itself, answered without the coordinator.
_STREAM_OPS = _REGION_OPS | {kvstore_pb2.SESSION_OP_OPEN_DATA_CHANNEL, kvstore_pb2.SESSION_OP_REGISTER_LAYOUT}
_OPS_WITHOUT_VALUES = _STREAM_OPS | {kvstore_pb2.SESSION_OP_BARRIER}
# The ops that may name a packed layout (SessionRequest.layout_id), and those of them that pull.
_PACKED_OPS = {kvstore_pb2.SESSION_OP_PUSH, kvstore_pb2.SESSION_OP_PULL, kvstore_pb2.SESSION_OP_PUSH_PULL}
_PACKED_PULLS = {kvstore_pb2.SESSION_OP_PULL, kvstore_pb2.SESSION_OP_PUSH_PULL}
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}  # status number -> its name, for metrics


def _row_ids(item):
    """The row ids that an entry of a SESSION_OP_ROW_SPARSE_PULL call carries."""
    if item.slice is not None or item.two_bit is not None:
        raise InvalidArgumentError(f"key {key_repr(item.key)}: a row-sparse pull's entry carries row ids, not a "
                                   f"slice or 2-bit codes")
    return to_host(item.array)  # where a pinned region's bytes were copied to the GPU


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


class _Call:
    """One call of a stream as it goes: its request and values once decoded, and what its
    error answer needs to know (whether the data channel is still in step)."""

    __slots__ = ("on_channel", "id", "request", "items", "incoming", "layout", "uses_channel", "in_step")

    def __init__(self, on_channel):
        self.on_channel = on_channel  # framed on the data channel, not a message of the stream
        self.id = 0
        self.request = self.items = self.layout = None
        self.incoming = []  # buffers for the values that follow the request on the data channel
        self.uses_channel = True  # until the request says otherwise
        self.in_step = False  # whether the bytes the request announced on the channel were all read


class SessionStream:
    """One Session stream of ``service`` (a service.KVStoreService) from ``peer``: its
    shared-memory regions, its data channel (None: --no-data-channel) and its packed layouts,
    released when it ends, however it ends."""

    def __init__(self, service, peer):
        self.service = service
        self.regions = shm.Regions(peer, service.staging)
        self.channel = datachan.StreamChannel(service.data_port, peer, service.streams) \
            if service.data_port else None
        self.layouts = packed.Layouts()

    async def serve(self, requests):
        """The serialized responses to ``requests`` (serialized SessionRequests), one each,
        until the client ends the stream or the server stops."""
        streams, server_budget = self.service.streams, self.service.budget
        streams.opened()
        try:
            async for data in self._requests(requests):
                metrics.received("grpc", len(data))
                budget.hold(server_budget.charge(len(data)))  # read already; the call's answer holds what it reserves
                try:
                    response, outgoing, close = await self.call(data)
                    if close:
                        self.channel.close()
                    metrics.sent("grpc", len(response))
                    try:
                        yield response
                    except BaseException:
                        if outgoing is not None:
                            outgoing.release()
                        raise
                    if outgoing is not None:
                        await self._send_after(outgoing)
                finally:
                    budget.release_held()
        finally:
            await self._close()

    async def _close(self):
        channel, streams = self.channel, self.service.streams
        try:
            if channel is not None and streams.ending:  # its calls on the channel end at their next boundary
                await channel.calls_ended()
        finally:  # also when gRPC's stop cancels that wait
            try:
                if channel is not None:
                    channel.close()
                self.regions.close()
            finally:
                streams.closed()

    async def _requests(self, requests):
        """The requests of a stream, until the server stops (OpenStreams.next_call)."""
        requests = aiter(requests)
        while True:
            try:
                request = await self.service.streams.next_call(lambda: anext(requests))
            except StopAsyncIteration:
                return
            yield request

    async def call(self, data, on_channel=False):
        """(the serialized SessionResponse to one serialized SessionRequest, None or (buffer
        to send on the data channel after it, as an _Outgoing), whether the data channel
        is out of step and must close once the response is sent). ``on_channel``: the request
        came framed on the data channel (datachan.StreamChannel.serve_calls)."""
        call = _Call(on_channel)
        decoder = self.service.decoder(kvstore_pb2.SessionRequest, resolve=metrics.counting_shm(self.regions.resolve),
                                       with_data=lambda first: not first.wait_only, channel=self.channel is not None)
        try:
            self._decode(data, call, decoder)
            if call.request.op in _STREAM_OPS:
                return self._stream_op(call), None, False
            return await self._values_call(data, call, decoder)
        except Exception as error:
            self.regions.settle()  # no copy may touch the client's memory once it has the answer
            # The stream of bytes may be out of step: start afresh. Calls framed on the channel
            # keep it when every byte the request announced was read (no answer bytes follow an error).
            close = call.uses_channel and self.channel is not None and not (on_channel and call.in_step)
            code, message, error_class = error_status(error)
            metrics.session_error(_CODE_NAMES[code])
            return kvstore_pb2.SessionResponse(
                id=call.id, code=code, message=message, error_class=error_class).SerializeToString(), None, close

    def _decode(self, data, call, decoder):
        """Decode ``data`` into ``call`` with ``decoder``, and check that the call fits the stream."""
        decoder.feed(data)
        call.items = decoder.finish()
        call.request = request = decoder.first
        call.id = request.id
        call.incoming = decoder.frames.incoming
        call.layout = self._layout(request, call.items) if request.layout_id else None
        if call.layout is not None and request.op != kvstore_pb2.SESSION_OP_PULL:
            call.incoming = [self.service.buffers.empty(call.layout.nbytes)]  # the packed values follow the request
        call.uses_channel = bool(call.incoming or request.data_channel_min_bytes or call.layout)
        call.in_step = not call.incoming
        if request.op in _OPS_WITHOUT_VALUES and call.items:  # bytes it announced would stay unread on the channel
            raise InvalidArgumentError(f"session op {kvstore_pb2.SessionOp.Name(request.op)} takes no values; the "
                                       f"request carries {plural(len(call.items), 'value')}")
        channel = self.channel
        if call.uses_channel and not call.on_channel and channel is not None and channel.takes_calls:
            raise FailedPreconditionError("this stream's calls that move bytes on the data channel must come on "
                                          "the channel (SessionResponse.calls_on_channel)")

    def _stream_op(self, call):
        """The serialized answer to a call about the stream itself: regions, the data channel, layouts."""
        request = call.request
        if request.op in _REGION_OPS:
            return self._region_call(request)
        if request.op == kvstore_pb2.SESSION_OP_OPEN_DATA_CHANNEL:
            if call.on_channel:
                raise FailedPreconditionError("a data channel is opened on the Session stream, not on a channel")
            return self._open_channel(request)
        if self.channel is None:
            raise FailedPreconditionError("packed layouts move on the data channel; this server has none "
                                          "(--no-data-channel)")
        layout_id = self.layouts.register(request.layout, self.service.limits)
        return kvstore_pb2.SessionResponse(id=call.id, layout_id=layout_id).SerializeToString()

    async def _values_call(self, data, call, decoder):
        """:meth:`call` of an op that runs on the coordinator, once ``data`` is decoded."""
        request, channel = call.request, self.channel
        # Checked before anything changes; written after the work, before any other await.
        output = self.regions.placement(request.output) if request.HasField("output") else None
        areas = self.regions.areas(request.outputs)
        if request.data_channel_min_bytes and (channel is None or not channel.bound):
            raise FailedPreconditionError("data_channel_min_bytes asks for values on the data channel, but no "
                                          "data channel is bound to this stream (open one, connect with its token)")
        timeout = request.timeout_ms / 1000 if request.timeout_ms else None
        if call.incoming:  # the bytes first, so that the channel stays in step whatever the work does
            await self._receive(len(data), call, timeout)
        items, layout = call.items, call.layout
        if layout is not None:
            # Not owned: a stored value that became a view of the buffer would keep all of it.
            items = [codec.Item(key, value) for key, value in zip(layout.keys, layout.views(call.incoming[0]))] \
                if call.incoming else []
        if call.incoming and self.service.staging is not None:
            items = self.service.staging.received(items, call.incoming)
        work = self._work(request, items, layout)
        if timeout is not None:
            try:
                items = await within(work, timeout)
            except asyncio.TimeoutError:
                raise DeadlineExceededError(f"the call took longer than its {request.timeout_ms} ms") from None
        else:
            items = await work
        decoder.remember()
        if request.op != kvstore_pb2.SESSION_OP_ROW_SPARSE_PULL:  # (which reserved its answer in pull_rows)
            budget.release_held()  # the request's values are merged
            if items and output is None:
                budget.hold(await self.service.answer_room(
                    items, timeout, f"the answer of {plural(len(items), 'value')}",
                    applied=request.op == kvstore_pb2.SESSION_OP_PUSH_PULL))
        response, outgoing = self._response(call, self._placed(items, areas, output), timeout)
        return response, outgoing, False

    def _placed(self, items, areas, output):
        """The host ``items`` of an answer, those that go to the client's memory written there
        (its output ``areas``, in order, and its one ``output`` area) and every copy done."""
        regions = self.regions
        if areas:
            items = regions.deliver(areas, items)
        if output is not None:
            items = output.place(items)
        if areas or output is not None:
            metrics.sent("shm", sum(item.array.nbytes for item in items if item.ref))
        items = self.service.on_host(items)
        regions.settle()
        return items

    async def _receive(self, nbytes, call, timeout):
        """Read the values that follow the request (``nbytes`` long) on the data channel."""
        budget.release_held()  # the request's, reserved again with the values: never one held while waiting
        nbytes += sum(buffer.nbytes for buffer in call.incoming)
        server_budget = self.service.budget
        budget.hold(await server_budget.reserve(
            min(nbytes, server_budget.total or nbytes), timeout,
            f"a call of {plural(len(call.incoming), 'value')} on the data channel"))
        await self.channel.receive(call.incoming, timeout)
        metrics.received("datachan", sum(buffer.nbytes for buffer in call.incoming))
        call.in_step = True

    def _response(self, call, items, timeout):
        """(the serialized SessionResponse of the host ``items`` that ``call`` answers, the values
        that follow it on the data channel or None)."""
        request = call.request
        if call.layout is not None and request.op in _PACKED_PULLS:
            values = call.layout.pack(_packable(call.layout, items))
            outgoing = _Outgoing([np.frombuffer(values, np.uint8)], timeout)
            return kvstore_pb2.SessionResponse(id=call.id, packed_bytes=len(values)).SerializeToString(), outgoing
        outgoing = None
        if request.data_channel_min_bytes:
            items, arrays = codec.following(items, request.data_channel_min_bytes)
            if arrays:
                outgoing = _Lent(self.service.coordinator.engine, arrays, timeout)
        response = codec.encode_stream(kvstore_pb2.SessionResponse, items, {"id": call.id},
                                       chunk_bytes=_ONE_MESSAGE)[0]
        return response, outgoing

    async def _send_after(self, outgoing):
        """Send the values (an _Outgoing) that follow a response; a failure closes the channel (the
        client's call fails on its side)."""
        try:
            await self.channel.send(outgoing.arrays, outgoing.timeout)
            metrics.sent("datachan", sum(array.nbytes for array in outgoing.arrays))
        except progress.StalledError:  # logged by the channel, at most once a minute
            pass
        except KVStoreError as error:
            log.warning("data channel of %s: %s", self.channel.peer, error)
        finally:
            outgoing.release()

    def _open_channel(self, request):
        channel = self.channel
        if channel is None:
            raise FailedPreconditionError("this server has no data channel (--no-data-channel)")
        token = channel.open()
        self.service.note_route(request, self.regions.route or "data-channel", self.regions.peer)
        if request.calls_on_channel:
            channel.serve_calls(self._channel_call, self._send_after, self._max_call_bytes(), self.service.budget)
        return kvstore_pb2.SessionResponse(id=request.id, data_token=token,
                                           calls_on_channel=request.calls_on_channel).SerializeToString()

    def _max_call_bytes(self):
        """The longest call a data channel reads (limits.max_call_bytes)."""
        return max_call_bytes(self.service.limits) or _ONE_MESSAGE

    async def _channel_call(self, data):
        metrics.received("datachan", len(data))
        response, outgoing, close = await self.call(data, on_channel=True)
        metrics.sent("datachan", len(response))
        return response, outgoing, close

    def _region_call(self, request):
        if request.op == kvstore_pb2.SESSION_OP_UNREGISTER_REGION:
            self.regions.unregister(request.region_id)
            return kvstore_pb2.SessionResponse(id=request.id).SerializeToString()
        if not self.service.shared_memory:
            raise FailedPreconditionError("shared memory is off on this server")
        if request.op == kvstore_pb2.SESSION_OP_REGISTER_CUDA_BUFFER:
            try:
                region_id = self.regions.open_cuda_buffer(request.cuda_buffer)
            except FailedPreconditionError as error:
                log.info("rank %d (%s): %s", request.rank, self.regions.peer, error)
                raise
            pinned = False
        else:
            region_id, pinned = self.regions.register(request.region)
        self.service.note_route(request, self.regions.route, self.regions.peer)
        return kvstore_pb2.SessionResponse(id=request.id, region_id=region_id, region_pinned=pinned).SerializeToString()

    def _layout(self, request, items):
        """The packed.Layout that ``request`` names (SessionRequest.layout_id), checked to fit the call."""
        layout = self.layouts.get(request.layout_id)
        if request.op not in _PACKED_OPS:
            raise InvalidArgumentError(f"session op {kvstore_pb2.SessionOp.Name(request.op)} takes no packed layout")
        if items or request.keys or request.HasField("output") or request.data_channel_min_bytes:
            raise InvalidArgumentError("a call with a packed layout carries its values packed on the data channel: "
                                       "no frame, keys, output area or data_channel_min_bytes")
        if self.channel is None or not self.channel.bound:
            raise FailedPreconditionError("a packed layout's values move on the data channel, but no data channel "
                                          "is bound to this stream (open one, connect with its token)")
        return layout

    async def _work(self, request, items, layout=None):
        coordinator = self.service.coordinator
        if request.op == kvstore_pb2.SESSION_OP_PUSH:
            await coordinator.push(request.rank, request.incarnation, items, request.sequence)
            return []
        if request.op == kvstore_pb2.SESSION_OP_PULL:
            keys = layout.keys if layout is not None else self.service.request_keys(request)
            return await coordinator.pull(request.rank, request.incarnation, keys, request.pull_sequence)
        if request.op == kvstore_pb2.SESSION_OP_PUSH_PULL:
            return await coordinator.pushpull(request.rank, request.incarnation, items, request.sequence)
        if request.op == kvstore_pb2.SESSION_OP_INIT:
            await coordinator.init(request.rank, request.incarnation, items, request.wait_only, request.sequence)
            return []
        if request.op == kvstore_pb2.SESSION_OP_BARRIER:
            await coordinator.barrier(request.rank, request.incarnation)
            return []
        if request.op == kvstore_pb2.SESSION_OP_ROW_SPARSE_PULL:
            requests = [(item.key, _row_ids(item)) for item in items]
            results = await self.service.pull_rows(request, requests, request.timeout_ms / 1000 or None)
            return [codec.Item(key, rows) for (key, _), (_, rows) in zip(requests, results)]
        raise InvalidArgumentError(f"unknown session op {request.op}")
