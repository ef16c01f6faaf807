"""The MaintenanceService handlers, for operators' tools (``tensorkv keys``, ``tensorkv get``):
they need no rank and change nothing, so they never disturb a job's membership or rounds."""
from tensorkv.wire import codec
from tensorkv.v1 import maintenance_pb2, maintenance_pb2_grpc, tensor_pb2

# Keys per ListKeysResponse: a page stays far below gRPC's message limit even with long keys.
PAGE_KEYS = 500
_FRAME_FIELD = maintenance_pb2.ReadKeyResponse.DESCRIPTOR.fields_by_name["frame"].number


class MaintenanceService(maintenance_pb2_grpc.MaintenanceServiceServicer):
    def __init__(self, coordinator, max_key_bytes):
        self.coordinator = coordinator
        self.max_key_bytes = max_key_bytes

    async def ListKeys(self, request, context):
        described = [_description(*entry) for entry in self.coordinator.describe_keys()]
        for start in range(0, len(described), PAGE_KEYS):
            yield maintenance_pb2.ListKeysResponse(keys=described[start:start + PAGE_KEYS])

    async def ReadKey(self, request, context):
        key = codec.get_key(request.key)
        codec.check_key_bytes(key, self.max_key_bytes)
        for message in codec.encode_messages([self.coordinator.read(key)], _FRAME_FIELD):
            yield message


def _description(key, stored, updates):
    description = maintenance_pb2.KeyDescription(dtype=codec.wire_dtype(stored.array.dtype), shape=stored.shape,
                                                 updates=updates)
    codec.set_key(description.key, key)
    if stored.slice is not None:
        description.slice.CopyFrom(tensor_pb2.Slice(begin=stored.slice[0], end=stored.slice[1]))
    return description
