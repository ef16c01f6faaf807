"""The server's log lines: ``--log-format text`` (for people) or ``json`` (one object a line,
for log pipelines).

Lifecycle events are log calls that name their event and its fields through ``extra``::

    log.warning("%s", error, extra={"event": "round_aborted", "key": key, "round": number})

Every JSON line has the same fields, so that a query never meets a missing one: ``time``
(ISO 8601, UTC), ``level``, ``event`` (null for lines that are not lifecycle events),
``rank``, ``key`` (a number or a string, as the key is), ``round`` (a barrier's number for
barrier_aborted), ``peer`` (null when the line has none), ``logger`` and ``message``, plus
``exception`` when there is a traceback. ``peer`` is the gRPC peer of the call being
handled (see :data:`PEER`) unless the call passes one.

The events: server_started, server_stopping, server_stopped, worker_registered,
worker_unregistered, worker_reregistered, lease_expired, run_started, run_resumed (a run
restored from a snapshot goes on), run_ended, round_aborted, barrier_aborted,
optimizer_installed, snapshot_written, snapshot_failed, snapshot_restored, snapshot_skipped,
call_refused (the token check refused a call: security.RefusalLog).
"""
import contextvars
import datetime
import json
import logging
import time

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# The peer of the gRPC call the current task handles, set by the handlers that log.
PEER = contextvars.ContextVar("peer", default=None)


class JsonFormatter(logging.Formatter):
    """One JSON object a line, with the fields of the module's docstring."""

    def format(self, record):
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "event": getattr(record, "event", None),
            "rank": getattr(record, "rank", None),
            "key": getattr(record, "key", None),
            "round": getattr(record, "round", None),
            "peer": getattr(record, "peer", None) or PEER.get(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class ThrottledLog:
    """WARNING lines that peers cause at will, ``line`` % (peer, reason) each (connections
    refused, calls of stalled peers): the first of each reason at once, then at most one per
    ``interval`` seconds for it, with the count of those in between, so that they cannot
    flood the log."""

    KEPT = 1024  # reasons remembered at most (an error's text may vary)

    def __init__(self, logger, line, interval=60.0, clock=time.monotonic):
        self._logger, self._line, self._interval, self._clock = logger, line, interval, clock
        self._last = {}  # reason -> (when its last line was written, lines held back since)

    def note(self, peer, reason):
        now = self._clock()
        logged, since = self._last.get(reason, (None, 0))
        if logged is not None and now - logged < self._interval:
            self._last[reason] = logged, since + 1
            return
        if len(self._last) >= self.KEPT:  # forget those quiet for an interval
            self._last = {kept: entry for kept, entry in self._last.items() if now - entry[0] < self._interval}
        more = f" ({since} more since the last such line)" if since else ""
        self._logger.warning(self._line + "%s", peer, reason, more)
        self._last[reason] = now, 0


def configure(log_format, level):
    """Send the server's log lines to stderr in ``log_format`` ('text' or 'json')."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
