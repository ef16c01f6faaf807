"""The KVStoreService handlers: decode the request, call the :class:`~.rounds.Coordinator`,
encode the answer. Errors become statuses in :func:`tensorkv.rpc.translate_errors`."""
from tensorkv import __version__, codec, states_wire
from tensorkv.rpc import translate_errors
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc

_MODES = {"sync": kvstore_pb2.MODE_SYNC, "async": kvstore_pb2.MODE_ASYNC}


async def _read(requests, with_data=None):
    """(first request or None, [codec.Item]) of a request stream of frames.

    ``with_data(first)`` says whether the frames carry data (Init's wait_only does not).
    """
    first, decoder, items = None, None, []
    async for request in requests:
        if first is None:
            first = request
            decoder = codec.FrameDecoder(with_data=with_data(first) if with_data else True)
        items.extend(decoder.feed(request.frame))
    if decoder is not None:
        decoder.finish()
    return first, items


class KVStoreService(kvstore_pb2_grpc.KVStoreServiceServicer):
    def __init__(self, coordinator):
        self.coordinator = coordinator

    @translate_errors
    async def Register(self, request, context):
        rank = self.coordinator.register(request.rank if request.HasField("rank") else None)
        return kvstore_pb2.RegisterResponse(
            rank=rank, num_workers=self.coordinator.num_workers, mode=_MODES[self.coordinator.mode])

    @translate_errors
    async def Info(self, request, context):
        info = self.coordinator.info()
        return kvstore_pb2.InfoResponse(
            mode=_MODES[info.pop("mode")], version=__version__, **info)

    @translate_errors
    async def Init(self, request_iterator, context):
        first, items = await _read(request_iterator, with_data=lambda first: not first.wait_only)
        if first is not None:
            await self.coordinator.init(first.rank, items, first.wait_only)
        return kvstore_pb2.InitResponse()

    @translate_errors
    async def Push(self, request_iterator, context):
        first, items = await _read(request_iterator)
        if first is not None:
            await self.coordinator.push(first.rank, items)
        return kvstore_pb2.PushResponse()

    @translate_errors
    async def Pull(self, request, context):
        keys = [codec.get_key(key) for key in request.keys]
        for frame in codec.encode_frames(await self.coordinator.pull(request.rank, keys)):
            yield kvstore_pb2.PullResponse(frame=frame)

    @translate_errors
    async def PushPull(self, request_iterator, context):
        first, items = await _read(request_iterator)
        if first is not None:
            for frame in codec.encode_frames(await self.coordinator.pushpull(first.rank, items)):
                yield kvstore_pb2.PushPullResponse(frame=frame)

    @translate_errors
    async def SetUpdater(self, request_iterator, context):
        name, params, key_states = states_wire.from_messages([r async for r in request_iterator])
        self.coordinator.set_optimizer(name, params, key_states)
        return kvstore_pb2.SetUpdaterResponse()

    @translate_errors
    async def GetOptimizerStates(self, request, context):
        optimizer, key_states = self.coordinator.optimizer_states()
        name, params = (optimizer.name, optimizer.params) if optimizer else ("", {})
        for message in states_wire.to_messages(kvstore_pb2.GetOptimizerStatesResponse, name, params, key_states):
            yield message

    @translate_errors
    async def Barrier(self, request, context):
        await self.coordinator.barrier(request.rank)
        return kvstore_pb2.BarrierResponse()

