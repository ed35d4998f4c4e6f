"""A ``FleetClient`` call read from the HTTP server's event loop, and its replies by engine step.

The client's I/O thread queues each reply on the call and wakes the loop
(``call_soon_threadsafe``); the loop then takes every reply queued so far at once, so a reader
never blocks the loop and never polls.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from shared.engine.request import stop_reason
from shared.protocol.messages import Chunk, Error, Generate, Result, Sampling
from shared.transport.client import FleetClient, Reply


class AsyncCall:
    """``request`` started on ``client`` (RequestInFlight or ValueError from ``FleetClient.start``
    propagate: nothing was sent), to be read on ``loop`` (the running one)."""

    def __init__(self, client: FleetClient, request: Generate, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._wake = asyncio.Event()
        self._client = client
        self.request = request
        self.call = client.start(request, notify=self._notify)

    def _notify(self) -> None:
        """On the client's I/O thread, after a reply is queued."""
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop has closed: nobody reads this call any more
            pass

    @property
    def ended(self) -> bool:
        """Whether the call's result or error has come (read or not)."""
        return self.call.done.is_set()

    def cancel(self) -> None:
        """Cancel the request unless it has ended (sent without waiting for the answer)."""
        if not self.ended:
            self._client.cancel_nowait(self.request.request_id)

    async def ready(self) -> list[Reply]:
        """Every reply queued now, after waiting for at least one; it ends with the result or
        error once that has come (then there are no more)."""
        while True:
            self._wake.clear()
            replies = self.call.ready_replies()
            if replies:
                return replies
            await self._wake.wait()

    async def outcome(self) -> Result | Error:
        """The call's result or error (chunks skipped)."""
        while True:
            last = (await self.ready())[-1]
            if isinstance(last, Result | Error):
                return last


async def replies_by_step(call: AsyncCall, eos_token_ids: frozenset[int]) -> AsyncIterator[list[Reply]]:
    """The call's replies in groups, one group per SSE message: the replies queued together,
    ending at the result or error. The server sends a request's last chunk and its result in the
    same step; when the chunk is known to be the last (``max_tokens`` reached, or
    end-of-sequence) the group waits for that result, so the finish reason rides on the text.
    A stop string or a finished grammar is not known from the chunk: its result joins the text
    when it is already queued, else it comes in a message of its own."""
    num_tokens = 0
    while True:
        group = await call.ready()
        num_tokens += _tokens(group)
        while isinstance(group[-1], Chunk) and ends_request(group[-1], num_tokens, call.request.sampling,
                                                              eos_token_ids):
            more = await call.ready()
            num_tokens += _tokens(more)
            group += more
        yield group
        if not isinstance(group[-1], Chunk):
            return


def _tokens(replies: list[Reply]) -> int:
    return sum(len(r.token_ids) for r in replies if isinstance(r, Chunk))


def ends_request(chunk: Chunk, num_tokens: int, sampling: Sampling, eos_token_ids: frozenset[int]) -> bool:
    """Whether the engine surely finished the request with this chunk (its ``num_tokens``-th
    token so far), by the engine's own stop rule; a stop string or a finished grammar is not
    known here (the caller then waits for the result as a reply of its own)."""
    token = chunk.token_ids[-1] if chunk.token_ids else None
    return stop_reason(sampling, token, eos_token_ids, False, num_tokens) is not None
