"""Row-sparse values on the wire: RowSparseValue, RowIds and the RowSparsePull and
RowSparsePush messages (plain protobuf messages: rows are few, so no stream of frames). A
worker's row_sparse_pull travels on its Session stream where it can
(SESSION_OP_ROW_SPARSE_PULL: the row ids and the rows as entries, large rows on the data
channel), else in these messages."""
import numpy as np

from ..backend import to_host
from ..errors import InvalidTensorError, key_repr
from . import codec


def set_value(message, key, shape, row_ids, rows):
    """Fill the RowSparseValue ``message``: ``rows`` (an array) are rows ``row_ids`` of ``key``'s
    value of ``shape``."""
    rows = to_host(rows)
    codec.set_key(message.key, key)
    message.shape.extend(shape)
    message.row_ids.extend(np.asarray(row_ids, np.int64).tolist())
    message.rows.dtype = codec.wire_dtype(rows.dtype)
    message.rows.shape.extend(rows.shape)
    message.rows.data = rows.tobytes()
    return message


def get_value(message, max_key_bytes=None):
    """(key, full shape, row ids as int64, rows as a read-only NumPy array) of a RowSparseValue;
    InvalidTensorError for rows that do not match their ids and shape."""
    key = codec.get_key(message.key)
    if max_key_bytes is not None:
        codec.check_key_bytes(key, max_key_bytes)
    shape, _ = codec.check_shape(message.shape)
    row_ids = np.array(message.row_ids, np.int64)
    dtype = codec.numpy_dtype(message.rows.dtype)
    rows_shape, count = codec.check_shape(message.rows.shape)
    if not shape or rows_shape != (len(row_ids),) + shape[1:]:
        raise InvalidTensorError(f"key {key_repr(key)}: rows of shape {rows_shape} are not {len(row_ids)} rows of "
                                 f"a value of shape {shape}")
    if len(message.rows.data) != count * dtype.itemsize:
        raise InvalidTensorError(f"key {key_repr(key)}: rows of shape {rows_shape} and dtype {dtype} take "
                                 f"{count * dtype.itemsize} bytes, got {len(message.rows.data)}")
    return key, shape, row_ids, np.frombuffer(message.rows.data, dtype).reshape(rows_shape)


def set_row_ids(message, key, row_ids):
    """Fill the RowIds ``message``."""
    codec.set_key(message.key, key)
    message.row_ids.extend(np.asarray(row_ids, np.int64).tolist())
    return message
