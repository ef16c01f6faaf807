"""Peers that stop moving a call's bytes (--progress-timeout).

A call's bytes count in the server's budget (budget.py) from before they are read until its
answer is sent. A peer that stops sending a request it began (a data-channel call whose
header announced its size, a stream of Push messages) or stops taking its answer (a Pull it
does not read) would hold them for as long as its connection lives, and keep other calls
out. So every read of a request's bytes and every write of an answer's waits at most
TIMEOUT seconds for the peer to move some: then the call ends with DEADLINE_EXCEEDED, its
bytes are given back, its data channel is closed (datachan.py), and a WARNING names the
peer, at most once a minute for each reason (logs.ThrottledLog).
"""
import asyncio
import logging

import grpc

from tensorkv.errors import ERROR_METADATA_KEY, DeadlineExceededError

from .deadline import within
from .logs import ThrottledLog

log = logging.getLogger(__name__)

TIMEOUT = 60.0  # seconds
FLAG = "--progress-timeout"

_STALLS = ThrottledLog(log, "call from %s ended: %s")


class StalledError(DeadlineExceededError):
    """A call whose peer moved none of its bytes for the progress timeout; logged already
    (ThrottledLog), so that a caller that logs other failures leaves it out."""


def stalled(what, seconds):
    """The StalledError of a call whose peer moved none of ``what`` for ``seconds``."""
    return StalledError(f"{what}: no bytes moved for {seconds:g} s ({FLAG})")


async def next_message(messages, seconds, peer, what):
    """The next message of the gRPC request stream ``messages`` (an async iterator), which
    must come within ``seconds`` (None: no limit), else DeadlineExceededError (logged)."""
    try:
        return await within(anext(messages), seconds)
    except asyncio.TimeoutError:
        error = stalled(what, seconds)
        _STALLS.note(peer, str(error))
        raise error from None


async def write_all(context, messages, seconds, what):
    """Write the list ``messages`` on the gRPC response stream of ``context``, emptying it,
    each message within ``seconds`` (None: no limit). A peer that takes none for that long
    ends the call with DEADLINE_EXCEEDED (logged), set on ``context`` rather than raised:
    its status waits behind the bytes the peer does not take, and a raised error's traceback
    would keep the handler's values (the whole answer) until then."""
    messages.reverse()  # popped from the end as they go: gRPC has its own copy of each then
    try:
        # On its own first: sent with a first message that stalls, it would count as unsent, and
        # the call's status could not follow (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS, logged; the
        # peer then waits for its deadline).
        await context.send_initial_metadata(())
        while messages:
            await within(context.write(messages.pop()), seconds)
    except grpc.aio.InternalError:  # the call ended under the write (cancelled, or past its deadline)
        messages.clear()
        raise asyncio.CancelledError from None  # as gRPC's own writes end then: no error logged
    except asyncio.TimeoutError:
        messages.clear()
        error = stalled(what, seconds)
        _STALLS.note(context.peer(), str(error))
        context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
        context.set_details(str(error))
        context.set_trailing_metadata(((ERROR_METADATA_KEY, DeadlineExceededError.__name__),))
