"""Awaiting work for at most a number of seconds, in the caller's own task."""
import asyncio

if hasattr(asyncio, "timeout"):  # Python 3.11+
    async def within(work, seconds):
        """``await work``, cancelled after ``seconds`` (None: no limit) with asyncio.TimeoutError.
        It runs in the caller's task: no task of its own and no extra turn of the event loop,
        which asyncio.wait_for costs on every call."""
        async with asyncio.timeout(seconds):
            return await work
else:
    async def within(work, seconds):
        return await asyncio.wait_for(work, seconds)
