"""Row-sparse pushes and pulls over several rounds, each checked against MXNet's formulas
written out here (lazy_update: only the rows pushed, and their states, change).

Run as a worker: ``row_sparse_rounds.py STORE_TYPE OPTIMIZER`` (OPTIMIZER: none, sgd or
adam) on every rank of a job; or imported by tests/test_row_sparse.py, which runs
:func:`run` on the embedded store. Prints "ok RANK" when every check passed.
"""
import sys

import numpy as np

import tensorkv

# 63 elements: with a bigarray_bound of 20 on 2 servers the slices are [0, 31) and [31, 63),
# which cuts row 4 in two.
SHAPE = (9, 7)
ROUNDS = 4
OPTIMIZERS = {
    "none": None,
    "sgd": lambda: tensorkv.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5),
    "adam": lambda: tensorkv.optimizer.Adam(learning_rate=0.05, beta1=0.9, beta2=0.99, epsilon=1e-6, wd=0.01,
                                            rescale_grad=0.5),
}


def pushed(rank, round_):
    """(row ids, rows) that ``rank`` pushes in ``round_``: a row given twice, row 4 always
    (the row a slice boundary cuts), others moving from round to round."""
    ids = np.array([(round_ + rank) % 9, (2 * round_ + 3) % 9, 4, (round_ + rank) % 9])
    rows = np.random.default_rng(100 * round_ + rank).standard_normal((len(ids), SHAPE[1])).astype(np.float32)
    return ids, rows


def merged(num_workers, round_):
    """{row id: the float32 sum of every rank's rows for it} in ``round_``."""
    total = {}
    for rank in range(num_workers):
        own = {}
        for i, row in zip(*pushed(rank, round_)):
            own[int(i)] = own.get(int(i), np.zeros(SHAPE[1], np.float32)) + row
        for i, row in own.items():
            total[i] = total.get(i, np.zeros(SHAPE[1], np.float32)) + row
    return total


class Expected:
    """The value (and states) MXNet's formulas give after each round, in float64."""

    def __init__(self, name):
        self.name = name
        self.weight = np.arange(63, dtype=np.float64).reshape(SHAPE) / 10
        self.states = [np.zeros(SHAPE), np.zeros(SHAPE)]
        self.t = 0

    def round(self, grads):
        self.t += 1
        w, (s0, s1) = self.weight, self.states
        if self.name == "none":  # MXNet stores the merged row_sparse value: other rows are zero
            w[...] = 0
        for r, g in grads.items():
            g = g.astype(np.float64)
            if self.name == "none":
                w[r] = g
            elif self.name == "sgd":  # sgd_mom_update, lazy_update=True
                lr, momentum, wd, rescale = 0.1, 0.9, 0.01, 0.5
                s0[r] = momentum * s0[r] - lr * wd * w[r] - lr * (rescale * g)
                w[r] = w[r] + s0[r]
            else:  # adam_update, lazy_update=True, bias correction folded into lr as MXNet's Adam
                lr, b1, b2, eps, wd, rescale = 0.05, 0.9, 0.99, 1e-6, 0.01, 0.5
                lr_t = lr * np.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t)
                g = rescale * g + wd * w[r]
                s0[r] = b1 * s0[r] + (1 - b1) * g
                s1[r] = b2 * s1[r] + (1 - b2) * g * g
                w[r] = w[r] - lr_t * s0[r] / (np.sqrt(s1[r]) + eps)


def close(actual, expected, what):
    if not np.allclose(actual, expected, rtol=2e-6, atol=1e-6):
        raise AssertionError(f"{what}:\n{actual}\n!=\n{expected}")


def run(kv, name):
    """Init 'w' (and a dense 'other'), then ROUNDS row-sparse pushes, each followed by
    row-sparse pulls in every call form, checked against :class:`Expected`."""
    rank, workers = kv.rank, kv.num_workers
    kv.init("w", np.arange(63, dtype=np.float32).reshape(SHAPE) / 10)
    kv.init("other", np.arange(12, dtype=np.float64).reshape(4, 3))
    if OPTIMIZERS[name] is not None:
        kv.set_optimizer(OPTIMIZERS[name]())
    expected = Expected(name)
    asked = np.array([4, 0, 8, 4, 3])
    for round_ in range(ROUNDS):
        ids, rows = pushed(rank, round_)
        kv.push("w", tensorkv.row_sparse(rows, ids, SHAPE))
        expected.round(merged(workers, round_))
        close(kv.row_sparse_pull("w", row_ids=asked), expected.weight[asked], f"round {round_}: rows {asked}")
        whole = np.full(SHAPE, -7, np.float32)
        kv.row_sparse_pull("w", out=whole, row_ids=[8, 4])
        untouched = np.full(SHAPE, -7.0)
        untouched[[8, 4]] = expected.weight[[8, 4]]
        close(whole, untouched, f"round {round_}: a whole-shape out gets rows [8, 4] only")
        close(kv.pull("w"), expected.weight, f"round {round_}: pull")
    # One id array for every out array of a key; one per out array; a list of keys.
    outs = [np.zeros((2, 7), np.float32), np.zeros((2, 7), np.float32)]
    kv.row_sparse_pull("w", out=outs, row_ids=np.array([8, 1]))
    for out in outs:
        close(out, expected.weight[[8, 1]], "one id array, two outs")
    kv.row_sparse_pull("w", out=outs, row_ids=[np.array([2, 2]), np.array([7, 6])])
    close(outs[0], expected.weight[[2, 2]], "first of two id arrays")
    close(outs[1], expected.weight[[7, 6]], "second of two id arrays")
    other = np.zeros((1, 3))
    kv.row_sparse_pull(["w", "other"], out=[outs[0], other], row_ids=[np.array([0, 6]), np.array([3])])
    close(outs[0], expected.weight[[0, 6]], "list of keys: w")
    close(other, [[9, 10, 11]], "list of keys: other")
    # Bad row ids: refused naming the key and the id, nothing written.
    before = kv.pull("w")
    for bad, shown in (([3, -1], "-1"), ([9], "9"), ([1.5], "1.5")):
        out = np.zeros((len(bad), 7), np.float32)
        try:
            kv.row_sparse_pull("w", out=out, row_ids=bad)
        except tensorkv.InvalidArgumentError as error:
            assert "'w'" in str(error) and shown in str(error), error
        else:
            raise AssertionError(f"row ids {bad} were accepted")
        assert not out.any()
    try:
        kv.push("w", tensorkv.row_sparse(np.ones((1, 7), np.float32), [9], (10, 7)))
    except tensorkv.ShapeMismatchError as error:
        assert "'w'" in str(error), error
    else:
        raise AssertionError("a row-sparse value of another shape was accepted")
    close(kv.pull("w"), before, "after refused calls")
    return expected


if __name__ == "__main__":
    with tensorkv.create(sys.argv[1]) as store:
        run(store, sys.argv[2])
        store.barrier()
        print("ok", store.rank)
