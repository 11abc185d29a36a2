"""Cancelling a run returns only after every rollout it started has ended (controller/settling.py)."""

from __future__ import annotations

import asyncio

import pytest

from lightning_middleware.controller.settling import cancel_and_wait, finish_despite_cancellation, gather_settled


async def _child(ended: list[str], name: str, cleanup_s: float) -> str:
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        await asyncio.sleep(cleanup_s)  # the end being written, as a cancelled rollout's row is
        ended.append(name)
        raise
    return name


@pytest.mark.parametrize("settled", [True, False])
def test_a_cancelled_gather_returns_after_every_child_ended(settled: bool) -> None:
    async def main() -> list[str]:
        ended: list[str] = []
        children = [_child(ended, "quick", 0.0), _child(ended, "slow", 0.2)]
        run = asyncio.ensure_future(gather_settled(children) if settled else asyncio.gather(*children))
        await asyncio.sleep(0.05)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        seen = list(ended)
        await asyncio.sleep(0.3)  # let asyncio.gather's orphan finish before the loop closes
        return seen

    seen = asyncio.run(main())
    # asyncio.gather raises when its first child ended: the contrast that shows the test can fail
    assert seen == (["quick", "slow"] if settled else ["quick"])


def test_a_childs_error_cancels_and_awaits_the_others() -> None:
    async def boom() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("boom")

    async def main() -> list[str]:
        ended: list[str] = []
        with pytest.raises(ValueError, match="boom"):
            await gather_settled([boom(), _child(ended, "other", 0.05)])
        return ended

    assert asyncio.run(main()) == ["other"]


def test_a_write_finishes_though_cancelled_twice() -> None:
    async def main() -> tuple[list[str], bool]:
        done: list[str] = []

        async def write() -> str:
            await asyncio.sleep(0.1)
            done.append("row")
            return "ok"

        async def canceller(waiter: asyncio.Future[str]) -> None:
            for _ in range(2):
                await asyncio.sleep(0.02)
                waiter.cancel()

        waiter = asyncio.ensure_future(finish_despite_cancellation(write()))
        await canceller(waiter)
        result = await waiter
        await cancel_and_wait([])  # nothing pending: returns at once
        return done, result == "ok"

    assert asyncio.run(main()) == (["row"], True)
