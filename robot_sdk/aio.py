"""``AsyncPlanClient``: the ``PlanClient`` API for asyncio code.

It runs a ``PlanClient``'s blocking calls in worker threads (``asyncio.to_thread``) rather than
being a second implementation: one code path for requests, validation and errors. Cancelling
the awaiting task cancels the request on the daemon. Each request in flight holds one worker
thread of the loop's default executor while it waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from robot_sdk.client import PlanClient
from robot_sdk.replies import ChatReply, Plan, PlanEvent


class AsyncPlanClient:
    """Same constructor and methods as ``PlanClient``; ``plan``/``chat``/``cancel``/``health``
    are coroutines and ``stream`` is an async iterator. Use ``async with`` or ``await close()``."""

    def __init__(self, endpoint: str, **options: Any):
        self.sync = PlanClient(endpoint, **options)

    async def plan(self, task: str, **options: Any) -> Plan:
        """``PlanClient.plan`` (same keyword arguments)."""
        options["request_id"] = options.get("request_id") or self.sync.new_request_id()
        return await self._cancelling(self.sync.plan, task, **options)

    async def stream(self, task: str, **options: Any) -> AsyncIterator[PlanEvent]:
        """``PlanClient.stream`` (same keyword arguments) as an async iterator; leaving the
        ``async for`` early, or cancelling the task iterating it, cancels the request."""
        options["request_id"] = options.get("request_id") or self.sync.new_request_id()
        events = self.sync.stream(task, **options)  # checks the arguments now
        end = object()
        waiting = False  # a worker thread is inside next(events)
        try:
            while True:
                waiting = True
                event = await asyncio.to_thread(next, events, end)
                waiting = False
                if event is end:
                    return
                yield event
        except asyncio.CancelledError:
            self.sync.cancel_nowait(options["request_id"])  # the worker's next() then ends
            raise
        finally:
            if not waiting:
                events.close()  # cancels the request unless it has ended

    async def chat(self, messages: Sequence[Mapping[str, str]], **options: Any) -> ChatReply:
        """``PlanClient.chat`` (same keyword arguments)."""
        options["request_id"] = options.get("request_id") or self.sync.new_request_id()
        return await self._cancelling(self.sync.chat, messages, **options)

    async def cancel(self, request_id: str) -> bool:
        return await asyncio.to_thread(self.sync.cancel, request_id)

    async def health(self) -> str:
        return await asyncio.to_thread(self.sync.health)

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncPlanClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _cancelling(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn`` in a worker thread; if the awaiting task is cancelled, so is the request."""
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except asyncio.CancelledError:
            self.sync.cancel_nowait(kwargs["request_id"])  # the worker thread then ends with Cancelled
            raise
