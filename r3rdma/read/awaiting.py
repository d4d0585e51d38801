"""``all_or_first_error``: every awaitable's result, or the first failure once the rest are cancelled.

``asyncio.gather`` raises the first failure and leaves the other awaitables running: a read
that failed would go on sending requests to the node after the caller has its error (and a
node being stopped waits for them). ``asyncio.TaskGroup`` cancels the rest but raises an
``ExceptionGroup``, while readers' callers catch the typed errors (:mod:`r3rdma.errors`) the
failed request raised; this raises that error itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any


async def all_or_first_error(awaitables: Iterable[Awaitable[Any]]) -> list[Any]:
    """The results in order; on the first failure, the others are cancelled and awaited, then
    that failure is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    if not tasks:
        return []
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # the caller was cancelled: so is its work
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    if pending:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for task in tasks:  # the first failure in order of the awaitables, as asyncio.gather's caller would see one
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    return [task.result() for task in tasks]
