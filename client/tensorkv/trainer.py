"""A Trainer after MXNet's ``gluon.Trainer``: each training step pushes every gradient in
one list push and pulls every weight back in place in one list pull, through any KVStore.

The optimizer runs in the store (on the servers of a dist store), as gluon's
``update_on_kvstore``. Keys are the parameter names. NumPy or CuPy parameters take their
gradients from ``step(grads={name: gradient})``; torch parameters from their ``.grad``.

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
"""
import math
import numbers
from collections.abc import Mapping

from .backend import is_array
from .errors import FailedPreconditionError, InvalidArgumentError
from .kvstore import KVStore


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


class Trainer:
    """Train ``params`` through the KVStore ``kv``, as gluon's ``Trainer`` with the optimizer on
    the store.

    Parameters
    ----------
    params : dict or iterable
        ``{name: array}`` (NumPy, CuPy or torch), ``model.named_parameters()``, or
        ``model.parameters()`` (named '0', '1', ... by position). The arrays are updated in
        place; torch Parameters that require grad are written without autograd complaints.
    kv : tensorkv.KVStore
        Any store: 'local', 'device', 'dist_sync', 'dist_async'.
    optimizer : tensorkv.optimizer.Optimizer or None
        Installed on the store now with ``kv.set_optimizer``. None: the store's optimizer, set
        before with ``kv.set_optimizer`` (or kept by a resumed run), does the updates.

    The first :meth:`step` initializes every parameter's key with ``kv.init`` and pulls it back,
    so on a dist store rank 0's initial values win on every worker (as gluon's ``_init_params``;
    the first gradients are still those each worker computed with its own values).
    """

    def __init__(self, params, kv, optimizer=None):
        if not isinstance(kv, KVStore):
            raise InvalidArgumentError(f"kv must be a tensorkv KVStore, got {type(kv).__name__}")
        self._params = _named(params)
        self._kv = kv
        self._initialized = False
        self._learning_rate = None
        if optimizer is not None:
            kv.set_optimizer(optimizer)
            self._learning_rate = optimizer.learning_rate

    @property
    def learning_rate(self):
        """The learning rate given to the optimizer (a schedule's base rate) or to
        :meth:`set_learning_rate` last."""
        if self._learning_rate is None:
            raise FailedPreconditionError(
                "this Trainer's learning rate is unknown: it was given no optimizer, and set_learning_rate() "
                "has not been called")
        return self._learning_rate

    def set_learning_rate(self, lr):
        """Make ``lr`` the store's learning rate from now on, keeping the optimizer's states
        (momentum) and counts: ``kv.set_learning_rate``, on every server of a dist store. In
        ``dist_sync`` call it at the same step on every worker."""
        self._kv.set_learning_rate(lr)
        self._learning_rate = float(lr)

    def step(self, batch_size=1, grads=None, ignore_stale_grad=False):
        """One training step: push every gradient, each scaled by ``1 / batch_size``, in one
        list push (the store's optimizer updates the weights), then pull every weight back
        into its array in one list pull.

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
