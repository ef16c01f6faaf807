"""A Trainer after MXNet's ``gluon.Trainer``: each training step pushes every gradient in
one list push and pulls every weight back in place in one list pull, through any KVStore.

The optimizer runs in the store (on the servers of a dist store), as gluon's
``update_on_kvstore``; with ``update_on_kvstore=False`` the store sums the gradients and the
optimizer runs in each worker (``allreduce_grads()``, then ``update()``). Keys are the
parameter names. NumPy or CuPy parameters take their gradients from ``step(grads={name:
gradient})``; torch parameters from their ``.grad``. gluon's order of arguments is taken too:
``Trainer(params, 'sgd', {'learning_rate': 0.1}, kvstore=kv)``.

>>> import numpy as np, tensorkv
>>> kv = tensorkv.create('local')
>>> w = np.ones(3, np.float32)
>>> trainer = tensorkv.Trainer({'w': w}, kv, tensorkv.optimizer.SGD(learning_rate=0.1))
>>> trainer.step(grads={'w': np.full(3, 2, np.float32)})
>>> print(w)
[0.8 0.8 0.8]
>>> trainer.set_learning_rate(0.5)
>>> trainer.learning_rate
0.5
>>> gluon = tensorkv.Trainer({'b': np.ones(2, np.float32)}, 'sgd', {'learning_rate': 0.1}, kvstore='local',
...                          update_on_kvstore=False)
>>> grads = {'b': np.full(2, 30, np.float32)}
>>> gluon.allreduce_grads(grads=grads)
>>> np.clip(grads['b'], -5, 5, out=grads['b'])  # doctest: +ELLIPSIS
array(...)
>>> gluon.update(grads=grads)
>>> print(gluon.optimizer.name, gluon.optimizer.num_update, grads['b'])
sgd 1 [5. 5.]
"""
from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Iterable, Mapping
from os import PathLike
from typing import Any

import numpy as np

from ..backend import DeviceBFloat16, is_array, on_gpu, to_namespace, write_into
from ..errors import FailedPreconditionError, InvalidArgumentError, KeyNotFoundError
from ..optimizer import Optimizer, check, create, get_updater
from ..wire import states_file
from .kvstore import ArrayLike, KVStore


def _named(params):
    """{name: array} from a dict, an iterable of (name, array) pairs (``model.named_parameters()``)
    or an iterable of arrays (``model.parameters()``, named by position: '0', '1', ...)."""
    if isinstance(params, Mapping):
        pairs = list(params.items())
    else:
        pairs = [item if isinstance(item, tuple) else (str(index), item) for index, item in enumerate(params)]
    if not pairs:
        raise InvalidArgumentError("a Trainer needs at least one parameter, got none")
    named = {}
    for pair in pairs:
        if len(pair) != 2 or not isinstance(pair[0], str):
            raise InvalidArgumentError(f"parameters are given as (name, array) pairs with str names, got {pair!r}")
        name, array = pair
        if not is_array(array):
            raise InvalidArgumentError(f"parameter {name!r}: a {type(array).__name__} is not an array")
        if name in named:
            raise InvalidArgumentError(f"parameter name {name!r} is given twice; each name is a key of the store")
        named[name] = array
    return named


def _scale(batch_size):
    """1 / ``batch_size``, a positive finite number."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Real) \
            or not math.isfinite(batch_size) or batch_size <= 0:
        raise InvalidArgumentError(f"batch_size must be a positive number, got {batch_size!r}")
    return 1.0 / float(batch_size)  # a Python float: a NumPy float64 would promote float32 gradients


def _frozen(param):
    """Whether ``param`` is a torch tensor that does not require grad (a frozen parameter)."""
    return getattr(param, "requires_grad", True) is False


def _tensorkv_order(params, kv, optimizer=None, optimizer_params=None, *, compression_params=None,
                    update_on_kvstore=None):
    """Trainer(params, kv, optimizer=None, ...): the order this Trainer has always taken."""


def _gluon_order(params, optimizer, optimizer_params=None, kvstore="device", compression_params=None,
                 update_on_kvstore=None):
    """gluon.Trainer's order: the store, by name or object, is the fourth argument."""


_ORDERS = {"tensorkv": inspect.signature(_tensorkv_order), "gluon": inspect.signature(_gluon_order)}


def _arguments(params, args, kwargs):
    """{name: value} of the Trainer's arguments, in tensorkv's order (the second a KVStore, or
    given as kv=) or in gluon's (the second an optimizer or its name)."""
    second = args[0] if args else kwargs.get("kv", kwargs.get("optimizer"))
    order = "tensorkv" if "kv" in kwargs or isinstance(second, KVStore) else "gluon"
    try:
        bound = _ORDERS[order].bind(params, *args, **kwargs)
    except TypeError as error:
        raise InvalidArgumentError(
            f"Trainer{_ORDERS[order]}: {error}; the other order is "
            f"Trainer{_ORDERS['gluon' if order == 'tensorkv' else 'tensorkv']}") from None
    bound.apply_defaults()
    if order == "gluon" and not isinstance(second, (str, Optimizer)):
        raise InvalidArgumentError(
            f"Trainer takes (params, kv, optimizer=None, ...) or gluon's (params, optimizer, optimizer_params=None, "
            f"kvstore='device', ...): its second argument, a {type(second).__name__}, is neither a tensorkv KVStore "
            "nor an optimizer or its name")
    return dict(bound.arguments)


def _store(kvstore):
    """The store gluon's ``kvstore`` names (a KVStore, a type name, or None: 'local')."""
    if isinstance(kvstore, KVStore):
        return kvstore
    if kvstore is not None and not isinstance(kvstore, str):
        raise InvalidArgumentError(f"kvstore must be a tensorkv KVStore or a store type, got {type(kvstore).__name__}")
    import tensorkv
    return tensorkv.create(kvstore or "local")


def _optimizer(optimizer, optimizer_params):
    """The Optimizer given, or made by name with ``optimizer_params`` (gluon's rule: params only with a name)."""
    if isinstance(optimizer, str):
        return create(optimizer, **(optimizer_params or {}))
    if optimizer_params:
        raise InvalidArgumentError(
            "optimizer_params is for an optimizer given by name (Trainer(params, 'sgd', {'learning_rate': 0.1}, ...)); "
            "an optimizer object carries its own, as gluon asserts")
    return None if optimizer is None else check(optimizer, "Trainer")


def _namespace(param):
    """CuPy for a parameter on a GPU, else NumPy."""
    if on_gpu(param):
        import cupy
        return cupy
    return np


def _view(param):
    """``param`` as a NumPy or CuPy array, its memory where it can be (torch's through DLPack)."""
    return to_namespace(param.detach() if hasattr(param, "detach") else param, _namespace(param))


def _address(array):
    """Where the first element of a NumPy, CuPy, DeviceBFloat16 or torch array is in memory."""
    if isinstance(array, DeviceBFloat16):
        array = array.bits
    module = type(array).__module__
    if module.startswith("torch"):
        return array.data_ptr()
    if module.startswith("cupy"):
        return array.data.ptr
    return array.__array_interface__["data"][0]


class Trainer:
    """Train ``params`` through a KVStore, as gluon's ``Trainer``.

    It takes its arguments in the order it always has, ``Trainer(params, kv, optimizer=None,
    optimizer_params=None, *, compression_params=None, update_on_kvstore=None)``, or in
    gluon's, ``Trainer(params, optimizer, optimizer_params=None, kvstore='device',
    compression_params=None, update_on_kvstore=None)``: a KVStore (or ``kv=``) second means the
    first, an optimizer or its name the second.

    Parameters
    ----------
    params : dict or iterable
        ``{name: array}`` (NumPy, CuPy or torch), ``model.named_parameters()``, or
        ``model.parameters()`` (named '0', '1', ... by position). The arrays are updated in
        place; torch Parameters that require grad are written without autograd complaints.
    kv, kvstore : tensorkv.KVStore, or (gluon's ``kvstore``) a store type or None
        Any store: 'local', 'device', 'dist_sync', 'dist_async'. A type name is created with
        ``tensorkv.create`` (reading ``TENSORKV_SERVERS`` and the rest for a dist type); None
        is a 'local' store.
    optimizer : tensorkv.optimizer.Optimizer, a name, or None
        An optimizer, or a name made with ``tensorkv.optimizer.create(name, **optimizer_params)``.
        None: the store's optimizer, set before with ``kv.set_optimizer`` (or kept by a resumed
        run), does the updates.
    compression_params : dict or None
        Given to ``kv.set_gradient_compression``.
    update_on_kvstore : bool or None
        True (None: the default): the optimizer is installed on the store now and runs there (on
        the servers of a dist store). False, as gluon's: the store only sums the gradients
        (:meth:`allreduce_grads`) and the optimizer runs here on every worker
        (:meth:`update`); refused for 'dist_async', as in gluon. In that mode the servers hold
        each parameter's last gradient sum under its key, never its weights (as MXNet's do): a
        worker that joins a run going on (a replacement rank, ``if_exists='resume'``, a job's
        worker after its server restarted from a snapshot) would take gradient sums for
        weights, so train such jobs with the default.

    The first :meth:`step` (or :meth:`allreduce_grads`, :meth:`update`, :meth:`save_states`,
    :meth:`load_states`) initializes every parameter's key with ``kv.init`` and pulls it back,
    so on a dist store rank 0's initial values win on every worker (as gluon's ``_init_params``;
    the first gradients are still those each worker computed with its own values).
    """

    def __init__(self, params: Mapping[str, ArrayLike] | Iterable[Any], *args: Any, **kwargs: Any) -> None:
        arguments = _arguments(params, args, kwargs)
        optimizer = _optimizer(arguments["optimizer"], arguments["optimizer_params"])
        update_on_kvstore = arguments["update_on_kvstore"] is None or bool(arguments["update_on_kvstore"])
        self._params = _named(params)
        if not update_on_kvstore and optimizer is None:
            raise InvalidArgumentError("update_on_kvstore=False runs the optimizer here: give one")
        kv = arguments["kv"] if "kv" in arguments else _store(arguments["kvstore"])
        if not isinstance(kv, KVStore):
            raise InvalidArgumentError(f"kv must be a tensorkv KVStore, got {type(kv).__name__}")
        if not update_on_kvstore and "async" in kv.type:
            if "kvstore" in arguments and not isinstance(arguments["kvstore"], KVStore):  # made here from its name
                kv.close()
            raise InvalidArgumentError(
                "update_on_kvstore=False sums gradients in rounds, which a 'dist_async' store has not: set "
                "update_on_kvstore=True when training in async mode, as gluon says")
        self._kv = kv
        self._update_on_kvstore = update_on_kvstore
        self._initialized = False
        self._optimizer = optimizer
        self._updater = None if update_on_kvstore else get_updater(optimizer)
        self._learning_rate = None if optimizer is None else optimizer.learning_rate
        if arguments["compression_params"]:
            kv.set_gradient_compression(arguments["compression_params"])
        if optimizer is not None and update_on_kvstore:
            kv.set_optimizer(optimizer)

    @property
    def optimizer(self) -> Optimizer | None:
        """The optimizer given, or read by :meth:`load_states`; None when the store's own does the updates."""
        return self._optimizer

    @property
    def learning_rate(self) -> float:
        """The learning rate given to the optimizer (a schedule's base rate) or to
        :meth:`set_learning_rate` last."""
        if self._learning_rate is None:
            raise FailedPreconditionError(
                "this Trainer's learning rate is unknown: it was given no optimizer, and set_learning_rate() "
                "has not been called")
        return self._learning_rate

    def set_learning_rate(self, lr: float) -> None:
        """Make ``lr`` the learning rate from now on, keeping the optimizer's states (momentum)
        and counts: ``kv.set_learning_rate``, on every server of a dist store (with
        ``update_on_kvstore=False``, this worker's optimizer). In ``dist_sync`` call it at the
        same step on every worker."""
        if self._update_on_kvstore:
            self._kv.set_learning_rate(lr)
        else:
            self._updater.set_learning_rate(lr)
            self._optimizer = self._updater.optimizer
        self._learning_rate = float(lr)

    def step(self, batch_size: float = 1, grads: Mapping[str, ArrayLike] | None = None,
             ignore_stale_grad: bool = False) -> None:
        """One training step: push every gradient, each scaled by ``1 / batch_size``, in one
        list push (the store's optimizer updates the weights), then pull every weight back
        into its array in one list pull. With ``update_on_kvstore=False``:
        :meth:`allreduce_grads`, then :meth:`update`.

        ``batch_size``: as gluon's; 1 when the loss is already a mean. On a dist store the
        servers sum the workers' gradients, so ``batch_size=kv.num_workers`` with a mean loss
        averages them. The scaling is done here, on the gradients, so the store's optimizer
        keeps its ``rescale_grad`` and ``batch_size`` may change between steps.

        ``grads``: ``{name: gradient}``; None: each parameter's ``.grad`` (torch). A torch
        parameter that does not require grad is skipped. Any other parameter without a
        gradient raises FailedPreconditionError, unless ``ignore_stale_grad`` skips it too
        (in ``dist_sync`` every worker must then push the same parameters).
        """
        scale = _scale(batch_size)
        names, gradients = self._gradients(grads, ignore_stale_grad)
        if not self._update_on_kvstore:
            self._init_params()
            self._allreduce(names, gradients)
            self._update_here(names, gradients, scale)
            return
        if scale != 1.0:
            gradients = [gradient * scale for gradient in gradients]
        pulled = names
        if not self._initialized:
            pulled = list(self._params)
            self._kv.init(pulled, [self._params[name] for name in pulled])
            self._initialized = True
        if names:
            self._kv.push(names, gradients)
        if pulled:
            self._kv.pull(pulled, out=[self._params[name] for name in pulled])

    def allreduce_grads(self, grads: Mapping[str, ArrayLike] | None = None) -> None:
        """Sum every gradient over the workers in place (gluon's): one list push and one list
        pull into the gradients, ``grads`` (``{name: gradient}``) or the torch ``.grad``. Then
        transform them (clip them, say) and call :meth:`update`. Only with
        ``update_on_kvstore=False``, as in gluon."""
        self._check_here("allreduce_grads")
        names, gradients = self._gradients(grads, False)
        self._init_params()
        self._allreduce(names, gradients)

    def update(self, batch_size: float = 1, grads: Mapping[str, ArrayLike] | None = None,
               ignore_stale_grad: bool = False) -> None:
        """Apply the optimizer here to every parameter with its gradient scaled by
        ``1 / batch_size`` (gluon's), after :meth:`allreduce_grads`; ``grads`` and
        ``ignore_stale_grad`` as in :meth:`step`. Only with ``update_on_kvstore=False``."""
        self._check_here("update")
        scale = _scale(batch_size)
        names, gradients = self._gradients(grads, ignore_stale_grad)
        self._init_params()
        self._update_here(names, gradients, scale)

    def save_states(self, fname: str | PathLike[str]) -> None:
        """Write the optimizer and its states (momentum, counts) to ``fname`` (gluon's): the
        store's (``kv.save_optimizer_states``), or this worker's with ``update_on_kvstore=False``,
        in the same file format, so either kind of Trainer loads it."""
        self._init_params()
        if self._update_on_kvstore:
            self._kv.save_optimizer_states(fname)
        else:
            states_file.save(fname, self._updater.optimizer, self._updater.get_states())

    def load_states(self, fname: str | PathLike[str]) -> None:
        """Install the optimizer and states :meth:`save_states` wrote (gluon's); the Trainer's
        ``optimizer`` and ``learning_rate`` become the file's. Every key of the file must be a
        parameter of this Trainer, of the shape it had."""
        self._init_params()
        if self._update_on_kvstore:
            self._kv.load_optimizer_states(fname)
            optimizer = states_file.load(fname)[0]
        else:
            optimizer, saved = states_file.load(fname)
            updater, states = get_updater(optimizer), {}
            for key, (num_update, arrays) in saved.items():
                if key not in self._params:
                    raise KeyNotFoundError(f"{fname} holds states of key {key!r}, which this Trainer does not train")
                states[key] = (num_update, updater.check_states(key, _view(self._params[key]), arrays))
            updater.set_states(states)
            self._updater = updater
        self._optimizer, self._learning_rate = optimizer, optimizer.learning_rate

    def _check_here(self, call):
        if self._update_on_kvstore:
            raise FailedPreconditionError(
                f"{call}() is for a Trainer whose optimizer runs here: this one's runs in the store "
                "(update_on_kvstore); create it with update_on_kvstore=False, as gluon says, or call step()")

    def _init_params(self):
        """Init every parameter's key and pull it back, once (rank 0's values win)."""
        if self._initialized:
            return
        names = list(self._params)
        self._kv.init(names, [self._params[name] for name in names])
        self._kv.pull(names, out=[self._params[name] for name in names])
        self._initialized = True

    def _allreduce(self, names, gradients):
        """Push the gradients, and pull their sum over the workers back into them (the store
        assigns what it sums: it has no optimizer with update_on_kvstore=False)."""
        if names:
            self._kv.push(names, gradients)
            self._kv.pull(names, out=gradients)

    def _update_here(self, names, gradients, scale):
        """Run this Trainer's optimizer on the parameters ``names``, in place."""
        updates = []
        for name, gradient in zip(names, gradients):
            param = self._params[name]
            weight, gradient = _view(param), to_namespace(gradient, _namespace(param))
            updates.append((name, gradient * scale if scale != 1.0 else gradient, weight))
        self._updater.update_each(updates)
        for name, _, weight in updates:
            param = self._params[name]
            if _address(weight) != _address(param):  # a copy: a non-contiguous array, another device
                write_into(param, weight)

    def _gradients(self, grads, ignore_stale_grad):
        """([name], [gradient]) of the parameters to push."""
        if grads is not None:
            unknown = sorted(set(grads) - set(self._params), key=str)
            if unknown:
                raise InvalidArgumentError(
                    f"grads has {', '.join(map(repr, unknown))}, which this Trainer does not train")
        names, gradients = [], []
        for name, param in self._params.items():
            gradient = getattr(param, "grad", None) if grads is None else grads.get(name)
            if gradient is None:
                if _frozen(param) or ignore_stale_grad:
                    continue
                where = "grads has none for it" if grads is not None else \
                    "its .grad is None (backward() did not reach it), or it has no .grad: pass step(grads=...)"
                raise FailedPreconditionError(
                    f"parameter {name!r} has no gradient: {where}; step(ignore_stale_grad=True) skips such "
                    "parameters, as gluon's Trainer does")
            names.append(name)
            gradients.append(gradient)
        return names, gradients
