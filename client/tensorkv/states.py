"""Optimizer states, on the wire and in files.

States are ``{key: (num_update, [arrays])}``, as ``optimizer.Updater.get_states()`` gives
them. On the wire (SetUpdater, GetOptimizerStates) the first message names the optimizer
and lists the keys with their number of states; the state tensors follow as frames. In a
file (``save_optimizer_states``) they are a NumPy ``.npz`` archive of raw bytes plus a
JSON header, so loading never unpickles anything.
"""
import json

import numpy as np

from . import codec
from .backend import to_host
from .errors import InvalidArgumentError, InvalidTensorError
from .v1 import tensor_pb2

FILE_FORMAT = "tensorkv.optimizer_states"
FILE_VERSION = 1
_DTYPES = {str(dtype): dtype for dtype in codec.SUPPORTED_DTYPES}


# ---- wire -------------------------------------------------------------------------------

def to_messages(message_type, name, params, states):
    """Messages of ``message_type`` (SetUpdaterRequest or GetOptimizerStatesResponse) for the
    optimizer ``name(**params)`` (empty name: none) and ``states`` {key: (num_update, [codec.Item])}."""
    first = message_type()
    first.optimizer.name = name
    first.optimizer.params.update(params)
    for key, (num_update, items) in states.items():
        codec.set_key(first.key_states.add(num_states=len(items), num_update=num_update).key, key)
    frames = codec.encode_frames([item for _, items in states.values() for item in items])
    first.states.CopyFrom(next(frames, tensor_pb2.TensorFrame()))
    yield first
    for frame in frames:
        yield message_type(states=frame)


def from_messages(messages):
    """(name, params, {key: (num_update, [codec.Item])}) from such messages; name '' when
    the stream named no optimizer."""
    first, decoder, items = None, codec.FrameDecoder(), []
    for message in messages:
        first = message if first is None else first
        items.extend(decoder.feed(message.states))
    decoder.finish()
    if first is None:
        return "", {}, {}
    return first.optimizer.name, dict(first.optimizer.params), _group(first.key_states, items)


def _group(key_states, items):
    expected = sum(state.num_states for state in key_states)
    if expected != len(items):
        raise InvalidTensorError(f"key_states announce {expected} state tensors, the stream carried {len(items)}")
    states, position = {}, 0
    for state in key_states:
        key = codec.check_key(codec.get_key(state.key))
        if key in states:
            raise InvalidArgumentError(f"key {key!r} appears twice in key_states")
        chunk = items[position:position + state.num_states]
        position += state.num_states
        for item in chunk:
            if item.key != key:
                raise InvalidTensorError(
                    f"a state tensor of key {item.key!r} arrived where the states of key {key!r} belong")
        states[key] = (state.num_update, chunk)
    return states


# ---- files ------------------------------------------------------------------------------

def save(fname, name, params, states):
    """Write the optimizer ``name(**params)`` and ``states`` {key: (num_update, [arrays])} to ``fname``."""
    header = {"format": FILE_FORMAT, "version": FILE_VERSION,
              "optimizer": {"name": name, "params": dict(params)}, "keys": []}
    arrays = {}
    for i, (key, (num_update, values)) in enumerate(states.items()):
        hosts = [to_host(value) for value in values]
        header["keys"].append({"key": key, "num_update": int(num_update),
                               "states": [{"dtype": str(a.dtype), "shape": list(a.shape)} for a in hosts]})
        for j, host in enumerate(hosts):
            arrays[f"state_{i}_{j}"] = host.reshape(-1).view(np.uint8)
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    with open(fname, "wb") as f:
        np.savez(f, **arrays)


def load(fname):
    """(name, params, {key: (num_update, [numpy arrays])}) from a file written by :func:`save`."""
    with np.load(fname, allow_pickle=False) as archive:
        header = json.loads(archive["header"].tobytes())
        if header.get("format") != FILE_FORMAT or header.get("version") != FILE_VERSION:
            raise InvalidArgumentError(f"{fname} is not a tensorkv optimizer states file (version {FILE_VERSION})")
        states = {}
        for i, entry in enumerate(header["keys"]):
            values = [archive[f"state_{i}_{j}"].view(_DTYPES[s["dtype"]]).reshape(s["shape"])
                      for j, s in enumerate(entry["states"])]
            states[codec.check_key(entry["key"])] = (entry["num_update"], values)
    optimizer = header["optimizer"]
    return optimizer["name"], optimizer["params"], states
