"""The KVStoreService handlers: decode the request, call the :class:`~.rounds.Coordinator`,
encode the answer. Errors become statuses in :func:`tensorkv.wire.status.translate_errors`, which
:func:`add_to_server` wraps around each handler.

The streams of tensors (Init, Push and PushPull requests, Pull and PushPull responses)
reach and leave the handlers as serialized bytes, decoded and encoded by
:mod:`tensorkv.wire.codec` without protobuf objects for the tensor bytes; :func:`add_to_server`
registers the handlers with those (de)serializers. The wire is the proto's either way. The
Session stream's protocol is :mod:`.session`'s, which takes the service's decoder, budget
and coordinator.
"""
import contextlib
import logging
import secrets

import grpc
import numpy as np
from google.protobuf.message_factory import GetMessageClass

from tensorkv import __version__
from tensorkv.backend import on_gpu
from tensorkv.errors import FailedPreconditionError, InternalError, InvalidArgumentError, ResourceExhaustedError
from tensorkv.update.rowsparse import RowSparse
from tensorkv.wire import allocator, codec, rowsparse_wire, states_wire
from tensorkv.wire.status import translate_errors
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc
from tensorkv.words import plural, size

from . import budget, logs, metrics, progress, shm
from .limits import Limits
from .membership import FAIL, MAX_EARLIER_INCARNATIONS, MAX_JOB_BYTES, REPLACE, RESUME, Registration
from .moves import check_changeable
from .security import READ_ONLY_CALL
from .session import SessionStream
from .staging import Staging
from .streams import OpenStreams
from .transfer import move_message

log = logging.getLogger(__name__)
_MODES = {"sync": kvstore_pb2.MODE_SYNC, "async": kvstore_pb2.MODE_ASYNC}
_IF_EXISTS = {FAIL: kvstore_pb2.IF_EXISTS_FAIL, RESUME: kvstore_pb2.IF_EXISTS_RESUME,
              REPLACE: kvstore_pb2.IF_EXISTS_REPLACE}
_IF_EXISTS_BY_VALUE = {value: name for name, value in _IF_EXISTS.items()} | {kvstore_pb2.IF_EXISTS_UNSPECIFIED: FAIL}
_SERVICE = kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"]
# Methods whose requests, or responses, the handlers see as bytes.
RAW_REQUESTS = {"Init", "Push", "PushPull", "Session"}
RAW_RESPONSES = {"Pull", "PushPull", "Session", "ReadKey"}
# Unary methods whose handlers write their answer (progress.write_all), so that its bytes stay
# counted in the budget until gRPC has sent them: registered as server streams, which on the
# wire answer as a unary method does, with one message.
WRITTEN_ANSWERS = {"RowSparsePull"}
# Copies of a row-sparse answer's rows and ids that the server may hold at once: the rows, the
# answer message, its serialized bytes.
ROW_ANSWER_COPIES = 3
# Copies of a Pull or PushPull answer's values held at once: our messages, and gRPC's of them.
_GRPC_ANSWER_COPIES = 2
# Copies of the optimizer states a GetOptimizerStates answer holds at once: the host copies
# of the states, and our messages of them.
STATE_ANSWER_COPIES = 2
# How a worker's large values travel (WorkerLease.route), in words for the log.
_ROUTE_NAMES = {"cuda-ipc": "CUDA IPC (device to device)", "pinned-shm": "shared memory pinned on both ends",
                "shm": "shared memory", "data-channel": "the data channel"}


def _ms(seconds):
    return round(seconds * 1000)


def _responses(items):
    """The serialized PullResponse (= PushPullResponse) messages of ``items``, all encoded
    before the caller's next await, so that they hold the values of this moment."""
    messages = codec.encode_messages(items, kvstore_pb2.PullResponse.DESCRIPTOR.fields_by_name["frame"].number)
    metrics.sent("grpc", sum(map(len, messages)))
    return messages


def add_to_server(service, server, descriptor=_SERVICE):
    """Register ``service``, the handlers of the service ``descriptor``, on ``server`` as the
    generated code would, except that every
    request arrives as bytes: the tensor streams (RAW_REQUESTS) reach their handlers so, the
    other requests are parsed here (:func:`_parser`), the tensor streams of RAW_RESPONSES
    leave as bytes, and the handlers of WRITTEN_ANSWERS write their one message. Each handler
    is wrapped in :func:`tensorkv.wire.status.translate_errors`."""
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
        server_streaming = method.server_streaming or method.name in WRITTEN_ANSWERS
        handlers[method.name] = factories[method.client_streaming, server_streaming](
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
    def __init__(self, coordinator, shared_memory=True, data_port=None, limits=Limits(), snapshots=None, device="cpu"):
        self.coordinator = coordinator
        # Where the coordinator's values live (backend.select's name of it), for Info.
        self.device = device
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
        # rank -> how its large values travel (WorkerLease.route), as its last Session set them up.
        self.routes = {}
        # Receive buffers of 32 MiB or more, used again once nothing refers to them (as many
        # bytes kept as glibc is told to keep of freed memory, and no more than the budget: a
        # call's buffers are made before it waits for room, and would all be kept).
        self.buffers = allocator.Buffers(min(allocator.SERVER_TRIM_THRESHOLD,
                                             limits.max_inflight_bytes or allocator.SERVER_TRIM_THRESHOLD),
                                         self.staging.empty_pinned if self.staging else None)

    def decoder(self, message_class, **options):
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
        decoder = self.decoder(message_class, with_data=with_data)
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

    async def answer_room(self, items, timeout, what, copies=1, applied=False):
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

    def request_keys(self, request):
        """The keys of a Pull or Session request; InvalidArgumentError for one over --max-key-bytes,
        ResourceExhaustedError for more than --max-keys-per-call."""
        keys = [codec.get_key(key) for key in request.keys]
        codec.check_key_count(keys, self.limits.max_keys_per_call)
        for key in keys:
            codec.check_key_bytes(key, self.limits.max_key_bytes)
        return keys

    def on_host(self, items):
        """``items`` with values on the GPU copied to the host through pinned memory."""
        if self.staging is None:
            return items
        moved = [index for index, item in enumerate(items) if on_gpu(item.array) and item.ref is None]
        hosts = self.staging.download([items[index].array for index in moved]) if moved else ()
        items = list(items)
        for index, host in zip(moved, hosts):
            item = items[index]
            items[index] = codec.Item(item.key, host, item.shape, item.slice)
        return items

    def note_route(self, request, route, peer):
        """Keep (for Info) and log the ``route`` of the large values of the rank that sent ``request``."""
        if not request.incarnation or self.routes.get(request.rank) == route:
            return
        self.routes[request.rank] = route
        log.info("rank %d (%s): large values travel by %s", request.rank, peer, _ROUTE_NAMES[route])

    async def Register(self, request, context):
        logs.PEER.set(context.peer())
        if_exists = _IF_EXISTS_BY_VALUE.get(request.if_exists)
        if if_exists is None:
            raise InvalidArgumentError(f"unknown if_exists value {request.if_exists}")
        if len(request.job.encode()) > MAX_JOB_BYTES:
            raise InvalidArgumentError(f"job {request.job[:40]!r}... is {len(request.job.encode())} bytes long; "
                                       f"at most {MAX_JOB_BYTES}")
        asked = Registration(
            if_exists, request.previous_incarnation if request.HasField("previous_incarnation") else None,
            request.request_id, request.job, tuple(request.earlier_incarnations[-MAX_EARLIER_INCARNATIONS:]),
            request.bigarray_bound)
        rank, incarnation = self.coordinator.register(request.rank if request.HasField("rank") else None, asked)
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
        workers = [kvstore_pb2.WorkerLease(rank=rank, incarnation=incarnation, ms_since_renewal=_ms(since),
                                           route=self.routes.get(rank, ""))
                   for rank, incarnation, since in info.pop("leases")]
        return kvstore_pb2.InfoResponse(
            mode=_MODES[info.pop("mode")], version=__version__, device=self.device, shared_memory=self.shared_memory,
            data_port=self.data_port.advertised if self.data_port else 0,
            if_exists=_IF_EXISTS.get(info.pop("if_exists"), kvstore_pb2.IF_EXISTS_UNSPECIFIED),
            lease_ttl_ms=_ms(info.pop("lease_timeout")), workers=workers, server_id=self.server_id,
            snapshots=self.snapshots is not None, move=move_message(self.coordinator.move),
            **_snapshot_info(self.snapshots), **info)

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
            items = [self.coordinator.read(key) for key in self.request_keys(request)]
        else:
            items = await self.coordinator.pull(request.rank, request.incarnation, self.request_keys(request),
                                                request.pull_sequence)
        held = await self.answer_room(items, context.time_remaining(), f"a pull of {plural(len(items), 'value')}",
                                       _GRPC_ANSWER_COPIES)
        try:
            await progress.write_all(context, _responses(self.on_host(items)), self.limits.progress_timeout,
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
            results = await self.pull_rows(request, requests, context.time_remaining())
            response = kvstore_pb2.RowSparsePullResponse()
            for (key, row_ids), (shape, rows) in zip(requests, results):
                rowsparse_wire.set_value(response.values.add(), key, shape, row_ids, rows)
            await progress.write_all(context, [response], self.limits.progress_timeout,
                                     "the answer of a row-sparse pull")
        finally:
            budget.release_held()

    async def pull_rows(self, request, requests, timeout):
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
            held = await self.answer_room(items, context.time_remaining(),
                                           f"a push-pull of {plural(len(items), 'value')}", _GRPC_ANSWER_COPIES, True)
            try:
                await progress.write_all(context, _responses(self.on_host(items)), self.limits.progress_timeout,
                                         "the answer of a push-pull")
            finally:
                held.release()

    async def Session(self, request_iterator, context):
        async with contextlib.aclosing(SessionStream(self, context.peer()).serve(request_iterator)) as responses:
            async for response in responses:
                yield response

    async def SetUpdater(self, request_iterator, context):
        check_changeable(self.coordinator.move, "SetUpdater")
        optimizer, key_states = states_wire.from_messages([r async for r in request_iterator])
        if optimizer is None:
            raise InvalidArgumentError("SetUpdater names no optimizer")
        self.coordinator.set_optimizer(optimizer, key_states)
        return kvstore_pb2.SetUpdaterResponse(multipliers=len(optimizer.lr_mult) + len(optimizer.wd_mult))

    async def GetOptimizerStates(self, request, context):
        """All the states in one answer, which cannot be split: counted in the budget, past it
        if need be (budget.Budget.reserve_whole), until written."""
        what = "the answer of GetOptimizerStates"
        held = await self.budget.reserve_whole(STATE_ANSWER_COPIES * self.coordinator.optimizer_state_bytes(),
                                               context.time_remaining(), what)
        try:
            messages = list(states_wire.to_messages(kvstore_pb2.GetOptimizerStatesResponse,
                                                    *self.coordinator.optimizer_states()))
            await progress.write_all(context, messages, self.limits.progress_timeout, what)
        finally:
            held.release()

    async def SetLearningRate(self, request, context):
        check_changeable(self.coordinator.move, "SetLearningRate")
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
