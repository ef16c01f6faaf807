"""The stub: KVStoreService's generated stub, plus the tensor streams with serialized
messages in and out."""
from ..v1 import kvstore_pb2, kvstore_pb2_grpc


class Stub(kvstore_pb2_grpc.KVStoreServiceStub):
    """The generated stub, plus the tensor streams with bytes in and out (encoded and decoded
    by :mod:`tensorkv.wire.codec`): ``init``, ``push`` and ``pushpull`` take the list of serialized
    request messages and make a unary call when there is only one, which is the same on the
    wire as a stream of one message and saves the thread that feeds a request stream."""

    _PATH = "/" + kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"].full_name + "/"

    def __init__(self, channel):
        super().__init__(channel)
        path = self._PATH
        self._init = (channel.unary_unary(path + "Init", response_deserializer=kvstore_pb2.InitResponse.FromString),
                      channel.stream_unary(path + "Init", response_deserializer=kvstore_pb2.InitResponse.FromString))
        self._push = (channel.unary_unary(path + "Push", response_deserializer=kvstore_pb2.PushResponse.FromString),
                      channel.stream_unary(path + "Push", response_deserializer=kvstore_pb2.PushResponse.FromString))
        self._pushpull = (channel.unary_stream(path + "PushPull"), channel.stream_stream(path + "PushPull"))
        self.pull_raw = channel.unary_stream(path + "Pull", request_serializer=kvstore_pb2.PullRequest.SerializeToString)

    @staticmethod
    def _send(calls, messages, timeout):
        if len(messages) == 1:
            return calls[0](messages[0], timeout=timeout)
        return calls[1](iter(messages), timeout=timeout)

    def init_raw(self, messages, timeout):
        return self._send(self._init, messages, timeout)

    def push_raw(self, messages, timeout):
        return self._send(self._push, messages, timeout)

    def pushpull_raw(self, messages, timeout):
        """The serialized PushPullResponse messages, as an iterator."""
        return self._send(self._pushpull, messages, timeout)
