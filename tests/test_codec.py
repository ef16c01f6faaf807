"""The wire codec: round trips of every dtype and the rejection of malformed tensors and streams."""
import ml_dtypes
import numpy as np
import pytest

from tensorkv import codec
from tensorkv.codec import FrameDecoder, Item, encode_frames, from_tensor, to_tensor
from tensorkv.errors import InvalidTensorError, KeyTypeError
from tensorkv.v1 import tensor_pb2

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8]


def sample(dtype, shape=(3, 5)):
    return (np.arange(np.prod(shape, dtype=int)) % 100 - 50).astype(dtype).reshape(shape)


def decode(frames, **kwargs):
    decoder = FrameDecoder(**kwargs)
    items = [item for frame in frames for item in decoder.feed(frame)]
    decoder.finish()
    return items


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5), (), (0,), (2, 0, 3), (7,)])
def test_tensor_round_trip(dtype, shape):
    array = sample(dtype, shape)
    message = tensor_pb2.Tensor.FromString(to_tensor(array).SerializeToString())
    back = from_tensor(message)
    assert back.dtype == np.dtype(dtype) and back.shape == shape
    np.testing.assert_array_equal(back, array)


def test_non_contiguous_and_big_endian_inputs():
    array = sample(np.float32, (4, 6))[::2, 1::2]
    np.testing.assert_array_equal(from_tensor(to_tensor(array)), array)
    big = np.arange(4, dtype=">i4")
    back = from_tensor(to_tensor(big))
    assert back.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(back, big)
    np.testing.assert_array_equal(from_tensor(to_tensor(np.float64(2.5))), 2.5)


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
    (tensor(data=b"\0" * 7), "needs 8 bytes, got 7"),
    (tensor(data=b"\0" * 9), "needs 8 bytes, got 9"),
    (tensor(dtype=0), "DTYPE_UNSPECIFIED"),
    (tensor(dtype=42), "unknown wire dtype 42"),
    (tensor(shape=(2, -1), data=b""), "negative dimension"),
    (tensor(shape=(1 << 40, 1 << 20), data=b""), "the limit is"),
    (tensor(shape=(1,) * 33, data=b"\0" * 4), "at most 32"),
])
def test_malformed_tensors_are_rejected(bad, message):
    with pytest.raises(InvalidTensorError, match=message):
        from_tensor(bad)
    if "got" not in message:
        with pytest.raises(InvalidTensorError, match=message):
            decode([frame(bad)])


def test_max_bytes_bound():
    with pytest.raises(InvalidTensorError, match="limit is 4"):
        from_tensor(tensor(), max_bytes=4)
    with pytest.raises(InvalidTensorError, match="limit is 4"):
        decode([frame(tensor())], max_bytes=4)


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
