"""The wire codec: round trips of every dtype and the rejection of malformed tensors and streams."""
import ml_dtypes
import numpy as np
import pytest

from tensorkv.wire import codec, protobuf
from tensorkv.wire.codec import FrameDecoder, Item, encode_frames
from tensorkv.errors import InvalidTensorError, KeyTypeError, ResourceExhaustedError
from tensorkv.v1 import tensor_pb2

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8]


def sample(dtype, shape=(3, 5)):
    return (np.arange(np.prod(shape, dtype=int)) % 100 - 50).astype(dtype).reshape(shape)


def decode(frames, **kwargs):
    decoder = FrameDecoder(**kwargs)
    items = [item for frame in frames for item in decoder.feed(frame)]
    decoder.finish()
    return items


def round_trip(array):
    """``array`` encoded into serialized frames and decoded back."""
    frames = [tensor_pb2.TensorFrame.FromString(f.SerializeToString()) for f in encode_frames([Item(1, array)])]
    (item,) = decode(frames)
    return item.array


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5), (), (0,), (2, 0, 3), (7,)])
def test_tensor_round_trip(dtype, shape):
    array = sample(dtype, shape)
    back = round_trip(array)
    assert back.dtype == np.dtype(dtype) and back.shape == shape
    np.testing.assert_array_equal(back, array)


def test_non_contiguous_and_big_endian_inputs():
    array = sample(np.float32, (4, 6))[::2, 1::2]
    np.testing.assert_array_equal(round_trip(array), array)
    big = np.arange(4, dtype=">i4")
    back = round_trip(big)
    assert back.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(back, big)
    np.testing.assert_array_equal(round_trip(np.float64(2.5)), 2.5)


@pytest.mark.parametrize("chunk_bytes", [7, 64, 1 << 20])
def test_frames_round_trip_with_chunking_and_slices(chunk_bytes):
    items = [Item(3, sample(np.float32, (10, 10))), Item(4, sample(np.int8, (0,))),
             Item(5, sample(ml_dtypes.bfloat16, ())), Item(6, sample(np.float64, (6,))[2:5], shape=(6,), slice=(2, 5))]
    frames = [tensor_pb2.TensorFrame.FromString(f.SerializeToString()) for f in encode_frames(items, chunk_bytes)]
    if chunk_bytes == 7:
        assert any(frame.more for frame in frames)
    back = decode(frames)
    assert [(i.key, i.shape, i.slice) for i in back] == [(i.key, i.shape, i.slice) for i in items]
    for got, sent in zip(back, items):
        assert got.array.dtype == sent.array.dtype
        np.testing.assert_array_equal(got.array, sent.array)


def test_wait_only_frames_carry_no_data():
    frames = list(encode_frames([Item("w", sample(np.float32))], with_data=False))
    assert frames[0].entries[0].tensor.data == b""
    (item,) = decode(frames, with_data=False)
    assert item.key == "w" and item.shape == (3, 5) and item.array.dtype == np.float32


def test_a_wait_only_entry_takes_no_memory():
    entry = tensor_pb2.TensorFrame(entries=[tensor_pb2.Entry(
        key=tensor_pb2.Key(str_key="w"), tensor=tensor(shape=(1 << 38,), data=b""))])
    (item,) = decode([entry], with_data=False)
    assert item.shape == (1 << 38,) and item.array.dtype == np.float32 and item.array.strides == (0,)


def tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=(2,), data=b"\0" * 8):
    return tensor_pb2.Tensor(dtype=dtype, shape=shape, data=data)


def frame(*tensors, more=b"", key=1):
    message = tensor_pb2.TensorFrame(more=more)
    for t in tensors:
        entry = message.entries.add()
        entry.key.int_key = key
        entry.tensor.CopyFrom(t)
    return message


@pytest.mark.parametrize("bad, message", [
    (tensor(data=b"\0" * 7), "stream ended after 7 of 8 bytes"),
    (tensor(data=b"\0" * 9), "needs 8 bytes, got 9"),
    (tensor(dtype=0), "DTYPE_UNSPECIFIED"),
    (tensor(dtype=42), "unknown wire dtype 42"),
    (tensor(shape=(2, -1), data=b""), "negative dimension"),
    (tensor(shape=(1,) * 33, data=b"\0" * 4), "at most 32"),
])
def test_malformed_tensors_are_rejected(bad, message):
    with pytest.raises(InvalidTensorError, match=message):
        decode([frame(bad)])


def test_a_server_s_limits_are_checked_before_anything_is_allocated():
    with pytest.raises(ResourceExhaustedError, match=r"takes 8 bytes; this server's limit is 4 bytes per value "
                                                     r"\(--max-value-bytes\)"):
        decode([frame(tensor())], max_bytes=4)
    huge = tensor(shape=(1 << 40, 1 << 20), data=b"")
    with pytest.raises(ResourceExhaustedError, match="--max-value-bytes"):
        decode([frame(huge)], max_bytes=1 << 30)
    with pytest.raises(ResourceExhaustedError, match=r"key 1 is key 3 of this call; this server's limit is 2 keys "
                                                     r"per call \(--max-keys-per-call\)"):
        decode([frame(tensor(data=b"\0" * 8), tensor(data=b"\0" * 8), tensor(data=b"\0" * 8))], max_keys=2)
    with pytest.raises(ResourceExhaustedError, match=r"to 16 bytes; this server's limit is 12 bytes per call "
                                                     r"\(--max-inflight-bytes\)"):
        decode([frame(tensor(data=b"\0" * 8), tensor(data=b"\0" * 8))], max_call_bytes=12)


def test_values_on_the_data_channel_count_against_max_call_bytes_even_unused():
    """An Init that only waits uses no values, but those its entries announce on the data channel
    are received all the same: they count (before the fix they did not, and a server allocated
    and read whatever such entries announced)."""
    entry = tensor_pb2.Entry(key=tensor_pb2.Key(int_key=1), tensor=tensor(shape=(4,), data=b""),
                             channel=tensor_pb2.DataChannelRef(length=16))
    with pytest.raises(ResourceExhaustedError, match=r"to 16 bytes; this server's limit is 12 bytes per call"):
        decode([tensor_pb2.TensorFrame(entries=[entry])], with_data=False, channel=True, max_call_bytes=12)


def test_malformed_streams_are_rejected():
    with pytest.raises(InvalidTensorError, match="stream ended after 4 of 8 bytes"):
        decode([frame(tensor(data=b"\0" * 4))])
    with pytest.raises(InvalidTensorError, match="10 bytes sent for a tensor of 8"):
        decode([frame(tensor(data=b"\0" * 4)), frame(more=b"\0" * 6)])
    with pytest.raises(InvalidTensorError, match="continuation bytes arrived with no incomplete entry"):
        decode([frame(more=b"\0")])
    with pytest.raises(InvalidTensorError, match="a new entry arrived"):
        decode([frame(tensor(data=b"\0" * 4)), frame(tensor())])
    with pytest.raises(InvalidTensorError, match="needs 8 bytes, got 4"):
        decode([frame(tensor(data=b"\0" * 4), tensor())])
    with pytest.raises(InvalidTensorError, match="needs 8 bytes, got 12"):
        decode([frame(tensor(data=b"\0" * 12))])
    sliced = frame(tensor())
    sliced.entries[0].slice.begin, sliced.entries[0].slice.end = 1, 3
    with pytest.raises(InvalidTensorError, match=r"slice \[1, 3\) is outside"):
        decode([sliced])


def test_keys():
    assert codec.check_key(np.int64(3)) == 3 and codec.check_key("w") == "w"
    for bad in (True, 1.5, None, b"w", 1 << 63):
        with pytest.raises(KeyTypeError):
            codec.check_key(bad)
    with pytest.raises(KeyTypeError, match="neither"):
        codec.get_key(tensor_pb2.Key())


def test_unsupported_dtypes_are_rejected():
    for dtype in (np.bool_, np.complex64, np.uint16, np.object_):
        with pytest.raises(InvalidTensorError, match="not supported"):
            codec.wire_dtype(dtype)


# ---- the hand-made messages of the hot paths --------------------------------------------

from tensorkv.v1 import kvstore_pb2  # noqa: E402

STREAM_ITEMS = [
    Item(3, sample(np.float32, (10, 10))), Item(-4, sample(np.int8, (0,))), Item(0, sample(ml_dtypes.bfloat16, ())),
    Item("name", sample(np.float64, (6,))[2:5], shape=(6,), slice=(2, 5)), Item(1 << 40, sample(np.int64, (300,))),
    Item("émoji", sample(np.uint8, (2, 3))), Item(-(1 << 63), sample(np.float16, (4, 2))), Item(7, sample(np.float32, (0,)),
                                                                                                shape=(9,), slice=(0, 0)),
]


def stream_decode(message_class, messages, **kwargs):
    decoder = codec.StreamDecoder(message_class, "frame", **kwargs)
    for message in messages:
        decoder.feed(message)
    return decoder.first, decoder.finish()


def assert_same_items(got, sent):
    assert [(i.key, i.shape, i.slice) for i in got] == [(i.key, i.shape, i.slice) for i in sent]
    for g, s in zip(got, sent):
        assert g.array.dtype == s.array.dtype
        np.testing.assert_array_equal(g.array, s.array)


@pytest.mark.parametrize("chunk_bytes", [16, 1000, 1 << 20])
def test_fast_encoder_output_parses_with_generated_classes(chunk_bytes):
    messages = codec.encode_stream(kvstore_pb2.PushRequest, STREAM_ITEMS, {"rank": 3}, chunk_bytes=chunk_bytes)
    parsed = [kvstore_pb2.PushRequest.FromString(m) for m in messages]
    assert parsed[0].rank == 3 and all(p.rank == 0 for p in parsed[1:])
    for p in parsed:  # each message's data, entries and continuations alike, is at most one chunk
        assert sum(len(e.tensor.data) for e in p.frame.entries) + len(p.frame.more) <= chunk_bytes
        # a tensor larger than a chunk starts as a metadata-only entry, then continues in `more` frames
        assert not (p.frame.more and p.frame.entries)
        for e in p.frame.entries[:-1]:  # only the last entry of a frame may be incomplete
            assert len(e.tensor.data) == np.prod(e.tensor.shape if not e.HasField("slice") else
                                                 [e.slice.end - e.slice.begin]) * codec.numpy_dtype(e.tensor.dtype).itemsize
    if chunk_bytes == 16:
        big = [e for p in parsed for e in p.frame.entries if e.key.int_key == 3][0]
        assert big.tensor.data == b"" and list(big.tensor.shape) == [10, 10]
        assert any(p.frame.more for p in parsed)
    # the generated classes' frames through the FrameDecoder: the same items
    assert_same_items(decode([p.frame for p in parsed]), STREAM_ITEMS)
    # and re-serialized by protobuf itself, through the fast decoder
    _, items = stream_decode(kvstore_pb2.PushRequest, [p.SerializeToString() for p in parsed])
    assert_same_items(items, STREAM_ITEMS)


def test_fast_encoder_entry_bytes_equal_protobuf_serialization():
    item = Item("w", sample(np.float32, (2, 3)))
    message = kvstore_pb2.PullResponse.FromString(codec.encode_stream(kvstore_pb2.PullResponse, [item])[0])
    entry = message.frame.entries[0]
    assert entry.key.str_key == "w" and entry.tensor.dtype == tensor_pb2.DTYPE_FLOAT32
    assert not entry.HasField("slice")
    assert entry.tensor.data == item.array.tobytes()
    wait_only = kvstore_pb2.InitRequest.FromString(codec.encode_stream(
        kvstore_pb2.InitRequest, [item], {"rank": 1, "wait_only": True}, with_data=False)[0])
    assert wait_only.wait_only and wait_only.frame.entries[0].tensor.data == b""


@pytest.mark.parametrize("chunk_bytes", [7, 64, 1 << 20])
def test_plain_protobuf_streams_decode_with_the_fast_decoder(chunk_bytes):
    """What another language's generated client sends: rank in every message, entries with
    partial data, `more` frames."""
    messages = [kvstore_pb2.PushPullRequest(rank=1, frame=frame).SerializeToString()
                for frame in encode_frames(STREAM_ITEMS, chunk_bytes)]
    first, items = stream_decode(kvstore_pb2.PushPullRequest, messages)
    assert first.rank == 1
    assert_same_items(items, STREAM_ITEMS)
    init = [kvstore_pb2.InitRequest(rank=2, wait_only=True, frame=frame).SerializeToString()
            for frame in encode_frames(STREAM_ITEMS, chunk_bytes, with_data=False)]
    first, items = stream_decode(kvstore_pb2.InitRequest, init, with_data=lambda f: not f.wait_only)
    assert first.wait_only and [i.key for i in items] == [i.key for i in STREAM_ITEMS]


def test_fast_decoder_writes_into_the_destination():
    value = sample(np.float32, (64, 8))
    messages = codec.encode_stream(kvstore_pb2.PullResponse, [Item("w", value)], chunk_bytes=100)
    out = np.zeros_like(value)
    _, items = stream_decode(kvstore_pb2.PullResponse, messages,
                             destination=lambda index, key, dtype, shape, slice: out)
    np.testing.assert_array_equal(out, value)
    assert np.shares_memory(items[0].array, out) and not items[0].owned
    _, items = stream_decode(kvstore_pb2.PullResponse, messages)
    assert items[0].owned and items[0].array.flags.writeable


class _ChunkReceiver:
    """A staging receiver as the codec drives it (a GPU server's copies each chunk on to the
    device): records the chunks, in order, into host memory."""

    def __init__(self, key, dtype, shape, nbytes):
        self.key, self.shape, self.bytes, self.chunks = key, shape, np.zeros(nbytes, np.uint8), []

    def __setitem__(self, where, data):
        self.chunks.append((where.start or 0, where.stop))
        self.bytes[where] = data

    def view(self, dtype):
        return self.bytes.view(dtype).reshape(self.shape)


@pytest.mark.parametrize("plain_protobuf", [False, True])
def test_values_that_span_messages_go_through_the_staging_receiver_chunk_by_chunk(plain_protobuf):
    receivers = []

    def staging(key, dtype, shape, nbytes):
        receivers.append(_ChunkReceiver(key, dtype, shape, nbytes))
        return receivers[-1]

    if plain_protobuf:
        messages = [kvstore_pb2.PushRequest(rank=1, frame=f).SerializeToString() for f in encode_frames(STREAM_ITEMS, 64)]
    else:
        messages = codec.encode_stream(kvstore_pb2.PushRequest, STREAM_ITEMS, {"rank": 1}, chunk_bytes=64)
    _, items = stream_decode(kvstore_pb2.PushRequest, messages, staging=staging)
    assert_same_items(items, STREAM_ITEMS)
    spanning = [item for item in STREAM_ITEMS if item.array.nbytes > 64]
    assert [r.key for r in receivers] == [item.key for item in spanning]
    for receiver, item in zip(receivers, spanning):
        # contiguous chunks of at most one message's data each, in order, covering the value
        assert receiver.chunks[0][0] == 0 and receiver.chunks[-1][1] == item.array.nbytes
        assert all(a[1] == b[0] for a, b in zip(receiver.chunks, receiver.chunks[1:]))
        assert all(stop - start <= 64 for start, stop in receiver.chunks)
    assert all(item.owned for item in items if item.key in {r.key for r in receivers})


def _continuation(more, frame_field=2):
    body = b"\x12" + codec._varint(len(more)) + more
    return codec._tag(frame_field, 2) + codec._varint(len(body)) + body


@pytest.mark.parametrize("tail, message", [
    ([_continuation(b"x" * 500)], "bytes sent for a tensor of 400 bytes"),   # too many bytes
    ([_continuation(b"x" * 100)], "stream ended after 100 of 400 bytes"),    # too few
    ([_continuation(b"x" * 400), _continuation(b"y")], "no incomplete entry"),  # bytes after the end
    ([_continuation(b"x" * 100)[:-5]], "malformed PushRequest"),              # truncated
    ([b"\x12\x05\x12\x10abc"], "malformed PushRequest"),                       # length past the end
    ([b"\xff\xff\xff"], "malformed PushRequest"),                              # garbage
])
def test_malformed_hand_encoded_frames_are_rejected(tail, message):
    # A first message that does not say how many follow (PushRequest.messages), as another client's may not.
    head = codec.encode_messages([Item(1, sample(np.float32, (10, 10)))], 2,
                                 kvstore_pb2.PushRequest(rank=0).SerializeToString(), chunk_bytes=64)[0]
    assert kvstore_pb2.PushRequest.FromString(head).frame.entries[0].tensor.data == b""
    with pytest.raises(InvalidTensorError, match=message):
        stream_decode(kvstore_pb2.PushRequest, [head] + tail)


def test_a_stream_says_how_many_messages_it_has_and_one_cut_short_is_refused():
    items = [Item(1, sample(np.float32, (10, 10))), Item(2, sample(np.int16, (3,)))]
    messages = codec.encode_stream(kvstore_pb2.PushRequest, items, {"rank": 0}, chunk_bytes=64)
    assert [kvstore_pb2.PushRequest.FromString(m).messages for m in messages] == [len(messages)] + [0] * 8
    assert_same_items(stream_decode(kvstore_pb2.PushRequest, messages)[1], items)
    with pytest.raises(InvalidTensorError, match=f"^the stream ended after 8 messages of the 9 its first one "
                                                 "announced: it was cut short$"):
        stream_decode(kvstore_pb2.PushRequest, messages[:-1])  # cut between two entries: each is whole
    [single] = codec.encode_stream(kvstore_pb2.PushRequest, items[1:], {"rank": 0})
    assert kvstore_pb2.PushRequest.FromString(single).messages == 0  # one message: nothing to cut


@pytest.mark.parametrize("data", [b"\x12\x01\x0a", b"\x12\x01\x12", b"\x12\x03\x0a\x81\x80"])
def test_a_frame_cut_short_inside_an_entry_is_malformed(data):
    with pytest.raises(InvalidTensorError, match="malformed PushRequest"):
        stream_decode(kvstore_pb2.PushRequest, [data])


def test_frame_with_entries_before_the_more_that_completes_the_previous_entry():
    """Protobuf serializes `entries` (1) before `more` (2); `more` still completes the earlier entry."""
    a, b = sample(np.float32, (4,)), sample(np.int16, (3,))
    tensor_a = tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=a.shape, data=a.tobytes())
    tensor_b = tensor(dtype=tensor_pb2.DTYPE_INT16, shape=b.shape, data=b.tobytes())
    frames = [tensor_pb2.TensorFrame(entries=[tensor_pb2.Entry(key=tensor_pb2.Key(int_key=1), tensor=tensor_a)]),
              tensor_pb2.TensorFrame(more=a.tobytes()[10:], entries=[
                  tensor_pb2.Entry(key=tensor_pb2.Key(int_key=2), tensor=tensor_b)])]
    frames[0].entries[0].tensor.data = a.tobytes()[:10]
    messages = [kvstore_pb2.PushRequest(rank=1, frame=f).SerializeToString() for f in frames]
    assert messages[1].index(b"\x12", 2) < len(messages[1]) - len(a.tobytes()[10:]) - 2  # entries come first
    _, items = stream_decode(kvstore_pb2.PushRequest, messages)
    assert_same_items(items, [Item(1, a), Item(2, b)])


def test_decoders_learn_entries_only_when_told():
    """The entry cache that makes known entries fast learns a stream's entries only at
    remember() (the server calls it once the call succeeded), within a byte budget."""
    key = "learned-only-when-told-" + "k" * 4096
    (message,) = codec.encode_stream(kvstore_pb2.PushRequest, [Item(key, sample(np.float32))], {"rank": 0})
    decoder = codec.StreamDecoder(kvstore_pb2.PushRequest, "frame")
    decoder.feed(message)
    decoder.finish()
    assert not any(key.encode() in start for start in protobuf._KNOWN_ENTRIES)
    decoder.remember()
    assert any(key.encode() in start for start in protobuf._KNOWN_ENTRIES)
    cache = protobuf._Cache(100_000)
    for i in range(1000):
        cache.put(i, b"", 1000)
        assert cache.used <= 100_000 and len(cache) <= 100_000 // (1000 + cache.ENTRY_OVERHEAD)


def test_a_shape_numpy_cannot_hold_is_refused_even_with_no_elements():
    """Found by tests/robustness/test_fuzz.py: (8, 0, 2**31, 2**31) has no elements, yet NumPy
    cannot reshape to it; the server answered INTERNAL."""
    with pytest.raises(InvalidTensorError, match="more than any array can hold"):
        codec.check_shape((8, 0, 2**31, 2**31))
    assert codec.check_shape((8, 0, 3)) == ((8, 0, 3), 0)
