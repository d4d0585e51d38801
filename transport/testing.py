"""Test and benchmark support: a scripted handler and servers in a separate process.

Like ``zarr.testing``, this ships with the package so the conformance suite (and
``r3rdma bench transport``) can run a real UCXX server in another process and drive it
from the test process through a pipe, with no sleeps.

The :class:`ScriptedHandler` decides by ``rollout_id`` prefix of a batch's first record:

- ``gate*``: report ``("entered", rollout_id)``, wait for one :meth:`Harness.release`, then
  behave as a plain batch.
- ``fail.<ErrorName>*``: raise that ``r3rdma.errors`` class (typed error frame).
- anything else: report ``("batch", rollout_id, [RecordCopy ...])`` and return (durable).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import multiprocessing.connection
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from r3rdma import errors as _errors
from r3rdma.records import RequestRecord

from .base import TransportClient
from .limits import TransportLimits
from .loopback import LoopbackClient, LoopbackServer

__all__ = ["RecordCopy", "ScriptedHandler", "Harness", "LoopbackHarness", "UcxxProcessHarness"]


@dataclass(frozen=True, slots=True)
class RecordCopy:
    """A received record as reported by the server side (picklable, owns its bytes)."""

    rollout_id: str
    request_id: str
    ids_TLK: np.ndarray
    layer_map: tuple[int, ...]
    num_experts: int
    start_row: int
    crc32c: int
    final: bool = True
    total_rows: int | None = None

    @classmethod
    def of(cls, r: RequestRecord) -> RecordCopy:
        """A copy of ``r`` that owns its ids (the received buffer may be reused)."""
        return cls(
            r.rollout_id,
            r.request_id,
            r.ids_TLK.copy(),
            r.layer_map,
            r.num_experts,
            r.start_row,
            r.crc32c,
            r.final,
            r.total_rows,
        )


class ScriptedHandler:
    """A transport handler scripted by rollout id (see module docstring)."""

    def __init__(self, report: Callable[[tuple[Any, ...]], object]) -> None:  # what report returns is ignored
        self._report = report
        self._releases = asyncio.Semaphore(0)

    def release(self) -> None:
        """Let one batch waiting at a ``gate*`` rollout go on."""
        self._releases.release()

    async def __call__(self, records: list[RequestRecord]) -> None:
        """Handle a batch as its first record's rollout id scripts it (see the module docstring)."""
        rollout = records[0].rollout_id
        if rollout.startswith("fail."):
            name = rollout[5:].split("-")[0]
            cls = getattr(_errors, name)
            raise cls(f"scripted failure for {rollout}")
        if rollout.startswith("gate"):
            self._report(("entered", rollout))
            await self._releases.acquire()
        self._report(("batch", rollout, [RecordCopy.of(r) for r in records]))


class Harness:
    """A running server plus a way to observe its handler; same API in- and cross-process."""

    kind: str

    async def start(self) -> None:
        """Start the server (per test)."""

    async def stop(self) -> None:
        """Stop the server without draining (per test)."""

    def client(self, secret: bytes, limits: TransportLimits | None = None) -> TransportClient:
        """A client of this harness's server (not yet connected)."""
        raise NotImplementedError

    def release(self) -> None:
        """Let one batch waiting at a ``gate*`` rollout go on."""
        raise NotImplementedError

    async def next_event(self, rollout_id: str, timeout: float = 10.0) -> tuple[Any, ...]:
        """The next handler report about ``rollout_id``; reports about other rollouts are
        kept for their own callers (concurrent tests interleave)."""
        pending: dict[str, list[tuple[Any, ...]]] = self.__dict__.setdefault("_pending", {})

        async def wait() -> tuple[Any, ...]:
            if pending.get(rollout_id):
                return pending[rollout_id].pop(0)
            while True:
                event = await self._get()
                if event[1] == rollout_id:
                    return event
                pending.setdefault(event[1], []).append(event)

        return await asyncio.wait_for(wait(), timeout)

    async def _get(self) -> tuple[Any, ...]:
        raise NotImplementedError


class LoopbackHarness(Harness):
    """In-process: a LoopbackServer in the test's event loop."""

    kind = "loopback"

    def __init__(self, secret: bytes, limits: TransportLimits) -> None:
        self._secret, self._limits = secret, limits

    async def start(self) -> None:
        """Start a :class:`LoopbackServer` in this event loop with a fresh :class:`ScriptedHandler`."""
        self._events: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self._handler = ScriptedHandler(self._events.put_nowait)
        self.server = LoopbackServer(self._handler, secret=self._secret, limits=self._limits)
        await self.server.start()

    async def stop(self) -> None:
        """Stop the server without draining."""
        await self.server.stop(drain=False)

    def client(self, secret: bytes, limits: TransportLimits | None = None) -> TransportClient:
        """A :class:`LoopbackClient` of the server."""
        return LoopbackClient(self.server, secret=secret, limits=limits)

    def release(self) -> None:
        """Let one batch waiting at a ``gate*`` rollout go on."""
        self._handler.release()

    async def _get(self) -> tuple[Any, ...]:
        return await self._events.get()


class UcxxProcessHarness(Harness):
    """A UcxxServer in a spawned process; events and releases travel over a pipe.

    Spawn once (:meth:`spawn`, a few seconds) and reuse across tests; :meth:`start` and
    :meth:`stop` are per-test no-ops.
    """

    kind = "ucxx"

    def __init__(self, secret: bytes, limits: TransportLimits) -> None:
        self._secret, self._limits = secret, limits
        self.port = 0
        self._proc: Any = None
        self._pipe: multiprocessing.connection.Connection | None = None

    def spawn(self, timeout: float = 60.0) -> None:
        """Start the server process and wait for its port; raises :class:`TimeoutError` after
        ``timeout`` seconds (the process is killed)."""
        ctx = mp.get_context("spawn")  # no fork: UCX and threads do not survive fork
        ours, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_server_main, args=(theirs, "transport", self._secret, asdict(self._limits)), daemon=True)
        self._proc.start()
        theirs.close()
        self._pipe = ours
        if not ours.poll(timeout):
            self.kill()
            raise TimeoutError(f"server process did not report its port within {timeout} s")
        kind, self.port = ours.recv()
        assert kind == "port", kind

    def kill(self) -> None:
        """Tell the server process to stop and reap it (killed if it has not exited in 10 s)."""
        if self._pipe is not None:
            try:
                self._pipe.send(("stop",))
            except OSError:
                pass
        if self._proc is not None:
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)

    async def start(self) -> None:
        """Nothing to do: the process serves from :meth:`spawn` on."""

    async def stop(self) -> None:
        """Nothing to do: the process serves until :meth:`kill`."""

    def client(self, secret: bytes, limits: TransportLimits | None = None) -> TransportClient:
        """A :class:`UcxxClient` of the server process (on 127.0.0.1)."""
        from .ucxx_transport import UcxxClient

        return UcxxClient("127.0.0.1", self.port, secret=secret, limits=limits)

    def release(self) -> None:
        """Let one batch waiting at a ``gate*`` rollout in the server process go on."""
        assert self._pipe is not None
        self._pipe.send(("release",))

    async def _get(self) -> tuple[Any, ...]:
        pipe = self._pipe
        assert pipe is not None
        # Poll in a thread with a short period so cancellation by wait_for is prompt.
        while not await asyncio.to_thread(pipe.poll, 0.2):
            pass
        return pipe.recv()


def _server_main(pipe: multiprocessing.connection.Connection, what: str, secret: bytes, limits: dict) -> None:
    """Entry point of a spawned server process: serve until told to stop."""
    import logging

    logging.basicConfig(level=logging.ERROR)  # refusals are expected in tests
    asyncio.run(_server_async(pipe, what, secret, TransportLimits(**limits)))


async def _server_async(pipe: multiprocessing.connection.Connection, what: str, secret: bytes, limits: TransportLimits) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from .raw_baseline import RawSinkServer
    from .ucxx_transport import UcxxServer

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    # Reports can be MBs of pickled records: a blocking pipe.send on the event loop would
    # deadlock against a parent that is itself waiting for our ack. One writer thread keeps
    # them ordered and off the loop.
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="r3-report")
    handler = ScriptedHandler(lambda event: writer.submit(pipe.send, event))
    server: Any
    if what == "raw":
        server = RawSinkServer()
        port = await server.start()
    else:
        server = UcxxServer(handler, secret=secret, limits=limits)
        port = (await server.start()).port

    def on_command() -> None:
        try:
            cmd = pipe.recv()
        except (EOFError, OSError):  # parent gone
            cmd = ("stop",)
        if cmd[0] == "release":
            handler.release()
        elif cmd[0] == "stop":
            loop.remove_reader(pipe.fileno())
            stop.set()

    loop.add_reader(pipe.fileno(), on_command)
    pipe.send(("port", port))
    await stop.wait()
    if what == "raw":
        await server.stop()
    else:
        await server.stop(drain=False)
    writer.shutdown(wait=False, cancel_futures=True)
