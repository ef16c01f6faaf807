"""The :class:`Updater` (MXNet's ``get_updater``): applies an optimizer to pushed values,
key by key, and keeps their states and update counts."""
from __future__ import annotations

import numpy as np

from ..backend import array_module
from ..errors import DtypeMismatchError, InvalidArgumentError, ShapeMismatchError, key_repr
from ..update.rowsparse import Rows
from ..words import plural
from .optimizer import Optimizer, _updatable
from .registry import check, copy


def get_updater(optimizer: Optimizer) -> Updater:
    """An :class:`Updater` applying ``optimizer`` (MXNet's ``mx.optimizer.get_updater``):
    ``updater(key, grad, weight)``, or lists of each, updates the weights in place and counts
    the updates in ``optimizer.num_update``.

    >>> from tensorkv.optimizer import SGD
    >>> sgd = SGD(learning_rate=0.5)
    >>> updater = get_updater(sgd)
    >>> w, b = np.ones(2, np.float32), np.ones(1, np.float32)
    >>> updater(['w', 'b'], [np.ones(2, np.float32), np.ones(1, np.float32)], [w, b])
    >>> updater('w', np.ones(2, np.float32), w)
    >>> print(w, b, sgd.num_update)
    [0. 0.] [0.5] 2
    """
    return Updater(optimizer)


def _counted(given):
    """'a list of N' or 'a TYPE' (for an error message)."""
    return f"a {type(given).__name__} of {len(given)}" if isinstance(given, (list, tuple)) else f"a {type(given).__name__}"


# Updater.update_each gathers values of at most GATHER_MAX_BYTES (a larger one amortizes its
# kernel call itself), in groups of at most GATHER_GROUP_BYTES of weights (the gathered copies
# of weights, states and gradients come on top of the values).
GATHER_MAX_BYTES = 64 << 10
GATHER_GROUP_BYTES = 4 << 20


def _chunks(members):
    """``members`` (key, grad, weight, state, num_update) in runs of at most GATHER_GROUP_BYTES
    of weights (a run of one member past it)."""
    chunk, size = [], 0
    for member in members:
        nbytes = member[2].nbytes
        if chunk and size + nbytes > GATHER_GROUP_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(member)
        size += nbytes
    if chunk:
        yield chunk


class Updater:
    """Applies an optimizer to pushed values, key by key: ``updater(key, grad, weight)``.

    Holds each key's optimizer states and update count (Adam's ``t``), and their largest,
    ``num_update``, at which the optimizer's ``lr_scheduler`` gives each update's learning
    rate (MXNet's ``Optimizer._update_count``). This is what a store's engine calls when
    ``set_optimizer`` is used.

    >>> from tensorkv.optimizer import SGD
    >>> updater = Updater(SGD(learning_rate=0.5))
    >>> w = np.ones(2, np.float32)
    >>> updater('w', np.ones(2, np.float32), w)
    >>> print(w, updater.get_states()['w'][0])
    [0.5 0.5] 1
    """
    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = check(optimizer, "an Updater")
        self._states = {}
        self._num_updates = {}
        self.num_update = 0

    def check(self, key, weight):
        """Raise DtypeMismatchError unless ``weight`` has a floating-point dtype the optimizer can update."""
        if not _updatable(weight.dtype):
            raise DtypeMismatchError(
                f"key {key_repr(key)}: optimizer {self.optimizer.name!r} cannot update a value of dtype {weight.dtype}"
            )

    def __call__(self, key, grad, weight):
        """Update ``weight`` in place by ``grad``; or, as MXNet's, each of lists of keys,
        gradients and weights (:meth:`update_each`)."""
        if isinstance(key, (list, tuple)):
            if not all(isinstance(given, (list, tuple)) and len(given) == len(key) for given in (grad, weight)):
                raise InvalidArgumentError(
                    f"an updater given a list of {len(key)} keys takes a list of as many gradients and one of as many "
                    f"weights, got {_counted(grad)} and {_counted(weight)}")
            self.update_each(list(zip(key, grad, weight)))
            return
        self._step(key, weight, grad,
                   lambda xp, state, t, lr, wd: self.optimizer.update(xp, weight, grad, state, t, lr, wd))

    def update_each(self, updates):
        """``self(key, grad, weight)`` for each (key, grad, weight) of ``updates``, in order, with
        the same results: on NumPy, where a kernel call costs tens of µs whatever its size, small
        values (GATHER_MAX_BYTES at most) whose updates share their scalars (``t``, learning
        rate, weight decay) and dtypes are gathered into one array per input, GATHER_GROUP_BYTES of weights at
        most, updated by one kernel call and written back. A key is counted once its update ran;
        a key given twice is updated twice, in order."""
        groups, num_update, seen = {}, self.num_update, set()
        for key, grad, weight in updates:
            if key in seen:  # its earlier update first, as one call per key would
                self._run_groups(groups)
                groups, num_update, seen = {}, self.num_update, set()
            seen.add(key)
            xp, state, t, _ = self._next(key, weight)
            num_update = max(num_update, t)  # as each earlier key's update left it
            lr, wd = self.optimizer.learning_rate_of(key, num_update), self.optimizer.wd_of(key)
            small = self.optimizer.elementwise and xp is np and weight.nbytes <= GATHER_MAX_BYTES \
                and weight.flags.c_contiguous \
                and all(array.flags.c_contiguous for array in state)
            group = (t, lr, wd, weight.dtype, grad.dtype) if small else (key,)
            groups.setdefault(group, (xp, t, lr, wd, []))[4].append((key, grad, weight, state, num_update))
        self._run_groups(groups)

    def _run_groups(self, groups):
        """Run the kernels of :meth:`update_each`'s ``groups``; count each group's keys after its
        kernel ran."""
        for xp, t, lr, wd, members in groups.values():
            for chunk in _chunks(members):
                if len(chunk) == 1:
                    key, grad, weight, state, _ = chunk[0]
                    rate = self.optimizer.adapted_rate(xp, key, weight, grad, lr, wd)
                    self.optimizer.update(xp, weight, grad, state, t, rate, wd)
                else:
                    self._update_gathered(chunk, t, lr, wd)
                for key, _, _, _, num_update in chunk:
                    self._count(key, t, max(self.num_update, num_update))

    def _update_gathered(self, members, t, lr, wd):
        """One kernel call over the (key, grad, weight, state, _) ``members`` (C-contiguous NumPy
        arrays), gathered end to end; the weights and states written back."""
        flat = [[array.reshape(-1) for array in (weight, *state)] for _, _, weight, state, _ in members]
        gathered = [np.concatenate(column) for column in zip(*flat)]
        grad = np.concatenate([grad.reshape(-1) for _, grad, _, _, _ in members])
        self.optimizer.update(np, gathered[0], grad, gathered[1:], t, lr, wd)
        start = 0
        for arrays in flat:
            end = start + arrays[0].size
            for array, updated in zip(arrays, gathered):
                array[...] = updated[start:end]
            start = end

    def update_rows(self, key, weight, shape, slice, ids, grad):
        """The lazy update (MXNet's ``lazy_update``): ``grad``, full-width rows of the distinct
        row ``ids`` of a value of ``shape``, updates only those rows of ``weight`` (the value,
        or its elements ``slice``) and of its states. It counts as one update of the key; the
        optimizer's :meth:`Optimizer.adapted_rate` sees all of ``weight`` and the rows."""
        def update(xp, state, t, lr, wd):
            views = [Rows(array, shape, slice) for array in (weight, *state)]
            gathered = [view.gather(ids) for view in views]
            self.optimizer.update(xp, gathered[0], grad, gathered[1:], t, lr, wd)
            for view, array in zip(views, gathered):
                view.scatter(ids, array)
        self._step(key, weight, grad, update)

    def _step(self, key, weight, grad, update):
        """``update(xp, state, t, lr, wd)`` for the next update of ``key`` by ``grad``, then count it."""
        xp, state, t, num_update = self._next(key, weight)
        lr, wd = self.optimizer.learning_rate_of(key, num_update), self.optimizer.wd_of(key)
        update(xp, state, t, self.optimizer.adapted_rate(xp, key, weight, grad, lr, wd), wd)
        self._count(key, t, num_update)

    def _next(self, key, weight):
        """(xp, state, t, num_update) of the next update of ``key``; its states made if it has none."""
        xp = array_module(weight)
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = self.optimizer.create_state(xp, weight)
        t = self._num_updates.get(key, 0) + 1
        return xp, state, t, max(self.num_update, t)

    def _count(self, key, t, num_update):
        self._num_updates[key] = t
        self.num_update = self.optimizer.num_update = num_update

    def set_learning_rate(self, lr):
        """Make ``lr`` the learning rate of the updates to come; states and counts stay.

        As MXNet's ``Optimizer.set_learning_rate``, refused when the optimizer has an lr_scheduler
        (set_optimizer with a new schedule starts fresh states). The optimizer given to
        set_optimizer is left as it was: a copy takes the new rate.
        """
        optimizer = copy(self.optimizer)
        optimizer.set_learning_rate(lr)
        optimizer.num_update = self.num_update
        self.optimizer = optimizer

    def check_states(self, key, weight, arrays):
        """Fresh states for ``weight`` holding copies of ``arrays``; errors name any count, shape or dtype mismatch."""
        xp = array_module(weight)
        states = self.optimizer.create_state(xp, weight)
        if len(arrays) != len(states):
            raise InvalidArgumentError(
                f"key {key_repr(key)}: optimizer {self.optimizer.name!r} keeps {plural(len(states), 'state array')}, "
                f"got {len(arrays)}"
            )
        for state, array in zip(states, arrays):
            if tuple(array.shape) != tuple(state.shape):
                raise ShapeMismatchError(
                    f"key {key_repr(key)}: state of shape {tuple(array.shape)}, expected {state.shape}")
            if array.dtype != state.dtype:
                raise DtypeMismatchError(f"key {key_repr(key)}: state of dtype {array.dtype}, expected {state.dtype}")
            state[...] = xp.asarray(array)
        return states

    def get_states(self):
        """``{key: (num_update, [state arrays])}`` for every key updated so far; the arrays are
        the live states, not copies."""
        return {key: (self._num_updates.get(key, 0), list(state)) for key, state in self._states.items()}

    def set_states(self, states):
        """Replace every key's states and update count by ``{key: (num_update, [state arrays])}``;
        the updater takes the arrays over and updates them in place."""
        self._states = {key: tuple(arrays) for key, (_, arrays) in states.items()}
        self._num_updates = {key: int(num_update) for key, (num_update, _) in states.items()}
        self.num_update = self.optimizer.num_update = max(self._num_updates.values(), default=0)
