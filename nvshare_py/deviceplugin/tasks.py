"""The one way the device plugin's asyncio tasks are run together (structured: one owner)."""

from __future__ import annotations

import asyncio
from typing import Awaitable


async def run_until_first_exits(*awaitables: Awaitable) -> None:
    """Runs the awaitables as sibling tasks; when one ends, cancels the others and waits for
    them, then re-raises the first failure (asyncio.TaskGroup, which Python 3.10 lacks)."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in done:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error
