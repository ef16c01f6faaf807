"""A worker's leases: one daemon thread per store renews the registration of its rank on
every server (the KeepAlive RPC) every third of the shortest lease, for as long as the
store is open, whatever the worker does meanwhile: computing between calls, or waiting in
a call for a sync round (a call in progress does not renew a lease).

A server that answers FAILED_PRECONDITION no longer has the registration (the lease
expired, or the server restarted): the heartbeat stops renewing it and sets the
ServerConn's ``lease_lost``, so that its next call registers again if the server restarted
and raises FailedPreconditionError if not. Other failures (a server briefly unreachable)
are logged and the renewals go on.
"""
import logging
import threading
import time

import grpc

from ..v1 import kvstore_pb2

log = logging.getLogger(__name__)


class Heartbeat:
    """Renews the registration of each of ``conns`` (ServerConns with a lease) with its
    current incarnation, from a thread started here."""

    def __init__(self, conns):
        self._conns = conns
        self._interval = min(conn.lease_ttl for conn in conns) / 3
        self._failing = set()  # the ServerConns whose last renewal failed
        self._calls = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tensorkv-heartbeat", daemon=True)
        self._thread.start()

    def _run(self):
        due = time.monotonic() + self._interval
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            # A steady pace, however long the renewals take; no burst after this process was paused.
            due = max(due + self._interval, time.monotonic())
            self._calls = {(conn, conn.incarnation): conn.stub.KeepAlive.future(
                kvstore_pb2.KeepAliveRequest(rank=conn.rank, incarnation=conn.incarnation), timeout=self._interval,
                wait_for_ready=True)  # a connection being made again is waited for, up to the interval
                for conn in self._conns if conn.lease_lost is None}
            if self._stop.is_set():  # close() ran while they were made: it did not see them
                for call in self._calls.values():
                    call.cancel()
            for (conn, incarnation), call in self._calls.items():
                self._renewed(conn, incarnation, call)

    def _renewed(self, conn, incarnation, call):
        """Wait for ``call``, the renewal of ``conn``'s registration ``incarnation``: a refusal
        of that registration (not of one made since) sets ``conn.lease_lost``."""
        address, rank = conn.address, conn.rank
        try:
            call.result()
        except grpc.FutureCancelledError:  # by close()
            return
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                if conn.incarnation != incarnation:  # registered again meanwhile (a reconnect): no news
                    return
                # The next call says what it means: registered again after a server restart,
                # or FailedPreconditionError for a lease that expired (a durability probe read
                # the words of the second in the log of the first).
                conn.lease_lost = f"rank {rank} lost its lease on server {address}: {error.details()}"
                log.debug("%s", conn.lease_lost)
                return
            if error.code() == grpc.StatusCode.CANCELLED and self._stop.is_set():
                return
            if conn not in self._failing:
                why = f"no connection within {self._interval:g} s" \
                    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED else error.details()
                log.warning("server %s: lease of rank %d not renewed (%s: %s); trying again every %g s",
                            address, rank, error.code().name, why, self._interval)
                self._failing.add(conn)
            return
        if conn in self._failing:
            log.info("server %s: lease of rank %d renewed again", address, rank)
            self._failing.discard(conn)

    def close(self):
        """Stop renewing (the renewals in flight are cancelled) and wait for the thread."""
        self._stop.set()
        for call in list(self._calls.values()):
            call.cancel()
        self._thread.join(self._interval + 1.0)
