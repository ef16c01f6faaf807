"""Stochastic gradient descent and the optimizers built on its step: SGD, NAG, Signum
(signSGD) and LARS."""
from __future__ import annotations

from ..update.kernels import l2_norm
from ..errors import InvalidArgumentError
from .optimizer import LARS_RANGES, Optimizer, _compute_dtype, _flag, _number, _statements
from ..lr_scheduler import LRScheduler


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
    def __init__(self, learning_rate: float | None = None, momentum: float = 0.0, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None, lr_scheduler: LRScheduler | None = None,
                 multi_precision: bool = False, *, lazy_update: bool = True) -> None:
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

    # MXNet's NAG takes no lazy_update.
    def __init__(self, learning_rate: float | None = None, momentum: float = 0.0, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None, lr_scheduler: LRScheduler | None = None,
                 multi_precision: bool = False) -> None:
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

    def __init__(self, learning_rate: float | None = 0.01, momentum: float = 0.9, wd_lh: float = 0.0, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None, lr_scheduler: LRScheduler | None = None,
                 multi_precision: bool = False) -> None:
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
    (:meth:`adapted_rate`, with :func:`tensorkv.update.kernels.l2_norm`: squares summed in float64,
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

    >>> import numpy as np
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

    def __init__(self, learning_rate: float | None = None, momentum: float = 0.0, lazy_update: bool = True,
                 eta: float = 0.001, eps: float = 0.0, momentum_correction: bool = True, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None, lr_scheduler: LRScheduler | None = None,
                 multi_precision: bool = False) -> None:
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
