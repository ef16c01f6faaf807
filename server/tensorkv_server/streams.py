"""Ending the long-lived streams (Session streams, the calls on their data channels) when the
server stops, each at a call's boundary, before gRPC's own stop: gRPC aborts a stream it
still has then, with a WARNING or a traceback in the log per stream, and the worker gets a
bare CANCELLED instead of this server's UNAVAILABLE."""
import asyncio

from tensorkv.errors import ServerUnavailableError

# Seconds the streams still open after --grace get to reach their next call's boundary.
END_TIMEOUT = 1.0


class OpenStreams:
    """The tasks of the open streams, and those of them that wait for their next call."""

    def __init__(self):
        self.ending = False
        self._open = set()
        self._idle = set()
        self._ended = set()  # the idle tasks that end() cancelled

    def opened(self):
        """Count the calling task (a stream's handler) as open until :meth:`closed`."""
        self._open.add(asyncio.current_task())

    def closed(self):
        self._open.discard(asyncio.current_task())

    async def next_call(self, read):
        """``await read()``, the wait of a stream for its next call, which ends with
        ServerUnavailableError once :meth:`end` ends the streams (before or during the wait)."""
        if self.ending:
            raise _stopping()
        task = asyncio.current_task()
        self._idle.add(task)
        try:
            return await read()
        except asyncio.CancelledError:
            if task not in self._ended:  # gRPC's: the client went away
                raise
            task.uncancel()  # ours, turned into the stream's end: the task is not being cancelled
            raise _stopping() from None
        finally:
            self._idle.discard(task)

    async def end(self, grace):
        """Give the open streams ``grace`` seconds to end on their own (their calls are served
        meanwhile), then end the others at their next call's boundary, and wait at most
        END_TIMEOUT seconds for their handlers (each gRPC's task of a call) to finish."""
        if self._open:
            await asyncio.wait(self._open, timeout=grace)
        self.ending = True
        for task in self._idle:
            self._ended.add(task)
            task.cancel()
        if self._open:
            await asyncio.wait(self._open, timeout=END_TIMEOUT)


def _stopping():
    return ServerUnavailableError("the server is stopping")
