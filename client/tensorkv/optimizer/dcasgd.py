"""Delay-compensated asynchronous SGD (DCASGD)."""
from __future__ import annotations

from ..update.kernels import sum_into
from .optimizer import Optimizer, _number, _statements
from ..lr_scheduler import LRScheduler


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

    def __init__(self, learning_rate: float | None = None, momentum: float = 0.0, lamda: float = 0.04, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None, lr_scheduler: LRScheduler | None = None,
                 multi_precision: bool = False) -> None:
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
