"""The Adam family, steps from moving averages of the gradient and of its square: Adam,
Adamax, Nadam, FTML and LAMB."""
from __future__ import annotations

import functools
import math

import numpy as np

from ..backend import empty
from ..update.kernels import l2_norm
from ..errors import InvalidArgumentError
from .optimizer import Optimizer, _WEIGHT, _bound, _compute_dtype, _flag, _kernel, _number, _on_master, _statements
from ..lr_scheduler import LRScheduler


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

    # lazy_update is keyword-only, as SGD's.
    def __init__(self, learning_rate: float | None = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, wd: float = 0.0, rescale_grad: float = 1.0, clip_gradient: float | None = None,
                 lr_scheduler: LRScheduler | None = None, multi_precision: bool = False, *,
                 lazy_update: bool = True) -> None:
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

    def __init__(self, learning_rate: float | None = 0.002, beta1: float = 0.9, beta2: float = 0.999, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None, lr_scheduler: LRScheduler | None = None,
                 multi_precision: bool = False) -> None:
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

    def __init__(self, learning_rate: float | None = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, schedule_decay: float = 0.004, wd: float = 0.0, rescale_grad: float = 1.0,
                 clip_gradient: float | None = None, lr_scheduler: LRScheduler | None = None,
                 multi_precision: bool = False) -> None:
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

    def __init__(self, learning_rate: float | None = None, beta1: float = 0.6, beta2: float = 0.999,
                 epsilon: float = 1e-8, wd: float = 0.0, rescale_grad: float = 1.0, clip_gradient: float | None = None,
                 lr_scheduler: LRScheduler | None = None, multi_precision: bool = False) -> None:
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
    (:func:`tensorkv.update.kernels.l2_norm`, with the squares summed in float64: MXNet's CPU sums
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

    def __init__(self, learning_rate: float | None = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-6, lower_bound: float | None = None, upper_bound: float | None = None,
                 bias_correction: bool = True, wd: float = 0.0, rescale_grad: float = 1.0,
                 clip_gradient: float | None = None, lr_scheduler: LRScheduler | None = None,
                 multi_precision: bool = False) -> None:
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
