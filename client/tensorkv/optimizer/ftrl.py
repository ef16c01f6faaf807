"""FTRL-Proximal (Ftrl), for sparse linear models."""
from __future__ import annotations

from ..errors import InvalidArgumentError
from .optimizer import Optimizer, _number, _statements
from ..lr_scheduler import LRScheduler


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

    def __init__(self, learning_rate: float | None = 0.1, lamda1: float = 0.01, beta: float = 1.0, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None, lr_scheduler: LRScheduler | None = None,
                 multi_precision: bool = False) -> None:
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
