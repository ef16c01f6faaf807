"""The arguments of the KVStore API in every form MXNet takes them (one key or a list, one
array or a list per key, ``out`` or a return value), turned into lists of (key, [arrays])
and checked before a store sees them; and values delivered into ``out`` arrays.
"""
import numpy as np

from ..backend import is_array, shape_dtype, to_host, to_namespace, write_into
from ..errors import DtypeMismatchError, InvalidArgumentError, KeyExistsError, ShapeMismatchError, key_repr
from ..update.rowsparse import RowSparse, check_row_ids
from ..wire.codec import Item, check_key
from ..words import plural


def as_list(keys, values, what):
    """([keys], [values]) for a single key or a list of keys."""
    if isinstance(keys, (list, tuple)):
        if not isinstance(values, (list, tuple)) or len(values) != len(keys):
            count = len(values) if isinstance(values, (list, tuple)) else 1
            raise InvalidArgumentError(
                f"{what}: {plural(count, 'value')} for {plural(len(keys), 'key')}: give one value per key")
        return list(keys), list(values)
    return [keys], [values]


def given_arrays(key, value):
    """The list of arrays given for one key: one array, or a list (one per device).

    Objects that only expose ``__array__`` or ``__dlpack__`` are converted to NumPy here.
    """
    if type(value) is np.ndarray:
        return [value]
    arrays = list(value) if isinstance(value, (list, tuple)) else [value]
    if not arrays:
        raise InvalidArgumentError(f"key {key_repr(key)}: an empty list of values")
    for i, array in enumerate(arrays):
        if not is_array(array):
            raise InvalidArgumentError(
                f"key {key_repr(key)}: value of type {type(array).__name__} is not an array"
            )
        if not (hasattr(array, "shape") and hasattr(array, "dtype")):
            arrays[i] = to_host(array)
    return arrays


def check_same(key, arrays, verb, shape=None, dtype=None):
    """Check every array has the same shape and dtype (those of the first, unless given)."""
    if len(arrays) == 1 and shape is None:
        return
    if shape is None:
        shape, dtype = shape_dtype(arrays[0])
    for other in arrays:
        other_shape, other_dtype = shape_dtype(other)
        if other_dtype != dtype:
            raise DtypeMismatchError(f"key {key_repr(key)}: {verb} dtype {other_dtype} where {dtype} is expected")
        if other_shape != shape:
            raise ShapeMismatchError(f"key {key_repr(key)}: {verb} shape {other_shape} where {shape} is expected")


def row_sparse_targets(key, out, row_ids):
    """([(key, row ids)] to pull, and [(index into those, out array)] or None for out=None),
    for the call forms of MXNet's row_sparse_pull."""
    if row_ids is None:
        raise InvalidArgumentError("row_sparse_pull needs row_ids: the rows to pull")
    several = isinstance(key, (list, tuple))
    keys, outs = pull_targets(key, out)
    ids_per_key = as_list(key, row_ids, "row_sparse_pull row_ids")[1] if several else [row_ids]
    requests, deliveries = [], None if outs is None else []
    for index, (k, ids) in enumerate(zip(keys, ids_per_key)):
        targets = [None] if outs is None else outs[index]
        per_target = isinstance(ids, (list, tuple)) and ids and all(is_array(i) or isinstance(i, (list, tuple))
                                                                     for i in ids)
        if per_target and len(ids) not in (1, len(targets)):
            raise InvalidArgumentError(f"key {key_repr(k)}: {len(ids)} row id arrays for "
                                       f"{plural(len(targets), 'out array')}: give one, or one per out array")
        id_arrays = [check_row_ids(k, i) for i in ids] if per_target else [check_row_ids(k, ids)]
        first = len(requests)
        requests.extend((k, i) for i in id_arrays)
        if deliveries is not None:
            deliveries.extend((first + (j if len(id_arrays) > 1 else 0), target)
                              for j, target in enumerate(targets))
    return requests, deliveries

def init_items(key, value):
    """The :class:`Item` of each key of MXNet's init(key, value) forms, checked."""
    keys, values = as_list(key, value, "init")
    items, seen = [], set()
    for k, v in zip(keys, values):
        k = check_key(k)
        if k in seen:
            raise KeyExistsError(f"key {key_repr(k)} appears twice in one init")
        seen.add(k)
        arrays = given_arrays(k, v)
        if len(arrays) != 1:
            raise InvalidArgumentError(f"key {key_repr(k)}: init takes one array per key, got {len(arrays)}")
        items.append(Item(k, arrays[0].todense() if isinstance(arrays[0], RowSparse) else arrays[0]))
    return items

def push_pairs(key, value):
    """[(key, [arrays])] of MXNet's push(key, value) forms, the arrays of a key alike."""
    keys, values = as_list(key, value, "push")
    pairs = []
    for k, v in zip(keys, values):
        k = check_key(k)
        arrays = given_arrays(k, v)
        check_same(k, arrays, "pushed")
        pairs.append((k, arrays))
    return pairs

def pull_targets(key, out):
    """(keys, outs): ``outs`` is None for ``out=None``, else one list of arrays per key."""
    keys = [check_key(k) for k in key] if isinstance(key, (list, tuple)) else [check_key(key)]
    if out is None:
        return keys, None
    if isinstance(key, (list, tuple)):
        _, outs = as_list(key, out, "pull")
    else:
        outs = [out]
    return keys, [given_arrays(k, o) for k, o in zip(keys, outs)]

def deliver(key, keys, outs, values):
    """Write ``values`` into ``outs``, all checked before any is written; or return them.

    ``values`` come from ``_pull(keys, fresh)``: with ``fresh=True`` (``outs`` is None)
    they are new NumPy arrays the caller owns; otherwise they may alias stored memory.
    """
    if outs is None:
        return values if isinstance(key, (list, tuple)) else values[0]
    for k, targets, value in zip(keys, outs, values):
        for target in targets:
            if target is value:
                continue
            shape, dtype = shape_dtype(target)
            if shape != tuple(value.shape):
                raise ShapeMismatchError(
                    f"key {key_repr(k)}: out array of shape {shape} cannot hold the stored shape "
                    f"{tuple(value.shape)}"
                )
            if dtype != value.dtype:
                raise DtypeMismatchError(
                    f"key {key_repr(k)}: out array of dtype {dtype} does not match the stored dtype {value.dtype}"
                )
        check_writable(k, targets)
    for targets, value in zip(outs, values):
        for target in targets:
            if target is value:  # a store may have written the value into it already
                continue
            if type(target) is np.ndarray and type(value) is np.ndarray:
                np.copyto(target, value)
            else:
                write_into(target, value)
    return None


def check_writable(key, targets):
    """InvalidArgumentError when one of the NumPy arrays ``targets``, the out arrays of ``key``,
    is read-only."""
    if any(isinstance(target, np.ndarray) and not target.flags.writeable for target in targets):
        raise InvalidArgumentError(f"key {key_repr(key)}: the out array is read-only")


def write_rows(target, ids, rows):
    """``target[ids] = rows`` for an out array of the value's whole shape, of any array type."""
    module = type(target).__module__
    if isinstance(target, np.ndarray):
        target[ids] = to_host(rows)
    elif module.startswith("torch"):
        import torch
        with torch.no_grad():
            whole = torch.as_tensor(to_host(rows)).to(target.device)
            target[torch.as_tensor(ids, device=target.device)] = whole
    else:
        import cupy
        with target.device:
            target[cupy.asarray(ids)] = to_namespace(rows, cupy)
