"""Learning-rate schedules with MXNet 1.9's arguments, warmup and formulas
(``python/mxnet/lr_scheduler.py``), passed as ``lr_scheduler=`` to an optimizer.

A schedule is data, like an optimizer: ``sched.name`` and ``sched.params`` travel to a
server and :func:`create` rebuilds it there. The learning rate of an update is
``sched(num_update)``, where ``num_update`` is the largest number of updates applied to any
key so far, counting this one (MXNet's ``Optimizer._update_count``); a store's updater
counts them, one per key per update.

During the first ``warmup_steps`` updates (``num_update < warmup_steps``) every schedule
returns ``warmup_begin_lr + (base_lr - warmup_begin_lr) * num_update / warmup_steps``
(``warmup_mode='linear'``) or ``warmup_begin_lr`` (``'constant'``); then:

- ``FactorScheduler``: ``base_lr * factor**k``, k = ``(num_update - 1) // step``, never below
  ``stop_factor_lr``;
- ``MultiFactorScheduler``: ``base_lr * factor**k``, k = how many of ``step`` are below ``num_update``;
- ``PolyScheduler``: ``final_lr + (base_lr - final_lr) * (1 - (num_update - warmup_steps) / (max_update - warmup_steps))**pwr``;
- ``CosineScheduler``: ``final_lr + (base_lr - final_lr) * (1 + cos(pi * (num_update - warmup_steps) / (max_update - warmup_steps))) / 2``;

Poly and Cosine keep their ``max_update`` value after ``max_update``. As in MXNet, an
optimizer's ``learning_rate``, when given, replaces the schedule's ``base_lr``: the optimizer
sets ``sched.base_lr`` to it (MXNet's ``Optimizer.__init__``), and Factor and MultiFactor
decay from it. Warmup still ends at the ``base_lr`` the schedule was made with, which it
keeps as ``warmup_final_lr``, and Poly and Cosine start from that one too (MXNet's
``base_lr_orig``); ``params`` gives it as ``base_lr``, the constructor's argument, so a
schedule rebuilt from ``params`` under the same optimizer is the same. Without a
``learning_rate`` the optimizer takes the schedule's ``base_lr``.

>>> sched = FactorScheduler(step=2, factor=0.5, base_lr=1.0)
>>> [sched(n) for n in range(1, 8)]
[1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.125]
>>> create(sched.name, **sched.params) == sched
True
"""
from __future__ import annotations

import inspect
import math
from typing import Any

from .errors import InvalidArgumentError

WARMUP_MODES = ("linear", "constant")


def _finite(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(f"lr_scheduler parameter {name}={value!r} is not a finite number")
    return float(value)


def _count(name, value, low):
    """``value`` as an int of at least ``low``; a whole float (as a proto double carries it) is accepted."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < low:
        raise InvalidArgumentError(f"lr_scheduler parameter {name}={value!r} must be a whole number >= {low}")
    return int(value)


class LRScheduler:
    """Base class: the warmup every schedule shares.

    Parameters
    ----------
    base_lr : float, default 0.01
        The learning rate after warmup (where the decay starts).
    warmup_steps : int, default 0
        The number of warmup updates.
    warmup_begin_lr : float, default 0
        The learning rate warmup starts from; at most ``base_lr``.
    warmup_mode : {'linear', 'constant'}
        Rise from ``warmup_begin_lr`` to ``base_lr`` in equal steps, or stay at ``warmup_begin_lr``.
    """

    name: str | None = None

    def __init__(self, base_lr: float = 0.01, warmup_steps: int = 0, warmup_begin_lr: float = 0.0,
                 warmup_mode: str = "linear") -> None:
        self.base_lr = _finite("base_lr", base_lr)
        self.warmup_final_lr = self.base_lr  # base_lr as given; an optimizer may replace base_lr
        self.warmup_steps = _count("warmup_steps", warmup_steps, 0)
        self.warmup_begin_lr = _finite("warmup_begin_lr", warmup_begin_lr)
        if self.warmup_begin_lr > self.warmup_final_lr:
            raise InvalidArgumentError(
                f"lr_scheduler warmup_begin_lr={self.warmup_begin_lr:g} is above base_lr={self.warmup_final_lr:g}")
        if warmup_mode not in WARMUP_MODES:
            raise InvalidArgumentError(f"lr_scheduler warmup_mode={warmup_mode!r}: use one of {', '.join(WARMUP_MODES)}")
        self.warmup_mode = warmup_mode

    @property
    def params(self) -> dict[str, Any]:
        """Every constructor argument by name, as given: numbers, MultiFactor's ``step`` list,
        ``warmup_mode``; ``base_lr`` is the one the schedule was made with (``warmup_final_lr``)."""
        names = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        return {name: getattr(self, "warmup_final_lr" if name == "base_lr" else name) for name in names}

    def __eq__(self, other):
        return isinstance(other, LRScheduler) and (self.name, self.params) == (other.name, other.params)

    def __repr__(self):
        """The arguments, with ``base_lr`` as it is now; ``warmup_final_lr`` after them when an
        optimizer replaced ``base_lr`` and the one given still counts (warmup, Poly, Cosine)."""
        args = dict(self.params, base_lr=self.base_lr)
        if self.base_lr != self.warmup_final_lr and (self.warmup_steps or isinstance(self, _ToMaxUpdate)):
            args["warmup_final_lr"] = self.warmup_final_lr
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in args.items())})"

    def __call__(self, num_update: int) -> float:
        """The learning rate of the update that makes ``num_update`` (see the module's docstring)."""
        return self.at(num_update, self.base_lr)

    def at(self, num_update: int, base_lr: float) -> float:
        """The learning rate at ``num_update`` when ``base_lr`` (an optimizer's learning_rate)
        replaced this schedule's, as MXNet's optimizer does."""
        if num_update < self.warmup_steps:
            if self.warmup_mode == "constant":
                return self.warmup_begin_lr
            return self.warmup_begin_lr + (self.warmup_final_lr - self.warmup_begin_lr) * float(num_update) / float(
                self.warmup_steps)
        return self._decayed(num_update, base_lr)

    def _decayed(self, num_update, base_lr):
        raise NotImplementedError


class FactorScheduler(LRScheduler):
    """``base_lr`` times ``factor`` every ``step`` updates, not below ``stop_factor_lr``.

    >>> [FactorScheduler(step=3, factor=0.5, base_lr=1.0, warmup_steps=2)(n) for n in range(8)]
    [0.0, 0.5, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25]
    """

    name = "factor"

    def __init__(self, step: int, factor: float = 1.0, stop_factor_lr: float = 1e-8, base_lr: float = 0.01,
                 warmup_steps: int = 0, warmup_begin_lr: float = 0.0, warmup_mode: str = "linear") -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self.step = _count("step", step, 1)
        self.factor = _finite("factor", factor)
        if self.factor > 1:
            raise InvalidArgumentError(f"lr_scheduler factor={self.factor:g} must be at most 1 to make lr reduce")
        self.stop_factor_lr = _finite("stop_factor_lr", stop_factor_lr)
        self._memo = (None, 0, None)  # (base_lr, decays, rate): the last rate, to continue from

    def _decayed(self, num_update, base_lr):
        decays = max(0, (num_update - 1) // self.step)
        memo_base, done, rate = self._memo
        if memo_base != base_lr or done > decays:
            done, rate = 0, base_lr
        # One multiplication at a time, clamped each time, as MXNet's loop: the same floats.
        while done < decays:
            decayed = rate * self.factor
            if decayed < self.stop_factor_lr:
                decayed = self.stop_factor_lr
            done += 1
            if decayed == rate:  # at stop_factor_lr (or 0): no later decay changes it
                done = decays
            rate = decayed
        self._memo = (base_lr, done, rate)
        return rate


class MultiFactorScheduler(LRScheduler):
    """``base_lr`` times ``factor`` once each update count of ``step`` (increasing) is passed.

    >>> [MultiFactorScheduler(step=[2, 4], factor=0.1, base_lr=1.0)(n) for n in range(1, 7)]
    [1.0, 1.0, 0.1, 0.1, 0.010000000000000002, 0.010000000000000002]
    """

    name = "multifactor"

    def __init__(self, step: list[int], factor: float = 1.0, base_lr: float = 0.01, warmup_steps: int = 0,
                 warmup_begin_lr: float = 0.0, warmup_mode: str = "linear") -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        if not isinstance(step, (list, tuple)) or not step:
            raise InvalidArgumentError(f"lr_scheduler step={step!r} must be a non-empty list of update counts")
        self.step = [_count("step", s, 1) for s in step]
        if any(b <= a for a, b in zip(self.step, self.step[1:])):
            raise InvalidArgumentError(f"lr_scheduler step={self.step} must be increasing")
        self.factor = _finite("factor", factor)
        if self.factor > 1:
            raise InvalidArgumentError(f"lr_scheduler factor={self.factor:g} must be at most 1 to make lr reduce")

    def _decayed(self, num_update, base_lr):
        rate = base_lr
        for step in self.step:
            if num_update <= step:
                break
            rate *= self.factor
        return rate


class _ToMaxUpdate(LRScheduler):
    """A decay from ``base_lr`` at the end of warmup to ``final_lr`` at ``max_update``."""

    def __init__(self, max_update: int, base_lr: float, final_lr: float, warmup_steps: int, warmup_begin_lr: float,
                 warmup_mode: str) -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self.max_update = _count("max_update", max_update, 1)
        if self.max_update <= self.warmup_steps:
            raise InvalidArgumentError(
                f"lr_scheduler max_update={self.max_update} must be above warmup_steps={self.warmup_steps}")
        self.final_lr = _finite("final_lr", final_lr)

    @property
    def base_lr_orig(self):
        """The ``base_lr`` the decay starts from: the one given, whatever an optimizer set (MXNet's name)."""
        return self.warmup_final_lr

    def _decayed(self, num_update, base_lr):
        return self._rate(min(num_update, self.max_update) - self.warmup_steps, self.max_update - self.warmup_steps)


class PolyScheduler(_ToMaxUpdate):
    """A polynomial of power ``pwr`` from ``base_lr`` down to ``final_lr`` at ``max_update``.

    >>> [PolyScheduler(max_update=4, base_lr=1.0, pwr=2)(n) for n in range(6)]
    [1.0, 0.5625, 0.25, 0.0625, 0.0, 0.0]
    """

    name = "poly"

    def __init__(self, max_update: int, base_lr: float = 0.01, pwr: float = 2, final_lr: float = 0.0,
                 warmup_steps: int = 0, warmup_begin_lr: float = 0.0, warmup_mode: str = "linear") -> None:
        super().__init__(max_update, base_lr, final_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self.pwr = _finite("pwr", pwr)

    def _rate(self, done, total):
        # MXNet's expression, operation for operation: the same floats.
        return self.final_lr + (self.base_lr_orig - self.final_lr) * pow(1 - float(done) / float(total), self.pwr)


class CosineScheduler(_ToMaxUpdate):
    """Half a cosine from ``base_lr`` down to ``final_lr`` at ``max_update``.

    >>> [round(CosineScheduler(max_update=4, base_lr=1.0)(n), 6) for n in range(6)]
    [1.0, 0.853553, 0.5, 0.146447, 0.0, 0.0]
    """

    name = "cosine"

    def __init__(self, max_update: int, base_lr: float = 0.01, final_lr: float = 0.0, warmup_steps: int = 0,
                 warmup_begin_lr: float = 0.0, warmup_mode: str = "linear") -> None:
        super().__init__(max_update, base_lr, final_lr, warmup_steps, warmup_begin_lr, warmup_mode)

    def _rate(self, done, total):
        return self.final_lr + (self.base_lr_orig - self.final_lr) * (1 + math.cos(math.pi * done / total)) / 2


SCHEDULERS = {cls.name: cls for cls in (FactorScheduler, MultiFactorScheduler, PolyScheduler, CosineScheduler)}


def create(name: str, **params: Any) -> LRScheduler:
    """The schedule called ``name`` with arguments ``params``: how a server rebuilds one.

    >>> create('poly', max_update=10, base_lr=0.1)
    PolyScheduler(max_update=10, base_lr=0.1, pwr=2.0, final_lr=0.0, warmup_steps=0, warmup_begin_lr=0.0, warmup_mode='linear')
    """
    cls = SCHEDULERS.get(str(name).lower())
    if cls is None:
        raise InvalidArgumentError(f"unknown lr_scheduler {name!r}; use one of {', '.join(SCHEDULERS)}")
    names = list(inspect.signature(cls.__init__).parameters)[1:]
    unknown = sorted(set(params) - set(names))
    if unknown:
        raise InvalidArgumentError(
            f"lr_scheduler {cls.name!r} has no parameter {', '.join(unknown)}; its parameters are {', '.join(names)}")
    try:
        return cls(**params)
    except TypeError as error:  # a required argument is missing
        raise InvalidArgumentError(f"lr_scheduler {cls.name!r}: {error}") from None
