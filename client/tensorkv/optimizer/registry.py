"""The optimizers by name: :data:`OPTIMIZERS`, and :func:`create` (how a server rebuilds
an optimizer from the wire), :func:`check` and :func:`copy`."""
from __future__ import annotations

import heapq
from typing import Any

from ..errors import InvalidArgumentError
from ..lr_scheduler import LRScheduler
from .optimizer import Optimizer
from .sgd import SGD, NAG, Signum, LARS
from .adam import Adam, Adamax, Nadam, FTML, LAMB
from .adagrad import AdaGrad, AdaDelta
from .rmsprop import RMSProp
from .ftrl import Ftrl
from .dcasgd import DCASGD


OPTIMIZERS = {cls.name: cls for cls in (SGD, NAG, Adam, Adamax, Nadam, AdaGrad, AdaDelta, RMSProp, Signum, Ftrl, FTML,
                                        LAMB, LARS, DCASGD)}


def create(name: str, lr_scheduler: LRScheduler | None = None, lr_mult: dict[Any, float] | None = None,
           wd_mult: dict[Any, float] | None = None, **params: Any) -> Optimizer:
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
