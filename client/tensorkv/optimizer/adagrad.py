"""Per-coordinate rates from accumulated squared gradients: AdaGrad and AdaDelta."""
from __future__ import annotations

from .optimizer import Optimizer, _number, _statements
from ..lr_scheduler import LRScheduler


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

    def __init__(self, learning_rate: float | None = None, eps: float = 1e-7, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None, lr_scheduler: LRScheduler | None = None,
                 multi_precision: bool = False) -> None:
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

    def __init__(self, learning_rate: float | None = None, rho: float = 0.9, epsilon: float = 1e-5, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None, lr_scheduler: LRScheduler | None = None,
                 multi_precision: bool = False) -> None:
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
