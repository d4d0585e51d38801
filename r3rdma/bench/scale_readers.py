"""The trainer side of ``r3rdma bench scale`` (and of ``bench rlstep``'s after-step reads): what a
reader process runs, driven over its pipe (:class:`r3rdma.bench.support.Worker`) to read its share
of a rollout through :class:`~r3rdma.read.reader.RoutingReader` or as plain HTTP GETs of the
stored files (the raw-GET ceiling)."""

from __future__ import annotations

import http.client
import os
import time
import urllib.parse
from typing import Any

from r3rdma.bench.support import Worker, serve, wait_go

__all__ = ["reader_worker", "reader_main", "worker_read", "open_index_ms"]


def reader_worker(ctx, rank: int, urls: list[str], token: str) -> Worker:
    """Start reader process ``rank`` (:func:`reader_main` over the nodes at ``urls``) from ``ctx``, a
    :func:`~r3rdma.bench.support.worker_context`."""
    return Worker(ctx, rank, reader_main, (urls, token), f"r3rdma-reader-{rank}")


def reader_main(conn, urls: list[str], token: str) -> None:
    """Body of a reader process: build the reader, then run the commands arriving on ``conn``."""
    os.dup2(2, 1)  # the parent's stdout ends with its JSON line: anything printed here goes to stderr
    from r3rdma.read.reader import RoutingReader

    reader = RoutingReader(urls, token=token, progress=False)
    raw = FileGetter(token)
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

    serve(
        conn,
        {"read": lambda cmd: worker_read(reader, cmd, conn), "raw": lambda cmd: _worker_raw(raw, cmd, conn), "open": open_fresh},
    )
    reader.close()
    raw.close()


def open_index_ms(worker: Worker, rollout: str, requests: int, timeout: float) -> dict[str, float]:
    """A fresh reader's ``info()`` of the whole rollout, three times: ``index_open_ms`` (median)
    and ``index_open_ms_first``."""
    import statistics

    worker.send({"cmd": "open", "rollout": rollout, "repeat": 3})
    opened = worker.recv(timeout)
    assert opened["requests"] == requests, (opened["requests"], requests)
    return {"index_open_ms": round(statistics.median(opened["ms"]), 2), "index_open_ms_first": round(opened["ms"][0], 2)}


def worker_read(reader, cmd: dict[str, Any], conn) -> None:
    """Arm (index read, one untimed micro-batch), wait for go, read every micro-batch in order
    through ``prefetch``; stop after the micro-batch that crosses ``cmd["seconds"]`` (0: none)."""
    from r3rdma.records import checksum

    rollout, batches = cmd["rollout"], cmd["batches"]
    reader.info(rollout)  # the index, as a trainer holds it before its step's reads
    if batches:
        reader.get_packed(rollout, batches[-1])  # connections and buffers warm
    wait_go(conn)
    limit = cmd["seconds"] or float("inf")
    crcs: dict[str, int] = {}
    requests = rows = nbytes = 0
    cpu0 = time.process_time()  # every thread of this reader: decode pool and HTTP client included
    start = time.time()
    stream = reader.prefetch(rollout, batches, depth=2)
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
        stream.close()
    conn.send(
        {
            "event": "done",
            "start": start,
            "end": time.time(),
            "requests": requests,
            "rows": rows,
            "bytes": nbytes,
            "cpu_s": time.process_time() - cpu0,
            "api": "prefetch",
            "crcs": crcs,
        }
    )


def _worker_raw(raw: FileGetter, cmd: dict[str, Any], conn) -> None:
    files = cmd["files"]
    for base in {b for b, _ in files}:  # connections up before the clock starts
        raw.get(base, cmd["warm"][base])
    wait_go(conn)
    limit = cmd["seconds"] or float("inf")
    got = count = 0
    start = time.time()
    for base, path in files:
        got += raw.get(base, path)
        count += 1
        if time.time() - start > limit:
            break
    conn.send({"event": "done", "start": start, "end": time.time(), "bytes": got, "files": count})


class ReadPhases:
    """Timed read phases (:func:`~r3rdma.bench.support.run_phase`), summed by name over rounds:
    bytes read, spans, the phase's rate each round, the readers' CPU and the cores the store
    nodes (their read workers included) kept busy."""

    def __init__(self, node_procs, timeout: float) -> None:
        self.nodes, self.timeout = node_procs, timeout
        self.totals: dict[str, dict[str, Any]] = {}

    def run(self, name: str, workers: list[Worker], commands: list[dict[str, Any]], wanted: int = 0):
        """One phase; its answers and (GB/s, seconds, bytes)."""
        from r3rdma.bench.support import cpu_seconds, run_phase, span_rate

        cpu0, wall0 = sum(cpu_seconds(n.proc.pid) for n in self.nodes), time.perf_counter()
        answers = run_phase(workers, commands, self.timeout)
        node_cpu = sum(cpu_seconds(n.proc.pid) for n in self.nodes) - cpu0
        gbps, span, moved = span_rate(answers)
        t = self.totals.setdefault(
            name, {"node_cpu": 0.0, "wall": 0.0, "reader_cpu": 0.0, "span": 0.0, "moved": 0, "wanted": 0, "rates": []}
        )
        t["node_cpu"] += node_cpu
        t["wall"] += time.perf_counter() - wall0
        t["reader_cpu"] += sum(a["cpu_s"] for a in answers)
        t["span"] += span
        t["moved"] += moved
        t["wanted"] += wanted
        t["rates"].append(gbps)
        return answers, (gbps, span, moved)

    def gbps(self, name: str) -> float:
        """All rounds of a phase: bytes over the summed spans."""
        return self.totals[name]["moved"] / max(self.totals[name]["span"], 1e-9) / 1e9


class FileGetter:
    """Whole-file GETs of a node's ``/zarr/`` files with ``http.client`` into one reused buffer,
    a kept-alive connection per node: the plain-HTTP yardstick (the raw-GET phase). One per thread."""

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
            if url.hostname is None:
                raise ValueError(f"{base!r} is not a node's http://host:port URL")
            conn = self._conns[base] = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        try:
            conn.request("GET", f"/zarr/{path}", headers=self._headers)
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"GET {base}/zarr/{path}: HTTP {response.status}")
            length = response.getheader("Content-Length")
            if length is None:
                raise RuntimeError(f"GET {base}/zarr/{path}: no Content-Length")
            size = int(length)
            if size > len(self._buffer):
                self._buffer = memoryview(bytearray(size))
            got = 0
            while got < size:
                n = response.readinto(self._buffer[got:size])
                if not n:
                    raise RuntimeError(f"GET {base}/zarr/{path}: body ended after {got} of {size} bytes")
                got += n
            response.read()  # the response is done: the connection can carry the next request
        except BaseException:
            del self._conns[base]
            conn.close()
            raise
        return got
