"""``tensorkv``, the operator's command: what each server of a cluster holds and who is
connected, as etcdctl does for etcd. It asks every server at once, reports one line on stderr
for each server that did not answer, and still reports the others."""
import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from google.protobuf import empty_pb2, json_format
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tensorkv.config import parse_servers, variable_text
from tensorkv.wire import codec
from tensorkv.tools import reshard as resharding
from tensorkv.errors import InvalidArgumentError, KVStoreError
from tensorkv.wire.status import error_from_rpc
from tensorkv.transport.security import Security
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc, maintenance_pb2, maintenance_pb2_grpc

OK, FAILED, USAGE = 0, 1, 2
EPILOG = """exit status:
  0  every server answered (and, for health, is SERVING)
  1  a server could not be reached, is not SERVING, refused the command, or (status) failed
     its last snapshot (one line each on stderr; the other servers are still reported)
  2  usage error

-o json prints a list of objects, one a row; for status, each server's Info in protobuf's
JSON mapping (64-bit integers as strings, enums by name); for status and health, a server
that did not answer is {"server": ..., "error": why}, in the order of --servers.

examples:
  tensorkv status
  tensorkv --servers tkv-0:50051,tkv-1:50051 --tls-ca ca.pem -o json keys
  tensorkv get weight --stats
  tensorkv reset                  (refused while a job's workers are registered or can come back)"""
# Info fields that `status` shows where this client's protos have them (leases, snapshots).
STATUS_EXTRAS = ("lease_ttl_ms", "expired_leases", "server_id", "restored_from")
_MODES = {kvstore_pb2.MODE_SYNC: "sync", kvstore_pb2.MODE_ASYNC: "async"}


class Server:
    """One server: its address and the stubs of its services."""

    def __init__(self, address, security, timeout):
        self.address, self.timeout, self.security = address, timeout, security
        self.channel = security.channel(address, ())
        self.kv = kvstore_pb2_grpc.KVStoreServiceStub(self.channel)
        self.maintenance = maintenance_pb2_grpc.MaintenanceServiceStub(self.channel)
        self.read_key = self.channel.unary_stream(  # the value's bytes, for codec's decoder
            "/tensorkv.v1.MaintenanceService/ReadKey",
            request_serializer=maintenance_pb2.ReadKeyRequest.SerializeToString)

    def info(self):
        return self.kv.Info(kvstore_pb2.InfoRequest(), timeout=self.timeout)

    def keys(self):
        pages = self.maintenance.ListKeys(maintenance_pb2.ListKeysRequest(), timeout=self.timeout)
        return [key for page in pages for key in page.keys]


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.servers and args.command != "reshard":
        parser.error("no servers: pass --servers HOST:PORT,... or set TENSORKV_SERVERS")
    if not args.timeout > 0:
        parser.error(f"--timeout must be positive, not {args.timeout:g}")
    if args.token is not None:
        parser.error("--token would show the token to every user of this host (in the process list): put it in a "
                     "file only you can read and pass --token-file FILE, or set TENSORKV_TOKEN")
    try:
        args.security = Security.from_options(args.tls_ca, args.tls_cert, args.tls_key, _read_token(args.token_file))
        addresses = parse_servers(args.servers) if args.servers else []  # reshard names its own
        servers = [Server(address, args.security, args.timeout) for address in addresses]
    except KVStoreError as error:
        parser.error(str(error))
    args.failures = []  # one line for each server that did not answer (see _answers)
    args.unanswered = {}  # address -> why that server did not answer
    try:
        return args.run(args, servers)
    except BrokenPipeError:  # the reader of the output left (`tensorkv keys | head`): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # for the interpreter's flush at exit
        return FAILED
    finally:
        for server in servers:
            server.channel.close()


def _read_token(path):
    """The token in the file ``path`` (its first word), or None without one."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as file:
            words = file.read().split()
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidArgumentError(f"--token-file {path}: cannot read it ({error})") from None
    if not words:
        raise InvalidArgumentError(f"--token-file {path} holds no token")
    return words[0]


def _parser():
    # allow_abbrev=False: reshard's --to would be taken for an abbreviation of --token(-file)
    parser = argparse.ArgumentParser(prog="tensorkv", description="Inspect and operate tensorkv servers.",
                                     allow_abbrev=False,
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _options(parser, defaults=True)
    options = argparse.ArgumentParser(add_help=False)  # the same options after the command too
    _options(options, defaults=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, run, help):
        sub = commands.add_parser(name, help=help, parents=[options])
        sub.set_defaults(run=run)
        return sub

    command("status", status, "mode, workers, keys, run, optimizer, version of each server, and how each "
                              "rank's large values travel")
    command("health", health, "the gRPC health status of each server")
    command("keys", keys, "every key: dtype, shape, slice, updates")
    get = command("get", get_key, "one key's dtype and shape; its statistics or values on request")
    get.add_argument("key", help="the key, as `tensorkv keys` shows it")
    get.add_argument("--stats", action="store_true", help="min, max, mean and L2 norm of the value")
    get.add_argument("--values", action="store_true", help="the value itself")
    command("workers", workers, "the registered ranks of each server")
    command("reset", reset, "drop every key, the optimizer and its states (no run may be registered)").add_argument(
        "--force", action="store_true", help="even while the run of a snapshot the server restored can come back")
    resharding.add_arguments(command("reshard", reshard, "move the run of some servers (--from) to others (--to)"))
    snapshot = commands.add_parser("snapshot", help="snapshots of the servers' state")
    snapshot.add_subparsers(dest="action", required=True, metavar="ACTION").add_parser(
        "save", help="each server writes its state to its --state-dir", parents=[options]
    ).set_defaults(run=snapshot_save)
    return parser


def _options(parser, defaults):
    """The options of every command; with ``defaults`` False, an option not given leaves the
    value given before the command (or its default) as it is."""
    def default(value):
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("--servers", default=default(variable_text("servers")),
                        help="HOST:PORT,... (default: TENSORKV_SERVERS)")
    parser.add_argument("-o", "--output", choices=("table", "json"), default=default("table"), help="default: table")
    parser.add_argument("--timeout", type=float, default=default(10.0), help="seconds for each call (default 10.0)")
    parser.add_argument("--tls-ca", default=default(None), help="CA of the servers' certificates (default: TENSORKV_TLS_CA)")
    parser.add_argument("--tls-cert", default=default(None),
                        help="client certificate, for mutual TLS (default: TENSORKV_TLS_CERT)")
    parser.add_argument("--tls-key", default=default(None), help="its key (default: TENSORKV_TLS_KEY)")
    parser.add_argument("--token-file", default=default(None), metavar="FILE",
                        help="file that holds the bearer token (default: TENSORKV_TOKEN); never the token itself "
                             "on the command line, where every user of the host sees it in the process list")
    parser.add_argument("--token", default=default(None), help=argparse.SUPPRESS)  # refused: see main


# ---- the commands: each returns the exit status ----------------------------------------

def status(args, servers):
    rows = []
    for server, info in _answers(args, servers, Server.info, "info"):
        row = {"server": server.address, "mode": _MODES.get(info.mode, "?"),
               "workers": f"{len(info.registered_ranks)}/{info.num_workers}", "ranks": _ranks(info.registered_ranks),
               "keys": info.num_keys, "run": info.run, "job": info.job or "-", "optimizer": info.optimizer or "-",
               "version": info.version}
        row.update((field, getattr(info, field)) for field in STATUS_EXTRAS if field in info.DESCRIPTOR.fields_by_name)
        row["snapshot"] = _snapshot(info)
        if info.move.role:
            row["move"] = resharding.move_words(info.move)
        row["routes"] = _routes(info)
        rows.append(row if args.output == "table" else {"server": server.address, **_fields(info)})
        if info.snapshot_error:
            print(f"tensorkv: server {server.address}: its last snapshot failed: {info.snapshot_error} "
                  f"({info.failed_snapshots} failed since it started; its log names the file)", file=sys.stderr)
            args.failures.append(server.address)
    return _show(args, _with_unanswered(args, servers, rows))


def _with_unanswered(args, servers, rows):
    """``rows`` (one per server that answered), and with ``-o json`` one ``{"server", "error"}``
    per server that did not, in the servers' order: a script sees which one is missing."""
    if args.output != "json":
        return rows
    order = {server.address: index for index, server in enumerate(servers)}
    rows = rows + [{"server": address, "error": why} for address, why in args.unanswered.items()]
    return sorted(rows, key=lambda row: order[row["server"]])


def _snapshot(info):
    """The status cell of a server's snapshots: off, none yet, the last one and its age, or failing."""
    if not info.snapshots:
        return "off"
    if info.snapshot_error:
        return f"FAILING: {info.snapshot_error}"
    if not info.last_snapshot:
        return "none yet"
    age = max(0.0, time.time() - info.last_snapshot_unix_ms / 1000)
    return f"{info.last_snapshot} ({age:.0f} s ago)"


def health(args, servers):
    def check(server):
        reply = health_pb2_grpc.HealthStub(server.channel).Check(health_pb2.HealthCheckRequest(),
                                                                 timeout=server.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    rows = [{"server": server.address, "status": answer}
            for server, answer in _answers(args, servers, check, "health check")]
    for row in rows:
        if row["status"] != "SERVING":
            print(f"tensorkv: server {row['server']} is {row['status']}", file=sys.stderr)
    return max(_show(args, _with_unanswered(args, servers, rows)),
               OK if all(r["status"] == "SERVING" for r in rows) else FAILED)


def keys(args, servers):
    rows = [{"server": server.address, **_key_row(key)}
            for server, described in _answers(args, servers, Server.keys, "key listing")
            for key in described]
    return _show(args, rows)


def get_key(args, servers):
    holders = [(server, key) for server, described in _answers(args, servers, Server.keys, "key listing")
               for key in described if str(codec.get_key(key.key)) == args.key]
    if not holders:
        print(f"tensorkv: no server that answered holds key {args.key!r}", file=sys.stderr)
        return FAILED
    pieces = _answers(args, holders, _read, "read")
    description = holders[0][1]
    row = {"key": args.key, "dtype": _key_row(description)["dtype"], "shape": list(description.shape),
           "servers": [server.address for (server, _), _ in pieces], "updates": max(k.updates for _, k in holders)}
    value = _assemble(description, [item for _, item in pieces])
    if value is None:
        print(f"tensorkv: key {args.key!r}: not every server holding a slice of it answered", file=sys.stderr)
    elif args.stats:
        values = value.astype(np.float64)
        row.update(min=values.min(), max=values.max(), mean=values.mean(), l2_norm=float(np.linalg.norm(values)))
    if args.values and value is not None:
        row["values"] = value.tolist() if args.output == "json" else _one_line(value)
    return max(_show(args, [row]), OK if value is not None else FAILED)


def workers(args, servers):
    rows = []
    for server, info in _answers(args, servers, Server.info, "info"):
        if "workers" in info.DESCRIPTOR.fields_by_name:  # ranks with their leases, where the protos have them
            rows += [{"server": server.address, "run": info.run, **_scalars(lease)} for lease in info.workers]
        else:
            rows += [{"server": server.address, "run": info.run, "rank": rank} for rank in info.registered_ranks]
    return _show(args, rows)


def reset(args, servers):
    def drop(server):
        return server.kv.Reset(kvstore_pb2.ResetRequest(force=args.force), timeout=server.timeout).num_keys

    rows = [{"server": server.address, "keys_dropped": dropped}
            for server, dropped in _answers(args, servers, drop, "reset")]
    return _show(args, rows)


def reshard(args, servers):
    try:
        rows = resharding.run(args)
    except KVStoreError as error:
        print(f"tensorkv reshard: {error}", file=sys.stderr)
        return FAILED
    return _show(args, rows)


def snapshot_save(args, servers):
    path, response = _snapshot_method()

    def save(server):
        call = server.channel.unary_unary(path, request_serializer=bytes, response_deserializer=response.FromString)
        try:
            return _fields(call(b"", timeout=server.timeout))  # b"": any request message with no field set
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            raise KVStoreError(f"server {server.address} has no Snapshot RPC (UNIMPLEMENTED): "
                               "it is older than snapshots") from None

    rows = [{"server": server.address, **saved} for server, saved in _answers(args, servers, save, "snapshot")]
    return _show(args, rows)


def _snapshot_method():
    """The path and response class of the Snapshot RPC in this client's protos; where they
    have none, MaintenanceService's (a server of a later version may have it), read as Empty."""
    for module in (maintenance_pb2, kvstore_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            method = service.methods_by_name.get("Snapshot")
            if method is not None:
                return f"/{service.full_name}/Snapshot", GetMessageClass(method.output_type)
    return "/tensorkv.v1.MaintenanceService/Snapshot", empty_pb2.Empty


# ---- helpers ---------------------------------------------------------------------------

def _answers(args, servers, call, kind):
    """[(server, call(server))] of the servers that answered, all asked at once; each failure
    printed as one line on stderr and kept in args.failures for the exit status. ``servers``
    may also be (server, argument) pairs, for ``call((server, argument))``."""
    def ask(item):
        try:
            return item, call(item), None
        except (grpc.RpcError, KVStoreError) as error:
            server = item[0] if isinstance(item, tuple) else item
            if isinstance(error, grpc.RpcError):
                diagnosed = None  # a TLS mismatch, named, in place of gRPC's "unavailable"
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    diagnosed = server.security.diagnose(server.address)
                error = diagnosed or error_from_rpc(error, server.address, kind)
            message = str(error)
            return item, None, message if server.address in message else f"server {server.address}: {message}"

    answers = []
    with ThreadPoolExecutor(max_workers=min(16, len(servers))) as pool:
        for item, answer, failure in pool.map(ask, servers):
            if failure is None:
                answers.append((item, answer))
            else:
                print(f"tensorkv: {failure}", file=sys.stderr)
                args.failures.append(failure)
                args.unanswered[(item[0] if isinstance(item, tuple) else item).address] = failure
    return answers


def _read(holder):
    server, description = holder
    decoder = codec.StreamDecoder(maintenance_pb2.ReadKeyResponse, "frame")
    for message in server.read_key(maintenance_pb2.ReadKeyRequest(key=description.key), timeout=server.timeout):
        decoder.feed(message)
    return decoder.finish()[0]


def _assemble(description, items):
    """The whole value from the items read (whole, or slices of it); None if some are missing."""
    whole = next((item.array for item in items if item.slice is None), None)
    if whole is not None:
        return np.asarray(whole).reshape(description.shape)
    size = int(np.prod(description.shape))
    if sum(end - begin for begin, end in (item.slice for item in items)) != size:
        return None
    flat = np.empty(size, dtype=items[0].array.dtype)
    for item in items:
        flat[item.slice[0]:item.slice[1]] = np.asarray(item.array).ravel()
    return flat.reshape(description.shape)


def _key_row(key):
    return {"key": str(codec.get_key(key.key)), "dtype": str(codec.numpy_dtype(key.dtype)), "shape": list(key.shape),
            "slice": f"{key.slice.begin}:{key.slice.end}" if key.HasField("slice") else "-", "updates": key.updates}


def _fields(message):
    """``message`` in protobuf's JSON mapping (64-bit integers as strings, enums by name)."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def _scalars(message):
    """The fields of a message of scalar fields, in their order, as Python values."""
    return {field.name: getattr(message, field.name) for field in message.DESCRIPTOR.fields}


def _routes(info):
    """The status cell of how each registered rank's large values travel (WorkerLease.route):
    'RANK:ROUTE,...', '-' for none."""
    return ",".join(f"{lease.rank}:{lease.route or 'messages'}" for lease in info.workers) or "-"


def _ranks(ranks):
    return ",".join(map(str, ranks)) or "-"


def _show(args, rows):
    """Print ``rows`` (dicts) as an aligned table or as JSON; the exit status: FAILED when a
    server failed (see _answers)."""
    if args.output == "json":
        print(json.dumps(rows, indent=1, default=float))
    elif not rows:
        if args.command in ("keys", "workers") and not args.failures:  # every server answered: there are none
            print(f"(no {args.command})")
    else:
        columns = list(dict.fromkeys(name for row in rows for name in row))
        cells = [[_cell(row.get(name, "")) for name in columns] for row in rows]
        widths = [max(len(text) for text in column) for column in zip(columns, *cells)]
        for line in [columns, *cells]:
            print("  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip())
    return FAILED if args.failures else OK


def _one_line(value):
    """NumPy's text of ``value`` on one line of the table (a large one summarized with ...)."""
    return " ".join(line.strip() for line in np.array2string(value, max_line_width=sys.maxsize).splitlines())


def _cell(value):
    if isinstance(value, list):  # a shape (2x3, () for a scalar), or names
        if all(isinstance(v, int) for v in value):
            return "x".join(map(str, value)) or "()"
        return ",".join(map(str, value))
    if isinstance(value, (float, np.floating)):
        return f"{value:.6g}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
