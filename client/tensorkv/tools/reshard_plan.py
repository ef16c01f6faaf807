"""Where a run's keys go when it moves from N servers to M (``tensorkv reshard``).

Each key goes whole or in slices to the new servers by the rule the workers use
(:func:`tensorkv.stores.spread.placement`), with its value and each optimizer state (all of the value's
shape), so each new piece is a list of :class:`Segment`, element ranges of the old pieces. Each
new server gets the header of a snapshot (docs/snapshot.md) of its part of the run; the run's
identity (job, run number, rounds, the optimizer) is that of the old servers.
"""
import math

import numpy as np

from tensorkv.backend import BFLOAT16
from tensorkv.errors import FailedPreconditionError, key_repr
from tensorkv.stores.spread import placement
from tensorkv.wire.codec import check_key
from tensorkv.words import plural


class Segment:
    """Elements ``begin:end`` of the whole value flattened, of array ``array`` (0: the value, N:
    state N - 1) of ``key``, held by old server ``source``: ``nbytes`` bytes."""

    __slots__ = ("source", "key", "array", "begin", "end", "nbytes")

    def __init__(self, source, key, array, begin, end, nbytes):
        self.source, self.key, self.array, self.begin, self.end, self.nbytes = source, key, array, begin, end, nbytes


class Target:
    """What one new server gets: ``header`` (a snapshot's, with its keys and states), and the
    ``segments`` whose bytes follow it, in the order of its arrays."""

    def __init__(self, header):
        self.header, self.segments = header, []

    @property
    def nbytes(self):
        return sum(segment.nbytes for segment in self.segments)


class _Piece:
    """One old server's part of a key: elements begin:end, its header entries."""

    __slots__ = ("source", "begin", "end", "entry", "states")

    def __init__(self, source, begin, end, entry, states):
        self.source, self.begin, self.end, self.entry, self.states = source, begin, end, entry, states


def itemsize(dtype_name):
    return (BFLOAT16 if dtype_name == "bfloat16" else np.dtype(dtype_name)).itemsize


def plan(headers, num_targets, bound):
    """[Target] of the run whose old servers' snapshot headers are ``headers``, on
    ``num_targets`` new servers whose workers slice values of more than ``bound`` elements."""
    run = run_header(headers)
    if run["run"] is not None:
        run["run"]["bigarray_bound"] = bound
    targets = [Target({**run, "keys": [], "states": []}) for _ in range(num_targets)]
    for key, pieces in _pieces(headers).items():
        _place(key, pieces, targets, bound)
    return targets


def _pieces(headers):
    """{key: [_Piece] by begin} of every key of the old servers, checked to cover each value
    once, in the same dtype, shape and optimizer states."""
    pieces = {}
    for source, header in enumerate(headers):
        states = {check_key(entry["key"]): entry for entry in header["states"]}
        for entry in header["keys"]:
            key = check_key(entry["key"])
            begin, end = entry["slice"] or (0, math.prod(entry["shape"]))
            pieces.setdefault(key, []).append(_Piece(source, begin, end, entry, states.get(key)))
    for key, held in pieces.items():
        held.sort(key=lambda piece: piece.begin)
        first, size = held[0], math.prod(held[0].entry["shape"])
        for piece in held:
            for field in ("dtype", "shape"):
                if piece.entry[field] != first.entry[field]:
                    raise FailedPreconditionError(
                        f"key {key_repr(key)}: {field} {first.entry[field]} on one old server, "
                        f"{piece.entry[field]} on another: these servers do not hold one run")
            if (piece.states or {}).get("dtypes") != (first.states or {}).get("dtypes"):
                raise FailedPreconditionError(
                    f"key {key_repr(key)}: the old servers hold optimizer states for some of its slices and not "
                    "others (a push that reached some servers only): push it once more on the old servers, then move")
        position = 0
        for piece in held:
            if piece.begin != position:
                what = "twice" if piece.begin < position else "on none of the old servers"
                raise FailedPreconditionError(
                    f"key {key_repr(key)}: elements [{min(position, piece.begin)}, {max(position, piece.begin)}) of "
                    f"its {size} are {what}: give every server of the run (and only those) to --from, each once")
            position = piece.end
        if position != size:
            raise FailedPreconditionError(
                f"key {key_repr(key)}: elements [{position}, {size}) are on none of the old servers: give every "
                "server of the run to --from")
    return pieces


def _place(key, pieces, targets, bound):
    """Add ``key`` (its old ``pieces``) to the new servers it goes to."""
    first = pieces[0]
    shape, dtype, states = first.entry["shape"], first.entry["dtype"], first.states
    itemsizes = [itemsize(dtype), *(itemsize(name) for name in (states or {}).get("dtypes", ()))]
    size = math.prod(shape)
    for index, where in placement(key, size, len(targets), bound):
        begin, end = where or (0, size)
        under = [piece for piece in pieces if piece.begin < end and begin < piece.end] or pieces[:1]
        target = targets[index]
        target.header["keys"].append({
            "key": key, "shape": shape, "slice": where and list(where), "dtype": dtype,
            "round": max(piece.entry["round"] for piece in under),
            "updates": max(piece.entry["updates"] for piece in under),
            "initialized_in": under[0].entry["initialized_in"]})
        if states is not None:
            target.header["states"].append({
                "key": key, "num_update": max(piece.states["num_update"] for piece in under),
                "num_states": len(itemsizes) - 1, "dtypes": states["dtypes"]})
        for array, item in enumerate(itemsizes):
            for piece in under:
                low, high = max(begin, piece.begin), min(end, piece.end)
                if low < high:
                    target.segments.append(Segment(piece.source, key, array, low, high, (high - low) * item))


def held(headers):
    """{key: (elements of its value, elements of its optimizer states)} that the servers whose
    snapshot headers are ``headers`` hold together, the slices of a key added up."""
    found = {}
    for header in headers:
        states = {check_key(entry["key"]): entry["num_states"] for entry in header["states"]}
        for entry in header["keys"]:
            key = check_key(entry["key"])
            begin, end = entry["slice"] or (0, math.prod(entry["shape"]))
            values, state_elements = found.get(key, (0, 0))
            found[key] = (values + end - begin, state_elements + (end - begin) * states.get(key, 0))
    return found


def run_header(headers):
    """The header fields, besides keys and states, of the run that the old servers' ``headers``
    hold together: theirs, checked to agree; the run not going on (its workers start again)."""
    first = headers[0]
    for header in headers[1:]:
        for field in ("mode", "num_workers"):
            if header[field] != first[field]:
                raise FailedPreconditionError(f"the old servers differ in {field} ({first[field]} and "
                                              f"{header[field]}): they do not hold one run")
    key_types = {header["key_type"] for header in headers} - {None}
    optimizers = {repr(header["optimizer"]) for header in headers if header["optimizer"] is not None}
    if len(key_types) > 1:
        raise FailedPreconditionError(f"the old servers hold keys of types {sorted(key_types)}: not one run")
    if len(optimizers) > 1:
        raise FailedPreconditionError(f"the old servers hold {plural(len(optimizers), 'different optimizer')} "
                                      f"({' and '.join(sorted(optimizers))}): they do not hold one run")
    runs = [header["run"] for header in headers if header["run"] is not None]
    run = max(runs, key=lambda entry: entry["number"], default=None)
    jobs = {entry.get("job", "") for entry in runs} - {""}
    if len(jobs) > 1:
        raise FailedPreconditionError(f"the old servers served jobs {sorted(jobs)}: they do not hold one run")
    return {"format": first["format"], "version": first["version"], "mode": first["mode"],
            "num_workers": first["num_workers"], "key_type": key_types.pop() if key_types else None,
            "optimizer": next((header["optimizer"] for header in headers if header["optimizer"] is not None), None),
            "run": run and {**run, "going": False},
            "next_incarnation": max(header["next_incarnation"] for header in headers),
            "barriers_done": max(header["barriers_done"] for header in headers), "sequences": [], "moved": None}


def recorded_bound(headers):
    """The bigarray bound the old servers' last run recorded (RegisterRequest.bigarray_bound),
    or 0 when none did; FailedPreconditionError when they differ."""
    bounds = {header["run"].get("bigarray_bound", 0) for header in headers if header["run"]} - {0}
    if len(bounds) > 1:
        raise FailedPreconditionError(f"the old servers' workers sliced values by different bounds {sorted(bounds)}: "
                                      "pass the one the workers will use as --bigarray-bound")
    return bounds.pop() if bounds else 0


def check_layout(headers, names):
    """FailedPreconditionError unless each old server ``names[i]`` holds, of each key in
    ``headers[i]``, what the workers' rule for ``len(names)`` servers puts there, whatever the
    bound: a server of the job left out of --from, or the servers in another order, would
    otherwise go unnoticed where no key is sliced."""
    count = len(names)
    for index, header in enumerate(headers):
        for entry in header["keys"]:
            key, size = check_key(entry["key"]), math.prod(entry["shape"])
            held = tuple(entry["slice"]) if entry["slice"] else None
            rule = placement(key, size, count, 0 if held else size)  # a bound that slices it as it is sliced
            if (index, held) not in rule:
                where = "the whole value" if held is None else f"elements [{held[0]}, {held[1]})"
                expected = "; ".join(f"{'the whole value' if part is None else f'elements [{part[0]}, {part[1]})'} "
                                     f"on {names[server]}" for server, part in rule)
                raise FailedPreconditionError(
                    f"key {key_repr(key)}: {names[index]} holds {where}, where the workers' rule for "
                    f"{plural(count, 'server')} puts {expected}: give --from every server of the job, in the order of "
                    "its workers' TENSORKV_SERVERS")


def check_bound(headers, bound):
    """FailedPreconditionError when ``bound`` cannot be the one the old servers' keys were
    split by (a key sliced though it has no more elements, or whole on several servers though
    it has more)."""
    if len(headers) == 1:
        return
    for header in headers:
        for entry in header["keys"]:
            size = math.prod(entry["shape"])
            if (entry["slice"] is not None) != (size > bound):
                how = "sliced" if entry["slice"] is not None else "whole"
                raise FailedPreconditionError(
                    f"key {key_repr(entry['key'])} of {size} elements is {how} on the old servers, so their workers' "
                    f"bigarray bound was not {bound}: pass the workers' TENSORKV_BIGARRAY_BOUND as --bigarray-bound")
