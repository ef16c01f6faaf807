"""Shared-memory regions on the server: the sealed memory files that clients on this host
registered on their Session streams (the client's half is ``tensorkv.transport.shm``).

A client names a file by its pid and a descriptor it holds open on it; the server opens
``/proc/<pid>/fd/<fd>``, which only works on the same host, as the same user (or root) and in
the same pid namespace. It maps the file only when

- the file is sealed against shrinking, growing and further sealing (``tensorkv.wire.shm.SEALS``):
  seals can never be removed, so the size checked is the size for good and no access to the
  mapping can fault past the end of the file (SIGBUS), whatever the client does afterwards;
- it is a memfd of the kernel's shared memory (checked before the file is opened, so that
  no other kind of file is ever opened; on hugetlbfs, a hole punched in a mapped file may
  have no huge page to refill it, which is SIGBUS too) of the size registered;
- it belongs to the user who owns the caller's end of its connection (the one established
  connection of ``/proc/net/tcp`` or ``tcp6`` with both of this connection's ends; root may
  register any): the server, which may run as another user, never opens a file on
  behalf of a caller who could not open it itself (a file of another user's process whose
  first bytes are known, e.g. zero, would pass the token check below);
- its first bytes are the random token that the client sent over its own stream: the caller
  can read the file.

A client with CUDA asks for its region to be pinned (SharedMemoryRegion.cuda): a server whose
values live on a GPU then registers its mapping as pinned memory too (cudaHostRegister, once,
unregistered as it is released), reads a pushed value from it host to device straight onto the
GPU, and writes a pulled one into it device to host (tensorkv_server.staging). A stream that
attached a region may also open a client's CUDA IPC buffers (tensorkv_server.cuda_ipc), which
references name by their ids as they name regions.

The server then overwrites the token with random bytes of its own (no replay). Clients write
no values in a region's header, so these bytes stay unknown to anyone who cannot read the
file, and the file, which stays openable through /proc while a process holds it, cannot be
registered again by someone who could not read and write it anyway. A region is known only
to the stream that registered it, by an id of 64 random bits, and is unmapped when that
stream ends however it ends (close, error, the client killed). Every reference is
bounds-checked against the mapped size, so a client can make the server read or write only
memory that it could read and write itself.
"""
import fcntl
import functools
import hmac
import ipaddress
import logging
import mmap
import os
import secrets
import sys

import numpy as np

from tensorkv.backend import DeviceBytes, on_gpu
from tensorkv.wire import shm
from tensorkv.wire.codec import Item
from tensorkv.wire.shm import Placement, aligned, check_ref
from tensorkv.errors import FailedPreconditionError, InvalidArgumentError, InvalidTensorError

from . import cuda_ipc

log = logging.getLogger(__name__)

# The most regions one stream may hold, the largest region, and the most CUDA IPC buffers.
MAX_REGIONS = 16
MAX_REGION_BYTES = 1 << 40
MAX_CUDA_BUFFERS = 1024


def _mount_id(fd):
    """The id of the mount that the file of descriptor ``fd`` is on."""
    with open(f"/proc/self/fdinfo/{fd}") as info:
        for line in info:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    return None


@functools.cache
def _memfd_mount_id():
    """The id of the kernel's shared-memory mount, where every plain memfd lives."""
    fd = os.memfd_create("tensorkv_probe", os.MFD_CLOEXEC)
    try:
        return _mount_id(fd)
    finally:
        os.close(fd)


def available():
    """Whether this host has sealed memory files, and /proc to find them by and tell them."""
    try:
        return shm.available() and _memfd_mount_id() is not None
    except OSError:  # no /proc, or memfds refused (a sandbox)
        return False


class _Attached:
    """One mapped region, ``what`` names it: ``readable`` (read-only view, for pushed values)
    and ``writable`` (for the values the server returns into it); with ``staging`` (a GPU
    server's, once :meth:`pin` registered it as pinned memory), values move straight between
    it and the GPU."""

    device = False  # host memory

    def __init__(self, what, mapping, size):
        self.what, self.mapping, self.size = what, mapping, size
        self.writable = np.frombuffer(mapping, np.uint8)
        self.readable = self.writable.view()
        self.readable.flags.writeable = False
        self.staging = self._unpin = None

    def pin(self, staging):
        """Register the mapping as pinned memory on ``staging``'s GPU; whether it is."""
        try:
            self._unpin = staging.pin(self.writable)
        except staging.cupy.cuda.runtime.CUDARuntimeError as error:
            log.warning("shared memory: %s is not pinned (%s): its values go through pageable memory", self.what,
                        error)
            return False
        self.staging = staging
        return True

    def read(self, offset, length):
        """The bytes [offset, offset + length) (checked by the caller) of a pushed value: on the
        GPU, copied there straight, where the region is pinned."""
        if self.staging is None:
            return self.readable[offset:offset + length]
        return DeviceBytes(self.staging.from_host(self.writable.ctypes.data + offset, length))

    def write(self, offset, item, region_id):
        """Write the value of ``item`` at ``offset`` (room checked by the caller); the item that
        references it."""
        array = item.array
        if self.staging is not None and on_gpu(array):
            self.staging.to_host(array, self.writable.ctypes.data + offset)
            return Item(item.key, array, item.shape, item.slice, ref=(region_id, offset, array.nbytes))
        return Placement(self.writable, region_id, offset).put(item)

    def close(self):
        if self._unpin is not None:
            self.staging.settle()  # no copy may still read or write the memory
            self._unpin()
            self._unpin = self.staging = None
        self.writable = self.readable = None
        try:
            self.mapping.close()
        except BufferError:  # a view is still alive (a call in flight): unmapped when it goes
            pass


ESTABLISHED = "01"  # the state column of /proc/net/tcp for an established connection
TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def peer_uid(peer):
    """The user that owns the caller's end of the TCP connection of the gRPC peer ``peer``
    ('ipv4:127.0.0.1:PORT', 'ipv6:[::1]:PORT') on this host's network namespace, from
    /proc/net/tcp and tcp6; None when that connection is not found there exactly once (not
    TCP, from another namespace or host). See :func:`connection_uid`."""
    address = _peer_address(peer)
    if address is None:
        return None
    rows = []
    for table in TCP_TABLES:
        try:
            with open(table) as file:
                rows += file.read().splitlines()[1:]
        except OSError:
            continue
    return connection_uid(address, rows, _own_sockets())


def connection_uid(peer, rows, own):
    """The uid of the row of ``rows`` (lines of /proc/net/tcp or tcp6) that is the caller's
    end of the connection from ``peer`` ((ip, port)) to one of ``own`` sockets (inode numbers
    of this process's sockets); None unless exactly one row is.

    Both ends are matched, and only established connections: first this process's end (local
    address any, remote ``peer``), whose local address is the one the caller connected to; then
    the caller's end, local ``peer`` and remote that address. A port alone is not enough: the
    kernel lists a connection in TIME_WAIT, which anyone can leave on a port of their own and
    then connect from that port again, with uid 0."""
    parsed = [entry for entry in map(_row, rows) if entry is not None and entry[2] == ESTABLISHED]
    ours = [local for local, remote, _, _, inode in parsed if remote == peer and inode in own]
    if len(ours) != 1:
        return None
    theirs = [uid for local, remote, _, uid, _ in parsed if local == peer and remote == ours[0]]
    return theirs[0] if len(theirs) == 1 else None


def _peer_address(peer):
    """(ip, port) of a gRPC peer string; None for another kind (unix:...) or a malformed one."""
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = address.rpartition(":")
    try:
        return _unmapped(ipaddress.ip_address(host.strip("[]"))), int(port)
    except ValueError:
        return None


def _row(row):
    """(local (ip, port), remote (ip, port), state, uid, inode) of a line of /proc/net/tcp or
    tcp6 (sl, local_address, rem_address, st, tx:rx, tr:when, retrnsmt, uid, timeout, inode);
    None for a line that is not one."""
    fields = row.split()
    try:
        return _proc_address(fields[1]), _proc_address(fields[2]), fields[3], int(fields[7]), int(fields[9])
    except (IndexError, ValueError):
        return None


def _proc_address(text):
    ip, _, port = text.partition(":")
    return _unmapped(_proc_ip(ip)), int(port, 16)


def _own_sockets():
    """The inode numbers of this process's sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _unmapped(ip):
    """``ip``, an IPv4 address where it is one mapped into IPv6 (a dual-stack socket's view)."""
    return getattr(ip, "ipv4_mapped", None) or ip


def _proc_ip(text):
    """The address of /proc/net/tcp's hex notation: 32-bit words in the host's byte order."""
    raw = bytes.fromhex(text)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw)


def attach(pid, fd, size, token, caller_uid):
    """Map the memory file that process ``pid`` holds open as ``fd``, of ``size`` bytes, if it
    is sealed, belongs to ``caller_uid`` (the user of the caller's connection; root: any) and
    its first bytes are ``token``; then overwrite them. FailedPreconditionError when it cannot
    be attached, which says as little about other processes' files as it can."""
    if len(token) != shm.TOKEN_BYTES:
        raise InvalidArgumentError(f"shared-memory token has {len(token)} bytes, not {shm.TOKEN_BYTES}")
    if not shm.HEADER_BYTES <= size <= MAX_REGION_BYTES:
        raise InvalidArgumentError(f"shared-memory region of {size} bytes is outside [{shm.HEADER_BYTES}, "
                                   f"{MAX_REGION_BYTES}]")
    what = f"descriptor {fd} of process {pid}"
    refusal = FailedPreconditionError(f"cannot use {what}: the server takes only a sealed memfd of the caller's "
                                      "own user, on its host and in its pid namespace")
    if caller_uid is None:
        log.info("shared memory: %s refused: the caller's connection is not found, established, exactly once "
                 "in /proc/net/tcp or tcp6", what)
        raise refusal
    try:
        # Found, not opened (O_PATH): nothing of the file runs before it is known to be a memfd
        # (a device's open, a FUSE server that never answers).
        found = os.open(f"/proc/{pid}/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
    except OSError as error:
        log.info("shared memory: %s refused: %s", what, error.strerror)
        raise refusal from None
    try:
        owner = os.fstat(found).st_uid
        if caller_uid != 0 and owner != caller_uid:
            log.warning("shared memory: %s refused: it belongs to uid %d, the caller is uid %d", what, owner,
                        caller_uid)
            raise refusal
        if _mount_id(found) != _memfd_mount_id():
            raise FailedPreconditionError(f"{what} is not a memfd (a memory file of the kernel's shared memory)")
        opened = os.open(f"/proc/self/fd/{found}", os.O_RDWR | os.O_CLOEXEC)
    finally:
        os.close(found)
    try:
        if fcntl.fcntl(opened, fcntl.F_GET_SEALS) & shm.SEALS != shm.SEALS:
            raise FailedPreconditionError(f"{what} is not sealed with F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL: "
                                          "its size could change under the server's mapping")
        actual = os.fstat(opened).st_size  # after the seals: it cannot change any more
        if actual != size:
            raise FailedPreconditionError(f"{what} has {actual} bytes, not {size}")
        if not hmac.compare_digest(os.pread(opened, shm.TOKEN_BYTES, 0), token):
            raise FailedPreconditionError(f"{what}: the token does not match; the caller did not prove that it "
                                          "can read the file")
        try:
            mapping = mmap.mmap(opened, size)
        except OSError as error:
            raise FailedPreconditionError(f"cannot map {what} ({error.strerror})") from None
    finally:
        os.close(opened)
    mapping[:shm.TOKEN_BYTES] = secrets.token_bytes(shm.TOKEN_BYTES)
    return _Attached(what, mapping, size)


class Regions:
    """The regions of one Session stream, and the CUDA IPC buffers it opened, by id;
    ``staging``: the server's GPU staging.Staging where its values live on a GPU, else None."""

    def __init__(self, peer, staging=None):
        self.peer, self.staging = peer, staging
        self._by_id = {}
        # Whether the call in progress referenced a CUDA IPC buffer (until :meth:`settle`): the
        # engine may read it after a suspension, after another stream's call settled.
        self._read_device = False
        # The user of the caller's connection, once it attached a region: on this host, and
        # the owner of memory it could read and write itself.
        self.proven_uid = None

    def register(self, region):
        """Attach ``region`` (a SharedMemoryRegion message), pinned where it asks and the
        server's values live on a GPU; (its new id, whether it is pinned)."""
        if sum(not r.device for r in self._by_id.values()) >= MAX_REGIONS:
            raise FailedPreconditionError(f"a stream may register at most {MAX_REGIONS} shared-memory regions")
        caller_uid = peer_uid(self.peer)
        attached = attach(region.pid, region.fd, region.size, region.token, caller_uid)
        pinned = region.cuda and self.staging is not None and attached.pin(self.staging)
        self.proven_uid = caller_uid
        region_id = self._add(attached)
        log.info("shared-memory region (%s, %d bytes%s) attached for %s", attached.what, attached.size,
                 ", pinned" if pinned else "", self.peer)
        return region_id, pinned

    def open_cuda_buffer(self, message):
        """Open the CUDA IPC buffer ``message`` (a CudaIpcBuffer) for a caller of the server's
        own user (or root) that proved its host and user with a region; its new id. A handle
        alone proves neither: a process of another user that came by one must not have the
        server open that user's GPU memory for it."""
        if self.staging is None:
            raise FailedPreconditionError("CUDA IPC: this server's values are not on a GPU (--device cpu)")
        if self.proven_uid is None:
            raise FailedPreconditionError("CUDA IPC: this stream attached no shared-memory region, which proves the "
                                          "caller's host and user")
        if self.proven_uid not in (0, os.getuid()):
            raise FailedPreconditionError(f"CUDA IPC is for callers of the server's own user (uid {os.getuid()}) or "
                                          f"root; this one is uid {self.proven_uid}")
        if sum(r.device for r in self._by_id.values()) >= MAX_CUDA_BUFFERS:
            raise FailedPreconditionError(f"a stream may open at most {MAX_CUDA_BUFFERS} CUDA IPC buffers")
        region_id = self._add(cuda_ipc.open_buffer(self.staging, message))
        log.debug("%s opened for %s", self._by_id[region_id].what, self.peer)
        return region_id

    def _add(self, region):
        region_id = secrets.randbits(64) or 1
        while region_id in self._by_id:
            region_id = secrets.randbits(64) or 1
        self._by_id[region_id] = region
        return region_id

    @property
    def route(self):
        """How this stream's large values travel: 'cuda-ipc', 'pinned-shm' or 'shm'; None
        without a region."""
        regions = self._by_id.values()
        if any(r.device for r in regions):
            return "cuda-ipc"
        if any(r.staging is not None for r in regions):
            return "pinned-shm"
        return "shm" if self._by_id else None

    def unregister(self, region_id):
        self._get(region_id).close()
        del self._by_id[region_id]

    def _get(self, region_id):
        try:
            return self._by_id[region_id]
        except KeyError:
            raise InvalidTensorError(f"shared-memory region {region_id} is not registered on this stream") from None

    def resolve(self, region_id, offset, length):
        """The bytes that a pushed entry references, bounds-checked: read-only host bytes, or
        DeviceBytes (a pinned region's, copied to the GPU; a CUDA IPC buffer's)."""
        region = self._get(region_id)
        check_ref(region.size, offset, length)
        self._read_device = self._read_device or region.device
        return region.read(offset, length)

    def placement(self, ref):
        """The _Placement (a tensorkv.wire.shm.Placement) over the output area ``ref`` (a
        SharedMemoryRef message) of a region."""
        region = self._get(ref.region_id)
        if region.device:
            raise InvalidArgumentError("an output area is in a shared-memory region, not a CUDA IPC buffer")
        check_ref(region.size, ref.offset, ref.length, "output area")
        return _Placement(region, ref.region_id, ref.offset, ref.offset + ref.length, self.staging)

    def areas(self, refs):
        """The areas of ``refs`` (SessionRequest.outputs), bounds-checked: (region, its id,
        offset, length) each, None where a ref names none."""
        areas = []
        for ref in refs:
            if not ref.length:
                areas.append(None)
                continue
            region = self._get(ref.region_id)
            check_ref(region.size, ref.offset, ref.length, "output area")
            areas.append((region, ref.region_id, ref.offset, ref.length))
        return areas

    def deliver(self, areas, items):
        """``items`` with each value whose area (of :meth:`areas`, by position) has exactly its
        bytes written there (the others unchanged)."""
        delivered = []
        for index, item in enumerate(items):
            area = areas[index] if index < len(areas) else None
            if area is not None and item.ref is None and area[3] == item.array.nbytes:
                region, region_id, offset, _ = area
                item = region.write(offset, item, region_id)
            delivered.append(item)
        return delivered

    def settle(self):
        """Wait for the copies into and out of the stream's pinned regions and CUDA IPC buffers
        (before the call is answered: the client may then change them)."""
        if self.staging is not None:
            self.staging.settle(self._read_device)
        self._read_device = False

    def close(self):
        """Unmap every region of the stream and close its CUDA IPC buffers; one that fails to
        close (a CUDA error) is logged, and the others are closed all the same."""
        for region_id, region in self._by_id.items():
            try:
                region.close()
            except Exception:  # noqa: BLE001 - whatever the driver raised, the other regions are released
                log.exception("region %d of %s did not close", region_id, self.peer)
        if self._by_id:
            buffers = sum(region.device for region in self._by_id.values())
            log.info("released %d shared-memory region(s) and %d CUDA IPC buffer(s) of %s",
                     len(self._by_id) - buffers, buffers, self.peer)
        self._by_id.clear()


class _Placement(Placement):
    """A codec.Placement over an area of a region that writes a GPU value straight into it
    where the region is pinned, else through the staging's pinned memory."""

    def __init__(self, region, region_id, start, end, staging):
        super().__init__(region.writable, region_id, start, end)
        self.region, self.staging = region, staging

    def put(self, item):
        array = item.array
        if not on_gpu(array):
            return super().put(item)
        if self.region.staging is None:  # not pinned: through the staging's pinned memory
            host = self.staging.download([array])[0] if self.staging is not None else array
            return super().put(Item(item.key, host, item.shape, item.slice))
        offset = self.next
        if offset + array.nbytes > self.end:
            return None
        self.next = offset + aligned(array.nbytes)
        return self.region.write(offset, item, self.region_id)
