"""A worker's leases: one daemon thread per store renews the registration of its rank on
every server (the KeepAlive RPC) every third of the shortest lease, for as long as the
store is open, whatever the worker does meanwhile: computing between calls, or waiting in
a call for a sync round (a call in progress does not renew a lease).

A server that answers FAILED_PRECONDITION no longer has the registration (the lease
expired, or the server restarted): the store's next call raises FailedPreconditionError.
Other failures (a server briefly unreachable) are logged and the renewals go on.
"""
import logging
import threading
import time

import grpc

from .errors import FailedPreconditionError
from .v1 import kvstore_pb2

log = logging.getLogger(__name__)


class Heartbeat:
    """Renews the registration of each of ``conns`` (ServerConns with a lease) with its
    current incarnation, from a thread started here."""

    def __init__(self, conns):
        self._conns = conns
        self._interval = min(conn.lease_ttl for conn in conns) / 3
        self._lost = None  # the message of the first lease lost
        self._failing = set()  # the ServerConns whose last renewal failed
        self._calls = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tensorkv-heartbeat", daemon=True)
        self._thread.start()

    def check(self):
        """FailedPreconditionError once a server has said that this worker's lease is gone."""
        if self._lost is not None:
            raise FailedPreconditionError(self._lost)

    def _run(self):
        due = time.monotonic() + self._interval
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            # A steady pace, however long the renewals take; no burst after this process was paused.
            due = max(due + self._interval, time.monotonic())
            self._calls = {conn: conn.stub.KeepAlive.future(
                kvstore_pb2.KeepAliveRequest(rank=conn.rank, incarnation=conn.incarnation), timeout=self._interval)
                for conn in self._conns}
            for conn, call in self._calls.items():
                if not self._renewed(conn, call):
                    return

    def _renewed(self, conn, call):
        """Whether ``call`` renewed the lease on ``conn``'s server or may be tried again."""
        address, rank = conn.address, conn.rank
        try:
            call.result()
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._lost = f"rank {rank} lost its lease on server {address}: {error.details()}"
                log.error("%s", self._lost)
                return False
            if error.code() == grpc.StatusCode.CANCELLED and self._stop.is_set():
                return False
            if conn not in self._failing:
                log.warning("server %s: lease of rank %d not renewed (%s: %s); trying again every %g s",
                            address, rank, error.code().name, error.details(), self._interval)
                self._failing.add(conn)
            return True
        if conn in self._failing:
            log.info("server %s: lease of rank %d renewed again", address, rank)
            self._failing.discard(conn)
        return True

    def close(self):
        """Stop renewing (the renewals in flight are cancelled) and wait for the thread."""
        self._stop.set()
        for call in list(self._calls.values()):
            call.cancel()
        self._thread.join(self._interval + 1.0)
