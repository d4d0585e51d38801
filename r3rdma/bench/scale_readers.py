"""The trainer side of ``r3rdma bench scale``: reader processes (forked from one forkserver that
imported the reader once), each driven over a pipe to read its share of a rollout, through
:class:`~r3rdma.read.reader.RoutingReader` or as plain HTTP GETs of the stored files (the
raw-GET ceiling), and the span rate of a phase over all of them."""

from __future__ import annotations

import http.client
import os
import time
import urllib.parse
from typing import Any

__all__ = ["reader_context", "ReaderWorker", "run_phase", "span_rate", "serve"]


def reader_context():
    """Reader processes fork from one server that imported the reader once: on 2 cores, eight
    separate imports of torch and zarr took ~16 s; forks of one take well under a second."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["r3rdma.read.reader", "r3rdma.bench.scale_readers"])
    return ctx


class ReaderWorker:
    """A reader process and its pipe: commands one way, answers the other."""

    def __init__(self, ctx, rank: int, urls: list[str], token: str) -> None:
        self.rank = rank
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, urls, token), name=f"r3rdma-scale-reader-{rank}", daemon=True)
        self.proc.start()
        child.close()
        self._stopping = False

    def send(self, message: dict[str, Any]) -> None:
        self.conn.send(message)

    def recv(self, timeout: float) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"reader process {self.rank}: no answer in {timeout} s")
        try:
            message = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"reader process {self.rank} exited with {self.proc.exitcode}") from None
        if message.get("event") == "error":
            raise RuntimeError(f"reader process {self.rank} failed:\n{message['error']}")
        return message

    def request_stop(self) -> None:
        if self.proc.is_alive() and not self._stopping:
            self._stopping = True
            try:
                self.conn.send({"cmd": "stop"})
            except OSError:
                pass

    def stop(self) -> None:
        if self.proc.is_alive():
            self.request_stop()
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(30)
        self.conn.close()


def serve(conn, handlers: dict[str, Any]) -> None:
    """Run the commands arriving on ``conn`` (``handlers[cmd["cmd"]](cmd)``) until ``stop`` or
    the pipe closes; an exception goes back as ``{"event": "error"}`` and serving goes on."""
    import traceback

    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        if cmd["cmd"] == "stop":
            return
        try:
            handler = handlers.get(cmd["cmd"])
            if handler is None:
                raise ValueError(f"unknown command {cmd['cmd']!r}")
            handler(cmd)
        except BaseException:
            conn.send({"event": "error", "error": traceback.format_exc()})


def _worker_main(conn, urls: list[str], token: str) -> None:
    """Body of a reader process: build the reader, then run the commands arriving on ``conn``."""
    os.dup2(2, 1)  # the parent's stdout ends with its JSON line: anything printed here goes to stderr
    from r3rdma.read.reader import RoutingReader

    reader = RoutingReader(urls, token=token, progress=False)
    raw = _RawGetter(token)
    conn.send({"event": "ready"})

    def open_fresh(cmd: dict[str, Any]) -> None:
        times = []
        for _ in range(cmd["repeat"]):
            fresh = RoutingReader(urls, token=token, progress=False)
            t0 = time.perf_counter()
            info = fresh.info(cmd["rollout"])
            times.append((time.perf_counter() - t0) * 1e3)
            fresh.close()
        conn.send({"event": "done", "ms": times, "requests": len(info.request_ids)})

    serve(conn, {"read": lambda cmd: _worker_read(reader, cmd, conn), "raw": lambda cmd: _worker_raw(raw, cmd, conn),
                 "open": open_fresh})
    reader.close()
    raw.close()


def _worker_read(reader, cmd: dict[str, Any], conn) -> None:
    """Arm (index read, one untimed micro-batch), wait for go, read every micro-batch in order."""
    from r3rdma.records import checksum

    rollout, batches = cmd["rollout"], cmd["batches"]
    reader.info(rollout)  # the index, as a trainer holds it before its step's reads
    if batches:
        reader.get_packed(rollout, batches[-1])  # connections and buffers warm
    use_prefetch = hasattr(reader, "prefetch")
    conn.send({"event": "armed"})
    if conn.recv()["cmd"] != "go":
        raise RuntimeError("expected go")
    limit = cmd["seconds"] or float("inf")
    crcs: dict[str, int] = {}
    requests = rows = nbytes = 0
    cpu0 = time.process_time()  # every thread of this reader: decode pool and HTTP client included
    start = time.time()
    if use_prefetch:
        stream = reader.prefetch(rollout, batches, depth=2)
    else:
        stream = (reader.get_packed(rollout, ids) for ids in batches)
    try:
        for packed in stream:
            ids_TLK = packed.ids_TLK
            requests += len(packed.request_ids)
            rows += int(ids_TLK.shape[0])
            nbytes += ids_TLK.numel() * ids_TLK.element_size()
            if cmd["verify"]:
                cu = packed.cu_seqlens.tolist()
                array = ids_TLK.numpy()
                for j, rid in enumerate(packed.request_ids):
                    crcs[rid] = checksum(array[cu[j] : cu[j + 1]])
            if time.time() - start > limit:
                break
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
    end = time.time()
    conn.send({"event": "done", "start": start, "end": end, "requests": requests, "rows": rows, "bytes": nbytes,
               "cpu_s": time.process_time() - cpu0, "api": "prefetch" if use_prefetch else "get_packed", "crcs": crcs})


class _RawGetter:
    """Whole-file GETs with ``http.client`` into one reused buffer, a kept-alive connection per node."""

    def __init__(self, token: str) -> None:
        self._headers = {"Authorization": f"Bearer {token}"}
        self._conns: dict[str, http.client.HTTPConnection] = {}
        self._buffer = memoryview(bytearray(1 << 20))

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()

    def get(self, base: str, path: str) -> int:
        conn = self._conns.get(base)
        if conn is None:
            url = urllib.parse.urlsplit(base)
            conn = self._conns[base] = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        conn.request("GET", f"/zarr/{path}", headers=self._headers)
        response = conn.getresponse()
        if response.status != 200:
            response.read()
            raise RuntimeError(f"GET {base}/zarr/{path}: HTTP {response.status}")
        size = int(response.getheader("Content-Length"))
        if size > len(self._buffer):
            self._buffer = memoryview(bytearray(size))
        got = 0
        while got < size:
            n = response.readinto(self._buffer[got:size])
            if not n:
                raise RuntimeError(f"GET {base}/zarr/{path}: body ended after {got} of {size} bytes")
            got += n
        response.read()
        return got


def _worker_raw(raw: _RawGetter, cmd: dict[str, Any], conn) -> None:
    files = cmd["files"]
    for base in {b for b, _ in files}:  # connections up before the clock starts
        raw.get(base, cmd["warm"][base])
    conn.send({"event": "armed"})
    if conn.recv()["cmd"] != "go":
        raise RuntimeError("expected go")
    limit = cmd["seconds"] or float("inf")
    got = count = 0
    start = time.time()
    for base, path in files:
        got += raw.get(base, path)
        count += 1
        if time.time() - start > limit:
            break
    conn.send({"event": "done", "start": start, "end": time.time(), "bytes": got, "files": count})


def run_phase(workers: list[ReaderWorker], commands: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    """Arm each worker with its command, then release them together; their answers."""
    for worker, cmd in zip(workers, commands):
        worker.send(cmd)
    for worker in workers:
        assert worker.recv(timeout)["event"] == "armed"
    for worker in workers:
        worker.send({"cmd": "go"})
    return [worker.recv(timeout) for worker in workers]


def span_rate(results: list[dict[str, Any]]) -> tuple[float, float, int]:
    """(GB/s, seconds, bytes) of a phase: all bytes over first start to last end."""
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    total = sum(r["bytes"] for r in results)
    return total / max(span, 1e-9) / 1e9, span, total

