"""Optimizer states on the wire, as SetUpdater and GetOptimizerStates carry them.

States are ``{key: (num_update, [codec.Item])}``. The first message names the optimizer and
lists the keys with their number of states and updates; the state tensors follow as
frames, key after key. (Files of states are :mod:`tensorkv.states_file`.)
"""
from . import codec
from .errors import InvalidArgumentError, InvalidTensorError, key_repr
from .v1 import tensor_pb2


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
            raise InvalidArgumentError(f"key {key_repr(key)} appears twice in key_states")
        chunk = items[position:position + state.num_states]
        position += state.num_states
        for item in chunk:
            if item.key != key:
                raise InvalidTensorError(
                    f"a state tensor of key {key_repr(item.key)} arrived where the states of key "
                    f"{key_repr(key)} belong")
        states[key] = (state.num_update, chunk)
    return states

