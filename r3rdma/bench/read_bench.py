"""`r3rdma bench read`: RoutingReader over a store node's HTTP service vs raw HTTP GETs.

A store node (separate process) serves a root holding one rollout per round, each of the same
synthetic routing in several committed batches. Round ``r`` runs, back to back: (a)
``RoutingReader(url).get_numpy`` of every request of rollout ``r`` (index, array metadata,
shard reads, decompression, CRC checks), a rollout the reader has not seen, as a trainer reads
each new step's rollout; (b) plain GETs of the same files in full, with the same concurrency,
two ways: ``http.client`` reading into preallocated buffers from a thread pool, and aiohttp.
The yardstick of a round is the faster of the two. Throughput counts the bytes of those files
(what crosses the wire) per second; the ratio is the reader's time over the yardstick's.

Two modes, both fair to each side:
- ``warm`` (default; a trainer's steady state): one reader for all rounds, and the plain GETs
  reuse their kept-alive connections and threads across rounds.
- ``fresh``: a new reader each round, and new connections and threads for the plain GETs.
The last line is JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from r3rdma.store.process import new_token, spawn_node
from r3rdma.bench.synthetic import synthetic_records
from r3rdma.bench._progress import rounds_bar as _rounds

__all__ = ["run_read_bench", "add_arguments", "main"]


class _PlainGets:
    """GETs of whole files with ``http.client``, each into a buffer of its Content-Length (no
    copies), ``concurrency`` at a time; with ``keep_alive`` threads and connections outlive a call."""

    def __init__(self, base: str, token: str, concurrency: int, keep_alive: bool) -> None:
        self._url = urllib.parse.urlsplit(base)
        self._headers = {"Authorization": f"Bearer {token}"}
        self._concurrency = concurrency
        self._keep_alive = keep_alive
        self._pool = ThreadPoolExecutor(concurrency) if keep_alive else None
        self._local = threading.local()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def _one(self, path: str) -> int:
        conn = getattr(self._local, "conn", None) if self._keep_alive else None
        if conn is None:
            conn = http.client.HTTPConnection(self._url.hostname, self._url.port, timeout=60)
        try:
            conn.request("GET", f"/zarr/{path}", headers=self._headers)
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {response.status}")
            size = int(response.getheader("Content-Length"))
            view = memoryview(np.empty(size, dtype=np.uint8))
            got = 0
            while got < size:
                n = response.readinto(view[got:])
                if not n:
                    raise RuntimeError(f"GET {path}: body ended after {got} of {size} bytes")
                got += n
            response.read()  # the response is done: the connection can carry the next request
        except BaseException:
            conn.close()
            self._local.conn = None
            raise
        if self._keep_alive:
            self._local.conn = conn
        else:
            conn.close()
        return got

    def get_all(self, paths: list[str]) -> int:
        if self._pool is not None:
            return sum(self._pool.map(self._one, paths))
        with ThreadPoolExecutor(self._concurrency) as pool:
            return sum(pool.map(self._one, paths))


async def _raw_get_all(session, base: str, paths: list[str], concurrency: int) -> int:
    """GET each file whole with aiohttp (``concurrency`` at a time)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(path: str) -> int:
        async with sem, session.get(f"{base}/zarr/{path}") as response:
            response.raise_for_status()
            return len(await response.read())

    return sum(await asyncio.gather(*(one(p) for p in paths)))


def run_read_bench(
    *, requests: int = 64, rounds: int = 3, root: str | None = None, zstd_level: int = 3, mode: str = "warm",
    progress: bool = True,
) -> dict:
    from r3rdma.store.local_store import LocalRoutingStore
    from r3rdma.read.reader import RoutingReader

    if mode not in ("warm", "fresh"):
        raise ValueError(f"mode must be 'warm' or 'fresh', got {mode!r}")
    base = Path(root or tempfile.mkdtemp(prefix="r3rdma-bench-read-"))
    store_root = base / "node"
    records = synthetic_records(requests, rollout_id="bench-0", seed=1)
    rollouts = [f"bench-{r}" for r in range(rounds)]
    with LocalRoutingStore(store_root, zstd_level=zstd_level) as store:
        for rollout in rollouts:  # the same routing under one rollout id per round
            mine = [dataclasses.replace(rec, rollout_id=rollout) for rec in records]
            for i in range(0, len(mine), 16):  # a few MB-sized batches, as a writer commits them
                store.commit(mine[i : i + 16])
    files = {
        rollout: sorted(str(p.relative_to(store_root)) for p in (store_root / rollout).rglob("*") if p.is_file())
        for rollout in rollouts
    }
    file_bytes = {rollout: sum((store_root / f).stat().st_size for f in paths) for rollout, paths in files.items()}
    node = spawn_node(store_root, new_token())
    token = node.read_token  # HTTP reads take the read token derived from the push secret
    url = node.http_url
    warm = mode == "warm"
    ids = [r.request_id for r in records]
    reader = RoutingReader(url, token=token) if warm else None
    plain = _PlainGets(url, token, concurrency=10, keep_alive=warm)
    loop = asyncio.new_event_loop()
    session = loop.run_until_complete(_new_session(token)) if warm else None
    try:
        reader_s, client_s, aiohttp_s = [], [], []
        for rnd in _rounds(rounds, "read"):
            rollout = rollouts[rnd]
            t0 = time.perf_counter()
            if warm:
                got = reader.get_numpy(rollout, ids)  # a rollout it has not seen: the index is fetched
            else:
                with RoutingReader(url, token=token) as fresh:
                    got = fresh.get_numpy(rollout, ids)
            reader_s.append(time.perf_counter() - t0)
            assert sum(a.nbytes for a in got.values()) == sum(r.nbytes for r in records)
            t0 = time.perf_counter()
            assert plain.get_all(files[rollout]) == file_bytes[rollout]
            client_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            moved = loop.run_until_complete(_aiohttp_round(session, token, url, files[rollout]))
            assert moved == file_bytes[rollout], (moved, file_bytes[rollout])
            aiohttp_s.append(time.perf_counter() - t0)
            if progress:
                gbps = [file_bytes[rollout] / t[-1] / 1e9 for t in (reader_s, client_s, aiohttp_s)]
                print(f"round {rnd + 1}/{rounds}: reader {gbps[0]:.3f} GB/s, raw GET http.client {gbps[1]:.3f} GB/s, "
                      f"aiohttp {gbps[2]:.3f} GB/s", file=sys.stderr, flush=True)
    finally:
        if reader is not None:
            reader.close()
        plain.close()
        if session is not None:
            loop.run_until_complete(session.close())
        loop.close()
        node.stop()
    size = file_bytes[rollouts[0]]
    raw_s = [min(a, b) for a, b in zip(client_s, aiohttp_s)]  # each round's faster plain GET
    ratios = sorted(r / t for t, r in zip(reader_s, raw_s))
    return {
        "bench": "read", "mode": mode, "requests": requests, "zstd_level": zstd_level, "files": len(files[rollouts[0]]),
        "file_bytes": size, "routing_bytes": sum(r.nbytes for r in records),
        "reader_gbps": round(size / statistics.median(reader_s) / 1e9, 4),
        "raw_http_gbps": round(size / statistics.median(raw_s) / 1e9, 4),
        "raw_http_client_gbps": round(size / statistics.median(client_s) / 1e9, 4),
        "raw_aiohttp_gbps": round(size / statistics.median(aiohttp_s) / 1e9, 4),
        # Median of per-round ratios: a round's reader and raw reads run back to back.
        "ratio": round(statistics.median(ratios), 3), "ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)],
        "reader_routing_gbps": round(sum(r.nbytes for r in records) / statistics.median(reader_s) / 1e9, 4),
    }


async def _new_session(token: str):
    import aiohttp

    return aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"})


async def _aiohttp_round(session, token: str, url: str, paths: list[str]) -> int:
    """One round of aiohttp GETs: on the kept session (warm), or on a session of its own."""
    if session is not None:
        return await _raw_get_all(session, url, paths, concurrency=10)
    async with await _new_session(token) as own:
        return await _raw_get_all(own, url, paths, concurrency=10)


def add_arguments(parser) -> None:
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", default=None, help="scratch directory (default: temporary)")
    parser.add_argument("--zstd-level", type=int, default=3, help="compression of the store read (0: none; default: the store's)")
    parser.add_argument("--mode", choices=("warm", "fresh"), default="warm",
                        help="warm: one reader and kept-alive plain GETs across rounds (a trainer's steady state); "
                             "fresh: new ones each round")


def main(args) -> int:
    print(json.dumps(run_read_bench(requests=args.requests, rounds=args.rounds, root=args.root, zstd_level=args.zstd_level, mode=args.mode)))
    return 0
