"""How a dist store spreads values over its servers: a key lives on its home server, chosen
by a hash of the key that is the same in every process and run; a value of more than
``bound`` elements is cut into contiguous slices, one per server, and put back together
from their answers.
"""
import zlib

import numpy as np

from ..backend import write_into
from ..transport.routes import receivable
from ..wire.codec import Item


def home(key, num_servers):
    """The server index of ``key``: a hash that is the same in every process and run."""
    if num_servers == 1:
        return 0
    return zlib.crc32(f"{type(key).__name__}:{key}".encode()) % num_servers


def placement(key, size, num_servers, bound):
    """[(server index, slice or None)] of a value of ``size`` elements of ``key`` on
    ``num_servers`` servers: the whole value on its :func:`home`, or, past ``bound`` elements
    on several servers, the contiguous slice (begin, end) of the flattened value on each
    (the rule every worker and ``tensorkv reshard`` follow)."""
    if num_servers == 1 or size <= bound:
        return [(home(key, num_servers), None)]
    bounds = [size * i // num_servers for i in range(num_servers + 1)]
    return [(i, (bounds[i], bounds[i + 1])) for i in range(num_servers)]


class Spread:
    """The places of values over ``count`` servers, those of more than ``bound`` elements sliced."""

    def __init__(self, count, bound):
        self.count, self.bound = count, bound

    def home(self, key):
        return home(key, self.count)

    def placement(self, key, size):
        """[(server index, slice or None)] of a value of ``size`` elements."""
        return placement(key, size, self.count, self.bound)

    def split(self, key, array, shape=None):
        """[(server index, Item)] that carry ``array`` (a whole value, or its shape with no data)."""
        shape = tuple(array.shape) if shape is None else shape
        flat = array.reshape(-1)
        return [(index, Item(key, array if where is None else flat[where[0]:where[1]], shape, where))
                for index, where in self.placement(key, flat.size)]

    def plan(self, entries):
        """{server index: [(position, Item)]} that carry each (position, key, array) of
        ``entries``: a value on its key's server, or in slices over all servers."""
        if self.count == 1:
            return {0: [(position, Item(key, array)) for position, key, array in entries]}
        plan = {}
        for position, key, array in entries:
            for index, item in self.split(key, array):
                plan.setdefault(index, []).append((position, item))
        return plan


def assemble(values, plan, results, outs=None):
    """Fill ``values`` (by position) from each server's answer, in the order of ``plan``.
    A value that was decoded (or, on the GPU, copied) straight into its out array (see
    :func:`tensorkv.transport.server_conn.decode`, tensorkv.transport.routes) is that array;
    the slices of a value that came apart from it are written into it."""
    apart = {}  # position -> [(slice, host array, full shape)]
    for index, answered in results.items():
        for (position, _), item in zip(plan[index], answered):
            if outs is not None and (item.array is outs[position][0] or (
                    receivable(outs[position][0], item.array.dtype, item.shape)
                    and np.may_share_memory(outs[position][0], item.array))):
                values[position] = outs[position][0]
            elif item.slice is None:
                values[position] = item.array
            else:
                apart.setdefault(position, []).append((item.slice, item.array, item.shape))
    for position, slices in apart.items():
        whole = values[position]
        if whole is None:
            whole = values[position] = np.empty(slices[0][2], slices[0][1].dtype)
        for (begin, end), array, _ in slices:
            if type(whole) is np.ndarray:
                whole.reshape(-1)[begin:end] = array
            else:  # a GPU out array that other slices went to
                write_into(whole.reshape(-1)[begin:end], array)
    return values
