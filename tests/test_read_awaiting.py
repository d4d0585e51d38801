"""The readers' all_or_first_error (asyncio.gather that cancels the rest): the first failure is raised as itself, once the other work is cancelled
(a failed read sends nothing more to the node)."""

import asyncio

import pytest

from r3rdma.errors import AuthenticationError
from r3rdma.read.awaiting import all_or_first_error


def test_results_in_order():
    async def value(v, delay):
        await asyncio.sleep(delay)
        return v

    assert asyncio.run(all_or_first_error(value(i, 0.01 * (3 - i)) for i in range(3))) == [0, 1, 2]
    assert asyncio.run(all_or_first_error([])) == []


def test_first_failure_is_raised_itself_and_the_rest_are_cancelled():
    cancelled = []

    async def refused():
        await asyncio.sleep(0.01)
        raise AuthenticationError("node http://n1: refused the token (HTTP 403)")

    async def slow_read(i):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def main():
        with pytest.raises(AuthenticationError, match="HTTP 403"):
            await asyncio.wait_for(all_or_first_error([slow_read(0), refused(), slow_read(1)]), 5)

    asyncio.run(main())
    assert sorted(cancelled) == [0, 1]


def test_a_cancelled_caller_cancels_its_work():
    cancelled = []

    async def slow_read():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(all_or_first_error([slow_read(), slow_read()]), 0.05)

    asyncio.run(main())
    assert cancelled == [True, True]
