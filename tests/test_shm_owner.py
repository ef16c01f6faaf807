"""Whose memory a shared-memory region may be: the owner of the caller's end of its very
connection (shm.peer_uid), which a caller cannot borrow from another socket of the same port,
with a crafted /proc/net/tcp table and with real processes of another user."""
import contextlib
import fcntl
import ipaddress
import os
import subprocess
import sys

import grpc
import pytest

from tensorkv.wire import shm
from tensorkv_server import shm as server_shm

from cluster import Cluster, stop

pytestmark = pytest.mark.skipif(not shm.available(), reason="no sealed memory files (memfd_create)")

SERVER, CALLER, ELSEWHERE = ("127.0.0.1", 50051), ("127.0.0.1", 40000), ("127.0.0.1", 40001)
OURS, THEIRS = 1001, 2002  # socket inodes: the server's end, the caller's
ESTABLISHED, TIME_WAIT = "01", "06"


def _hex(address):
    """``address`` (ip, port) in /proc/net/tcp's notation: 32-bit words in the host's byte order."""
    ip, port = ipaddress.ip_address(address[0]), address[1]
    raw = ip.packed
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return f"{raw.hex().upper()}:{port:04X}"


def _line(local, remote, state, uid, inode=0):
    """A line of /proc/net/tcp (tcp6 for IPv6 addresses) for one socket."""
    return (f"   0: {_hex(local)} {_hex(remote)} {state} 00000000:00000000 00:00000000 00000000 {uid:5d}        0 "
            f"{inode} 1 0000000000000000 20 4 30 10 -1")


def _uid(peer, *lines):
    return server_shm.connection_uid((ipaddress.ip_address(peer[0]), peer[1]), list(lines), {OURS})


def test_the_owner_is_that_of_the_callers_end_of_this_very_connection():
    ours, theirs = _line(SERVER, CALLER, ESTABLISHED, 0, OURS), _line(CALLER, SERVER, ESTABLISHED, 65534, THEIRS)
    # The bypass (issue 31): a TIME_WAIT connection from the caller's port, which the kernel
    # lists with uid 0, listed first; and a socket of root on that port to somewhere else
    decoys = [_line(CALLER, ELSEWHERE, TIME_WAIT, 0), _line(CALLER, ("127.0.0.1", 40002), ESTABLISHED, 0, 3003)]
    assert _uid(CALLER, *decoys, ours, theirs) == 65534
    assert _uid(CALLER, ours, *decoys, theirs) == 65534
    # only a TIME_WAIT row of the caller's end, or none: not found
    assert _uid(CALLER, ours, _line(CALLER, SERVER, TIME_WAIT, 0)) is None
    assert _uid(CALLER, ours, *decoys) is None
    # the server's end must be a socket of this process, and established
    assert _uid(CALLER, _line(SERVER, CALLER, ESTABLISHED, 0, 4004), theirs) is None
    assert _uid(CALLER, _line(SERVER, CALLER, TIME_WAIT, 0, OURS), theirs) is None
    # the caller's end must have the server's end as its remote: not the server's port elsewhere
    assert _uid(CALLER, ours, _line(CALLER, ("127.0.0.2", SERVER[1]), ESTABLISHED, 65534, THEIRS)) is None
    # more than one row for either end (no kernel lists that): refused rather than guessed
    assert _uid(CALLER, ours, theirs, _line(CALLER, SERVER, ESTABLISHED, 0, 5005)) is None
    assert _uid(CALLER, ours, _line(("127.0.0.2", SERVER[1]), CALLER, ESTABLISHED, 0, OURS), theirs) is None
    # lines that are not sockets (a header, garbage) are skipped
    assert _uid(CALLER, "  sl  local_address rem_address   st", "x y", ours, theirs) == 65534


def test_ipv6_and_ipv4_mapped_ends():
    # a dual-stack server ([::]) sees an IPv4 caller as ::ffff:127.0.0.1 in tcp6; the caller's
    # end is in tcp
    mapped = lambda address: (f"::ffff:{address[0]}", address[1])  # noqa: E731
    assert _uid(CALLER, _line(mapped(SERVER), mapped(CALLER), ESTABLISHED, 0, OURS),
                _line(CALLER, SERVER, ESTABLISHED, 1234, THEIRS)) == 1234
    server6, caller6 = ("::1", 50051), ("::1", 40000)
    assert _uid(caller6, _line(caller6, ("::1", 1), TIME_WAIT, 0), _line(server6, caller6, ESTABLISHED, 0, OURS),
                _line(caller6, server6, ESTABLISHED, 1234, THEIRS)) == 1234
    assert server_shm.peer_uid("unix:/tmp/socket") is None and server_shm.peer_uid("ipv4:nonsense") is None


# Started as root, a script becomes user argv[1] (every uid and gid, no groups) once it has
# imported what it needs: it runs where only root can read the checkout and its .venv (a clone
# under a 0700 directory, where the venv's Python run as another user finds no grpc), and
# what it makes after that is that user's.
_BECOME = """
import os, sys
def become(uid):
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    assert os.getresuid() == os.getresgid() == (uid,) * 3 and not os.getgroups()
"""

# Run as another user (argv[1]): leaves TIME_WAIT connections (uid 0 in /proc/net/tcp) on a
# port of its own, connects from that port to the server at argv[4] (through a relay in this
# process, as gRPC cannot choose its source port) and registers descriptor argv[3] of process
# argv[2], a memfd of root that starts with zeros, with a token of zeros. It tries argv[5]
# ports, each with argv[6] TIME_WAIT connections, and prints one line per try: the count of
# TIME_WAIT rows seen on the port, the answer's code and its message. The relays' listening
# sockets and the channels to them are made before it becomes that user (gRPC imports modules
# as it goes); every socket whose owner the server looks at after.
_BORROWED_PORT = _BECOME + """
import socket, threading, time
import grpc
from tensorkv.wire.grpc_options import CHANNEL_OPTIONS
from tensorkv.transport.session import RawSession as Session
from tensorkv.v1 import kvstore_pb2

uid, pid, fd, address = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
tries, waits = int(sys.argv[5]), int(sys.argv[6])
server = address.rsplit(":", 1)[0], int(address.rsplit(":", 1)[1])


def bound(port):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


# How many of the connections from port to the listeners are in TIME_WAIT as root's: distinct
# ones, seen in any of three reads (a read of /proc/net/tcp while other sockets come and go may
# list a row twice, or miss one: other test processes open and close many), and only those to
# the listeners (other connections of the host may have used the port before).
def time_waits(port):
    seen = set()
    for _ in range(3):
        with open("/proc/net/tcp") as table:
            rows = [line.split() for line in table.read().splitlines()[1:]]
        seen |= {int(row[2].split(":")[1], 16) for row in rows
                 if int(row[1].split(":")[1], 16) == port and row[3] == "06" and row[7] == "0"}
    return len(seen & targets)


def relay(source, sink):
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
    except OSError:
        pass
    for sock in (source, sink):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


relays = []
for _ in range(tries):
    front = socket.socket()
    front.bind(("127.0.0.1", 0))
    front.listen(1)
    here = "127.0.0.1:%d" % front.getsockname()[1]
    channel = grpc.insecure_channel(here, options=CHANNEL_OPTIONS)
    relays.append((front, channel, Session(channel, here, shm_allowed=True)))  # not connected yet
become(uid)

listeners = []
for _ in range(waits):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listeners.append(listener)
targets = {listener.getsockname()[1] for listener in listeners}
for front, channel, session in relays:
    probe = bound(0)
    port = probe.getsockname()[1]
    probe.close()
    for listener in listeners:  # this end closes first: it is the one left in TIME_WAIT
        sock = bound(port)
        sock.connect(listener.getsockname())
        accepted, _ = listener.accept()
        sock.close()
        accepted.close()
    deadline = time.monotonic() + 30
    while time_waits(port) < waits and time.monotonic() < deadline:
        time.sleep(0.01)
    back = bound(port)
    back.connect(server)

    def serve():
        accepted, _ = front.accept()
        threading.Thread(target=relay, args=(accepted, back), daemon=True).start()
        relay(back, accepted)

    threading.Thread(target=serve, daemon=True).start()

    def build(call_id, timeout_ms, region, data_channel):
        return kvstore_pb2.SessionRequest(id=call_id, op=kvstore_pb2.SESSION_OP_REGISTER_REGION,
            region=kvstore_pb2.SharedMemoryRegion(pid=pid, fd=fd, size=4096, token=bytes(32))).SerializeToString(), ()

    answer = kvstore_pb2.SessionResponse.FromString(session.call(build, 30.0)[1])
    print(time_waits(port), answer.code, answer.message, flush=True)
    session.close()
    channel.close()
    front.close()
    if answer.code == 0:
        break
"""


# Run as the victim, user argv[1] (0: root, as started): a sealed memfd of 4096 bytes whose
# first bytes are zeros; prints its pid and descriptor, and holds it until its stdin closes.
_VICTIM = _BECOME + """
import fcntl
from tensorkv.wire import shm
if int(sys.argv[1]):
    become(int(sys.argv[1]))
fd = os.memfd_create("not-a-tensorkv-region", os.MFD_ALLOW_SEALING)
os.ftruncate(fd, 4096)
os.pwrite(fd, b"a secret of the victim's", 64)
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, shm.SEALS)
print(os.getpid(), fd, flush=True)
sys.stdin.read()
"""
VICTIM_UID, CALLER_UID = 65533, 65534


@contextlib.contextmanager
def victim_memfd(uid, cwd):
    """(pid, descriptor) of a sealed memfd of the user ``uid`` (0: root, this process's own)
    whose first bytes are zeros, held by a process of that user while in the block: memory
    that another user must not get the server to map."""
    victim = subprocess.Popen([sys.executable, "-c", _VICTIM, str(uid)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=cwd)
    try:
        pid, fd = map(int, victim.stdout.readline().split())
        yield pid, fd
    finally:
        victim.stdin.close()
        stop(victim)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run callers as others")
@pytest.mark.parametrize("victim_uid", [0, VICTIM_UID], ids=["root's", "another user's"])
def test_a_time_wait_connection_on_the_callers_port_lends_it_no_uid(tmp_path, victim_uid):
    """Issue 31: the server took the first /proc/net/tcp row of the caller's local port as its
    connection, and the kernel lists TIME_WAIT connections with uid 0: a user who left some on
    a port, then connected from it, was taken for root and registered a memfd of another user
    (or of root) that starts with zeros, whose bytes the server then read and wrote for it."""
    tries, waits = 8, 16
    with victim_memfd(victim_uid, tmp_path) as (pid, fd), Cluster(tmp_path=tmp_path) as cluster:
        done = subprocess.run([sys.executable, "-c", _BORROWED_PORT, str(CALLER_UID), str(pid), str(fd),
                               cluster.addresses[0], str(tries), str(waits)], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        answers = [line.split(" ", 2) for line in done.stdout.splitlines()]
        for seen, code, message in answers:
            assert int(seen) == waits  # the TIME_WAIT rows of uid 0 were there, on the caller's port
            assert int(code) == grpc.StatusCode.FAILED_PRECONDITION.value[0], message
            assert message.startswith(f"cannot use descriptor {fd} of process {pid}: the server takes only a "
                                      "sealed memfd of the caller's own user")
        assert len(answers) == tries, done.stdout
        log = (tmp_path / "server0.log").read_text()
        assert log.count(f"it belongs to uid {victim_uid}, the caller is uid {CALLER_UID}") == tries
        with open(f"/proc/{pid}/fd/{fd}", "rb") as victim:
            assert victim.read(32) == bytes(32)  # untouched: the server never mapped it
