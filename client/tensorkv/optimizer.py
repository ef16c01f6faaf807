"""Declarative optimizers with MXNet 1.9's argument names, defaults and update formulas.

An optimizer is data, a name and numbers (``opt.name``, ``opt.params``), so it can
travel to a server and be rebuilt there with :func:`create`. Its update is one
:class:`tensorkv.kernels.Kernel`: a single fused pass over weight, gradient and states on
a GPU (CuPy), the same statements as NumPy ufuncs on the host, so an embedded store and a
GPU server run the same formula (LAMB's is two, with the norms of the whole value between
them: :meth:`LAMB.update`; LARS reads its norms before its kernel: :meth:`LARS.adapted_rate`).
float16 and bfloat16 weights are updated in float32 and rounded back; optimizer states are
float32 (float64 for float64 weights). With ``multi_precision=True``, as MXNet's, a float16 or
bfloat16 weight also keeps a float32 master copy among its states: the update runs on it, and
the weight is its rounding, so updates smaller than the weight's precision add up instead of
being rounded away.

>>> import numpy as np
>>> from tensorkv import optimizer
>>> sgd = optimizer.SGD(learning_rate=0.1, momentum=0.9)
>>> sgd.params['momentum']
0.9
>>> weight, grad = np.ones(3, np.float32), np.ones(3, np.float32)
>>> state = sgd.create_state(np, weight)
>>> sgd.update(np, weight, grad, state, t=1, lr=sgd.learning_rate)
>>> print(weight)
[0.9 0.9 0.9]

With ``lr_scheduler=`` (see :mod:`tensorkv.lr_scheduler`) the learning rate of each update
comes from the schedule, at the update count MXNet uses: the largest number of updates
applied to any key so far (:class:`Updater` counts them).
"""
import functools
import heapq
import inspect
import math
import re

import numpy as np

from .backend import array_module, empty
from .codec import check_key
from .kernels import Kernel, l2_norm, sum_into
from .errors import DtypeMismatchError, FailedPreconditionError, InvalidArgumentError, ShapeMismatchError, key_repr
from .lr_scheduler import LRScheduler
from .rowsparse import Rows
from .words import plural


# The valid range of each hyper-parameter, by MXNet's name: (low, low included, high, high
# included), None for no bound. A value outside its range fails at once, in the constructor,
# on the client and on the server alike (a server rebuilds optimizers with :func:`create`),
# instead of dividing by zero or turning weights into NaN on the first push. The learning
# rate may be negative: the tutorial's ``stored += 2 * input`` is ``SGD(learning_rate=-2)``.
RANGES = {
    "learning_rate": (None, False, None, False),
    "wd": (0.0, True, None, False),
    "rescale_grad": (0.0, False, None, False),
    "clip_gradient": (0.0, False, None, False),
    "clip_weights": (0.0, False, None, False),
    "momentum": (0.0, True, 1.0, False),
    "beta1": (0.0, True, 1.0, False),
    "beta2": (0.0, True, 1.0, False),
    "gamma1": (0.0, True, 1.0, False),
    "gamma2": (0.0, True, 1.0, False),
    "epsilon": (0.0, False, None, False),
    "eps": (0.0, False, None, False),
    "wd_lh": (0.0, True, None, False),
    "rho": (0.0, True, 1.0, False),
    "lamda1": (0.0, True, None, False),
    "beta": (0.0, True, None, False),
    "schedule_decay": (0.0, True, None, False),
    "lower_bound": (0.0, False, None, False),
    "upper_bound": (0.0, False, None, False),
    "lamda": (0.0, True, None, False),
    "eta": (0.0, True, None, False),
}
# LARS's eps, MXNet's default 0, may be 0: it is added to a denominator that is positive
# wherever LARS scales the rate (the gradient's norm is).
LARS_RANGES = dict(RANGES, eps=(0.0, True, None, False))


def _range_text(low, low_in, high, high_in):
    """A range in interval notation: [0, 1), (0, inf)."""
    return (("[" if low_in else "(") + ("-inf" if low is None else f"{low:g}") + ", "
            + ("inf" if high is None else f"{high:g}") + ("]" if high_in else ")"))


def _number(name, value, ranges=RANGES):
    """``value`` as a float, checked against ``ranges[name]``; InvalidArgumentError naming the
    parameter and its range otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"optimizer parameter {name}={value!r} is not a number")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidArgumentError(f"optimizer parameter {name}={value!r} is not finite")
    low, low_in, high, high_in = ranges.get(name, (None, False, None, False))
    if (low is not None and (value < low or (value == low and not low_in))) or \
            (high is not None and (value > high or (value == high and not high_in))):
        raise InvalidArgumentError(
            f"optimizer parameter {name}={value:g} is outside its range {_range_text(low, low_in, high, high_in)}")
    return value


def _bound(name, value):
    """A clipping bound: None (no clipping) or a positive number."""
    return None if value is None else _number(name, value)


def _compute_dtype(dtype):
    """The dtype updates are computed and states kept in: float64 for float64, else float32."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _updatable(dtype):
    """Whether optimizers update values of ``dtype``: floating point ones."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype.name == "bfloat16"


def keeps_master(dtype):
    """Whether a weight of ``dtype`` keeps a float32 master copy under ``multi_precision``."""
    return np.dtype(dtype).name in ("float16", "bfloat16")


def state_array_bytes(weight):
    """The bytes of one optimizer state array for ``weight``: 0 for a dtype no optimizer updates."""
    if not _updatable(weight.dtype):
        return 0
    return _compute_dtype(weight.dtype).itemsize * math.prod(weight.shape)


class Optimizer:
    """Base class: the hyper-parameters every optimizer shares.

    Parameters
    ----------
    learning_rate : float or None
        The step size. None (where the default is None): the ``lr_scheduler``'s ``base_lr``,
        else 0.01, as MXNet's.
    wd : float, default 0
        Weight decay (L2 regularization) coefficient.
    rescale_grad : float, default 1
        The gradient is multiplied by it first, e.g. ``1.0 / batch_size``.
    clip_gradient : float or None, default None
        Clip the (rescaled) gradient into ``[-clip_gradient, clip_gradient]``.
    lr_scheduler : tensorkv.lr_scheduler.LRScheduler or None, default None
        The learning rate of each update comes from it. ``learning_rate`` replaces its
        ``base_lr``, as in MXNet: the optimizer sets ``lr_scheduler.base_lr`` to it (see
        :mod:`tensorkv.lr_scheduler`). It is not in ``params``.
    multi_precision : bool, default False
        A float16 or bfloat16 weight keeps a float32 master copy, its first state: the
        update runs on the copy and the weight is its rounding (MXNet's, for float16). In
        ``params`` (as 1.0) only when True.
    """

    name = None
    # Whether the update is element-wise, so that Updater.update_each may run the values of
    # several keys as one array; False where it reads norms of the whole value (LAMB).
    elementwise = True
    # Whether a row-sparse push updates only its rows and their states (MXNet's lazy_update);
    # False: it updates the whole value with the dense gradient it stands for, as MXNet's
    # optimizers without a row-sparse update do.
    lazy_update = True
    # Flags left out of ``params`` at these values, so that the wire and states files carry
    # what they did before the flag existed.
    _UNSENT = {"multi_precision": False}

    def __init__(self, learning_rate, wd=0.0, rescale_grad=1.0, clip_gradient=None, lr_scheduler=None,
                 multi_precision=False):
        if lr_scheduler is not None and not isinstance(lr_scheduler, LRScheduler):
            raise InvalidArgumentError(
                f"lr_scheduler must be a tensorkv.lr_scheduler schedule, got {type(lr_scheduler).__name__}")
        if learning_rate is None:
            learning_rate = lr_scheduler.base_lr if lr_scheduler is not None else 0.01
        self.learning_rate = _number("learning_rate", learning_rate)
        if lr_scheduler is not None:
            lr_scheduler.base_lr = self.learning_rate  # MXNet's Optimizer.__init__ does the same
        self.wd = _number("wd", wd)
        self.rescale_grad = _number("rescale_grad", rescale_grad)
        self.clip_gradient = _bound("clip_gradient", clip_gradient)
        self.lr_scheduler = lr_scheduler
        self.multi_precision = _flag("multi_precision", multi_precision)
        self.lr_mult = {}
        self.wd_mult = {}
        # The largest number of updates of any key by an Updater of this object (MXNet's
        # num_update): an embedded store's, or a Trainer's; a server updates with its own copy.
        self.num_update = 0

    @classmethod
    def parameter_names(cls):
        """The names of the constructor's numeric hyper-parameters (all but ``lr_scheduler``)."""
        return [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "lr_scheduler")]

    @property
    def params(self):
        """All hyper-parameters as ``{name: float}``; bounds left at None are omitted, and so are
        ``multi_precision`` when False and SGD's and Adam's ``lazy_update`` when True."""
        values = {name: getattr(self, name) for name in self.parameter_names()}
        return {name: float(value) for name, value in values.items()
                if value is not None and not (name in self._UNSENT and value == self._UNSENT[name])}

    def __eq__(self, other):
        return isinstance(other, Optimizer) and \
            (self.name, self.params, self.lr_scheduler, self.lr_mult, self.wd_mult) == \
            (other.name, other.params, other.lr_scheduler, other.lr_mult, other.wd_mult)

    def __repr__(self):
        args = [f"{k}={v!r}" for k, v in self.params.items()]
        if self.lr_scheduler is not None:
            args.append(f"lr_scheduler={self.lr_scheduler!r}")
        return f"{type(self).__name__}({', '.join(args)})"

    def set_learning_rate(self, lr):
        """Make ``lr`` the learning rate (MXNet's ``Optimizer.set_learning_rate``); refused when
        the optimizer has an ``lr_scheduler``, as in MXNet. An embedded store updates with this
        object, so its next update takes it; a server holds a copy of the optimizer, as MXNet's
        do: there, call ``kv.set_learning_rate(lr)``.

        >>> sgd = SGD(learning_rate=0.1)
        >>> sgd.set_learning_rate(0.5)
        >>> sgd.learning_rate
        0.5
        """
        if self.lr_scheduler is not None:
            raise FailedPreconditionError(
                f"the optimizer has an lr_scheduler ({self.lr_scheduler!r}): its learning rate comes from the schedule "
                "and set_learning_rate cannot change it, as in MXNet")
        self.learning_rate = _number("learning_rate", lr)

    def set_lr_mult(self, args_lr_mult):
        """Make ``{key: multiplier}`` the keys' learning-rate multipliers (MXNet's
        ``Optimizer.set_lr_mult``; a key not in it keeps the optimizer's rate). A multiplier of
        0 freezes a key; with an lr_scheduler the key's rate is the schedule's times its
        multiplier. As MXNet's, a server gets the multipliers the optimizer has when
        ``kv.set_optimizer`` sends it; an embedded store reads them at each update.

        >>> sgd = SGD(learning_rate=0.1)
        >>> sgd.set_lr_mult({'embedding': 0.0, 'fc': 2.0})
        >>> sgd.learning_rate_of('fc', num_update=1), sgd.learning_rate_of('bias', num_update=1)
        (0.2, 0.1)
        """
        self.lr_mult = _multipliers("lr_mult", args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        """Make ``{key: multiplier}`` the keys' weight-decay multipliers (MXNet's
        ``Optimizer.set_wd_mult``), e.g. 0 for the biases; a key not in it keeps ``wd``.

        >>> sgd = SGD(learning_rate=0.1, wd=0.01)
        >>> sgd.set_wd_mult({'fc_bias': 0.0})
        >>> sgd.wd_of('fc_bias'), sgd.wd_of('fc_weight')
        (0.0, 0.01)
        """
        self.wd_mult = _multipliers("wd_mult", args_wd_mult)

    def learning_rate_at(self, num_update):
        """The learning rate of an update when the largest update count of any key is ``num_update``."""
        if self.lr_scheduler is None:
            return self.learning_rate
        return self.lr_scheduler.at(num_update, self.learning_rate)

    def learning_rate_of(self, key, num_update):
        """The learning rate of an update of ``key`` (MXNet's ``Optimizer._get_lr``): the rate
        at ``num_update`` times the key's multiplier."""
        return self.learning_rate_at(num_update) * self.lr_mult.get(key, 1.0)

    def wd_of(self, key):
        """The weight decay of ``key`` (MXNet's ``Optimizer._get_wd``): ``wd`` times its multiplier."""
        return self.wd * self.wd_mult.get(key, 1.0)

    def adapted_rate(self, xp, key, weight, grad, lr, wd):
        """The learning rate the update of ``key`` runs at, given the whole ``weight`` and the
        pushed ``grad`` before it (the Updater asks before every update): ``lr`` itself, but
        for :class:`LARS`, which scales it by their norms."""
        return lr

    def state_names(self):
        """The names of the per-key state arrays the update keeps, in the order
        :meth:`create_state` returns them (after the master copy, when there is one)."""
        return ()

    def _keeps_master(self, dtype):
        return self.multi_precision and keeps_master(dtype)

    def states_per_value(self, dtype):
        """How many state arrays a weight of ``dtype`` keeps: :meth:`state_names`, and its master copy."""
        return len(self.state_names()) + self._keeps_master(dtype)

    def create_state(self, xp, weight):
        """The tuple of state arrays for ``weight``: zeros, after a float32 copy of ``weight``
        when it keeps a master copy; empty when the update needs none."""
        dtype = _compute_dtype(weight.dtype)
        states = tuple(xp.zeros(weight.shape, dtype) for _ in self.state_names())
        if not self._keeps_master(weight.dtype):
            return states
        master = empty(xp, weight.shape, np.float32)
        sum_into(master, [weight])
        return (master,) + states

    def step(self, t, lr, wd):
        """(statements, {scalar: value}) of the update, for this key's ``t``-th update at
        learning rate ``lr`` and weight decay ``wd`` (see :meth:`learning_rate_of`, :meth:`wd_of`).

        The statements read ``grad``, ``weight``, the states and the scalars, and assign
        ``weight`` and every state (see :class:`tensorkv.kernels.Kernel`).
        """
        raise NotImplementedError

    def update(self, xp, weight, grad, state, t, lr, wd=None):
        """Update ``weight`` and ``state`` in place from ``grad`` at learning rate ``lr`` and
        weight decay ``wd`` (None: ``self.wd``); ``t`` counts this key's updates from 1. One
        fused kernel on a GPU; ``grad`` may be wider than ``weight`` (the float32 sum of float16
        pushes)."""
        kernel, names, scalars = self.kernel(weight.dtype, t, lr, wd)
        arrays = dict(zip(names, state), weight=weight, grad=grad)
        kernel(arrays, scalars, _compute_dtype(weight.dtype))

    def kernel(self, dtype, t, lr, wd=None):
        """(the Kernel, the names of its state arrays in order, its scalars) of the ``t``-th
        update at ``lr`` and ``wd`` (None: ``self.wd``) of a weight of ``dtype``."""
        body, scalars = self.step(t, lr, self.wd if wd is None else wd)
        names = self.state_names()
        if self._keeps_master(dtype):
            body, names = _on_master(body), ("master",) + names
        return _kernel(self.name, ("grad",), ("weight",) + names, tuple(scalars), body), names, scalars

    # ---- helpers for subclasses ---------------------------------------------------------

    def _gradient(self, with_wd=False):
        """The statements computing ``g``: rescaled (plus ``wd * weight``), then clipped."""
        lines = ["g = rescale_grad * grad + wd * weight" if with_wd else "g = rescale_grad * grad"]
        if self.clip_gradient is not None:
            lines.append("g = clip(g, clip_gradient)")
        return lines

    def _scalars(self, wd, **more):
        scalars = {"rescale_grad": self.rescale_grad, "wd": wd}
        if self.clip_gradient is not None:
            scalars["clip_gradient"] = self.clip_gradient
        scalars.update(more)
        return scalars


_WEIGHT = re.compile(r"\bweight\b")


def _multipliers(name, multipliers):
    """``{key: float}`` from a mapping of keys to finite numbers; InvalidArgumentError naming the key otherwise."""
    if not isinstance(multipliers, dict):
        raise InvalidArgumentError(f"{name} must be a dict of key to multiplier, got {type(multipliers).__name__}")
    return {check_key(key): _number(f"{name} of key {key_repr(key)}", value) for key, value in multipliers.items()}


def _flag(name, value):
    """A boolean hyper-parameter, given as a bool or (from the wire) as 1.0 / 0.0."""
    return value if isinstance(value, bool) else bool(_number(name, value))


def _on_master(body):
    """The statements ``body`` run on the master copy instead of the weight, which becomes
    the copy's rounding."""
    return _WEIGHT.sub("master", body) + "\nweight = master"


@functools.lru_cache(maxsize=None)
def _kernel(name, inputs, outputs, scalars, body):
    """One Kernel per update text: compiled once per dtype, shared by every optimizer."""
    return Kernel(name, inputs, outputs, scalars, body)


def _statements(*lines):
    return "\n".join(lines)


class SGD(Optimizer):
    """Stochastic gradient descent with momentum and weight decay (MXNet's ``multi_sgd_update``
    / ``multi_sgd_mom_update``, which MXNet's store runs for SGD)::

        g = clip(rescale_grad * grad, clip_gradient)
        mom = momentum * mom - lr * wd * weight - lr * g    (mom is 0 before it when momentum is 0)
        weight = weight + mom

    Without clipping, ``lr * g`` is ``(lr * rescale_grad) * grad``, as in MXNet's kernel.
    ``lazy_update`` (MXNet's, default True): a row-sparse push updates its rows and their
    momentum only; False: the whole value, as the dense gradient it stands for would (weight
    decay and momentum reach every row).

    >>> sgd = SGD(learning_rate=0.1, momentum=0.9, wd=0.0, rescale_grad=1.0)
    >>> sgd.name, sgd.params['learning_rate']
    ('sgd', 0.1)
    >>> SGD(lazy_update=False).params['lazy_update']
    0.0
    """

    name = "sgd"
    _UNSENT = dict(Optimizer._UNSENT, lazy_update=True)

    # lazy_update is keyword-only: added after wd and the rest, it leaves their positions as they were.
    def __init__(self, learning_rate=None, momentum=0.0, wd=0.0, rescale_grad=1.0, clip_gradient=None,
                 lr_scheduler=None, multi_precision=False, *, lazy_update=True):
        super().__init__(learning_rate, wd, rescale_grad, clip_gradient, lr_scheduler, multi_precision)
        self.momentum = _number("momentum", momentum)
        self.lazy_update = _flag("lazy_update", lazy_update)

    def state_names(self):
        return ("mom",) if self.momentum != 0 else ()

    def step(self, t, lr, wd):
        if self.momentum == 0:  # MXNet's weight + (0 - a - b), which rounds as weight - (a + b)
            return f"weight = weight - (lr * wd * weight + {self._scaled_gradient()})", self._scalars(wd, lr=lr)
        return _statements(f"mom = momentum * mom - lr * wd * weight - {self._scaled_gradient()}",
                           "weight = weight + mom"), self._scalars(wd, lr=lr, momentum=self.momentum)

    def _scaled_gradient(self):
        """``lr`` times the gradient, in the order of MXNet's SGD kernels' operations."""
        if self.clip_gradient is None:
            return "lr * rescale_grad * grad"
        return "lr * clip(rescale_grad * grad, clip_gradient)"


class Adam(Optimizer):
    """Adam (MXNet's ``adam_update`` with the bias correction folded into the step)::

        g = clip(rescale_grad * grad + wd * weight, clip_gradient)
        mean = beta1 * mean + (1 - beta1) * g
        var = beta2 * var + (1 - beta2) * g**2
        lr_t = learning_rate * sqrt(1 - beta2**t) / (1 - beta1**t)
        weight = weight - lr_t * mean / (sqrt(var) + epsilon)

    ``lazy_update`` as SGD's: False makes a row-sparse push update the whole value and its states.

    >>> Adam().params
    {'learning_rate': 0.001, 'beta1': 0.9, 'beta2': 0.999, 'epsilon': 1e-08, 'wd': 0.0, 'rescale_grad': 1.0}
    """

    name = "adam"
    _UNSENT = dict(Optimizer._UNSENT, lazy_update=True)

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0,
                 rescale_grad=1.0, clip_gradient=None, lr_scheduler=None,
                 multi_precision=False, *, lazy_update=True):  # keyword-only, as SGD's
        super().__init__(learning_rate, wd, rescale_grad, clip_gradient, lr_scheduler, multi_precision)
        self.lazy_update = _flag("lazy_update", lazy_update)
        self.beta1 = _number("beta1", beta1)
        self.beta2 = _number("beta2", beta2)
        self.epsilon = _number("epsilon", epsilon)

    def state_names(self):
        return ("mean", "var")

    def step(self, t, lr, wd):
        lr_t = lr * (math.sqrt(1 - self.beta2 ** t) / (1 - self.beta1 ** t))  # grouped as MXNet does
        return _statements(
            *self._gradient(with_wd=True),
            "mean = beta1 * mean + (1 - beta1) * g",  # 1 - beta1 in the kernel's dtype, as MXNet's adam_update
            "var = beta2 * var + (1 - beta2) * g * g",
            "weight = weight - lr_t * mean / (sqrt(var) + epsilon)",
        ), self._scalars(wd, beta1=self.beta1, beta2=self.beta2, lr_t=lr_t, epsilon=self.epsilon)


class AdaGrad(Optimizer):
    """AdaGrad (MXNet's dense update)::

        g = clip(rescale_grad * grad, clip_gradient)
        history = history + g**2
        weight = weight - lr * (g / sqrt(history + eps) + wd * weight)

    MXNet calls the stability constant ``eps`` here, not ``epsilon``.

    >>> AdaGrad(eps=1e-7).params['eps']
    1e-07
    """

    name = "adagrad"

    def __init__(self, learning_rate=None, eps=1e-7, wd=0.0, rescale_grad=1.0, clip_gradient=None, lr_scheduler=None,
                 multi_precision=False):
        super().__init__(learning_rate, wd, rescale_grad, clip_gradient, lr_scheduler, multi_precision)
        self.eps = _number("eps", eps)

    def state_names(self):
        return ("history",)

    def step(self, t, lr, wd):
        return _statements(
            *self._gradient(),
            "history = history + g * g",
            "weight = weight - lr * (g / sqrt(history + eps) + wd * weight)",
        ), self._scalars(wd, lr=lr, eps=self.eps)


class RMSProp(Optimizer):
    """RMSProp: Tieleman & Hinton's (``centered=False``, MXNet's ``rmsprop_update``) or
    Graves's (``centered=True``, ``rmspropalex_update``)::

        g = clip(rescale_grad * grad + wd * weight, clip_gradient)
        n = (1 - gamma1) * g**2 + gamma1 * n
        centered=False: weight = weight - lr * g / sqrt(n + epsilon)
        centered=True:  s = (1 - gamma1) * g + gamma1 * s
                        delta = gamma2 * delta - lr * g / sqrt(n - s**2 + epsilon)
                        weight = weight + delta
        weight = clip(weight, clip_weights)

    ``centered`` travels as 1.0 / 0.0 in ``params``.

    >>> RMSProp(centered=True).params['centered']
    1.0
    """

    name = "rmsprop"

    def __init__(self, learning_rate=0.001, gamma1=0.9, gamma2=0.9, epsilon=1e-8, centered=False,
                 clip_weights=None, wd=0.0, rescale_grad=1.0, clip_gradient=None, lr_scheduler=None,
                 multi_precision=False):
        super().__init__(learning_rate, wd, rescale_grad, clip_gradient, lr_scheduler, multi_precision)
        self.gamma1 = _number("gamma1", gamma1)
        self.gamma2 = _number("gamma2", gamma2)
        self.epsilon = _number("epsilon", epsilon)
        self.centered = _flag("centered", centered)
        self.clip_weights = _bound("clip_weights", clip_weights)

    def state_names(self):
        return ("n", "mean", "delta") if self.centered else ("n",)

    def step(self, t, lr, wd):
        # the operations grouped as in MXNet's rmspropalex_update / rmsprop_update, 1 - gamma1 in
        # the kernel's dtype as there, so that the numbers are MXNet's
        lines = self._gradient(with_wd=True)
        scalars = self._scalars(wd, lr=lr, gamma1=self.gamma1, epsilon=self.epsilon)
        if self.centered:
            lines += ["n = (1 - gamma1) * g * g + gamma1 * n",
                      "mean = (1 - gamma1) * g + gamma1 * mean",
                      "delta = gamma2 * delta - lr * g / sqrt(n - mean * mean + epsilon)",
                      "weight = weight + delta"]
            scalars["gamma2"] = self.gamma2
        else:
            lines += ["n = (1 - gamma1) * (g * g) + gamma1 * n",
                      "weight = weight - lr * (g / sqrt(n + epsilon))"]
        if self.clip_weights is not None:
            lines.append("weight = clip(weight, clip_weights)")
            scalars["clip_weights"] = self.clip_weights
        return _statements(*lines), scalars


class Signum(Optimizer):
    """Signum, or signSGD when ``momentum`` is 0 (MXNet's ``signum_update`` / ``signsgd_update``)::

        momentum != 0:  mom = momentum * mom - (1 - momentum) * (wd * weight + clip(rescale_grad * grad, clip_gradient))
                        weight = (1 - lr * wd_lh) * weight + lr * sign(mom)
        momentum == 0:  weight = (1 - lr * wd) * weight - lr * sign(grad)

    As in MXNet, signSGD takes no ``wd_lh`` (and its sign ignores rescaling and clipping).

    >>> Signum().params['momentum']
    0.9
    """

    name = "signum"

    def __init__(self, learning_rate=0.01, momentum=0.9, wd_lh=0.0, wd=0.0, rescale_grad=1.0, clip_gradient=None,
                 lr_scheduler=None, multi_precision=False):
        super().__init__(learning_rate, wd, rescale_grad, clip_gradient, lr_scheduler, multi_precision)
        self.momentum = _number("momentum", momentum)
        self.wd_lh = _number("wd_lh", wd_lh)
        if self.momentum == 0 and self.wd_lh != 0:
            raise InvalidArgumentError("signum with momentum=0 is MXNet's signsgd_update, which has no wd_lh")

    def state_names(self):
        return ("mom",) if self.momentum != 0 else ()

    def step(self, t, lr, wd):
        if self.momentum == 0:
            return "weight = keep * weight - lr * sign(grad)", {"lr": lr, "keep": 1 - lr * wd}
        return _statements(
            *self._gradient(),
            "mom = momentum * mom - one_minus_momentum * (wd * weight + g)",
            "weight = keep * weight + lr * sign(mom)",
        ), self._scalars(wd, lr=lr, momentum=self.momentum, one_minus_momentum=1 - self.momentum,
                         keep=1 - lr * self.wd_lh)


class NAG(SGD):
    """Nesterov accelerated gradient (MXNet's ``nag_mom_update``; with ``momentum`` 0 it is
    SGD's ``sgd_update``)::

        g = clip(rescale_grad * grad, clip_gradient)
        mom = momentum * mom
        weight = weight - mom + (momentum + 1) * (mom - lr * (g + wd * weight))
        mom = mom - lr * (g + wd * weight)

    The last line reads the weight just updated, as MXNet 1.9's kernel does (it writes the
    weight in place before it updates the momentum), so that the numbers are MXNet's.

    >>> NAG(momentum=0.9).state_names()
    ('mom',)
    """

    name = "nag"

    def __init__(self, learning_rate=None, momentum=0.0, wd=0.0, rescale_grad=1.0, clip_gradient=None,
                 lr_scheduler=None, multi_precision=False):  # MXNet's NAG takes no lazy_update
        super().__init__(learning_rate, momentum, wd=wd, rescale_grad=rescale_grad, clip_gradient=clip_gradient,
                         lr_scheduler=lr_scheduler, multi_precision=multi_precision)

    def step(self, t, lr, wd):
        if self.momentum == 0:  # MXNet's sgd_update: not the kernel SGD's store runs
            return f"weight = (1 - lr * wd) * weight - {self._scaled_gradient()}", self._scalars(wd, lr=lr)
        return _statements(
            *self._gradient(),
            "mom = momentum * mom",
            "weight = weight - mom + (momentum + 1) * (mom - lr * (g + wd * weight))",
            "mom = mom - lr * (g + wd * weight)",
        ), self._scalars(wd, lr=lr, momentum=self.momentum)


class AdaDelta(Optimizer):
    """AdaDelta (MXNet's; it uses no learning rate)::

        g = clip(rescale_grad * grad, clip_gradient)
        acc_g = rho * acc_g + (1 - rho) * g**2
        delta = sqrt(acc_delta + epsilon) / sqrt(acc_g + epsilon) * g
        acc_delta = rho * acc_delta + (1 - rho) * delta**2
        weight = weight - (delta + wd * weight)

    >>> AdaDelta().params['rho']
    0.9
    """

    name = "adadelta"

    def __init__(self, learning_rate=None, rho=0.9, epsilon=1e-5, wd=0.0, rescale_grad=1.0, clip_gradient=None,
                 lr_scheduler=None, multi_precision=False):
        super().__init__(learning_rate, wd, rescale_grad, clip_gradient, lr_scheduler, multi_precision)
        self.rho = _number("rho", rho)
        self.epsilon = _number("epsilon", epsilon)

    def state_names(self):
        return ("acc_g", "acc_delta")

    def step(self, t, lr, wd):
        return _statements(
            *self._gradient(),
            "acc_g = rho * acc_g + one_minus_rho * g * g",
            "delta = sqrt(acc_delta + epsilon) / sqrt(acc_g + epsilon) * g",
            "acc_delta = rho * acc_delta + one_minus_rho * delta * delta",
            "weight = weight - (delta + wd * weight)",
        ), self._scalars(wd, rho=self.rho, one_minus_rho=1 - self.rho, epsilon=self.epsilon)


class Adamax(Optimizer):
    """AdaMax, Adam on the infinity norm (MXNet's)::

        g = clip(rescale_grad * grad + wd * weight, clip_gradient)
        m = beta1 * m + (1 - beta1) * g
        u = maximum(beta2 * u, abs(g))
        weight = weight - lr / (1 - beta1**t) * m / u

    >>> Adamax().params['learning_rate']
    0.002
    """

    name = "adamax"

    def __init__(self, learning_rate=0.002, beta1=0.9, beta2=0.999, wd=0.0, rescale_grad=1.0, clip_gradient=None,
                 lr_scheduler=None, multi_precision=False):
        super().__init__(learning_rate, wd, rescale_grad, clip_gradient, lr_scheduler, multi_precision)
        self.beta1 = _number("beta1", beta1)
        self.beta2 = _number("beta2", beta2)

    def state_names(self):
        return ("mean", "norm")

    def step(self, t, lr, wd):
        return _statements(
            *self._gradient(with_wd=True),
            "mean = beta1 * mean + one_minus_beta1 * g",
            "norm = maximum(beta2 * norm, abs(g))",
            "weight = weight - lr_t * mean / norm",
        ), self._scalars(wd, beta1=self.beta1, one_minus_beta1=1 - self.beta1, beta2=self.beta2,
                         lr_t=lr / (1 - self.beta1 ** t))


class Nadam(Optimizer):
    """Adam with Nesterov momentum (MXNet's), whose momentum warms up by ``schedule_decay``::

        g = clip(rescale_grad * grad + wd * weight, clip_gradient)
        mu_t = beta1 * (1 - 0.5 * 0.96**(t * schedule_decay))
        schedule = mu_1 * ... * mu_t
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        m_bar = (1 - mu_t) * g / (1 - schedule) + mu_(t+1) * m / (1 - schedule * mu_(t+1))
        weight = weight - lr * m_bar / (sqrt(v / (1 - beta2**t)) + epsilon)

    MXNet keeps one ``schedule`` for the whole optimizer, which every key's update
    advances; here each key has its own (the paper's, and MXNet's for a single key).

    >>> Nadam().params['schedule_decay']
    0.004
    """

    name = "nadam"

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, schedule_decay=0.004, wd=0.0,
                 rescale_grad=1.0, clip_gradient=None, lr_scheduler=None, multi_precision=False):
        super().__init__(learning_rate, wd, rescale_grad, clip_gradient, lr_scheduler, multi_precision)
        self.beta1 = _number("beta1", beta1)
        self.beta2 = _number("beta2", beta2)
        self.epsilon = _number("epsilon", epsilon)
        self.schedule_decay = _number("schedule_decay", schedule_decay)

    def state_names(self):
        return ("mean", "var")

    def _momentum(self, t):
        return self.beta1 * (1.0 - 0.5 * 0.96 ** (t * self.schedule_decay))

    def step(self, t, lr, wd):
        schedule = _momentum_schedule(self.beta1, self.schedule_decay, t)
        momentum, momentum_next = self._momentum(t), self._momentum(t + 1)
        return _statements(
            *self._gradient(with_wd=True),
            "mean = beta1 * mean + one_minus_beta1 * g",
            "var = beta2 * var + one_minus_beta2 * g * g",
            "m_bar = one_minus_momentum * (g / one_minus_schedule) + momentum_next * (mean / one_minus_schedule_next)",
            "weight = weight - lr * m_bar / (sqrt(var / one_minus_beta2_t) + epsilon)",
        ), self._scalars(wd, beta1=self.beta1, one_minus_beta1=1 - self.beta1, beta2=self.beta2,
                         one_minus_beta2=1 - self.beta2, one_minus_momentum=1 - momentum,
                         one_minus_schedule=1 - schedule, momentum_next=momentum_next,
                         one_minus_schedule_next=1 - schedule * momentum_next, one_minus_beta2_t=1 - self.beta2 ** t,
                         lr=lr, epsilon=self.epsilon)


@functools.lru_cache(maxsize=16)
def _schedules(beta1, schedule_decay):
    """Nadam's products mu_1 * ... * mu_t for t = 0, 1, ..., as MXNet multiplies them, up to
    where one is too small to change ``1 - product`` (the product of every later t is 0 then)."""
    products, product, t = [1.0], 1.0, 0
    while product > 1e-17 and t < 10_000_000:
        t += 1
        product *= beta1 * (1.0 - 0.5 * 0.96 ** (t * schedule_decay))
        products.append(product)
    return products


def _momentum_schedule(beta1, schedule_decay, t):
    products = _schedules(beta1, schedule_decay)
    return products[t] if t < len(products) else 0.0


class Ftrl(Optimizer):
    """FTRL-Proximal (MXNet's ``ftrl_update``), for sparse linear models::

        g = clip(rescale_grad * grad, clip_gradient)
        z = z + g - (sqrt(n + g**2) - sqrt(n)) * weight / lr
        n = n + g**2
        weight = (sign(z) * lamda1 - z) / ((beta + sqrt(n)) / lr + wd) * (abs(z) > lamda1)

    >>> Ftrl().params['learning_rate'], Ftrl().params['lamda1']
    (0.1, 0.01)
    """

    name = "ftrl"

    def __init__(self, learning_rate=0.1, lamda1=0.01, beta=1.0, wd=0.0, rescale_grad=1.0, clip_gradient=None,
                 lr_scheduler=None, multi_precision=False):
        super().__init__(learning_rate, wd, rescale_grad, clip_gradient, lr_scheduler, multi_precision)
        if self.learning_rate == 0:
            raise InvalidArgumentError("optimizer parameter learning_rate=0 is outside ftrl's range: it divides by it")
        self.lamda1 = _number("lamda1", lamda1)
        self.beta = _number("beta", beta)

    def state_names(self):
        return ("z", "n")

    def step(self, t, lr, wd):
        return _statements(
            *self._gradient(),
            "z = z + (g - (sqrt(n + g * g) - sqrt(n)) * weight / lr)",
            "n = n + g * g",
            "weight = (sign(z) * lamda1 - z) / ((beta + sqrt(n)) / lr + wd) * above(abs(z), lamda1)",
        ), self._scalars(wd, lr=lr, lamda1=self.lamda1, beta=self.beta)


class FTML(Optimizer):
    """Follow the Moving Leader (MXNet's ``ftml_update``)::

        g = clip(rescale_grad * grad + wd * weight, clip_gradient)
        v = beta2 * v + (1 - beta2) * g**2
        d_t = (1 - beta1**t) / lr * (sqrt(v / (1 - beta2**t)) + epsilon)
        z = beta1 * z + (1 - beta1) * g - (d_t - beta1 * d) * weight
        d = d_t
        weight = -z / d_t

    >>> FTML().params['beta1']
    0.6
    """

    name = "ftml"

    def __init__(self, learning_rate=None, beta1=0.6, beta2=0.999, epsilon=1e-8, wd=0.0, rescale_grad=1.0,
                 clip_gradient=None, lr_scheduler=None, multi_precision=False):
        super().__init__(learning_rate, wd, rescale_grad, clip_gradient, lr_scheduler, multi_precision)
        if self.learning_rate == 0:
            raise InvalidArgumentError("optimizer parameter learning_rate=0 is outside ftml's range: it divides by it")
        self.beta1 = _number("beta1", beta1)
        self.beta2 = _number("beta2", beta2)
        self.epsilon = _number("epsilon", epsilon)

    def state_names(self):
        return ("d", "v", "z")

    def step(self, t, lr, wd):
        return _statements(
            *self._gradient(with_wd=True),
            "v = beta2 * v + (1 - beta2) * (g * g)",
            "d_t = (1 - beta1_t) / lr * (sqrt(v / (1 - beta2_t)) + epsilon)",
            "z = beta1 * z + (1 - beta1) * g - (d_t - beta1 * d) * weight",
            "d = d_t",
            "weight = -z / d_t",
        ), self._scalars(wd, lr=lr, beta1=self.beta1, beta2=self.beta2, beta1_t=_power32(self.beta1, t),
                         beta2_t=_power32(self.beta2, t), epsilon=self.epsilon)


def _power32(base, t):
    """``base**t`` in float32, as MXNet's FTML kernel computes it from its float32 parameters;
    the kernel takes ``1 -`` it in its own dtype (in double, the update differs in its last bits)."""
    return float(np.float32(base) ** np.float32(t))


class LAMB(Optimizer):
    """LAMB, layer-wise adaptive moments (MXNet's, as its Updater runs it:
    ``multi_lamb_update``): Adam's direction, then a step scaled by the trust ratio of the
    weight's norm to the direction's::

        g = clip(rescale_grad * grad, clip_gradient)
        mean = beta1 * mean + (1 - beta1) * g
        var = beta2 * var + (1 - beta2) * g**2
        bias_correction:  mean, var = mean / (1 - beta1**t), var / (1 - beta2**t)  (for the direction only)
        direction = mean / (sqrt(var) + epsilon) + wd * weight
        r1 = min(max(norm(weight), lower_bound), upper_bound)
        r2 = norm(direction)
        weight = weight - lr * (r1 / r2) * direction     (lr alone where r1 or r2 is 0)

    The norms are L2 norms of the whole value, a reduction between two element-wise passes
    (:func:`tensorkv.kernels.l2_norm`, with the squares summed in float64: MXNet's CPU sums
    them in float32, which can differ in the norm's last bit). With ``multi_precision``,
    ``r1`` is the norm of the float16 weight, as in MXNet. So a key is updated on its own, and a
    row-sparse push updates all of the value, as MXNet's dense-only LAMB does. With several
    servers, a value split into slices (``bigarray_bound``) is updated with each slice's
    norms, as MXNet's dist store updates its slices. ``bias_correction`` travels as 1.0 / 0.0
    in ``params``.

    >>> LAMB(lower_bound=0.1, bias_correction=False).params['bias_correction']
    0.0
    """

    name = "lamb"
    elementwise = False
    lazy_update = False

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-6, lower_bound=None,
                 upper_bound=None, bias_correction=True, wd=0.0, rescale_grad=1.0, clip_gradient=None,
                 lr_scheduler=None, multi_precision=False):
        super().__init__(learning_rate, wd, rescale_grad, clip_gradient, lr_scheduler, multi_precision)
        self.beta1 = _number("beta1", beta1)
        self.beta2 = _number("beta2", beta2)
        self.epsilon = _number("epsilon", epsilon)
        self.lower_bound = _bound("lower_bound", lower_bound)
        self.upper_bound = _bound("upper_bound", upper_bound)
        self.bias_correction = _flag("bias_correction", bias_correction)

    def state_names(self):
        return ("mean", "var")

    def update(self, xp, weight, grad, state, t, lr, wd=None):
        """The first pass (moments and direction), the two norms, then the step."""
        compute = _compute_dtype(weight.dtype)
        names = ("master",) * self._keeps_master(weight.dtype) + self.state_names()
        arrays = dict(zip(names, state), weight=weight, grad=grad, direction=empty(xp, weight.shape, compute))
        kernel, scalars = self.direction_kernel(weight.dtype, t, self.wd if wd is None else wd)
        kernel(arrays, scalars, compute)
        # r1 is the weight's norm, not its master copy's, as in MXNet's multi_mp_lamb_update.
        trusted = self.trust_lr(compute, lr, l2_norm(xp, weight), l2_norm(xp, arrays["direction"]))
        kernel, scalars = self.step_kernel(weight.dtype, trusted)
        kernel(arrays, scalars, compute)

    def direction_kernel(self, dtype, t, wd):
        """(Kernel, scalars) of the first pass at weight decay ``wd``: it updates ``mean`` and
        ``var`` and writes ``direction``."""
        lines = [*self._gradient(), "mean = beta1 * mean + (1 - beta1) * g", "var = beta2 * var + (1 - beta2) * g * g"]
        scalars = self._scalars(wd, beta1=self.beta1, beta2=self.beta2, epsilon=self.epsilon)
        mean, var = "mean", "var"
        if self.bias_correction:
            lines += ["mean_hat = mean / (1 - beta1_t)", "var_hat = var / (1 - beta2_t)"]
            mean, var = "mean_hat", "var_hat"
            scalars.update(beta1_t=_power32(self.beta1, t), beta2_t=_power32(self.beta2, t))
        # MXNet's kernel (multi_lamb_update, which its Updater runs) takes the double sqrt of a
        # float: the rest of its expression is computed in double.
        lines += ["decay = wd * weight", f"direction = wide({mean} / (sqrt({var}) + epsilon) + decay)"]
        body, weight = _statements(*lines), "weight"
        if self._keeps_master(dtype):
            body, weight = _WEIGHT.sub("master", body), "master"
        return _kernel(f"{self.name}_direction", ("grad", weight), ("mean", "var", "direction"), tuple(scalars),
                       body), scalars

    def trust_lr(self, compute, lr, r1, r2):
        """``lr`` scaled by the trust ratio of the norms ``r1`` (the weight's) and ``r2`` (the
        direction's), computed in the ``compute`` dtype as MXNet's phase-2 kernel does."""
        number = compute.type
        lr, r1, r2 = number(lr), number(r1), number(r2)
        if self.lower_bound is not None:
            r1 = max(r1, number(self.lower_bound))
        if self.upper_bound is not None:
            r1 = min(r1, number(self.upper_bound))
        return float(lr if r1 == 0 or r2 == 0 else lr * (r1 / r2))

    def step_kernel(self, dtype, lr):
        """(Kernel, scalars) of the second pass: the step along ``direction`` at the trusted ``lr``."""
        body, outputs = "weight = weight - lr * direction", ("weight",)
        if self._keeps_master(dtype):
            body, outputs = _on_master(body), ("weight", "master")
        return _kernel(self.name, ("direction",), outputs, ("lr",), body), {"lr": lr}


class LARS(SGD):
    """LARS, layer-wise adaptive rate scaling (MXNet's, as its Updater runs it: ``multi_sum_sq``,
    ``multi_lars``, then SGD's ``multi_sgd_mom_update``): SGD at a learning rate scaled, key by
    key, by the norm of the weight over the norm of the gradient::

        w_norm, g_norm = norm(weight), rescale_grad * norm(grad)
        lr = lr * eta * w_norm / (g_norm + wd * w_norm + eps)   (lr alone where w_norm or g_norm
                                                                 is 0, or str(key) ends in gamma,
                                                                 beta or bias)
        momentum_correction:  momentum = momentum * lr_at(t) / lr_at(t - 1)
        then SGD's update at that lr and momentum

    The norms are of the whole value and of the raw pushed gradient, read before the update
    (:meth:`adapted_rate`, with :func:`tensorkv.kernels.l2_norm`: squares summed in float64,
    where MXNet's CPU sums them in float32, which can differ in the norm's last bit), and the
    rate is computed in float32 as MXNet's ``multi_lars`` does (float64 for float64 weights).
    With ``multi_precision``, the norms are of the float16 weight, as in MXNet. With
    ``lazy_update`` a row-sparse push updates its rows only, at the rate from the whole
    weight's norm and its rows' norm, as MXNet's does.

    ``momentum_correction`` scales the momentum by the change of the schedule between a key's
    previous update and this one, ``lr_at(t) / lr_at(t - 1)`` at the key's own update count
    ``t``, so each key's momentum is corrected once for each change, whichever keys a server
    updates. MXNet keeps one last learning rate for the whole optimizer: only the first key
    it updates after a change is corrected. For a single key the two agree, but for a rate
    set by ``set_learning_rate``, which MXNet corrects for and this does not (the schedule
    alone says how the rate changed). Flags travel as 1.0 / 0.0 in ``params``.

    >>> lars = LARS(learning_rate=0.1, momentum=0.9, eta=0.01)
    >>> lars.params['eta'], lars.params['lazy_update'], lars.params['momentum_correction']
    (0.01, 1.0, 1.0)
    >>> lars.adapted_rate(np, 'fc_weight', np.full(4, 3.0), np.full(4, 4.0), lr=0.1, wd=0.0)
    0.00075
    >>> lars.adapted_rate(np, 'fc_bias', np.full(4, 3.0), np.full(4, 4.0), lr=0.1, wd=0.0)
    0.1
    """

    name = "lars"
    elementwise = False
    _UNSENT = Optimizer._UNSENT  # lazy_update always travels, as it did

    def __init__(self, learning_rate=None, momentum=0.0, lazy_update=True, eta=0.001, eps=0.0,
                 momentum_correction=True, wd=0.0, rescale_grad=1.0, clip_gradient=None, lr_scheduler=None,
                 multi_precision=False):
        super().__init__(learning_rate, momentum, wd, rescale_grad, clip_gradient, lr_scheduler, multi_precision,
                         lazy_update=lazy_update)
        self.eta = _number("eta", eta)
        self.eps = _number("eps", eps, LARS_RANGES)
        self.momentum_correction = _flag("momentum_correction", momentum_correction)

    def adapted_rate(self, xp, key, weight, grad, lr, wd):
        if str(key).endswith(("gamma", "beta", "bias")):
            return lr
        return self.scaled_rate(_compute_dtype(weight.dtype), lr, wd, l2_norm(xp, weight), l2_norm(xp, grad))

    def scaled_rate(self, compute, lr, wd, w_norm, g_norm):
        """``lr`` scaled by the norms ``w_norm`` (the weight's) and ``g_norm`` (the raw gradient's),
        computed in the ``compute`` dtype in the order of MXNet's ``multi_lars``."""
        number = compute.type
        lr, wd, w_norm, g_norm = number(lr), number(wd), number(w_norm), number(g_norm)
        if not (w_norm > 0 and g_norm > 0):
            return float(lr)
        return float(lr * number(self.eta) * w_norm
                     / (g_norm * number(self.rescale_grad) + wd * w_norm + number(self.eps)))

    def momentum_at(self, t):
        """The momentum of a key's ``t``-th update (see ``momentum_correction`` above)."""
        last = self.learning_rate_at(t - 1)
        if not self.momentum_correction or t == 1 or last == 0:
            return self.momentum
        return self.momentum * (self.learning_rate_at(t) / last)

    def step(self, t, lr, wd):
        statements, scalars = super().step(t, lr, wd)
        if "momentum" in scalars:
            scalars["momentum"] = self.momentum_at(t)
        return statements, scalars


class DCASGD(Optimizer):
    """Delay-compensated asynchronous SGD (MXNet's ``DCASGD``): the gradient is corrected by
    how far the weight moved since the previous update, kept as a state::

        g = clip(rescale_grad * grad, clip_gradient)
        step = -lr * (g + wd * weight + lamda * g * g * (weight - previous))
        momentum != 0:  mom = momentum * mom + step;  step = mom
        previous = weight
        weight = weight + step

    The ``previous`` state starts as a copy of the weight. MXNet 1.9.1's DCASGD with a
    ``momentum`` other than 0 raises inside its update (it tests an array's truth) and the
    weight never changes; here it is the formula above.

    >>> DCASGD(momentum=0.9).state_names()
    ('mom', 'previous')
    """

    name = "dcasgd"
    lazy_update = False

    def __init__(self, learning_rate=None, momentum=0.0, lamda=0.04, wd=0.0, rescale_grad=1.0, clip_gradient=None,
                 lr_scheduler=None, multi_precision=False):
        super().__init__(learning_rate, wd, rescale_grad, clip_gradient, lr_scheduler, multi_precision)
        self.momentum = _number("momentum", momentum)
        self.lamda = _number("lamda", lamda)

    def state_names(self):
        return ("mom", "previous") if self.momentum != 0 else ("previous",)

    def create_state(self, xp, weight):
        states = super().create_state(xp, weight)
        sum_into(states[-1], [weight])
        return states

    def step(self, t, lr, wd):
        step = "-lr * (g + wd * weight + lamda * g * g * (weight - previous))"
        lines = [f"mom = momentum * mom + {step}", "previous = weight", "weight = weight + mom"] \
            if self.momentum != 0 else [f"step = {step}", "previous = weight", "weight = weight + step"]
        scalars = self._scalars(wd, lr=lr, lamda=self.lamda)
        if self.momentum != 0:
            scalars["momentum"] = self.momentum
        return _statements(*self._gradient(), *lines), scalars


OPTIMIZERS = {cls.name: cls for cls in (SGD, NAG, Adam, Adamax, Nadam, AdaGrad, AdaDelta, RMSProp, Signum, Ftrl, FTML,
                                        LAMB, LARS, DCASGD)}


def create(name, lr_scheduler=None, lr_mult=None, wd_mult=None, **params):
    """The optimizer called ``name`` (case-insensitive) with hyper-parameters ``params`` (and
    the keys' multipliers, as :meth:`Optimizer.set_lr_mult` and :meth:`Optimizer.set_wd_mult`).

    This is how a server rebuilds an optimizer from ``(opt.name, opt.params, opt.lr_scheduler,
    opt.lr_mult, opt.wd_mult)``.

    >>> create('adam', learning_rate=0.01)
    Adam(learning_rate=0.01, beta1=0.9, beta2=0.999, epsilon=1e-08, wd=0.0, rescale_grad=1.0)
    """
    cls = OPTIMIZERS.get(str(name).lower())
    if cls is None:
        raise InvalidArgumentError(f"unknown optimizer {_shown([name])!r}; use one of {', '.join(OPTIMIZERS)}")
    unknown = set(params) - set(cls.parameter_names())
    if unknown:
        raise InvalidArgumentError(
            f"optimizer {cls.name!r} has no parameter {_shown(unknown)}; "
            f"its parameters are {', '.join(cls.parameter_names())}"
        )
    optimizer = cls(**params, lr_scheduler=lr_scheduler)
    optimizer.set_lr_mult(lr_mult or {})
    optimizer.set_wd_mult(wd_mult or {})
    return optimizer


def get_updater(optimizer):
    """An :class:`Updater` applying ``optimizer`` (MXNet's ``mx.optimizer.get_updater``):
    ``updater(key, grad, weight)``, or lists of each, updates the weights in place and counts
    the updates in ``optimizer.num_update``.

    >>> sgd = SGD(learning_rate=0.5)
    >>> updater = get_updater(sgd)
    >>> w, b = np.ones(2, np.float32), np.ones(1, np.float32)
    >>> updater(['w', 'b'], [np.ones(2, np.float32), np.ones(1, np.float32)], [w, b])
    >>> updater('w', np.ones(2, np.float32), w)
    >>> print(w, b, sgd.num_update)
    [0. 0.] [0.5] 2
    """
    return Updater(optimizer)


def check(optimizer, what):
    """``optimizer`` when it is an :class:`Optimizer`; else InvalidArgumentError saying, for
    ``what`` (the call), how to make one from a name, as MXNet's ``mx.optimizer.create``.

    >>> check('sgd', 'set_optimizer')
    Traceback (most recent call last):
    ...
    tensorkv.errors.InvalidArgumentError: set_optimizer takes an Optimizer object, not the name 'sgd': pass tensorkv.optimizer.create('sgd', learning_rate=...) (as MXNet's mx.optimizer.create) or tensorkv.optimizer.SGD(...)
    """
    if isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(optimizer, str):
        name, cls = _shown([optimizer]), OPTIMIZERS.get(optimizer.lower())
        if cls is None:
            raise InvalidArgumentError(
                f"{what} takes an Optimizer object, not a name, and {name!r} names no optimizer: pass "
                f"tensorkv.optimizer.create(name, learning_rate=...) with a name of {', '.join(OPTIMIZERS)}")
        raise InvalidArgumentError(
            f"{what} takes an Optimizer object, not the name {name!r}: pass tensorkv.optimizer.create({name!r}, "
            f"learning_rate=...) (as MXNet's mx.optimizer.create) or tensorkv.optimizer.{cls.__name__}(...)")
    kind = type(optimizer)
    raise InvalidArgumentError(
        f"{what} takes a tensorkv.optimizer.Optimizer, got {kind.__module__}.{kind.__qualname__}: make one with "
        "tensorkv.optimizer.create(name, learning_rate=...) or a class such as tensorkv.optimizer.SGD(...)")


def _counted(given):
    """'a list of N' or 'a TYPE' (for an error message)."""
    return f"a {type(given).__name__} of {len(given)}" if isinstance(given, (list, tuple)) else f"a {type(given).__name__}"


def copy(optimizer):
    """A new optimizer equal to ``optimizer``."""
    return create(optimizer.name, lr_scheduler=optimizer.lr_scheduler, lr_mult=optimizer.lr_mult,
                  wd_mult=optimizer.wd_mult, **optimizer.params)


def _shown(names, most=5, chars=40):
    """``names`` for an error message, however many and long they are (they may come from
    the wire): the ``most`` first in sorted order, each cut to ``chars`` characters."""
    first = heapq.nsmallest(most, map(str, names))
    shown = ", ".join(name if len(name) <= chars else name[:chars] + "..." for name in first)
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


# Updater.update_each gathers values of at most GATHER_MAX_BYTES (a larger one amortizes its
# kernel call itself), in groups of at most GATHER_GROUP_BYTES of weights (the gathered copies
# of weights, states and gradients come on top of the values).
GATHER_MAX_BYTES = 64 << 10
GATHER_GROUP_BYTES = 4 << 20


def _chunks(members):
    """``members`` (key, grad, weight, state, num_update) in runs of at most GATHER_GROUP_BYTES
    of weights (a run of one member past it)."""
    chunk, size = [], 0
    for member in members:
        nbytes = member[2].nbytes
        if chunk and size + nbytes > GATHER_GROUP_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(member)
        size += nbytes
    if chunk:
        yield chunk


class Updater:
    """Applies an optimizer to pushed values, key by key: ``updater(key, grad, weight)``.

    Holds each key's optimizer states and update count (Adam's ``t``), and their largest,
    ``num_update``, at which the optimizer's ``lr_scheduler`` gives each update's learning
    rate (MXNet's ``Optimizer._update_count``). This is what a store's engine calls when
    ``set_optimizer`` is used.

    >>> updater = Updater(SGD(learning_rate=0.5))
    >>> w = np.ones(2, np.float32)
    >>> updater('w', np.ones(2, np.float32), w)
    >>> print(w, updater.get_states()['w'][0])
    [0.5 0.5] 1
    """

    def __init__(self, optimizer):
        self.optimizer = check(optimizer, "an Updater")
        self._states = {}
        self._num_updates = {}
        self.num_update = 0

    def check(self, key, weight):
        """Raise DtypeMismatchError unless ``weight`` has a floating-point dtype the optimizer can update."""
        if not _updatable(weight.dtype):
            raise DtypeMismatchError(
                f"key {key_repr(key)}: optimizer {self.optimizer.name!r} cannot update a value of dtype {weight.dtype}"
            )

    def __call__(self, key, grad, weight):
        """Update ``weight`` in place by ``grad``; or, as MXNet's, each of lists of keys,
        gradients and weights (:meth:`update_each`)."""
        if isinstance(key, (list, tuple)):
            if not all(isinstance(given, (list, tuple)) and len(given) == len(key) for given in (grad, weight)):
                raise InvalidArgumentError(
                    f"an updater given a list of {len(key)} keys takes a list of as many gradients and one of as many "
                    f"weights, got {_counted(grad)} and {_counted(weight)}")
            self.update_each(list(zip(key, grad, weight)))
            return
        self._step(key, weight, grad,
                   lambda xp, state, t, lr, wd: self.optimizer.update(xp, weight, grad, state, t, lr, wd))

    def update_each(self, updates):
        """``self(key, grad, weight)`` for each (key, grad, weight) of ``updates``, in order, with
        the same results: on NumPy, where a kernel call costs tens of µs whatever its size, small
        values (GATHER_MAX_BYTES at most) whose updates share their scalars (``t``, learning
        rate, weight decay) and dtypes are gathered into one array per input, GATHER_GROUP_BYTES of weights at
        most, updated by one kernel call and written back. A key is counted once its update ran;
        a key given twice is updated twice, in order."""
        groups, num_update, seen = {}, self.num_update, set()
        for key, grad, weight in updates:
            if key in seen:  # its earlier update first, as one call per key would
                self._run_groups(groups)
                groups, num_update, seen = {}, self.num_update, set()
            seen.add(key)
            xp, state, t, _ = self._next(key, weight)
            num_update = max(num_update, t)  # as each earlier key's update left it
            lr, wd = self.optimizer.learning_rate_of(key, num_update), self.optimizer.wd_of(key)
            small = self.optimizer.elementwise and xp is np and weight.nbytes <= GATHER_MAX_BYTES \
                and weight.flags.c_contiguous \
                and all(array.flags.c_contiguous for array in state)
            group = (t, lr, wd, weight.dtype, grad.dtype) if small else (key,)
            groups.setdefault(group, (xp, t, lr, wd, []))[4].append((key, grad, weight, state, num_update))
        self._run_groups(groups)

    def _run_groups(self, groups):
        """Run the kernels of :meth:`update_each`'s ``groups``; count each group's keys after its
        kernel ran."""
        for xp, t, lr, wd, members in groups.values():
            for chunk in _chunks(members):
                if len(chunk) == 1:
                    key, grad, weight, state, _ = chunk[0]
                    rate = self.optimizer.adapted_rate(xp, key, weight, grad, lr, wd)
                    self.optimizer.update(xp, weight, grad, state, t, rate, wd)
                else:
                    self._update_gathered(chunk, t, lr, wd)
                for key, _, _, _, num_update in chunk:
                    self._count(key, t, max(self.num_update, num_update))

    def _update_gathered(self, members, t, lr, wd):
        """One kernel call over the (key, grad, weight, state, _) ``members`` (C-contiguous NumPy
        arrays), gathered end to end; the weights and states written back."""
        flat = [[array.reshape(-1) for array in (weight, *state)] for _, _, weight, state, _ in members]
        gathered = [np.concatenate(column) for column in zip(*flat)]
        grad = np.concatenate([grad.reshape(-1) for _, grad, _, _, _ in members])
        self.optimizer.update(np, gathered[0], grad, gathered[1:], t, lr, wd)
        start = 0
        for arrays in flat:
            end = start + arrays[0].size
            for array, updated in zip(arrays, gathered):
                array[...] = updated[start:end]
            start = end

    def update_rows(self, key, weight, shape, slice, ids, grad):
        """The lazy update (MXNet's ``lazy_update``): ``grad``, full-width rows of the distinct
        row ``ids`` of a value of ``shape``, updates only those rows of ``weight`` (the value,
        or its elements ``slice``) and of its states. It counts as one update of the key; the
        optimizer's :meth:`Optimizer.adapted_rate` sees all of ``weight`` and the rows."""
        def update(xp, state, t, lr, wd):
            views = [Rows(array, shape, slice) for array in (weight, *state)]
            gathered = [view.gather(ids) for view in views]
            self.optimizer.update(xp, gathered[0], grad, gathered[1:], t, lr, wd)
            for view, array in zip(views, gathered):
                view.scatter(ids, array)
        self._step(key, weight, grad, update)

    def _step(self, key, weight, grad, update):
        """``update(xp, state, t, lr, wd)`` for the next update of ``key`` by ``grad``, then count it."""
        xp, state, t, num_update = self._next(key, weight)
        lr, wd = self.optimizer.learning_rate_of(key, num_update), self.optimizer.wd_of(key)
        update(xp, state, t, self.optimizer.adapted_rate(xp, key, weight, grad, lr, wd), wd)
        self._count(key, t, num_update)

    def _next(self, key, weight):
        """(xp, state, t, num_update) of the next update of ``key``; its states made if it has none."""
        xp = array_module(weight)
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = self.optimizer.create_state(xp, weight)
        t = self._num_updates.get(key, 0) + 1
        return xp, state, t, max(self.num_update, t)

    def _count(self, key, t, num_update):
        self._num_updates[key] = t
        self.num_update = self.optimizer.num_update = num_update

    def set_learning_rate(self, lr):
        """Make ``lr`` the learning rate of the updates to come; states and counts stay.

        As MXNet's ``Optimizer.set_learning_rate``, refused when the optimizer has an lr_scheduler
        (set_optimizer with a new schedule starts fresh states). The optimizer given to
        set_optimizer is left as it was: a copy takes the new rate.
        """
        optimizer = copy(self.optimizer)
        optimizer.set_learning_rate(lr)
        optimizer.num_update = self.num_update
        self.optimizer = optimizer

    def check_states(self, key, weight, arrays):
        """Fresh states for ``weight`` holding copies of ``arrays``; errors name any count, shape or dtype mismatch."""
        xp = array_module(weight)
        states = self.optimizer.create_state(xp, weight)
        if len(arrays) != len(states):
            raise InvalidArgumentError(
                f"key {key_repr(key)}: optimizer {self.optimizer.name!r} keeps {plural(len(states), 'state array')}, "
                f"got {len(arrays)}"
            )
        for state, array in zip(states, arrays):
            if tuple(array.shape) != tuple(state.shape):
                raise ShapeMismatchError(
                    f"key {key_repr(key)}: state of shape {tuple(array.shape)}, expected {state.shape}")
            if array.dtype != state.dtype:
                raise DtypeMismatchError(f"key {key_repr(key)}: state of dtype {array.dtype}, expected {state.dtype}")
            state[...] = xp.asarray(array)
        return states

    def get_states(self):
        """``{key: (num_update, [state arrays])}`` for every key updated so far; the arrays are
        the live states, not copies."""
        return {key: (self._num_updates.get(key, 0), list(state)) for key, state in self._states.items()}

    def set_states(self, states):
        """Replace every key's states and update count by ``{key: (num_update, [state arrays])}``;
        the updater takes the arrays over and updates them in place."""
        self._states = {key: tuple(arrays) for key, (_, arrays) in states.items()}
        self._num_updates = {key: int(num_update) for key, (num_update, _) in states.items()}
        self.num_update = self.optimizer.num_update = max(self._num_updates.values(), default=0)
