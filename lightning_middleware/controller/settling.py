"""Cancellation that leaves the store complete: when a run is cancelled, it returns only after every
rollout it started has recorded its end.

`asyncio.gather` alone does not give that: cancelled, it raises as soon as its first child has
ended, while the others are still writing their "cancelled" rows, so a caller that reads the store
right after the cancellation can miss them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def gather_settled(aws: Iterable[Awaitable[T]]) -> list[T]:
    """`asyncio.gather` of `aws`, except that on cancellation or a child's error the other children
    are cancelled and awaited to their end before the error is raised."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await cancel_and_wait(tasks)
        raise


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel `tasks` and wait until each has ended, though this wait be cancelled again. A task
    already cancelled is not cancelled twice: that would cut short the end it is recording."""
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        if not (isinstance(t, asyncio.Task) and t.cancelling()):
            t.cancel()
    if pending:
        await finish_despite_cancellation(asyncio.wait(pending))


async def finish_despite_cancellation(aw: Awaitable[Any]) -> Any:
    """Await `aw` to its end though cancelled again (a short store write, recorded before the
    cancellation returns); its result."""
    task = asyncio.ensure_future(aw)
    while not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)
    return task.result()
