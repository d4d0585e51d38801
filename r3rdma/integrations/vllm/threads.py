"""Where the plug-in's threads run in a vLLM worker whose model is pinned to its cores.

vLLM's CPU backend binds each worker's OpenMP threads, its main thread included, to the cores
it gives the model (``VLLM_CPU_OMP_THREADS_BIND``; on a small host it keeps the others for the
engine core and the front end). A thread inherits the mask of the thread that starts it, so the
writer's and the store's threads (commit, encode, publish, fsync, zarr's I/O loop), all started
from the worker's main thread, would share the model's cores and take their time straight from
its forward. Measured on the CPU VM (2 cores, vLLM 0.32 CPU, 64 running requests, a local
store): the worker's main thread was pinned to one core and the engine core's busy wait for
the worker's reply ran on the other; two plug-in-on engines interleaved over 10 rounds took
5.54 s (median) per round with the plug-in's threads beside the model against 5.67 s on its
core (9 rounds of 10 faster).

:func:`threads_beside_the_model` starts them on the process's other cores instead: the cores
the worker's parent (vLLM's engine core, or the user's process) may use, less the model's. On a
GPU worker (never pinned) it does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from r3rdma.integrations.vllm.settings import LOGGER_NAME

__all__ = ["threads_beside_the_model", "spare_cpus"]

log = logging.getLogger(LOGGER_NAME)


def spare_cpus(own: set[int], parent: set[int]) -> set[int] | None:
    """The cores for threads started beside a model pinned to ``own``, the parent process
    allowed ``parent``: ``parent - own``, or None where the model is not pinned to fewer cores
    than the parent has (nothing to move)."""
    if not own < parent:
        return None
    return parent - own


@contextlib.contextmanager
def threads_beside_the_model() -> Iterator[None]:
    """Threads started inside this block run on the process's cores outside the calling
    thread's (the model's) pinned set; the calling thread's own mask is restored after."""
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    own = set(os.sched_getaffinity(0))
    try:
        parent = set(os.sched_getaffinity(os.getppid()))
    except OSError:  # the parent is gone or not ours to ask
        parent = own
    spare = spare_cpus(own, parent)
    if spare is None:
        yield
        return
    os.sched_setaffinity(0, spare)
    log.info("r3rdma: the model is pinned to cores %s; the plug-in's threads run on %s", sorted(own), sorted(spare))
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)
