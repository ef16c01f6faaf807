"""The MaintenanceService handlers, for operators' tools (``tensorkv keys``, ``tensorkv get``):
they need no rank and change nothing, so they never disturb a job's membership or rounds; and
those of a move (``tensorkv reshard``), whose work is :mod:`.transfer`'s."""
from tensorkv.wire import codec
from tensorkv.v1 import maintenance_pb2, maintenance_pb2_grpc, tensor_pb2

from . import transfer

# Keys per ListKeysResponse: a page stays far below gRPC's message limit even with long keys.
PAGE_KEYS = 500
_FRAME_FIELD = maintenance_pb2.ReadKeyResponse.DESCRIPTOR.fields_by_name["frame"].number


class MaintenanceService(maintenance_pb2_grpc.MaintenanceServiceServicer):
    def __init__(self, coordinator, max_key_bytes, snapshots=None):
        self.coordinator = coordinator
        self.max_key_bytes = max_key_bytes
        self.snapshots = snapshots  # snapshot.Snapshots of --state-dir, which keep a move's marks; or None

    async def ListKeys(self, request, context):
        described = [_description(*entry) for entry in self.coordinator.describe_keys()]
        for start in range(0, len(described), PAGE_KEYS):
            yield maintenance_pb2.ListKeysResponse(keys=described[start:start + PAGE_KEYS])

    async def ReadKey(self, request, context):
        key = codec.get_key(request.key)
        codec.check_key_bytes(key, self.max_key_bytes)
        for message in codec.encode_messages([self.coordinator.read(key)], _FRAME_FIELD):
            yield message

    async def DescribeRun(self, request, context):
        for piece in transfer.header_pieces(self.coordinator):
            yield maintenance_pb2.DescribeRunResponse(header=piece)

    async def ReadRanges(self, request, context):
        async for message in transfer.read_ranges(self.coordinator, request, self.max_key_bytes):
            yield message

    async def DigestRanges(self, request, context):
        return await transfer.digest_ranges(self.coordinator, request, self.max_key_bytes)

    async def ImportRun(self, request_iterator, context):
        return await transfer.import_run(self.coordinator, request_iterator)

    async def MarkMove(self, request, context):
        return await transfer.mark_move(self.coordinator, self.snapshots, request)


def _description(key, stored, updates):
    description = maintenance_pb2.KeyDescription(dtype=codec.wire_dtype(stored.array.dtype), shape=stored.shape,
                                                 updates=updates)
    codec.set_key(description.key, key)
    if stored.slice is not None:
        description.slice.CopyFrom(tensor_pb2.Slice(begin=stored.slice[0], end=stored.slice[1]))
    return description
