"""Optimizer states on the wire, as SetUpdater and GetOptimizerStates carry them.

States are ``{key: (num_update, [codec.Item])}``. The first message names the optimizer (and
its lr_scheduler) and lists the keys with their number of states and updates; the state
tensors follow as frames, key after key. (Files of states are :mod:`tensorkv.wire.states_file`.)
"""
from .. import lr_scheduler, optimizer as optimizers
from ..errors import InvalidArgumentError, InvalidTensorError, key_repr
from ..v1 import tensor_pb2
from ..words import plural
from . import codec


def to_messages(message_type, optimizer, states, chunk_bytes=None):
    """Messages of ``message_type`` (SetUpdaterRequest or GetOptimizerStatesResponse) for
    ``optimizer`` (None: none) and ``states`` {key: (num_update, [codec.Item])}, the states'
    data in frames of ``chunk_bytes`` at most (None: codec.CHUNK_BYTES)."""
    first = message_type()
    if optimizer is not None:
        set_optimizer(first.optimizer, optimizer)
    for key, (num_update, items) in states.items():
        codec.set_key(first.key_states.add(num_states=len(items), num_update=num_update).key, key)
    frames = codec.encode_frames([item for _, items in states.values() for item in items], chunk_bytes)
    first.states.CopyFrom(next(frames, tensor_pb2.TensorFrame()))
    yield first
    for frame in frames:
        yield message_type(states=frame)


def from_messages(messages):
    """(optimizer or None, {key: (num_update, [codec.Item])}) from such messages; None when
    the stream named no optimizer."""
    first, decoder, items = None, codec.FrameDecoder(), []
    for message in messages:
        first = message if first is None else first
        items.extend(decoder.feed(message.states))
    decoder.finish()
    if first is None or not first.optimizer.name:
        return None, {}
    return get_optimizer(first.optimizer), _group(first.key_states, items)


def set_optimizer(message, optimizer):
    """Fill the Optimizer ``message`` from ``optimizer``."""
    message.name = optimizer.name
    message.params.update(optimizer.params)
    for field, multipliers in ((message.lr_mult, optimizer.lr_mult), (message.wd_mult, optimizer.wd_mult)):
        for key, multiplier in multipliers.items():
            codec.set_key(field.add(multiplier=multiplier).key, key)
    schedule = optimizer.lr_scheduler
    if schedule is not None:
        message.lr_scheduler.name = schedule.name
        for name, value in schedule.params.items():
            if name == "warmup_mode":
                message.lr_scheduler.warmup_mode = value
            elif isinstance(value, list):  # MultiFactorScheduler's step
                message.lr_scheduler.steps.extend(value)
            else:
                message.lr_scheduler.params[name] = value


def get_optimizer(message):
    """The optimizer an Optimizer ``message`` describes; InvalidArgumentError naming what is wrong."""
    schedule = None
    if message.HasField("lr_scheduler"):
        params = dict(message.lr_scheduler.params, warmup_mode=message.lr_scheduler.warmup_mode or "linear")
        if message.lr_scheduler.steps:
            params["step"] = list(message.lr_scheduler.steps)
        schedule = lr_scheduler.create(message.lr_scheduler.name, **params)
    return optimizers.create(message.name, lr_scheduler=schedule, lr_mult=_multipliers(message.lr_mult, "lr_mult"),
                             wd_mult=_multipliers(message.wd_mult, "wd_mult"), **message.params)


def _multipliers(field, name):
    """``{key: multiplier}`` of a repeated KeyMultiplier ``field``; a key twice is refused."""
    multipliers = {}
    for entry in field:
        key = codec.check_key(codec.get_key(entry.key))
        if key in multipliers:
            raise InvalidArgumentError(f"key {key_repr(key)} appears twice in the optimizer's {name}")
        multipliers[key] = entry.multiplier
    return multipliers


def _group(key_states, items):
    expected = sum(state.num_states for state in key_states)
    if expected != len(items):
        raise InvalidTensorError(
            f"key_states announce {plural(expected, 'state tensor')}, the stream carried {len(items)}")
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

