"""Who may use a server: TLS on its port (``--tls-cert``, ``--tls-key``; mutual TLS with
``--tls-client-ca``), bearer tokens (``--token-file``), and the refusal to listen beyond
loopback unprotected: without TLS, or with TLS but no way to authenticate a client (a token
or a client certificate); ``--insecure`` overrides it.

The token file holds one token per line; a line ``TOKEN ro`` makes that token read-only
(Info, Pull, GetOptimizerStates, ListKeys and ReadKey only); ``#`` starts a comment, blank
lines are skipped.
The file is read once, at start: a token stays valid for the server's lifetime, so it never
expires in the middle of a job. Tokens are checked by :class:`TokenInterceptor`, for every
method but the health service (probes need no token, and it says only SERVING or not).

Certificate files are looked at again on each new connection, of the gRPC port and of the
data channel: replacing them (cert and key together, e.g. by renaming new files over them)
serves the new pair to new connections of both, while connections already open keep theirs.
Files that cannot be taken (mid-rotation, or expired) are warned about once, and both keep
serving the last pair that could.

A certificate file is as good as the first of its certificates to expire (its notAfter) for
--tls-cert (a chain stops working then), and as the last for --tls-client-ca (a bundle of CAs
works while one of them does: a retired CA kept in it during a rotation is normal): one that
has passed it is refused, at start (the server does not start) and at a rotation (the previous
pair stays); one within EXPIRY_WARNING_DAYS of it is warned about. The metric
tensorkv_tls_certificate_expiry_timestamp_seconds says when each file in use expires.
"""
import contextvars
import datetime
import hmac
import inspect
import logging
import os
import ssl
import threading
import time
from pathlib import Path

import grpc
from cryptography import x509

from tensorkv.errors import ERROR_METADATA_KEY, PermissionDeniedError, UnauthenticatedError
from tensorkv.wire.addresses import is_loopback
from tensorkv.v1 import kvstore_pb2, maintenance_pb2

from . import metrics

log = logging.getLogger(__name__)

_SERVICE = "/" + kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"].full_name + "/"
_MAINTENANCE = "/" + maintenance_pb2.DESCRIPTOR.services_by_name["MaintenanceService"].full_name + "/"
READ_ONLY_METHODS = frozenset([_SERVICE + name for name in ("Info", "Pull", "GetOptimizerStates")]
                              + [_MAINTENANCE + name for name in ("ListKeys", "ReadKey")])
PUBLIC_PREFIX = "/grpc.health.v1.Health/"
READ_ONLY_MARK = "ro"
MIN_TOKEN_CHARS = 16
# Whether the call being handled carries a read-only token (set by TokenInterceptor): such a
# caller is no rank, whatever rank its request names (KVStoreService.Pull).
READ_ONLY_CALL = contextvars.ContextVar("tensorkv_read_only_call", default=False)
_REFUSALS_KEPT = 4096  # (host, reason) pairs RefusalLog remembers before it forgets quiet ones
EXPIRY_WARNING_DAYS = 30


class ExpiredCertificate(ValueError):
    """A certificate file with a certificate that has expired."""


def add_arguments(parser):
    parser.add_argument("--tls-cert", metavar="FILE",
                        help="PEM certificate chain: serve TLS, with --tls-key (default: no TLS)")
    parser.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert (default: none)")
    parser.add_argument("--tls-client-ca", metavar="FILE",
                        help="PEM CA certificates: require client certificates signed by them, mutual TLS "
                             "(default: no client certificates)")
    parser.add_argument("--token-file", metavar="FILE",
                        help="bearer tokens, one per line ('TOKEN ro': read-only); every call but health "
                             "must carry one (default: no tokens)")
    parser.add_argument("--insecure", action="store_true",
                        help="WEAKENS SECURITY: allow a non-loopback --host without TLS, or with TLS but "
                             "neither a token nor client certificates, so any peer that reaches the port can "
                             "read and change every value (default: refuse)")


def read_tokens(path):
    """{token: read_only} from a token file; ValueError naming the line of a malformed one."""
    with open(path, encoding="utf-8") as file:
        lines = file.read().splitlines()
    tokens = {}
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2 or len(fields) == 2 and fields[1] != READ_ONLY_MARK:
            raise ValueError(f"--token-file line {number}: expected 'TOKEN' or 'TOKEN {READ_ONLY_MARK}'")
        if len(fields[0]) < MIN_TOKEN_CHARS or not (fields[0].isascii() and fields[0].isprintable()):
            raise ValueError(f"--token-file line {number}: a token needs at least {MIN_TOKEN_CHARS} "
                             "printable ASCII characters (gRPC metadata carries no others)")
        tokens[fields[0]] = len(fields) == 2
    if not tokens:
        raise ValueError("--token-file holds no token")
    return tokens


class ServerSecurity:
    """The security options of one server; see the module docstring."""

    def __init__(self, tls_cert=None, tls_key=None, tls_client_ca=None, token_file=None, insecure=False):
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if tls_client_ca is not None and tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        self._files = tuple(path for path in (tls_cert, tls_key, tls_client_ca) if path is not None)
        self.tls, self.mutual, self.insecure = tls_cert is not None, tls_client_ca is not None, insecure
        self.tokens = read_tokens(token_file) if token_file is not None else {}
        self.warnings = []  # for the log at start
        mode = os.stat(token_file).st_mode & 0o777 if token_file is not None else 0
        if mode & 0o007:  # a group may be meant (Kubernetes' fsGroup)
            self.warnings.append(f"--token-file {token_file} can be read by every user of the host (mode {mode:o}): "
                                 "chmod o-rwx it")
        # The last files that could be taken: their gRPC configuration, the data channel's
        # context, and their stamp; whether gRPC has that configuration; the stamp of files refused.
        self._config = self._context = self._stamp = self._refused = None
        self._grpc_current = True
        self._lock = threading.Lock()  # gRPC asks from its threads, the data channel from the event loop
        if self.tls:
            self._stamp = self._file_stamp()
            (self._config, expiries), self._context = self._load(), self._data_channel_context_of_files()
            self.warnings += _adopt(expiries)

    @classmethod
    def from_args(cls, args):
        """ValueError with one line naming the flag, its file and what is wrong with it."""
        files = {"--tls-cert": args.tls_cert, "--tls-key": args.tls_key, "--tls-client-ca": args.tls_client_ca,
                 "--token-file": args.token_file}
        try:
            _check_pem_files(files)
            return cls(args.tls_cert, args.tls_key, args.tls_client_ca, args.token_file, args.insecure)
        except ssl.SSLError as error:
            why = (error.reason or str(error)).lower()
            if "key_values_mismatch" in why or "mismatch" in why:
                why = "the key is not the certificate's"
            raise ValueError(f"--tls-key {args.tls_key} does not go with --tls-cert {args.tls_cert}: {why}") from None
        except OSError as error:
            flag = next((flag for flag, path in files.items() if path == error.filename), "a file")
            raise ValueError(f"{flag} {error.filename}: cannot read it: {error.strerror}") from None

    def refusal(self, host):
        """Why not to listen on ``host`` (one line), or None."""
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if is_loopback(bare) or (self.tls and (self.tokens or self.mutual)):
            return None
        if self.tokens:
            return (f"refusing --host {host} with tokens but no TLS: tokens would cross the network in "
                    "plaintext; add --tls-cert and --tls-key")
        if self.insecure:
            return None
        if self.tls:
            return (f"refusing --host {host} with TLS but neither a token nor client certificates: TLS encrypts, "
                    "but any peer could still read and change every value; add --token-file or --tls-client-ca, "
                    "or --insecure to accept that")
        return (f"refusing --host {host} with neither TLS nor a token: any peer could read and change every "
                "value; add --tls-cert/--tls-key and --token-file, or --insecure to accept that")

    def describe(self):
        tls = "mutual TLS" if self.mutual else "TLS" if self.tls else "plaintext"
        return f"{tls}, {'tokens' if self.tokens else 'no tokens'}"

    def interceptors(self):
        return [TokenInterceptor(self.tokens)] if self.tokens else []

    def add_port(self, server, address):
        """Listen on ``address``, with TLS when configured; the port (0: failed)."""
        if not self.tls:
            return server.add_insecure_port(address)
        credentials = grpc.dynamic_ssl_server_credentials(
            self._config, self._fetch_config, require_client_authentication=self.mutual)
        return server.add_secure_port(address, credentials)

    @property
    def data_channel_context(self):
        """A function that gives the ssl.SSLContext of a new data-channel connection: of the
        files as they are now, when they can be taken (so a rotation reaches the data channel
        too), else of the last ones that could; None without TLS."""
        return self._data_channel_context if self.tls else None

    def _data_channel_context(self):
        self._refresh()
        return self._context

    def _data_channel_context_of_files(self):
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self._files[0], self._files[1])
        if self.mutual:
            context.load_verify_locations(self._files[2])
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def _file_stamp(self):
        """What changes when one of the files does (the error, while one cannot be looked at)."""
        try:
            return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in map(os.stat, self._files))
        except OSError as error:
            return f"{error.filename}: {error.strerror}"

    def _load(self):
        """(the gRPC certificate configuration of the files as they are now, {metric label:
        (flag, file, notAfter)} of its certificate files); ExpiredCertificate for one that expired."""
        cert, key, *ca = (Path(path).read_bytes() for path in self._files)
        ssl.create_default_context().load_cert_chain(self._files[0], self._files[1])  # a key that fits the cert
        expiries = {"server": _expiry("--tls-cert", self._files[0], cert, min)}
        if ca:
            expiries["client_ca"] = _expiry("--tls-client-ca", self._files[2], ca[0], max)
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca[0] if ca else None), \
            expiries

    def _fetch_config(self):
        """gRPC asks on each new connection: a new configuration when the files changed, else None."""
        self._refresh()
        with self._lock:
            if self._grpc_current:
                return None
            self._grpc_current = True
            return self._config

    def _refresh(self):
        """Take the files again if they changed since they were last looked at, unless they
        cannot be (mid-rotation, or expired: the last pair that could stays, with one warning)."""
        with self._lock:
            stamp = self._file_stamp()
            if stamp in (self._stamp, self._refused):
                return
            try:
                (config, expiries), context = self._load(), self._data_channel_context_of_files()
            except (OSError, ssl.SSLError, ValueError) as error:
                self._refused = stamp
                log.warning("TLS files changed but cannot be loaded (%s): keeping the previous certificate", error)
                return
            self._config, self._context, self._stamp, self._grpc_current = config, context, stamp, False
        log.info("TLS certificate files changed: new connections get the new certificate")
        for warning in _adopt(expiries):
            log.warning("%s", warning)


# What each TLS file must hold: a PEM block that begins so (a key's is "-----BEGIN ... PRIVATE KEY-----").
_PEM = {"--tls-cert": (b"-----BEGIN CERTIFICATE-----", "a PEM certificate"),
        "--tls-key": (b"PRIVATE KEY-----", "a PEM private key"),
        "--tls-client-ca": (b"-----BEGIN CERTIFICATE-----", "a PEM CA certificate")}


def _check_pem_files(files):
    """ValueError naming the flag and its file when a TLS file of ``files`` {flag: path or None}
    does not hold what it should (a certificate and its key swapped, say); OSError (its filename
    set) when one cannot be read."""
    for flag, (marker, what) in _PEM.items():
        if files[flag] is None:
            continue
        data = Path(files[flag]).read_bytes()
        if marker not in data:
            holds = "a private key" if b"PRIVATE KEY-----" in data else "a certificate" \
                if b"-----BEGIN CERTIFICATE-----" in data else "no PEM block"
            swapped = " (are --tls-cert and --tls-key swapped?)" if flag in ("--tls-cert", "--tls-key") and \
                holds in ("a private key", "a certificate") else ""
            raise ValueError(f"{flag} {files[flag]} holds {holds}, not {what}{swapped}")


def _expiry(flag, path, pem, first_or_last):
    """(``flag``, ``path``, the notAfter of the certificates in ``pem``, the bytes of ``path``,
    as an aware datetime: their first, ``min``, or last, ``max``); ExpiredCertificate when it
    has passed."""
    not_after = first_or_last(cert.not_valid_after_utc for cert in x509.load_pem_x509_certificates(pem))
    if not_after <= datetime.datetime.now(datetime.timezone.utc):
        raise ExpiredCertificate(f"{flag} {path} expired on {_day(not_after)}: renew it")
    return flag, path, not_after


def _adopt(expiries):
    """Set the expiry metric of the certificate files in use, {label: (flag, path, notAfter)};
    the warnings about those that expire within EXPIRY_WARNING_DAYS."""
    warnings = []
    soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=EXPIRY_WARNING_DAYS)
    for label, (flag, path, not_after) in expiries.items():
        metrics.CERTIFICATE_EXPIRY.labels(label).set(not_after.timestamp())
        if not_after < soon:
            warnings.append(f"{flag} {path} expires on {_day(not_after)}, within {EXPIRY_WARNING_DAYS} days: "
                            "renew it (replacing the files serves the new one to new connections)")
    return warnings


def _day(moment):
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC"


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Every call but health carries ``authorization: Bearer TOKEN`` with a token of the file:
    else UNAUTHENTICATED; a read-only token on a method that writes: PERMISSION_DENIED. The
    check happens before the handler runs, so neither answer says anything about keys."""

    def __init__(self, tokens):
        self._tokens = [(token.encode(), read_only) for token, read_only in tokens.items()]
        self._refusals = RefusalLog()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(PUBLIC_PREFIX):
            return handler
        presented = _presented(details.invocation_metadata)
        read_only = self._lookup(presented)
        if read_only is None:
            if presented:
                why = "this server does not accept the token this call carries"
            else:
                why = "this server requires a token"
            return self._refusal(handler, details.method, why, UnauthenticatedError(
                f"{why}: give a token of the server's --token-file (Python: token= or TENSORKV_TOKEN; the CLI: "
                "--token-file)"))
        if read_only and details.method not in READ_ONLY_METHODS:
            return self._refusal(handler, details.method, "a read-only token may not call it", PermissionDeniedError(
                f"a read-only token may call only Info, Pull, GetOptimizerStates, ListKeys and ReadKey, not "
                f"{details.method.rsplit('/', 1)[1]}"))
        return _read_only(handler) if read_only else handler

    def _refusal(self, handler, method, why, error):
        """A handler that logs the refusal (RefusalLog) and fails the call with ``error``
        without reading its request: one that streams its requests, which gRPC reads only
        when asked (it reads a unary request whole before the handler runs: a caller without
        a token would have the server take in gRPC's longest message per call)."""
        async def refuse(requests, context):
            self._refusals.note(context.peer(), method.rsplit("/", 1)[1], why, error.code)
            await context.abort(grpc.StatusCode[error.code], str(error),
                                trailing_metadata=((ERROR_METADATA_KEY, type(error).__name__),))
        return _HANDLERS[True, handler.response_streaming](refuse)

    def _lookup(self, presented):
        """Whether the token ``presented`` (bytes) is read-only; None when it is not a known
        token. Every token is compared, in constant time, so the time taken says nothing
        about them."""
        found = None
        for token, read_only in self._tokens:
            if hmac.compare_digest(token, presented):
                found = read_only
        return found


def _read_only(handler):
    """``handler`` run with READ_ONLY_CALL set (in the call's own task, as gRPC runs each call)."""
    kind = handler.request_streaming, handler.response_streaming
    behavior = getattr(handler, _BEHAVIORS[kind])
    if inspect.isasyncgenfunction(behavior):
        async def marked(request, context):
            READ_ONLY_CALL.set(True)
            async for response in behavior(request, context):
                yield response
    else:
        async def marked(request, context):
            READ_ONLY_CALL.set(True)
            return await behavior(request, context)
    return _HANDLERS[kind](marked, request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)


def _presented(metadata):
    """The bearer token of a call's ``authorization`` metadata, as bytes (b"": none)."""
    value = next((v for k, v in metadata or () if k == "authorization"), "")
    scheme, _, presented = value.partition(" ")
    return presented.strip().encode() if scheme.lower() == "bearer" else b""


_HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


_BEHAVIORS = {(False, False): "unary_unary", (False, True): "unary_stream", (True, False): "stream_unary",
              (True, True): "stream_stream"}


class RefusalLog:
    """Log lines for calls refused by the token check, for whoever looks into a worker that
    cannot get in or a peer that tries tokens: the first refusal of each (peer host, reason)
    at once, then at most one line per ``interval`` seconds for it, counting the refusals in
    between, so that a client retrying in a loop cannot flood the log."""

    def __init__(self, interval=60.0, clock=time.monotonic):
        self._interval, self._clock = interval, clock
        self._last = {}  # (host, why) -> (when its last line was written, refusals since)

    def note(self, peer, method, why, code):
        host = _peer_host(peer)
        now = self._clock()
        logged, since = self._last.get((host, why), (None, 0))
        if logged is not None and now - logged < self._interval:
            self._last[host, why] = logged, since + 1
            return
        if len(self._last) >= _REFUSALS_KEPT:  # many hosts: forget those quiet for an interval
            self._last = {kept: entry for kept, entry in self._last.items() if now - entry[0] < self._interval}
        more = f" ({since} more from this host since the last such line)" if since else ""
        log.warning("call to %s from %s refused (%s): %s%s", method, peer, code, why, more,
                    extra={"event": "call_refused", "peer": peer})
        self._last[host, why] = now, 0


def _peer_host(peer):
    """The host of a gRPC peer string (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:...``)."""
    return peer.rpartition(":")[0] if peer.startswith(("ipv4:", "ipv6:")) else peer
