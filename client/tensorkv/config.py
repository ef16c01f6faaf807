"""The worker's settings: :class:`ClientConfig`, one field per setting, filled when a store is
created (never when tensorkv is imported) from the keyword arguments of
``tensorkv.create``, else a ``config=ClientConfig(...)``, else the field's ``TENSORKV_*``
variable, else its default. A bad value raises InvalidArgumentError naming the argument
or the variable (tensorkv.env's checks). On the client this module is the one reader of
``os.environ`` for settings.

>>> config = ClientConfig(servers="127.0.0.1:50051", timeout=30).resolved()
>>> config.servers, config.timeout, config.bigarray_bound
(['127.0.0.1:50051'], 30.0, 1000000)
>>> ClientConfig(servers="h1:1", transport="udp").resolved()
Traceback (most recent call last):
...
tensorkv.errors.InvalidArgumentError: unknown transport 'udp'; use one of 'auto', 'tcp', 'grpc'
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from collections.abc import Iterable
from typing import Any

from . import env
from .errors import InvalidArgumentError

TRANSPORTS = ("auto", "tcp", "grpc")
IF_EXISTS = ("fail", "resume", "replace")
SECURITY_FIELDS = ("tls_ca", "tls_cert", "tls_key", "token")


def _setting(variable, default, read, secret=False):
    """A field: None until resolved; then the argument given, else ``variable``, else
    ``default``, as ``read(name, variable, given, default)`` checks it. A ``secret`` one stays
    out of the config's repr."""
    return dataclasses.field(default=None, repr=not secret,
                             metadata={"variable": variable, "default": default, "read": read})


def _whole(low):
    return lambda name, variable, given, default: env.integer(variable, default, low, given=given, argument=name)


def _seconds(name, variable, given, default):
    return env.number(variable, default, given=given, argument=name)


def _choice(choices):
    return lambda name, variable, given, default: env.choice(variable, given, choices, default, argument=name)


def _text(name, variable, given, default):
    """A string (a path or a token): the argument when not None or empty, else the variable's."""
    if given is None or given == "":
        return os.environ.get(variable) or default
    if not isinstance(given, (str, os.PathLike)):
        raise InvalidArgumentError(f"{name}={given!r} is not a string")
    return os.fspath(given)


def _switch(name, variable, given, default):
    """``given`` (True or False), else the negation of the flag ``variable`` (TENSORKV_NO_...)."""
    if given is None:
        return not env.flag(variable)
    if not isinstance(given, bool):
        raise InvalidArgumentError(f"{name}={given!r} is neither True nor False")
    return given


def _malloc_tuning(name, variable, given, default):
    """Also off while the user set GLIBC_TUNABLES (their choice of malloc's settings wins)."""
    return _switch(name, variable, given, default) and os.environ.get("GLIBC_TUNABLES") is None


def _servers(name, variable, given, default):
    if given is None:
        return parse_servers(os.environ.get(variable, ""), variable)
    return parse_servers(given, name)


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """Every setting of a dist worker (``tensorkv.create('dist_sync', ...)``). A field left
    None is filled by :meth:`resolved` from its ``TENSORKV_*`` variable, else its default;
    docs/reference.md's table of worker settings lists them all.

    >>> ClientConfig(servers=["h1:50051", "h2:50051"], rank=0, num_workers=2).resolved().rank
    0
    """

    # servers is the list of servers, 'host:port' (or '[IPv6]:port'), as a list or one
    # comma-separated string. Required.
    servers: list[str] | str | None = _setting("TENSORKV_SERVERS", None, _servers)
    # rank is this worker's rank; None: the server assigns the lowest free one.
    rank: int | None = _setting("TENSORKV_RANK", None, _whole(0))
    # num_workers is checked against the servers' --num-workers; None: taken from them.
    num_workers: int | None = _setting("TENSORKV_NUM_WORKERS", None, _whole(1))
    # timeout is the seconds any call may take, reconnecting included (default 120).
    timeout: float | None = _setting("TENSORKV_TIMEOUT", 120.0, _seconds)
    # connect_timeout is the seconds each server gets to answer at start (default 10).
    connect_timeout: float | None = _setting("TENSORKV_CONNECT_TIMEOUT", 10.0, _seconds)
    # transport is how values travel: 'auto' (shared memory on the server's host, else the
    # data channel), 'tcp' (the data channel only) or 'grpc' (in the gRPC messages).
    transport: str | None = _setting("TENSORKV_TRANSPORT", "auto", _choice(TRANSPORTS))
    # session is whether small calls go on one Session stream per server (default True;
    # TENSORKV_NO_SESSION=1 turns it off).
    session: bool | None = _setting("TENSORKV_NO_SESSION", True, _switch)
    # tls_ca is the PEM file of the CA that signs the servers' certificates; None: no TLS.
    tls_ca: str | os.PathLike[str] | None = _setting("TENSORKV_TLS_CA", None, _text)
    # tls_cert and tls_key are this client's PEM certificate and key, for mutual TLS.
    tls_cert: str | os.PathLike[str] | None = _setting("TENSORKV_TLS_CERT", None, _text)
    tls_key: str | os.PathLike[str] | None = _setting("TENSORKV_TLS_KEY", None, _text)
    # token is the bearer token sent with every call; None: none.
    token: str | None = _setting("TENSORKV_TOKEN", None, _text, secret=True)
    # job names the job this worker belongs to ('' : none; tensorkv-launch sets it).
    job: str | None = _setting("TENSORKV_JOB", "", _text)
    # if_exists is what a new run does with the keys an earlier run left: 'fail', 'resume'
    # or 'replace'.
    if_exists: str | None = _setting("TENSORKV_IF_EXISTS", "fail", _choice(IF_EXISTS))
    # bigarray_bound is the number of elements above which a value is sliced over the servers.
    bigarray_bound: int | None = _setting("TENSORKV_BIGARRAY_BOUND", 1_000_000, _whole(1))
    # chunk_bytes is the most data bytes of one message the client sends (1 MiB); calls on a
    # Session stream move at most this many bytes in its messages.
    chunk_bytes: int | None = _setting("TENSORKV_CHUNK_BYTES", 1 << 20, _whole(1))
    # shm_min_bytes: values of at least this many bytes travel through shared memory (16 KiB).
    shm_min_bytes: int | None = _setting("TENSORKV_SHM_MIN_BYTES", 16 << 10, _whole(0))
    # datachan_min_bytes: values of at least this many bytes travel on the data channel (64 KiB).
    datachan_min_bytes: int | None = _setting("TENSORKV_DATACHAN_MIN_BYTES", 64 << 10, _whole(0))
    # pack_min_values: a list call of at least this many small values for one server moves
    # them packed in one buffer (16).
    pack_min_values: int | None = _setting("TENSORKV_PACK_MIN_VALUES", 16, _whole(0))
    # malloc_tuning is whether a store raises glibc's mmap threshold in this process (default
    # True; TENSORKV_NO_MALLOC_TUNING=1 or the user's GLIBC_TUNABLES turn it off).
    malloc_tuning: bool | None = _setting("TENSORKV_NO_MALLOC_TUNING", True, _malloc_tuning)

    def resolved(self, names: Iterable[str] | None = None) -> ClientConfig:
        """A copy with each field (of ``names``, default all) checked and, where None, filled
        from its variable or its default; InvalidArgumentError naming the argument or variable."""
        names = [field.name for field in dataclasses.fields(self)] if names is None else names
        return dataclasses.replace(self, **{name: resolve(name, getattr(self, name)) for name in names})

    def merged(self, **given: Any) -> ClientConfig:
        """A copy with the arguments of ``given`` that are not None in place of its fields."""
        return dataclasses.replace(self, **{name: value for name, value in given.items() if value is not None})


FIELDS = {field.name: field for field in dataclasses.fields(ClientConfig)}


def resolve(name, given):
    """The value of the setting ``name``: ``given`` checked, or when None its variable's, or
    its default."""
    metadata = FIELDS[name].metadata
    return metadata["read"](name, metadata["variable"], given, metadata["default"])


def default(name):
    """The default of the setting ``name``."""
    return FIELDS[name].metadata["default"]


def variable(name):
    """The ``TENSORKV_*`` variable of the setting ``name``."""
    return FIELDS[name].metadata["variable"]


def variable_text(name):
    """The text of the variable of the setting ``name`` as it is set, unchecked (None when it is
    unset or empty): the default of a command's option (``tensorkv --servers``)."""
    return os.environ.get(variable(name)) or None


def parse_servers(servers, source="servers"):
    """A list of 'host:port' from a comma-separated string or a list, each checked
    (InvalidArgumentError naming ``source`` and the entry) before any connection is tried."""
    if isinstance(servers, str):
        servers = servers.split(",")
    servers = [str(s).strip() for s in servers if str(s).strip()]
    if not servers:
        raise InvalidArgumentError("no servers given: pass servers='host:port,...' or set TENSORKV_SERVERS")
    for entry in servers:
        why = _address_problem(entry)
        if why:
            raise InvalidArgumentError(f"{source}: {entry!r} is not a server address host:port: {why}")
    return servers


_HOST_NAME = re.compile(r"[A-Za-z0-9._-]+")


def _address_problem(entry):
    """What is wrong with ``entry`` as 'host:port' or '[IPv6 address]:port'; '' if nothing."""
    _, has_scheme, rest = entry.partition("://")
    if has_scheme:
        return f"drop the scheme: write {rest!r}"
    if entry.startswith("["):
        address, bracket, port = entry[1:].partition("]")
        if not bracket:
            return "no ']' after the IPv6 address"
        try:
            ipaddress.IPv6Address(address)
        except ValueError:
            return f"{address!r} is not an IPv6 address"
        if not port.startswith(":"):
            return f"no port: write e.g. '[{address}]:50051'"
        port = port[1:]
    else:
        host, colon, port = entry.rpartition(":")
        if not colon:
            return f"no port: write e.g. '{entry}:50051'"
        if ":" in host:
            return f"an IPv6 address goes in brackets: write '[{host}]:{port}'"
        if not host:
            return "no host before the port"
        if not _HOST_NAME.fullmatch(host):
            return f"{host!r} is not a host name or address"
    if not (port.isascii() and port.isdigit()):
        return f"port {port!r} is not a number"
    if not 1 <= int(port) <= 65535:
        return f"port {port} is not in 1..65535"
    return ""
