"""How a client reaches servers: TLS (optionally with a client certificate) and a bearer token.

:class:`Security` builds every gRPC channel of a store. With ``tls_ca`` the channel is TLS
and the server's certificate must be signed by that CA; ``tls_cert`` and ``tls_key`` add
this client's certificate (servers started with ``--tls-client-ca`` require one). A
``token`` travels as ``authorization: Bearer <token>`` on every call, as gRPC call
credentials, which gRPC sends only on protected channels: over TLS, or in plaintext to a
loopback address (local credentials), never in plaintext across a network.

A connection that fails its handshake fails at once: :meth:`Security.diagnose` names the
reason (a server that speaks TLS to a plaintext client or the reverse, a certificate that is
expired or signed by another CA, a client certificate missing or refused).
"""
import socket
import ssl
import time
from dataclasses import dataclass

import grpc

from ..config import SECURITY_FIELDS, ClientConfig
from ..errors import InvalidArgumentError, UnauthenticatedError
from ..wire.addresses import is_loopback, split_host_port

CONNECT_POLL = 0.2  # seconds between looks at a channel that does not connect
PROBE_TIMEOUT = 5.0  # seconds the diagnosis of a failed handshake takes at most
_PLAINTEXT_REASONS = ("WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL", "RECORD_LAYER_FAILURE", "HTTP_REQUEST")


def _read(path, what):
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise InvalidArgumentError(f"cannot read the {what} file {path} ({what}= or TENSORKV_{what.upper()}): "
                                   f"{error.strerror}") from None


@dataclass(frozen=True)
class Security:
    """PEM files of the CA that signs the servers' certificates, of this client's certificate
    and key (mutual TLS), and a bearer token; each optional."""

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None

    @classmethod
    def from_options(cls, tls_ca=None, tls_cert=None, tls_key=None, token=None):
        """The arguments given, else TENSORKV_TLS_CA, TENSORKV_TLS_CERT, TENSORKV_TLS_KEY and
        TENSORKV_TOKEN (as tensorkv.ClientConfig reads them); InvalidArgumentError for a
        combination that cannot work."""
        given = ClientConfig(tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, token=token)
        return cls.from_config(given.resolved(SECURITY_FIELDS))

    @classmethod
    def from_config(cls, config):
        """The credentials of ``config`` (a tensorkv.ClientConfig whose security fields are
        resolved); InvalidArgumentError for a combination that cannot work."""
        security = cls(config.tls_ca, config.tls_cert, config.tls_key, config.token)
        if (security.tls_cert is None) != (security.tls_key is None):
            raise InvalidArgumentError("a client certificate needs both tls_cert= and tls_key= "
                                       "(TENSORKV_TLS_CERT, TENSORKV_TLS_KEY; the CLI: --tls-cert, --tls-key)")
        if security.tls_cert is not None and security.tls_ca is None:
            raise InvalidArgumentError("a client certificate is for TLS: pass tls_ca= (TENSORKV_TLS_CA; the CLI: --tls-ca) too")
        if security.token is not None and not security.token.isprintable():
            raise InvalidArgumentError("the token must be printable text on one line")
        return security

    @property
    def tls(self):
        return self.tls_ca is not None

    def channel(self, address, options):
        """A gRPC channel to ``address`` with these credentials."""
        if not self.tls:
            if self.token is None:
                return grpc.insecure_channel(address, options=options)
            if not is_loopback(split_host_port(address)[0]):
                raise InvalidArgumentError(
                    f"a token would cross the network in plaintext to {address}: "
                    "pass tls_ca= (TENSORKV_TLS_CA; the CLI: --tls-ca) to use TLS")
            return grpc.secure_channel(address, self._with_token(grpc.local_channel_credentials()), options=options)
        credentials = grpc.ssl_channel_credentials(*self._pems())
        return grpc.secure_channel(address, self._with_token(credentials), options=options)

    def _pems(self):
        root = _read(self.tls_ca, "tls_ca")
        if self.tls_cert is None:
            return root, None, None
        return root, _read(self.tls_key, "tls_key"), _read(self.tls_cert, "tls_cert")

    def _with_token(self, credentials):
        if self.token is None:
            return credentials
        return grpc.composite_channel_credentials(credentials, grpc.access_token_call_credentials(self.token))

    def wait_connected(self, channel, address, timeout):
        """Wait up to ``timeout`` seconds for ``channel`` to ``address`` to connect (a server
        still starting is waited for); the seconds left of ``timeout`` for the first call (which
        says that the server is unreachable if it has not connected). A failed handshake raises
        UnauthenticatedError at once."""
        deadline = time.monotonic() + timeout
        ready = grpc.channel_ready_future(channel)
        try:
            while not ready.done() and time.monotonic() < deadline:
                try:
                    ready.result(timeout=max(0.0, min(CONNECT_POLL, deadline - time.monotonic())))
                except grpc.FutureTimeoutError:
                    error = self.diagnose(address)
                    if error is not None:
                        raise error from None
        finally:
            ready.cancel()
        return max(CONNECT_POLL, deadline - time.monotonic())

    def diagnose(self, address):
        """UnauthenticatedError saying why a connection to ``address`` fails its handshake; None
        when the server is not listening or the handshake succeeds (nothing to say)."""
        host, port = split_host_port(address)
        try:
            sock = socket.create_connection((host, port), PROBE_TIMEOUT)
        except OSError:
            return None  # not up (yet): the caller keeps waiting
        with sock:
            if self.tls:
                return self._diagnose_tls(sock, host, address)
            return self._diagnose_plaintext(sock, host, address)

    @staticmethod
    def _diagnose_plaintext(sock, host, address):
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        try:
            with context.wrap_socket(sock, server_hostname=host):
                pass
        except (OSError, ssl.SSLError):
            return None  # not a TLS server: this client's plaintext is right
        return UnauthenticatedError(f"server {address} uses TLS and this client does not: "
                                    "pass tls_ca= (TENSORKV_TLS_CA; the CLI: --tls-ca), the CA that signed its certificate")

    def data_channel_context(self):
        """The ssl.SSLContext of data channels (the same checks as the gRPC channel); None without TLS."""
        if not self.tls:
            return None
        context = ssl.create_default_context(cadata=_read(self.tls_ca, "tls_ca").decode("ascii"))
        if self.tls_cert is not None:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        return context

    def _diagnose_tls(self, sock, host, address):
        context = self.data_channel_context()
        context.set_alpn_protocols(["h2"])
        try:
            with context.wrap_socket(sock, server_hostname=host) as tls:
                # With TLS 1.3 a server refuses the client's certificate after the handshake:
                # it closes the connection instead of sending its first HTTP/2 frame.
                tls.settimeout(PROBE_TIMEOUT)
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                if tls.recv(1):
                    return None
        except ssl.SSLCertVerificationError as error:
            return UnauthenticatedError(
                f"server {address}: its certificate is not trusted ({error.verify_message}); "
                "tls_ca= (the CLI: --tls-ca) must be the CA that signed it, for this host name, within its dates")
        except ssl.SSLError as error:
            if error.reason in _PLAINTEXT_REASONS:
                return UnauthenticatedError(f"server {address} does not use TLS: connect without tls_ca=, "
                                            "or start the server with --tls-cert and --tls-key")
        except OSError as error:
            if not isinstance(error, ConnectionError):
                return None
        if self.tls_cert is None:
            return UnauthenticatedError(f"server {address} requires a client certificate: "
                                        "pass tls_cert= and tls_key= (TENSORKV_TLS_CERT, TENSORKV_TLS_KEY; the CLI: --tls-cert, --tls-key)")
        return UnauthenticatedError(f"server {address} refused this client's certificate: "
                                    "it must be signed by the CA of the server's --tls-client-ca, and valid now")
