"""Every UCX / UCXX environment choice r3rdma makes, in one place.

UCX reads ``UCX_*`` variables when its context is created and ucxx sets a few of its own
defaults when it is *imported*, so these choices must be made before ``import ucxx``. The
transport never imports ucxx at module level: every use goes through :func:`import_ucxx`,
which calls :func:`configure_ucx_env` first. Importing ``r3rdma.transport`` therefore sets no
environment variable and loads no UCX library.

A value already present in the environment always wins: operators tune UCX (``UCX_TLS``,
``UCX_NET_DEVICES``, ``UCX_RNDV_THRESH`` ...) without touching code.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from types import MappingProxyType, ModuleType

from r3rdma.errors import ConfigError

__all__ = [
    "UCX_ENV_DEFAULTS",
    "STORE_NODE_UCX_ENV",
    "configure_ucx_env",
    "import_ucxx",
    "next_progress",
    "stop_ucxx",
    "without_our_choices",
]

#: Defaults applied with ``setdefault`` semantics (the user's environment wins).
UCX_ENV_DEFAULTS: Mapping[str, str] = MappingProxyType(
    {
        # ucxx >= 0.52 sets UCX_MEMTYPE_CACHE=n at import, a variable UCX 1.21 no longer
        # knows; without this every process prints two "unused environment variable" warnings.
        "UCX_WARN_UNUSED_ENV_VARS": "n",
        # Progress mode of the ucxx asyncio layer (not a UCX_* variable but the same kind of
        # choice). "thread": a UCX progress thread wakes the event loop; measured ~1.5 ms per
        # round trip on a 2-core VM. "polling" is 30x faster per message but spins the event
        # loop at 100% of a core, which an inference engine cannot afford; "thread-polling"
        # starves a small machine (50 ms round trips on 2 cores). Batches are MB-sized, so
        # per-message latency matters less than leaving the CPU to the engine.
        "UCXPY_PROGRESS_MODE": "thread",
    }
)

#: What a store node process (and the transport bench's server) passes as ``overrides``.
#: "blocking": the event loop itself progresses UCX when the worker's epoll fd fires; no
#: progress thread, no thread hand-offs. Measured on the 2-core VM (ucxx 0.52, TCP loopback,
#: ping-pong of 1 MiB / 8 MiB): thread 1.5-2.1 / 8.3-9.5 ms, blocking 0.65-0.82 / 4.6-6.3 ms.
#: Safe there because a node runs one event loop and nothing else touches UCX; engine
#: processes keep "thread", where pushes run on their own loop thread beside the engine's and
#: a worker must not be progressed from two threads. ucxx's blocking mode never re-armed the
#: worker after its first event (a core spun from the first push until exit):
#: :func:`import_ucxx` installs a fix. ucxx awaits a request without Python futures by yielding
#: to the loop in a loop (``UCXRequest.wait_yield``), so a receive posted for a message that has
#: not come spins a core: a node that posted one per connected client between batches kept a
#: core busy while any client stayed connected (measured 61-100% of a core; 0 once it left). A
#: node therefore waits for a connection's next message without a receive posted
#: (:func:`next_progress`, ``_UcxxConn.wait_incoming``): its worker's epoll fd wakes the loop,
#: the fix below resolves the waiters after each progress, and the receive is posted once the
#: message is there. Python futures (``UCXPY_ENABLE_PYTHON_FUTURE=1``, thread mode only) would
#: remove the spin too but kept the buffer of every batch a vanished client left half-sent
#: (+24 MB per abandoned 48 MB batch, never released; blocking mode releases them), so not used.
#:
#: ``UCX_TCP_CM_REUSEADDR=y``: the listener (UCX's TCP connection manager) binds with
#: SO_REUSEADDR. Nodes run on fixed ports on a cluster; after a SIGKILL or a stop, the node's
#: side of every open connection lingers in TIME_WAIT / FIN_WAIT for about 60 s, and without
#: it a restart on the same port failed with "bind(...) failed: Address already in use" for
#: that long (issue 19). It lets the node bind a port with lingering connections only, never
#: one another process listens on. The name exists in the bundled UCX: libuct's TCP_CM_
#: config table has a REUSEADDR field ("Allow using an address that is already in use").
STORE_NODE_UCX_ENV: Mapping[str, str] = MappingProxyType({"UCXPY_PROGRESS_MODE": "blocking", "UCX_TCP_CM_REUSEADDR": "y"})

# Deliberately *not* set:
# - UCX_TLS / UCX_NET_DEVICES: the default ("all") picks shared memory or TCP loopback on a
#   CPU box and RDMA + cuda_copy/cuda_ipc on a GPU node; both were verified to work over
#   loopback here (UCX_TLS=tcp alone works too). Narrowing them is a deployment decision.
# - UCX_RNDV_THRESH, UCX_MAX_RNDV_RAILS, UCX_RNDV_FRAG_MEM_TYPE: ucxx sets them at import.

_lock = threading.Lock()
_applied: dict[str, str] | None = None
_set_here: dict[str, str] = {}  # what configure_ucx_env put into os.environ (absent before)


def configure_ucx_env(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """Apply r3rdma's UCX environment defaults; return the effective values it governs.

    ``overrides`` replace entries of :data:`UCX_ENV_DEFAULTS` (still below the user's
    environment). Must run before ucxx is imported; calling it again is a no-op that returns
    the same mapping. Raises :class:`ConfigError` if ucxx was imported by someone else
    before and a choice could no longer take effect.
    """
    global _applied
    with _lock:
        if _applied is not None:
            return dict(_applied)
        wanted = dict(UCX_ENV_DEFAULTS)
        for key, value in (overrides or {}).items():
            if not (key.startswith("UCX_") or key.startswith("UCXPY_")):
                raise ConfigError(f"UCX override keys must start with UCX_ or UCXPY_, got {key!r}")
            wanted[key] = str(value)
        missing = [k for k in wanted if k not in os.environ]
        if "ucxx" in sys.modules and missing:
            raise ConfigError(
                "configure_ucx_env() must run before `import ucxx`; ucxx is already imported "
                f"and {sorted(missing)} would no longer take effect"
            )
        for key in missing:
            os.environ[key] = wanted[key]
            _set_here[key] = wanted[key]
        _applied = {k: os.environ[k] for k in wanted}
        return dict(_applied)


def without_our_choices(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` (e.g. ``os.environ`` for a child process) without the variables
    :func:`configure_ucx_env` set in this process (its defaults, not the user's choices).

    Why: a child that makes its own choices (a store node: :data:`STORE_NODE_UCX_ENV`) would
    otherwise inherit this process's as if the user had set them, and the user's environment
    wins. A test or bench that configured UCX for its clients (``UCXPY_PROGRESS_MODE=thread``)
    and then started a node ran that node in thread mode, not the blocking mode a node started
    from a shell runs in.
    """
    with _lock:
        ours = {k for k, v in _set_here.items() if env.get(k) == v}
    return {k: v for k, v in env.items() if k not in ours}


def import_ucxx() -> ModuleType:
    """Import ucxx after :func:`configure_ucx_env`; the only way r3rdma imports ucxx."""
    global _applied
    if "ucxx" not in sys.modules:
        configure_ucx_env()
    else:
        # Someone imported ucxx first. Do not fail: the defaults only silence a warning and
        # name ucxx's own default progress mode. Record that nothing was applied.
        with _lock:
            if _applied is None:
                _applied = {k: os.environ.get(k, "") for k in UCX_ENV_DEFAULTS}
    try:
        import ucxx
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ConfigError("the UCXX transport needs the `ucxx` package (pip install ucxx-cu13)") from e
    _rearming_blocking_mode()
    return ucxx


# Event loops whose UCX worker is progressed in blocking mode (by the class below), and per loop
# the futures waiting for its next progress. Both touched only from that loop's thread.
_blocking_loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
_progress_waiters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = weakref.WeakKeyDictionary()


def next_progress(loop: asyncio.AbstractEventLoop) -> asyncio.Future[None] | None:
    """A future resolved right after the next progress of the UCX worker that ``loop`` drives in
    blocking mode (an event on the worker's fd, or the once-a-second safety progress); None where
    UCX is not progressed that way in ``loop`` (thread mode: a progress thread, no such event).

    What completes a UCX request or queues an incoming message happens in a progress, so a
    coroutine that checks a condition (a message waiting: ``Endpoint.tag_probe``), finds it
    false and awaits this sleeps until that condition can have changed, using no CPU meanwhile.
    Call it from ``loop``'s thread; nothing can progress the worker between the check and the
    call (both run in one step of the loop).
    """
    if loop not in _blocking_loops:
        return None
    future = loop.create_future()
    _progress_waiters.setdefault(loop, []).append(future)
    return future


def _progressed(loop: asyncio.AbstractEventLoop) -> None:
    waiters = _progress_waiters.pop(loop, None)
    for future in waiters or ():
        if not future.done():  # cancelled: its waiter timed out
            future.set_result(None)


def _rearming_blocking_mode() -> None:
    """Make ucxx's "blocking" progress mode re-arm the worker after every event, and tell
    :func:`next_progress` waiters after every progress.

    ucxx 0.52's ``BlockingMode`` arms the UCX worker once, at start. Its epoll-fd callback
    progresses the worker but never arms it again (its predecessor ucx-py did), so after the
    first event the fd stays readable and asyncio calls the callback in a busy loop: a store
    node burned a whole core from its first push until it exited (measured: 1.0 core idle,
    before and after the client closed; 0.0 before any push). Its timeout task also cancels the
    arm task without starting a new one. This subclass starts a new arm task after each
    progress from either path; ``_arm_worker`` (progress, wait until asyncio's next step is
    epoll, ``ucp_worker_arm``, retry while busy) is ucxx's own, with the waiters told after each
    of its progress calls too. Installed where ucxx looks the class up when it starts progress
    for an event loop.
    """
    from ucxx._lib_async import application_context
    from ucxx._lib_async.continuous_ucx_progress import BlockingMode

    if getattr(application_context.BlockingMode, "_r3rdma_rearms", False):
        return

    class RearmingBlockingMode(BlockingMode):
        _r3rdma_rearms = True
        arm_task: asyncio.Task[None] | None  # ucxx's own attribute (its module is untyped): None once cleared

        def __init__(self, worker, event_loop, *args, **kwargs) -> None:
            _blocking_loops.add(event_loop)
            super().__init__(worker, event_loop, *args, **kwargs)

        def _progress(self) -> None:
            self.last_progress_time = time.monotonic()
            self.worker.progress()
            _progressed(self.event_loop)

        def _rearm(self) -> None:
            if self.arm_task is None or self.arm_task.done():
                self.arm_task = self.event_loop.create_task(self._arm_worker())

        def _fd_reader_callback(self) -> None:
            self._progress()
            self._rearm()

        async def _arm_worker(self) -> None:
            # ucxx's own loop (see BlockingMode._arm_worker), with _progress telling waiters.
            while True:
                self._progress()
                # Returns once every task not waiting on I/O ran: asyncio's next step is epoll.
                await self.event_loop.sock_recv(self.rsock, 1)
                if self.worker.arm():
                    break

        async def _progress_with_timeout(self) -> None:
            while True:
                worker = self.worker
                if worker is None:
                    return
                if time.monotonic() > self.last_progress_time + self._progress_timeout:
                    self._progress()
                    self._rearm()
                await asyncio.sleep(self._progress_timeout)

    application_context.BlockingMode = RearmingBlockingMode


def stop_ucxx() -> None:
    """Stop ucxx's notifier thread if ucxx was imported and runs one (it does when the
    environment asks for Python futures: a non-daemon thread that Python would wait for
    forever at exit); call once the process is done with UCX."""
    ucxx = sys.modules.get("ucxx")
    if ucxx is not None:
        ucxx.stop_notifier_thread()
