"""``tensorkv reshard``: move a job's run from its servers (``--from``, or their snapshot
directories, ``--from-snapshots``) to other servers (``--to``), started empty with the same
``--mode`` and ``--num-workers``; the procedure is in docs/operations.md.

Each step can be run again, so a move that was interrupted is completed by running the
command again:

1. refuse while workers hold ranks on the old servers, or the new ones hold anything
   (``--force`` drops it);
2. freeze the old servers (a mark, kept in their snapshots: no worker registers, nothing
   changes);
3. stream each new server its part, a snapshot header then the bytes of its values and
   optimizer states, read range by range from the old servers (:mod:`.reshard_plan`): the
   tool holds a few pieces of PIECE_BYTES at a time, never a whole value;
4. compare the SHA-256 of every range on both sides, and what the new servers hold with what
   the old ones do (keys, elements of values and optimizer states);
5. commit the new servers (they serve workers from then on), then mark the old ones moved
   (they refuse workers with a message naming the new servers). Nothing is deleted.
"""
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from tensorkv.config import ClientConfig, parse_servers
from tensorkv.errors import FailedPreconditionError, InvalidArgumentError, KVStoreError, key_repr
from tensorkv.tools import reshard_plan
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc, maintenance_pb2, maintenance_pb2_grpc
from tensorkv.wire import codec
from tensorkv.wire.grpc_options import CHANNEL_OPTIONS
from tensorkv.wire.status import error_from_rpc
from tensorkv.words import plural, size

PIECE_BYTES = 1 << 20  # bytes a snapshot directory is read by, and a header is sent in
# A transfer's deadline allows this rate at the least: a slow server is waited for, a stuck one is not for ever.
SLOWEST = 8 << 20  # bytes per second
DIGEST_BATCH = 4096  # ranges per DigestRanges call
# gRPC's estimate of the link's bandwidth-delay product grows a stream's window to megabytes on
# loopback: with a read stream open from each old server for each new one, those windows,
# not the pieces, would be most of the tool's memory (a 1 GiB move peaked at 180 to 310 MiB
# with it, 115 MiB without, in the same time).
_OPTIONS = CHANNEL_OPTIONS + [("grpc.http2.bdp_probe", 0)]
_ROLES = {kvstore_pb2.MOVE_ROLE_SOURCE: "source", kvstore_pb2.MOVE_ROLE_TARGET: "target"}


def add_arguments(parser):
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--from", dest="sources", metavar="H1,H2", help="the servers the run is on, in their order")
    given.add_argument("--from-snapshots", metavar="DIR1,DIR2",
                       help="the --state-dir of each server the run was on (servers that are gone), in their order: "
                            "the newest whole snapshot of each is read")
    parser.add_argument("--to", required=True, metavar="G1,G2,G3",
                        help="the new servers, started empty with the old ones' --mode and --num-workers, in the order "
                             "the workers' TENSORKV_SERVERS will list them")
    parser.add_argument("--bigarray-bound", type=int, metavar="N",
                        help="values of more than N elements are sliced over the new servers, as the workers' "
                             "TENSORKV_BIGARRAY_BOUND (default: the bound the old servers' workers registered with, "
                             "else TENSORKV_BIGARRAY_BOUND, else 1000000)")
    parser.add_argument("--force", action="store_true",
                        help="drop what the new servers hold (keys, an optimizer, another move's part) and import "
                             "there")
    parser.add_argument("--abort", action="store_true",
                        help="give the move up instead: the old servers take workers again (not once it is done)")


def move_words(move):
    """What a server's RunMove says, in words: 'moved to A,B', 'being moved there from ...'."""
    if not move.role:
        return "part of no move"
    role = _ROLES[move.role]
    peers = ",".join(move.servers)
    if role == "source":
        return f"moved to {peers}" if move.done else f"being moved to {peers}"
    return f"moved there from {peers}" if move.done else f"being moved there from {peers}"


class Remote:
    """One server of --from or --to, reached with the command's security options."""

    def __init__(self, address, security, timeout):
        self.address, self.security, self.timeout = address, security, timeout
        self.channel = security.channel(address, _OPTIONS)
        self.kv = kvstore_pb2_grpc.KVStoreServiceStub(self.channel)
        self.maintenance = maintenance_pb2_grpc.MaintenanceServiceStub(self.channel)

    def close(self):
        self.channel.close()

    def _error(self, error, kind):
        """The KVStoreError of a failed call (a TLS mismatch named as such)."""
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            diagnosed = self.security.diagnose(self.address)
            if diagnosed is not None:
                return diagnosed
        return error_from_rpc(error, self.address, kind)

    def call(self, kind, method, request, timeout=None):
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as error:
            raise self._error(error, kind) from None

    def info(self):
        return self.call("info", self.kv.Info, kvstore_pb2.InfoRequest())

    def describe(self):
        """The header of a snapshot of the server's state (docs/snapshot.md)."""
        pieces = self.call("describe-run", self.maintenance.DescribeRun, maintenance_pb2.DescribeRunRequest())
        try:
            return json.loads(b"".join(piece.header for piece in pieces))
        except grpc.RpcError as error:
            raise self._error(error, "describe-run") from None

    def read(self, segments, timeout):
        """The bytes of ``segments`` (reshard_plan.Segment), in order, as they come."""
        request = maintenance_pb2.ReadRangesRequest(ranges=map(_range, segments))
        try:
            for message in self.maintenance.ReadRanges(request, timeout=timeout):
                yield message.data
        except grpc.RpcError as error:
            raise self._error(error, "read") from None

    def digests(self, segments, timeout):
        request = maintenance_pb2.DigestRangesRequest(ranges=map(_range, segments))
        return list(self.call("digest", self.maintenance.DigestRanges, request, timeout).sha256)

    def mark(self, role, servers, done=False, force=False):
        move = kvstore_pb2.RunMove(role=role, servers=servers, done=done)
        return self.call("mark", self.maintenance.MarkMove, maintenance_pb2.MarkMoveRequest(move=move, force=force))

    def import_run(self, requests, timeout):
        return self.call("import", self.maintenance.ImportRun, requests, timeout)


def _range(segment):
    entry = maintenance_pb2.ElementRange(array=segment.array)
    entry.elements.begin, entry.elements.end = segment.begin, segment.end
    codec.set_key(entry.key, segment.key)
    return entry


class SnapshotDir:
    """The newest whole snapshot in the --state-dir of a server that is gone, read piece by piece."""

    def __init__(self, directory):
        from tensorkv_server import snapshot  # the server's format; its package comes with this one
        self.address = os.path.abspath(directory)
        try:
            self.file, self.header, index = snapshot.newest(directory)
        except (OSError, snapshot.NoSnapshotLoads) as error:
            raise FailedPreconditionError(f"--from-snapshots {directory}: no snapshot can be read: "
                                          f"{getattr(error, 'strerror', None) or error}") from None
        self._where = {}  # (key, array) -> (file offset of the piece's first element, that element, itemsize)
        states, position = {entry["key"]: entry for entry in self.header["states"]}, 0
        for number, entry in enumerate(self.header["keys"]):
            names = [f"value_{number}"]
            if entry["key"] in states:  # files written before the header named the states' dtypes: the arrays do
                count = states[entry["key"]]["num_states"]
                names += [f"state_{position + i}" for i in range(count)]
                states[entry["key"]].setdefault("dtypes", [str(index[name][1]) for name in names[1:]])
                position += count
            begin = entry["slice"][0] if entry["slice"] else 0
            for array, name in enumerate(names):
                offset, dtype, _ = index[name]
                self._where[entry["key"], array] = (offset, begin, dtype.itemsize)

    def close(self):
        self.file.close()

    def describe(self):
        return self.header

    def read(self, segments, timeout=None):
        """The bytes of ``segments``, in order (read at their offsets: several threads may read at once)."""
        for segment in segments:
            offset, begin, item = self._where[segment.key, segment.array]
            position, end = offset + (segment.begin - begin) * item, offset + (segment.end - begin) * item
            while position < end:
                data = os.pread(self.file.fileno(), min(end - position, PIECE_BYTES), position)
                if not data:
                    raise FailedPreconditionError(f"{self.address}: the snapshot file ended early")
                position += len(data)
                yield data

    def digests(self, segments, timeout=None):
        digests = []
        for segment in segments:
            sha256 = hashlib.sha256()
            for data in self.read([segment]):
                sha256.update(data)
            digests.append(sha256.digest())
        return digests


class _Stream:
    """The pieces of bytes of one read, taken range by range."""

    def __init__(self, pieces):
        self.pieces, self.rest = iter(pieces), b""

    def take(self, nbytes):
        while nbytes:
            data = self.rest or next(self.pieces, None)
            if data is None:
                raise FailedPreconditionError("a read of the old servers ended before the bytes it asked for")
            data, self.rest = data[:nbytes], data[nbytes:]
            nbytes -= len(data)
            yield data


def _each(items, call):
    """[call(item)] of ``items``, all at once; a failure of any raises their messages together."""
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(items)))) as pool:
        futures = [pool.submit(call, item) for item in items]
    failures = [future.exception() for future in futures if future.exception() is not None]
    if failures:
        if not all(isinstance(failure, KVStoreError) for failure in failures):
            raise next(failure for failure in failures if not isinstance(failure, KVStoreError))
        raise type(failures[0])("; ".join(map(str, failures)))
    return [future.result() for future in futures]


def _elements(held):
    """(elements of a value, of its optimizer states) of reshard_plan.held, in words."""
    if held is None:
        return "none of it"
    return f"{plural(held[0], 'element')} of value and {held[1]} of optimizer states"


def _say(text):
    print(f"tensorkv reshard: {text}", file=sys.stderr, flush=True)


def run(args):
    """The rows of the move (one per new server) that ``args`` (the command's) asks for;
    KVStoreError for a refusal, whose message says what to do."""
    opened = []  # every Remote and SnapshotDir, closed at the end

    def open_each(names, make):
        made = []
        for name in names:
            made.append(make(name))
            opened.append(made[-1])
        return made

    try:
        def remote(address):
            return Remote(address, args.security, args.timeout)

        targets = open_each(parse_servers(args.to, "--to"), remote)
        if args.from_snapshots:
            sources = open_each([path for path in args.from_snapshots.split(",") if path], SnapshotDir)
        else:
            sources = open_each(parse_servers(args.sources, "--from"), remote)
        return _Move(args, sources, targets).run()
    finally:
        for server in opened:
            server.close()


class _Move:
    """One run of the command: the old servers (``sources``: Remote, or SnapshotDir) and the new
    ones (``targets``), and the steps of module's docstring, each skipped when done before."""

    def __init__(self, args, sources, targets):
        self.sources, self.targets = sources, targets
        self.live = not args.from_snapshots  # the sources are servers, which are frozen and marked
        self.names = [source.address for source in sources]
        self.to = [target.address for target in targets]
        self.force, self.abort, self.timeout, self.bound = args.force, args.abort, args.timeout, args.bigarray_bound
        shared = set(self.names) & set(self.to)
        if shared:
            raise InvalidArgumentError(f"--from and --to share {', '.join(sorted(shared))}: a run moves to other "
                                       "servers (start new ones)")
        if self.abort and not self.live:
            raise InvalidArgumentError("--abort gives up a move from servers (--from): snapshots are never marked")
        if self.bound is not None and self.bound < 1:
            raise InvalidArgumentError(f"--bigarray-bound must be at least 1, not {self.bound}")

    def run(self):
        source_infos = _each(self.sources, Remote.info) if self.live else []
        if self.abort:
            return self._give_up(source_infos)
        target_infos = self.target_infos = _each(self.targets, Remote.info)
        self._check_sources(source_infos)
        if self._moved(source_infos, target_infos):
            _say(f"the run is moved to {','.join(self.to)} already")
            return [{"server": address, "keys": info.num_keys, "state": "moved already"}
                    for address, info in zip(self.to, target_infos)]
        self._check_targets(target_infos)
        # every refusal before anything changes
        headers = _each(self.sources, lambda source: source.describe())
        plan = self._plan(headers)
        self._check_not_empty(headers)
        if self.live:
            _each([source for source, info in zip(self.sources, source_infos) if not self._ours(info.move, "source")],
                  lambda source: source.mark(kvstore_pb2.MOVE_ROLE_SOURCE, self.to))
            _say(f"froze the run on {','.join(self.names)}: they refuse workers from now on")
            headers = _each(self.sources, Remote.describe)  # as frozen
            plan = self._plan(headers)
        pending = [index for index, info in enumerate(target_infos) if not self._committed(info)]
        started = time.monotonic()
        _each(pending, lambda index: self._import(self.targets[index], plan[index]))
        _say(f"streamed {size(sum(plan[index].nbytes for index in pending))} to "
             f"{plural(len(pending), 'new server')} in {time.monotonic() - started:.1f} s; checking every byte")
        self._verify([(self.targets[index], plan[index]) for index in pending])
        moved = self._check_held(headers)
        _each([self.targets[index] for index in pending],
              lambda target: target.mark(kvstore_pb2.MOVE_ROLE_TARGET, self.names, done=True))
        if self.live:
            _each(self.sources, lambda source: source.mark(kvstore_pb2.MOVE_ROLE_SOURCE, self.to, done=True))
        _say(f"moved: start the job's workers with TENSORKV_SERVERS={','.join(self.to)} and if_exists='resume' "
             "(TENSORKV_IF_EXISTS=resume)")
        return [{"server": target.address, "keys": len(header["keys"]), "bytes": part.nbytes,
                 "state": "moved" if index in pending else "moved already"}
                for index, (target, header, part) in enumerate(zip(self.targets, moved, plan))]

    # ---- checks ---------------------------------------------------------------------

    def _ours(self, move, role):
        """Whether ``move`` (a RunMove) is this move's, on a server of ``role``."""
        peers = self.to if role == "source" else self.names
        return _ROLES.get(move.role) == role and list(move.servers) == peers

    def _committed(self, info):
        return self._ours(info.move, "target") and info.move.done

    def _moved(self, source_infos, target_infos):
        return all(self._ours(info.move, "source") and info.move.done for info in source_infos) \
            and all(map(self._committed, target_infos))

    def _check_sources(self, infos):
        held = [f"{source.address}: ranks {list(info.registered_ranks)} of run {info.run}"
                f"{f' (job {info.job!r})' if info.job else ''}"
                for source, info in zip(self.sources, infos) if info.registered_ranks]
        if held:
            raise FailedPreconditionError(
                f"workers hold ranks on the --from servers ({'; '.join(held)}): stop the job's workers first (close "
                "their stores, or end their processes: a worker that ended without closing its store holds its rank "
                "until its lease expires, --lease-timeout after it was last heard from), then run this again; "
                "`tensorkv --servers ... workers` lists them")
        for source, info in zip(self.sources, infos):
            chained = info.move.role == kvstore_pb2.MOVE_ROLE_TARGET and info.move.done  # a run moved here before
            if info.move.role and not chained and not self._ours(info.move, "source"):
                raise FailedPreconditionError(
                    f"{source.address} is {move_words(info.move)}: complete that move (run its `tensorkv reshard` "
                    "again), or give it up (`tensorkv reshard --abort` with its --from and --to)")

    def _check_targets(self, infos):
        for target, info in zip(self.targets, infos):
            if self._committed(info):
                continue
            if info.registered_ranks:
                raise FailedPreconditionError(
                    f"{target.address}: workers hold ranks {list(info.registered_ranks)} there: the new servers must "
                    "have no workers until the move is done")
            if self.force or (self._ours(info.move, "target") and not info.move.done):
                continue
            held = [what for what, there in ((plural(info.num_keys, "key"), info.num_keys),
                                             (f"optimizer {info.optimizer!r}", info.optimizer),
                                             (f"a run {move_words(info.move)}", info.move.role)) if there]
            if held:
                raise FailedPreconditionError(
                    f"{target.address} holds {', '.join(held)}: a run moves to servers started empty; pass --force "
                    "to drop what it holds")

    def _check_not_empty(self, headers):
        """FailedPreconditionError when the old servers (their snapshot ``headers``) hold no key:
        new servers that took such a run would look moved to, and a job's workers resumed there
        would start from scratch without a word."""
        if not any(header["keys"] for header in headers):
            raise FailedPreconditionError(
                f"nothing to move: the old servers ({','.join(self.names)}) hold no keys, and nothing was changed; "
                f"check {'--from' if self.live else '--from-snapshots'}: the job's servers, in the order of its "
                "workers' TENSORKV_SERVERS")

    def _plan(self, headers):
        """reshard_plan.plan of ``headers`` on the new servers, by the bound the workers slice by."""
        mode = {(header["mode"], header["num_workers"]) for header in headers}
        ours = {(_MODES[info.mode], info.num_workers) for info in self.target_infos}
        if mode != ours:
            (old_mode, old_workers), (new_mode, new_workers) = min(mode), min(ours)
            raise FailedPreconditionError(
                f"the run's servers have --mode {old_mode} --num-workers {old_workers}, the --to servers --mode "
                f"{new_mode} --num-workers {new_workers}: start the new servers as the old ones")
        reshard_plan.check_layout(headers, self.names)
        bound = self.bound
        if bound is None:
            bound = reshard_plan.recorded_bound(headers) or ClientConfig().resolved(("bigarray_bound",)).bigarray_bound
            reshard_plan.check_bound(headers, bound)
        return reshard_plan.plan(headers, len(self.targets), bound)

    # ---- the steps ------------------------------------------------------------------

    def _import(self, target, part):
        """Stream ``part`` (reshard_plan.Target) to ``target``."""
        timeout = self.timeout + part.nbytes / SLOWEST
        failures = []
        try:
            target.import_run(self._requests(part, timeout, failures), timeout)
        except KVStoreError:
            if failures:  # what ended the stream, rather than the stream's end
                raise failures[0] from None
            raise

    def _requests(self, part, timeout, failures):
        """The ImportRunRequest messages of ``part``: its header, then the bytes of its segments,
        read from the old servers as they are sent. A failure to read ends the stream, kept
        in ``failures`` (raised in gRPC's thread it would only be logged)."""
        header = json.dumps(part.header).encode()
        try:
            yield maintenance_pb2.ImportRunRequest(header_size=len(header), sources=self.names, force=self.force,
                                                   data=header[:PIECE_BYTES])
            for start in range(PIECE_BYTES, len(header), PIECE_BYTES):
                yield maintenance_pb2.ImportRunRequest(data=header[start:start + PIECE_BYTES])
            streams = {}
            for segment in part.segments:
                if segment.source not in streams:
                    mine = [each for each in part.segments if each.source == segment.source]
                    streams[segment.source] = _Stream(self.sources[segment.source].read(mine, timeout))
                for data in streams[segment.source].take(segment.nbytes):
                    yield maintenance_pb2.ImportRunRequest(data=data)
        except (KVStoreError, OSError) as error:
            failures.append(error)

    def _verify(self, imported):
        """FailedPreconditionError unless every range of ``imported`` [(target, plan)] has the
        same SHA-256 on the new server as on the old one, and its header what the plan says."""
        for target, part in imported:
            header = target.describe()
            for field in ("keys", "states", "optimizer"):
                if header[field] != part.header[field]:
                    raise FailedPreconditionError(f"{target.address}: its {field} after the import differ from the "
                                                  "run's: run this again")
        wanted = {}  # server -> [segment]
        for target, part in imported:
            wanted.setdefault(target, []).extend(part.segments)
            for segment in part.segments:
                wanted.setdefault(self.sources[segment.source], []).append(segment)
        batches = [(server, segments[start:start + DIGEST_BATCH]) for server, segments in wanted.items()
                   for start in range(0, len(segments), DIGEST_BATCH)]
        digests = _each(batches, lambda batch: batch[0].digests(
            batch[1], self.timeout + sum(segment.nbytes for segment in batch[1]) / SLOWEST))
        found = {}  # (server, id of segment) -> digest
        for (server, segments), answer in zip(batches, digests):
            found.update(((server, id(segment)), digest) for segment, digest in zip(segments, answer))
        for target, part in imported:
            for segment in part.segments:
                if found[target, id(segment)] != found[self.sources[segment.source], id(segment)]:
                    raise FailedPreconditionError(
                        f"{target.address}: key {segment.key!r} array {segment.array} elements [{segment.begin}, "
                        f"{segment.end}) differ from those on {self.names[segment.source]}: run this again")
        ranges = sum(len(part.segments) for _, part in imported)
        _say(f"checked {plural(ranges, 'range')}: the same bytes on both sides")

    def _check_held(self, source_headers):
        """The snapshot headers of the new servers, as they describe themselves;
        FailedPreconditionError unless together they hold the keys of the old servers'
        ``source_headers``, each with as many elements of value and optimizer states: the
        servers' own numbers, not the plan's."""
        headers = _each(self.targets, Remote.describe)
        moved, run = reshard_plan.held(headers), reshard_plan.held(source_headers)
        differ = sorted((key for key in run.keys() | moved.keys() if run.get(key) != moved.get(key)), key=repr)
        if differ:
            shown = "; ".join(f"key {key_repr(key)}: {_elements(moved.get(key))} on the new servers, "
                              f"{_elements(run.get(key))} on the old ones" for key in differ[:5])
            raise FailedPreconditionError(
                f"the new servers do not hold the run of the old ones ({plural(len(moved), 'key')}, the old ones "
                f"{plural(len(run), 'key')}): {shown}{'; ...' if len(differ) > 5 else ''}. Nothing is committed: run "
                "this again; if this comes back, the tool's plan is wrong: give the move up (`tensorkv reshard "
                "--abort` with the same --from and --to)")
        return headers

    def _give_up(self, infos):
        """--abort: drop the freeze of the old servers (refused by them once the move is done)."""
        _each([source for source, info in zip(self.sources, infos) if self._ours(info.move, "source")],
              lambda source: source.mark(kvstore_pb2.MOVE_ROLE_UNSPECIFIED, []))
        _say(f"gave the move up: {','.join(self.names)} take workers again; the --to servers may hold part of the "
             "run: reset them (`tensorkv reset --force`) before they serve")
        return [{"server": source.address, "state": "not moved"} for source in self.sources]


_MODES = {kvstore_pb2.MODE_SYNC: "sync", kvstore_pb2.MODE_ASYNC: "async"}
