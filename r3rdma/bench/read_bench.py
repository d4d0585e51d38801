"""`r3rdma bench read`: RoutingReader over a store node's HTTP service vs raw HTTP GETs.

A store node (separate process) serves a root populated with synthetic routing (several
committed batches). Each round runs, back to back: (a) ``RoutingReader(url).get_numpy`` of
every request of the rollout, as a trainer opens it (index, array metadata, shard reads,
decompression, chunk and request CRC checks); (b) plain GETs of the same files in full,
with the same concurrency, two ways: ``http.client`` reading into preallocated buffers from
a thread pool, and aiohttp. The yardstick of a round is the faster of the two. Throughput
counts the bytes of those files (what crosses the wire) per second; the ratio is the
reader's time over the yardstick's. The last line is JSON.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ..store.process import new_token, spawn_node
from .synthetic import synthetic_records

from ._progress import rounds_bar as _rounds

__all__ = ["run_read_bench", "add_arguments", "main"]


def _raw_get_all_http_client(base: str, token: str, paths: list[str], concurrency: int) -> int:
    """GET each file whole with http.client, into a buffer of its Content-Length (no copies)."""
    import http.client
    import urllib.parse
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    url = urllib.parse.urlsplit(base)

    def one(path: str) -> int:
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        try:
            conn.request("GET", f"/zarr/{path}", headers={"Authorization": f"Bearer {token}"})
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
            return got
        finally:
            conn.close()

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(one, paths))


async def _raw_get_all(base: str, token: str, paths: list[str], concurrency: int) -> int:
    """GET each file whole with aiohttp (``concurrency`` at a time)."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
        async def one(path: str) -> int:
            async with sem, session.get(f"{base}/zarr/{path}") as response:
                response.raise_for_status()
                return len(await response.read())

        return sum(await asyncio.gather(*(one(p) for p in paths)))


def run_read_bench(
    *, requests: int = 64, rounds: int = 3, root: str | None = None, zstd_level: int = 3, progress: bool = True
) -> dict:
    from ..local_store import LocalRoutingStore
    from ..reader import RoutingReader

    base = Path(root or tempfile.mkdtemp(prefix="r3rdma-bench-read-"))
    store_root = base / "node"
    records = synthetic_records(requests, rollout_id="bench", seed=1)
    with LocalRoutingStore(store_root, zstd_level=zstd_level) as store:
        for i in range(0, len(records), 16):  # a few MB-sized batches, as a writer commits them
            store.commit(records[i : i + 16])
    token = new_token()
    files = sorted(str(p.relative_to(store_root)) for p in (store_root / "bench").rglob("*") if p.is_file())
    shard_bytes = sum((store_root / f).stat().st_size for f in files)
    node = spawn_node(store_root, token)
    url = node.http_url
    try:
        ids = [r.request_id for r in records]
        reader_s, client_s, aiohttp_s = [], [], []
        for rnd in _rounds(rounds, "read"):
            t0 = time.perf_counter()
            with RoutingReader(url, token=token) as reader:  # as a trainer opens it: a fresh index
                got = reader.get_numpy("bench", ids)
            reader_s.append(time.perf_counter() - t0)
            assert sum(a.nbytes for a in got.values()) == sum(r.nbytes for r in records)
            t0 = time.perf_counter()
            assert _raw_get_all_http_client(url, token, files, concurrency=10) == shard_bytes
            client_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            moved = asyncio.run(_raw_get_all(url, token, files, concurrency=10))
            assert moved == shard_bytes, (moved, shard_bytes)
            aiohttp_s.append(time.perf_counter() - t0)
            if progress:
                gbps = [shard_bytes / t[-1] / 1e9 for t in (reader_s, client_s, aiohttp_s)]
                print(f"round {rnd + 1}/{rounds}: reader {gbps[0]:.3f} GB/s, raw GET http.client {gbps[1]:.3f} GB/s, "
                      f"aiohttp {gbps[2]:.3f} GB/s", file=sys.stderr, flush=True)
    finally:
        node.stop()
    raw_s = [min(a, b) for a, b in zip(client_s, aiohttp_s)]  # each round's faster plain GET
    ratios = sorted(r / t for t, r in zip(reader_s, raw_s))
    reader_gbps = shard_bytes / statistics.median(reader_s) / 1e9
    raw_gbps = shard_bytes / statistics.median(raw_s) / 1e9
    return {
        "bench": "read", "requests": requests, "zstd_level": zstd_level, "files": len(files), "file_bytes": shard_bytes,
        "routing_bytes": sum(r.nbytes for r in records),
        "reader_gbps": round(reader_gbps, 4), "raw_http_gbps": round(raw_gbps, 4),
        "raw_http_client_gbps": round(shard_bytes / statistics.median(client_s) / 1e9, 4),
        "raw_aiohttp_gbps": round(shard_bytes / statistics.median(aiohttp_s) / 1e9, 4),
        # Median of per-round ratios: a round's reader and raw reads run back to back.
        "ratio": round(statistics.median(ratios), 3), "ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)],
        "reader_routing_gbps": round(sum(r.nbytes for r in records) / statistics.median(reader_s) / 1e9, 4),
    }


def add_arguments(parser) -> None:
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", default=None, help="scratch directory (default: temporary)")
    parser.add_argument("--zstd-level", type=int, default=3, help="compression of the store read (0: none; default: the store's)")


def main(args) -> int:
    print(json.dumps(run_read_bench(requests=args.requests, rounds=args.rounds, root=args.root, zstd_level=args.zstd_level)))
    return 0
