"""Submitting to a thread pool while the interpreter exits: the work runs on the caller's thread.

Why: vLLM closes its engine from an exit-time finalizer (``weakref.finalize``), and that is
where the plug-in's writer makes the last finished requests durable. By then Python's exit
hook has shut every ``ThreadPoolExecutor`` (``submit`` raises ``RuntimeError: cannot schedule
new futures after shutdown``): the writer's thread died of it, ``close()`` waited for it
forever, and the requests of the last batch were lost (found with an in-process engine,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, whose script simply returned). Running the work where the
pool would have run it keeps the commit's order and its errors; it is only slower, and only
at exit.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import TypeVar

__all__ = ["submit"]

T = TypeVar("T")


def submit(pool: Executor, fn: Callable[..., T], /, *args: object) -> Future[T]:
    """``pool.submit(fn, *args)``, or, once the pool refuses new work because it (or the
    interpreter) shut down, ``fn(*args)`` run now, as a completed future."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError as e:
        if "cannot schedule new futures" not in str(e):
            raise
    done: Future[T] = Future()
    try:
        done.set_result(fn(*args))
    except BaseException as e:  # the future carries it, as the pool's would
        done.set_exception(e)
    return done
