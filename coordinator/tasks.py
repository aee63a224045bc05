"""Stopping background tasks without swallowing the caller's own cancellation.

`await task` inside `suppress(CancelledError)` also swallows a cancellation
aimed at the awaiting task, which then runs on as if nothing happened (a
replication loop outliving its leader). `cancel_and_wait` waits with
`asyncio.wait`, which lets the caller's cancellation through and leaves the
task's own outcome behind. Used by the high-availability modules.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None, timeout_s: float = 5.0) -> None:
    """Cancel the tasks and wait until each has finished, whatever its outcome
    (at most `timeout_s`: a task stuck in its clean-up must not hang a shutdown)."""
    pending = {task for task in tasks if task is not None and not task.done()}
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=timeout_s)
    for finished in pending:
        if finished.done() and not finished.cancelled():
            with contextlib.suppress(BaseException):
                finished.exception()  # retrieved: no "exception never retrieved" noise
