"""Declarative optimizers with MXNet 1.9's argument names, defaults and update formulas.

An optimizer is data, a name and numbers (``opt.name``, ``opt.params``), so it can
travel to a server and be rebuilt there with :func:`create`. Its update is one
:class:`tensorkv.update.kernels.Kernel`: a single fused pass over weight, gradient and states on
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

The package holds a module per family, as MXNet's ``python/mxnet/optimizer/``: the base
:class:`Optimizer` (``optimizer``), ``sgd`` (SGD, NAG, Signum, LARS), ``adam`` (Adam,
Adamax, Nadam, FTML, LAMB), ``adagrad`` (AdaGrad, AdaDelta), ``rmsprop``, ``ftrl``,
``dcasgd``, ``registry`` (:func:`create` by name, :func:`check`, :func:`copy`) and
``updater`` (:class:`Updater`, :func:`get_updater`); every name is imported from here.
"""
from .optimizer import LARS_RANGES, RANGES, Optimizer, keeps_master, state_array_bytes
from .sgd import LARS, NAG, SGD, Signum
from .adam import FTML, LAMB, Adam, Adamax, Nadam
from .adagrad import AdaDelta, AdaGrad
from .rmsprop import RMSProp
from .ftrl import Ftrl
from .dcasgd import DCASGD
from .registry import OPTIMIZERS, check, copy, create
from .updater import GATHER_GROUP_BYTES, GATHER_MAX_BYTES, Updater, get_updater

__all__ = [
    "Optimizer", "SGD", "NAG", "Signum", "LARS", "Adam", "Adamax", "Nadam", "FTML", "LAMB", "AdaGrad", "AdaDelta",
    "RMSProp", "Ftrl", "DCASGD", "OPTIMIZERS", "RANGES", "LARS_RANGES", "create", "check", "copy", "Updater",
    "get_updater", "keeps_master", "state_array_bytes", "GATHER_MAX_BYTES", "GATHER_GROUP_BYTES",
]
