"""The remote store (``dist_sync``, ``dist_async``): a client of one or more tensorkv servers.

Keys are spread over the servers by a stable hash of the key; a value of more than
``bigarray_bound`` elements is split into contiguous slices, one per server, and put
back together on pull (tensorkv.stores.spread). A call over a list of keys makes one RPC per server involved, to
all of them at once, each with a deadline.
"""
from __future__ import annotations

import functools
import math
from typing import Any
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from ..backend import on_gpu, shape_dtype, to_host
from ..config import SECURITY_FIELDS, ClientConfig
from ..errors import (
    DeadlineExceededError, FailedPreconditionError, InternalError, InvalidArgumentError, ServerUnavailableError,
    ShapeMismatchError, key_repr,
)
from ..transport.lease import Heartbeat
from ..transport.routes import receivable
from ..transport.rpc import Stub
from ..transport.security import Security
from ..transport.server_conn import ServerConn
from ..update import compression
from ..update.engine import Engine, dtype_mismatch
from ..update.rowsparse import RowSparse, check_row_ids, merge as merge_rows, place, touching
from ..v1 import kvstore_pb2
from ..wire import allocator, states_file
from ..wire.codec import Item
from ..wire.grpc_options import CHANNEL_OPTIONS
from ..wire.status import error_from_rpc
from ..words import plural
from .fusion import FusedList, FusedLists
from .kvstore import Keys, KVStore, Values
from .spread import Spread, assemble

DEFAULT_CONNECT_TIMEOUT = 10.0  # of reset()
UNREGISTER_TIMEOUT = 5.0  # seconds close() waits for the servers to take the rank back
_MODES = {"dist_sync": kvstore_pb2.MODE_SYNC, "dist_async": kvstore_pb2.MODE_ASYNC}
# What a new run does with the keys earlier runs left on a server (RegisterRequest.if_exists).
IF_EXISTS = {"fail": kvstore_pb2.IF_EXISTS_FAIL, "resume": kvstore_pb2.IF_EXISTS_RESUME,
             "replace": kvstore_pb2.IF_EXISTS_REPLACE}
# Merges the list of arrays pushed for one key (one per device) as the server merges workers.
_MERGE = Engine()
_GPU_MERGE = {}  # CUDA device id -> Engine that merges lists of GPU arrays there


def _merge_engine(arrays):
    """The engine that sums ``arrays``: on the GPU of the first when all are on GPUs (the sum
    then crosses to the host once, slice by slice as it is sent), else on the host."""
    if len(arrays) == 1 or not all(on_gpu(array) for array in arrays):
        return _MERGE
    import cupy
    device = arrays[0].device
    index = device.index if hasattr(device, "index") else device.id  # torch or CuPy
    engine = _GPU_MERGE.get(index)
    if engine is None:
        with cupy.cuda.Device(index):
            engine = _GPU_MERGE[index] = Engine(cupy)
    return engine


def reset(servers: str | list[str] | None = None, timeout: float = DEFAULT_CONNECT_TIMEOUT, force: bool = False,
          tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
          token: str | None = None) -> int:
    """Reset each server, one after the other, reached with the credentials of
    :class:`~tensorkv.transport.security.Security`: see :func:`tensorkv.reset`."""
    given = ClientConfig(servers=servers, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, token=token)
    config = given.resolved(("servers", *SECURITY_FIELDS))
    security = Security.from_config(config)
    dropped = 0
    for address in config.servers:
        with security.channel(address, CHANNEL_OPTIONS) as channel:
            try:
                dropped += Stub(channel).Reset(kvstore_pb2.ResetRequest(force=force), timeout=timeout).num_keys
            except grpc.RpcError as error:
                failed = error_from_rpc(error, address, "reset")
                if isinstance(failed, ServerUnavailableError):  # no connection: a TLS mismatch is named as such
                    failed = security.diagnose(address) or failed
                raise failed from None
    return dropped


def _grouped(pairs):
    """{key: every array pushed for it} of the (key, [array]) ``pairs`` of one push (a key may
    repeat); the keys checked."""
    grouped = {}
    for key, arrays in pairs:
        grouped.setdefault(key, []).extend(arrays)
    _MERGE.check_keys(list(grouped))
    return grouped


class DistStore(KVStore):
    """A client of tensorkv servers; see :func:`tensorkv.create`.

    ``timeout`` bounds every call (seconds; a sync pull waits for the other workers within
    it), ``connect_timeout`` the first answer of each server (a refused connection or an
    unknown host fails at once). ``transport`` 'auto' (the
    default, or ``TENSORKV_TRANSPORT``) passes values through shared memory to a server that
    proves it is on this host and on the server's raw-TCP data channel otherwise; 'tcp'
    uses the data channel only; 'grpc' always sends them in the gRPC messages.
    ``if_exists`` (or ``TENSORKV_IF_EXISTS``) is what a new run does with the keys that an
    earlier run left on a server: 'fail' (the default), 'resume' or 'replace'. ``job`` (or
    ``TENSORKV_JOB``, which tensorkv-launch sets) names the job the worker belongs to: a server
    then keeps one job's workers together, and a worker process of the job restarted with a
    server rejoins the run the server restored whatever its ``if_exists``.
    ``tls_ca``, ``tls_cert``, ``tls_key`` and ``token`` are the credentials
    (:class:`tensorkv.transport.security.Security`). Each setting is a field of
    :class:`tensorkv.ClientConfig`: an argument given wins over ``config``'s field, which wins
    over the field's ``TENSORKV_*`` variable, all read here (never at import).
    """

    _compressor = None  # compression.Compressor once set_gradient_compression was called

    def __init__(self, name: str, servers: str | list[str] | None = None, rank: int | None = None,
                 num_workers: int | None = None, timeout: float | None = None, connect_timeout: float | None = None,
                 bigarray_bound: int | None = None, session: bool | None = None, transport: str | None = None,
                 if_exists: str | None = None, job: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, token: str | None = None,
                 config: ClientConfig | None = None) -> None:
        super().__init__(name)
        if config is not None and not isinstance(config, ClientConfig):
            raise InvalidArgumentError(f"config={config!r} is not a tensorkv.ClientConfig")
        given = (config or ClientConfig()).merged(
            servers=servers, rank=rank, num_workers=num_workers, timeout=timeout, connect_timeout=connect_timeout,
            bigarray_bound=bigarray_bound, session=session, transport=transport, if_exists=if_exists, job=job,
            tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, token=token)
        config = self._config = given.resolved()
        self.transport = config.transport
        allocator.tune_this_process(config.malloc_tuning)
        self._timeout = config.timeout
        self._security = Security.from_config(config)
        self._conns = [ServerConn(address, config, self._security) for address in config.servers]
        self._pool = ThreadPoolExecutor(len(self._conns)) if len(self._conns) > 1 else None
        self._spread = Spread(len(self._conns), config.bigarray_bound)  # where each value goes
        self._meta = {}  # key -> (full shape, dtype), from init, push and pull
        self._lists = FusedLists(config.pack_min_values)  # of the lists of keys pushed and pulled (tensorkv.stores.fusion)
        self._heartbeat = None  # renews the registrations' leases
        try:
            self._register(config.rank, config.num_workers, config.connect_timeout, IF_EXISTS[config.if_exists])
        except BaseException:
            self.close()
            raise

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def num_workers(self) -> int:
        return self._num_workers

    # What tests and tools look at, by server index.
    @property
    def _stubs(self):
        return [conn.stub for conn in self._conns]

    @property
    def _sessions(self):
        """The Session stream of each server, by index; None with sessions off."""
        sessions = [conn.session for conn in self._conns]
        return None if sessions[0] is None else sessions

    @property
    def _registered(self):
        """{server index: the incarnation of this worker's registration there}."""
        return {index: conn.incarnation for index, conn in enumerate(self._conns) if conn.incarnation is not None}

    def _register(self, rank, num_workers, connect_timeout, if_exists):
        """Check every server's mode and size, then join them: the first assigns the rank
        when none is given."""
        server_ids = []
        for conn in self._conns:
            try:
                info = conn.info(connect_timeout)
            except DeadlineExceededError:  # connected, or still connecting, but no answer
                raise ServerUnavailableError(
                    f"server {conn.address} is unreachable: no answer within {connect_timeout:g} s; "
                    f"is tensorkv-server running on {conn.address}?") from None
            except ServerUnavailableError as error:  # no connection: a TLS mismatch is named as such
                raise self._security.diagnose(conn.address) or error from None
            if info.mode != _MODES[self.type]:
                mode = kvstore_pb2.Mode.Name(info.mode).removeprefix("MODE_").lower()
                raise FailedPreconditionError(
                    f"server {conn.address} runs in {mode} mode; a '{self.type}' store needs a server started with "
                    f"--mode {self.type.removeprefix('dist_')} (for this one, create a 'dist_{mode}' store)")
            if num_workers is not None and info.num_workers != num_workers:
                raise FailedPreconditionError(
                    f"server {conn.address} expects {plural(info.num_workers, 'worker')}, "
                    f"this worker was told {num_workers}")
            num_workers = info.num_workers
            conn.offer(info, self.transport)
            server_ids.append(info.server_id)
        for conn, server_id in zip(self._conns, server_ids):
            try:
                rank = self._rank = conn.register(rank, if_exists, server_id).rank
            except FailedPreconditionError as error:  # the server's words say why, not which server
                raise FailedPreconditionError(f"server {conn.address} refused this worker: {error}") from None
        leased = [conn for conn in self._conns if conn.lease_ttl]
        if leased:
            self._heartbeat = Heartbeat(leased)
        self._num_workers = num_workers

    def _fanout(self, method, calls):
        """{server index: method(its ServerConn, *args)} for ``calls`` {server index: args},
        on all those servers at once; the first error is raised once all have ended."""
        if len(calls) <= 1 or self._pool is None:
            return {index: method(self._conns[index], *args) for index, args in calls.items()}
        futures = {index: self._pool.submit(method, self._conns[index], *args) for index, args in calls.items()}
        errors = [f.exception() for f in futures.values() if f.exception() is not None]
        if errors:
            raise errors[0]
        return {index: f.result() for index, f in futures.items()}

    def _check_known(self, key, shape, dtype, verb):
        """Check against what this worker knows of ``key``, so that a call spread over several
        servers fails before any of them changes."""
        known = self._meta.get(key)
        if known is None:
            return
        if dtype != known[1]:
            raise dtype_mismatch(key, verb, dtype, known[1])
        if shape != known[0]:
            raise ShapeMismatchError(
                f"key {key_repr(key)}: {verb} shape {shape} does not match the stored shape {known[0]}")

    def _merged(self, pairs):
        """{key: one array}: the arrays pushed for each key, summed (a repeated key too); GPU
        arrays are summed on their GPU."""
        grouped = _grouped(pairs)
        merged = {}
        for key, arrays in grouped.items():
            first = arrays[0]
            shape, dtype = (first.shape, first.dtype) if type(first) is np.ndarray else shape_dtype(first)
            self._check_known(key, shape, dtype, "pushed")
            merged[key] = _merge_engine(arrays).sum(arrays)
        return merged

    @staticmethod
    def _owned(values, fresh):
        """With ``fresh``, values the caller may write to (decoded ones are read-only views)."""
        return [v if not fresh or v.flags.writeable else v.copy() for v in values]

    # ---- the store --------------------------------------------------------------------

    def _init(self, items):
        _MERGE.check_keys([item.key for item in items])
        wait_only = self._rank != 0
        plan = self._spread.plan((position, item.key, to_host(item.array)) for position, item in enumerate(items))
        if wait_only:
            # Values this worker splits go first to their keys' home servers, where a worker that
            # does not split them (another TENSORKV_BIGARRAY_BOUND) stored them whole: a mismatch is
            # told at once there, not after the other servers waited a round timeout for a slice.
            homes = {self._spread.home(item.key) for part in plan.values() for _, item in part if item.slice}
            self._fanout(ServerConn.init, {index: (plan.pop(index), True) for index in homes & set(plan)})
        self._fanout(ServerConn.init, {index: (part, wait_only) for index, part in plan.items()})
        for item in items:
            self._meta[item.key] = shape_dtype(item.array)

    def _push_plan(self, entries):
        """(:meth:`_plan` of the pushed ``entries``, {key: residual} to keep once the push was
        sent). With gradient compression (set_gradient_compression), the items carry the
        values' packed 2-bit codes, quantized with each key's residual."""
        if self._compressor is None:
            return self._spread.plan(entries), {}
        plan, residuals, threshold = {}, {}, self._compressor.threshold
        for position, key, value in entries:
            placement = self._spread.placement(key, math.prod(value.shape))
            packed, residuals[key] = self._compressor.codes(key, value, [where for _, where in placement])
            for (index, where), codes in zip(placement, packed):
                plan.setdefault(index, []).append((position, Item(key, codes, value.shape, where, owned=True,
                                                                   two_bit=threshold)))
        return plan, residuals

    def _undos(self, plan):
        """{server index: what puts back the residuals that its part of a compressed push took
        (its keys, and its slices of the others), should that part, sent without waiting, fail}."""
        residuals = self._compressor.residuals
        return {index: functools.partial(self._compressor.restore, {
                    item.key: (residuals.get(item.key), item.slice) for _, item in part})
                for index, part in plan.items()}

    def _set_gradient_compression(self, compression_params):
        threshold = compression.parse(compression_params)
        if self._compressor is None:
            self._compressor = compression.Compressor(threshold)
        else:  # the residuals stay, as in MXNet
            self._compressor.threshold = threshold

    def _push(self, pairs):
        merged = self._merged(pairs)
        plan, residuals = self._push_plan((key, key, value) for key, value in merged.items())
        # Checked here against what this worker knows of every key, the push need not wait for
        # the servers' answers (ServerConn.push).
        known = all(key in self._meta for key in merged)
        undos = self._undos(plan) if residuals else {}
        self._fanout(ServerConn.push, {index: (part, known, undos.get(index)) for index, part in plan.items()})
        if residuals:
            self._compressor.keep(residuals)
        self._meta.update((key, shape_dtype(value)) for key, value in merged.items())

    # A list of keys pushed or pulled before, with plain NumPy arrays, is checked as a whole
    # and moves as one buffer per server (tensorkv.stores.fusion); the docstrings are KVStore's.
    def push(self, key: Keys, value: Values, priority: int = 0) -> None:
        fused = self._lists.get(key)
        if fused is None or self._compressor is not None or not fused.matches(value):
            super().push(key, value, priority)
            self._lists.learn(key, self._fuse)
            return
        self._check_open()
        self._fanout(ServerConn.push_packed, {index: (layout, layout.pack(arrays))
                                              for index, (layout, arrays) in fused.split(value).items()})

    def pull(self, key: Keys, out: Values | None = None, priority: int = 0, ignore_sparse: bool = True) -> Any:
        fused = self._lists.get(key) if out is not None else None
        if fused is None or not fused.matches(out, writable=True):
            values = super().pull(key, out, priority, ignore_sparse)
            self._lists.learn(key, self._fuse)
            return values
        self._check_open()
        self._fanout(ServerConn.pull_packed, fused.split(out))
        return None

    def _fuse(self, keys):
        """The FusedList of ``keys`` (just pushed or pulled: plain ints or strs, FusedLists.learn),
        or None when they do not fuse: keys not known, of several dtypes, a value that is not
        whole on its server, or a server's part that does not pack (ServerConn.packed_layout)."""
        known = [self._meta.get(key) for key in keys]
        if None in known or len({dtype for _, dtype in known}) > 1:
            return None
        by_server = {}
        for position, (key, (shape, _)) in enumerate(zip(keys, known)):
            placement = self._spread.placement(key, math.prod(shape))
            if len(placement) > 1:
                return None
            by_server.setdefault(placement[0][0], []).append(position)
        parts = []
        for index, positions in sorted(by_server.items()):
            layout = self._conns[index].packed_layout([keys[p] for p in positions], [known[p] for p in positions])
            if layout is None:
                return None
            parts.append((index, positions, layout))
        return FusedList(type(keys[0]), [shape for shape, _ in known], known[0][1], parts)

    def _pushpull(self, pairs, fresh, outs=None):
        merged = self._merged(pairs)
        order = list(merged)
        # A key pushed twice in one call is pulled once, into the first out of its first pair.
        first_outs = None
        if outs is not None:
            by_key = {}
            for (key, _), targets in zip(pairs, outs):
                by_key.setdefault(key, targets)
            first_outs = [by_key[key] for key in order]
        plan, residuals = self._push_plan((position, key, merged[key]) for position, key in enumerate(order))
        results = self._fanout(ServerConn.pushpull, {index: (part, first_outs) for index, part in plan.items()})
        if residuals:
            self._compressor.keep(residuals)
        self._meta.update((key, shape_dtype(value)) for key, value in merged.items())
        values = dict(zip(order, self._owned(assemble([None] * len(order), plan, results, first_outs), fresh)))
        return [values[key] for key, _ in pairs]

    def _pull(self, keys, fresh, outs=None):
        _MERGE.check_keys(keys)
        if outs is not None and not self._outs_fit(keys, outs):
            outs = None  # decoded into new arrays: the mismatch is raised before any out is written
        count, meta = len(self._conns), self._meta
        # A key this worker has not seen yet is asked of its home server; when that answers
        # with one slice of a large value, the other slices are asked of the other servers.
        plan, unknown = {}, []
        for position, key in enumerate(keys):
            known = meta.get(key)
            if known is None:
                unknown.append(position)
                indexes = (self._spread.home(key),)
            elif count == 1:
                indexes = (0,)
            else:
                indexes = [i for i, _ in self._spread.placement(key, math.prod(known[0]))]
            for index in indexes:
                plan.setdefault(index, []).append((position, key))
        values = self._pull_into([None] * len(keys), plan, outs)
        rest = {}
        for position in unknown:
            key = keys[position]
            if len(self._spread.placement(key, values[position].size)) > 1:
                for index in range(count):
                    if index != self._spread.home(key):
                        rest.setdefault(index, []).append((position, key))
        if rest:
            values = self._pull_into(values, rest, outs)
        return self._owned(values, fresh)

    def _pull_into(self, values, plan, outs=None):
        """Pull the keys of ``plan`` {server index: [(position, key)]} into ``values``."""
        results = self._fanout(ServerConn.pull, {index: (part, outs, *self._known(key for _, key in part),
                                                         self._pulled(index, [key for _, key in part]))
                                                 for index, part in plan.items()})
        for items in results.values():
            self._meta.update((item.key, (item.shape, shape_dtype(item.array)[1])) for item in items)
        return assemble(values, plan, results, outs)

    def _outs_fit(self, keys, outs):
        """Whether every out array of ``keys`` has the known dtype and shape of its key (all
        keys known), and is writable, so that values may be decoded straight into them: a pull
        then never writes some outs and fails on another."""
        meta = self._meta
        for key, targets in zip(keys, outs):
            known = meta.get(key)
            if known is None:
                return False
            shape, dtype = known
            for target in targets:
                if type(target) is np.ndarray:
                    if target.shape != shape or target.dtype != dtype or not target.flags.writeable:
                        return False
                elif shape_dtype(target) != (shape, dtype):
                    return False
        return True

    def _pulled(self, index, keys):
        """[(full shape, dtype, slice or None)] of what server ``index`` holds of each of ``keys``,
        when all are known; else None."""
        pulled = []
        for key in keys:
            known = self._meta.get(key)
            if known is None:
                return None
            pulled.append((*known, dict(self._spread.placement(key, math.prod(known[0]))).get(index)))
        return pulled

    def _known(self, keys):
        """(the bytes of the whole values of ``keys`` (an upper bound for slices), their [(shape,
        dtype)] when each is whole on one server); (None, None) when one of them is not known yet."""
        sizes, shapes, meta, whole = [], [], self._meta, True
        for key in keys:
            known = meta.get(key)
            if known is None:
                return None, None
            size = math.prod(known[0])
            sizes.append(size * known[1].itemsize)
            shapes.append(known)
            whole = whole and size <= self._spread.bound
        return sizes, shapes if whole or len(self._conns) == 1 else None

    # ---- row-sparse values: plain messages, only the rows travel ----------------------

    def _push_rows(self, pairs):
        """RowSparsePush of each key's merged rows to every server holding it (a slice's server
        gets the rows that touch its slice, or none, so that its round counts this push)."""
        grouped = _grouped(pairs)
        requests = {}
        for key, values in grouped.items():
            value = merge_rows(key, [RowSparse(to_host(v.data), v.indices, v.shape) for v in values])
            data = value.data.astype(values[0].dtype, copy=False)
            self._check_known(key, value.shape, data.dtype, "pushed")
            width = math.prod(value.shape[1:])
            for index, where in self._spread.placement(key, math.prod(value.shape)):
                sent = slice(None) if where is None else touching(value.indices, width, where)
                requests.setdefault(index, []).append((key, value.shape, value.indices[sent], data[sent]))
        self._fanout(ServerConn.row_sparse_push, {index: (values,) for index, values in requests.items()})

    def _row_sparse_pull(self, requests, outs=None):
        """[(full shape, rows)] of ``requests`` [(key, row ids)], all servers at once: a server
        holding a key whole is asked for the rows as asked, which go straight into
        ``outs[position]`` where that array fits them; the servers of a sliced key are asked
        for the distinct rows that touch what they hold (and, where they realign pushes after a
        restart, for none: ServerConn.realigns)."""
        _MERGE.check_keys([key for key, _ in requests])
        self._learn_shapes({key for key, _ in requests if key not in self._meta})
        plan, results, row_bytes = {}, [], []
        for position, (key, ids) in enumerate(requests):
            shape, dtype = self._meta[key]
            if not shape:
                raise InvalidArgumentError(f"key {key_repr(key)}: a scalar value has no rows to pull")
            ids = check_row_ids(key, ids, shape[0])
            row_bytes.append(math.prod(shape[1:]) * np.dtype(dtype).itemsize)
            placement = self._spread.placement(key, math.prod(shape))
            if placement[0][1] is None:
                results.append((shape, None, None))
                plan.setdefault(placement[0][0], []).append((position, None, None, ids))
                continue
            unique, inverse = np.unique(ids, return_inverse=True)
            results.append((shape, np.empty((len(unique),) + shape[1:], dtype), inverse))
            for index, where in placement:
                mask = touching(unique, math.prod(shape[1:]), where)
                # A server that realigns after a restart is asked with no rows too: the pull
                # tells it the rounds of this worker's pushes, which went to every slice, ended.
                if mask.any() or self._conns[index].realigns:
                    plan.setdefault(index, []).append((position, where, np.flatnonzero(mask), unique[mask]))
        outs = outs or {}
        answers = self._fanout(ServerConn.row_sparse_pull, {index: (
            [(requests[position][0], ids) for position, _, _, ids in part],
            [len(ids) * row_bytes[position] for position, _, _, ids in part],
            [[outs.get(position)] for position, _, _, _ in part]) for index, part in plan.items()})
        for index, answer in answers.items():
            for (position, where, positions, ids), rows in zip(plan[index], answer):
                key, (shape, dtype) = requests[position][0], self._meta[requests[position][0]]
                if rows.shape != (len(ids),) + shape[1:] or rows.dtype != dtype:
                    raise InternalError(f"key {key_repr(key)}: server {self._conns[index].address} answered rows "
                                        f"{rows.shape} {rows.dtype} for {len(ids)} rows of {shape} {dtype}")
                if where is None:
                    target = outs.get(position)
                    received = receivable(target, dtype, rows.shape) and np.may_share_memory(target, rows)
                    results[position] = (shape, target if received else rows, None)
                else:
                    place(results[position][1], positions, ids, rows, where)
        return [(shape, rows if inverse is None else rows[inverse]) for shape, rows, inverse in results]

    def _learn_shapes(self, keys):
        """Ask each key's home server for its shape and dtype."""
        homes = {}
        for key in keys:
            homes.setdefault(self._spread.home(key), []).append(key)
        answers = self._fanout(ServerConn.row_sparse_shapes, {index: (part,) for index, part in homes.items()})
        for shapes in answers.values():
            self._meta.update(shapes)

    # ---- optimizer --------------------------------------------------------------------

    def _set_updater(self, updater):
        raise FailedPreconditionError(
            f"a Python updater cannot run on a tensorkv server ('{self.type}'): code does not travel. "
            "Use kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=..., momentum=...)) or another "
            "declarative optimizer of tensorkv.optimizer, which runs on the servers")

    def _set_optimizer(self, optimizer):
        self._send_optimizer(optimizer, {}, "set_optimizer")

    def _send_optimizer(self, optimizer, by_server, kind):
        """SetUpdater on every server, with that server's states {index: {key: (n, [Item])}}."""
        self._fanout(ServerConn.set_updater, {index: (optimizer, by_server.get(index, {}), kind)
                                              for index in range(len(self._conns))})

    def _set_learning_rate(self, learning_rate):
        self._fanout(ServerConn.set_learning_rate, {index: (learning_rate,) for index in range(len(self._conns))})

    def _save_optimizer_states(self, fname):
        results = self._fanout(ServerConn.optimizer_states, {index: () for index in range(len(self._conns))})
        optimizer, merged = None, {}
        for index in sorted(results):
            server_optimizer, key_states = results[index]
            optimizer = server_optimizer or optimizer
            for key, (num_update, items) in key_states.items():
                arrays = merged.setdefault(key, (num_update, [None] * len(items)))[1]
                assemble(arrays, {0: list(enumerate(items))}, {0: items})
        if optimizer is None:
            raise FailedPreconditionError("no optimizer is set on the servers: call kv.set_optimizer(...) first")
        states_file.save(fname, optimizer, merged)

    def _load_optimizer_states(self, fname):
        optimizer, key_states = states_file.load(fname)
        by_server = {}
        for key, (num_update, arrays) in key_states.items():
            parts = [self._spread.split(key, array) for array in arrays]
            for j, split in enumerate(parts):
                for index, item in split:
                    entry = by_server.setdefault(index, {}).setdefault(key, (num_update, [None] * len(arrays)))
                    entry[1][j] = item
        self._send_optimizer(optimizer, by_server, "load_optimizer_states")

    # ---- the rest ---------------------------------------------------------------------

    def _barrier(self):
        self._fanout(ServerConn.settle, {index: () for index in range(len(self._conns))})
        self._conns[0].barrier()

    def close(self) -> None:
        if not self._closed:
            if self._heartbeat is not None:
                self._heartbeat.close()
            # The rank back to every server that gave it, all at once.
            timeout = min(self._timeout, UNREGISTER_TIMEOUT)
            self._fanout(ServerConn.unregister, {index: (timeout,) for index in range(len(self._conns))})
            for conn in self._conns:
                conn.close()
            if self._pool is not None:
                self._pool.shutdown()
        super().close()
