"""Read-worker processes: a store node's HTTP port served by several processes.

Why. One Python process serves about a thousand ranged GETs a second (aiohttp's per-request
work, not the bytes: ~0.5 ms of CPU per 0.6 MB range on the CPU VM, 1.4 ms per 8 MB one), and a
trainer rank's scattered share is thousands of sub-MB ranges (BENCHMARKS.md "A whole RL step").
So the node's HTTP port is served by ``http_workers`` processes, each listening on it with
``SO_REUSEPORT``: the kernel spreads connections over the workers by a hash of each
connection's addresses. (A single listening socket shared by all workers, gunicorn's pre-fork
model, came first; it leaves the balance to whichever worker wakes first, which can hand most
of a reader's pooled connections to one worker. That this caused the run-to-run spread seen on
the H100 host is not shown: with SO_REUSEPORT the spread stayed, 0.84 and 0.60 of contiguous.)
The node process binds the port with
``SO_REUSEPORT`` too, without listening, so that it stays reserved while a worker restarts;
it only ingests (UCX) and commits.

What a worker does. It runs the node's HTTP app (store/http_app.py) on its socket with the
same tokens, answering every read itself from the files (committed files are immutable,
index entry points are replaced atomically, so any process may read them). Requests that need
the node's writer or its in-memory state, DELETE and /metrics, go on to the node process over a
private Unix socket (``control``), bearer header and all, so the node checks the token again.
HTTP counters are kept in prometheus-client's multiprocess files (``metrics_dir``), which the
node's /metrics adds up (store/metrics.py).

Lifetimes. The node writes each worker its settings (tokens included: never argv, which ``ps``
shows) as one JSON line on the worker's stdin and keeps the pipe open: a worker exits when it
reads EOF, so workers never outlive a node that was killed. A worker that dies is started
again (logged); ``stop`` sends SIGTERM and waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from r3rdma.errors import StoreError

__all__ = ["ReadWorkers", "WorkerSettings", "default_http_workers", "reuse_port_socket"]

log = logging.getLogger("r3rdma.store")

_RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)  # a worker that keeps dying is restarted ever more slowly


def reuse_port_socket(host: str, port: int, *, listen: bool) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (listening if ``listen``)."""
    family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(where)
        if listen:
            sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def default_http_workers() -> int:
    """``--http-workers auto``: a quarter of the host's cores, at most 8 (0 below 4 cores:
    the node process serves HTTP itself)."""
    return min(8, (os.cpu_count() or 1) // 4)


@dataclass
class WorkerSettings:
    """What a worker needs; sent as JSON on its stdin."""

    root: str
    read_token: str | None
    admin_token: str | None
    public_read: bool
    control: str  # the node process's Unix socket, for DELETE and /metrics
    keepalive_timeout_s: float
    host: str  # the address and port to listen on (SO_REUSEPORT)
    port: int


class ReadWorkers:
    """Starts, watches and stops ``count`` worker processes listening on one port."""

    def __init__(self, count: int, settings: WorkerSettings, metrics_dir: str) -> None:
        if count < 1:
            raise ValueError(f"ReadWorkers needs at least 1 worker, got {count}")
        self.count = count
        self._settings = settings
        self._metrics_dir = metrics_dir
        self._procs: list[subprocess.Popen | None] = [None] * count
        self._restarts = [0] * count
        self._watcher: asyncio.Task | None = None
        self._stopping = False

    @property
    def pids(self) -> list[int]:
        """The process ids of the workers running now."""
        return [p.pid for p in self._procs if p is not None and p.poll() is None]

    def _spawn(self, slot: int) -> subprocess.Popen:
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=self._metrics_dir, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            [sys.executable, "-m", "r3rdma.store.read_workers"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(asdict(self._settings)) + "\n").encode())
        proc.stdin.flush()  # and keep it open: EOF tells the worker the node is gone
        self._procs[slot] = proc
        return proc

    async def start(self, timeout: float = 60.0) -> None:
        """Start the workers; return once each listens (it prints ``ready``), so the node's
        ready line never announces a port nobody accepts on."""
        procs = [self._spawn(slot) for slot in range(self.count)]
        for proc in procs:
            try:
                line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout)  # type: ignore[union-attr]
            except TimeoutError:
                line = b""
            if line.strip() != b"ready":
                await self.stop()
                raise StoreError(
                    f"HTTP read worker pid {proc.pid} did not start listening on port "
                    f"{self._settings.port} (exit status {proc.poll()}); its error is in the node's log"
                )
        self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        """Start again any worker that exits while the node runs."""
        while not self._stopping:
            await asyncio.sleep(0.2)
            for slot, proc in enumerate(self._procs):
                if self._stopping or proc is None or proc.poll() is None:
                    continue
                delay = _RESTART_BACKOFF_S[min(self._restarts[slot], len(_RESTART_BACKOFF_S) - 1)]
                log.warning(
                    "HTTP read worker %d (pid %d) exited with %s; starting it again in %.1f s",
                    slot,
                    proc.pid,
                    proc.returncode,
                    delay,
                )
                self._restarts[slot] += 1
                self._procs[slot] = None
                with contextlib.suppress(OSError):
                    proc.stdin.close()  # type: ignore[union-attr]
                await asyncio.sleep(delay)
                if not self._stopping:
                    self._spawn(slot)

    async def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM every worker (each finishes the responses it is sending), then wait; kill stragglers."""
        self._stopping = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        procs = [p for p in self._procs if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            while p.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if p.poll() is None:
                log.warning("HTTP read worker pid %d did not stop in %.0f s; killing it", p.pid, timeout)
                p.kill()
                p.wait()
            with contextlib.suppress(OSError):
                p.stdin.close()  # type: ignore[union-attr]


# --- the worker process -------------------------------------------------------------------


async def _serve(settings: WorkerSettings) -> None:
    from aiohttp import web

    from .http_app import make_http_app
    from .metrics import HttpMetrics

    app = make_http_app(
        Path(settings.root),
        read_token=settings.read_token,
        admin_token=settings.admin_token,
        public_read=settings.public_read,
        metrics=HttpMetrics(),
        control=settings.control,
    )
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=settings.keepalive_timeout_s)
    await runner.setup()
    await web.SockSite(runner, reuse_port_socket(settings.host, settings.port, listen=True)).start()
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # EOF on stdin: the node process is gone (even if it was killed), so this worker goes too.
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not os.read(sys.stdin.fileno(), 4096) else None)
    await stop.wait()
    loop.remove_reader(sys.stdin.fileno())
    await runner.cleanup()


def main() -> int:
    from .node_logging import setup_node_logging

    setup_node_logging("r3rdma-store[read worker]")
    line = sys.stdin.buffer.readline()
    if not line:
        return 0  # the node went away before sending settings
    settings = WorkerSettings(**json.loads(line))
    asyncio.run(_serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
