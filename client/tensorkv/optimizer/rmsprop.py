"""RMSProp: Tieleman & Hinton's, and Graves's (``centered=True``)."""
from __future__ import annotations

from .optimizer import Optimizer, _bound, _flag, _number, _statements
from ..lr_scheduler import LRScheduler


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

    def __init__(self, learning_rate: float | None = 0.001, gamma1: float = 0.9, gamma2: float = 0.9,
                 epsilon: float = 1e-8, centered: bool = False, clip_weights: float | None = None, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None, lr_scheduler: LRScheduler | None = None,
                 multi_precision: bool = False) -> None:
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
