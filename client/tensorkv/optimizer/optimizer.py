"""The base of every optimizer: :class:`Optimizer` (the hyper-parameters all share, their
valid RANGES) and the helpers that turn an update's statements into one fused Kernel."""
from __future__ import annotations

import functools
import inspect
import math
import re
from typing import Any

import numpy as np

from ..backend import empty
from ..wire.codec import check_key
from ..update.kernels import Kernel, sum_into
from ..errors import FailedPreconditionError, InvalidArgumentError, key_repr
from ..lr_scheduler import LRScheduler


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
    name: str | None = None
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

    def __init__(self, learning_rate: float | None, wd: float = 0.0, rescale_grad: float = 1.0,
                 clip_gradient: float | None = None, lr_scheduler: LRScheduler | None = None,
                 multi_precision: bool = False) -> None:
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
    def parameter_names(cls) -> list[str]:
        """The names of the constructor's numeric hyper-parameters (all but ``lr_scheduler``)."""
        return [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "lr_scheduler")]

    @property
    def params(self) -> dict[str, float]:
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

    def set_learning_rate(self, lr: float) -> None:
        """Make ``lr`` the learning rate (MXNet's ``Optimizer.set_learning_rate``); refused when
        the optimizer has an ``lr_scheduler``, as in MXNet. An embedded store updates with this
        object, so its next update takes it; a server holds a copy of the optimizer, as MXNet's
        do: there, call ``kv.set_learning_rate(lr)``.

        >>> from tensorkv.optimizer import SGD
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

    def set_lr_mult(self, args_lr_mult: dict[Any, float]) -> None:
        """Make ``{key: multiplier}`` the keys' learning-rate multipliers (MXNet's
        ``Optimizer.set_lr_mult``; a key not in it keeps the optimizer's rate). A multiplier of
        0 freezes a key; with an lr_scheduler the key's rate is the schedule's times its
        multiplier. As MXNet's, a server gets the multipliers the optimizer has when
        ``kv.set_optimizer`` sends it; an embedded store reads them at each update.

        >>> from tensorkv.optimizer import SGD
        >>> sgd = SGD(learning_rate=0.1)
        >>> sgd.set_lr_mult({'embedding': 0.0, 'fc': 2.0})
        >>> sgd.learning_rate_of('fc', num_update=1), sgd.learning_rate_of('bias', num_update=1)
        (0.2, 0.1)
        """
        self.lr_mult = _multipliers("lr_mult", args_lr_mult)

    def set_wd_mult(self, args_wd_mult: dict[Any, float]) -> None:
        """Make ``{key: multiplier}`` the keys' weight-decay multipliers (MXNet's
        ``Optimizer.set_wd_mult``), e.g. 0 for the biases; a key not in it keeps ``wd``.

        >>> from tensorkv.optimizer import SGD
        >>> sgd = SGD(learning_rate=0.1, wd=0.01)
        >>> sgd.set_wd_mult({'fc_bias': 0.0})
        >>> sgd.wd_of('fc_bias'), sgd.wd_of('fc_weight')
        (0.0, 0.01)
        """
        self.wd_mult = _multipliers("wd_mult", args_wd_mult)

    def learning_rate_at(self, num_update: int) -> float:
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
        ``weight`` and every state (see :class:`tensorkv.update.kernels.Kernel`).
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
