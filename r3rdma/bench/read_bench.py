"""`r3rdma bench read`: RoutingReader over a store node's HTTP service vs raw HTTP GETs.

A store node (separate process) serves a root populated with synthetic routing (several
committed batches). Rounds alternate between (a) ``RoutingReader.get_numpy`` of every request
of the rollout, through zarr's HTTP store (shard index + ranged chunk reads, decompression,
CRC checks), and (b) plain aiohttp GETs, with the same concurrency, of the same shard files
in full. Throughput counts the bytes of those files (what crosses the wire) per second; the
ratio is the reader's cost over moving the same files. The last line is JSON.
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


async def _raw_get_all(base: str, token: str, paths: list[str], concurrency: int) -> int:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    total = 0
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
        async def one(path: str) -> None:
            nonlocal total
            async with sem, session.get(f"{base}/zarr/{path}") as response:
                response.raise_for_status()
                total += len(await response.read())

        await asyncio.gather(*(one(p) for p in paths))
    return total


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
        reader_s, raw_s = [], []
        for rnd in _rounds(rounds, "read"):
            t0 = time.perf_counter()
            with RoutingReader(url, token=token) as reader:  # as a trainer opens it: a fresh index
                got = reader.get_numpy("bench", ids)
            reader_s.append(time.perf_counter() - t0)
            assert sum(a.nbytes for a in got.values()) == sum(r.nbytes for r in records)
            t0 = time.perf_counter()
            asyncio.run(_raw_get_all(url, token, files, concurrency=10))
            raw_s.append(time.perf_counter() - t0)
            if progress:
                print(f"round {rnd + 1}/{rounds}: reader {shard_bytes / reader_s[-1] / 1e9:.3f} GB/s, raw GET {shard_bytes / raw_s[-1] / 1e9:.3f} GB/s",
                      file=sys.stderr, flush=True)
    finally:
        node.stop()
    ratios = sorted(r / t for t, r in zip(reader_s, raw_s))
    reader_gbps = shard_bytes / statistics.median(reader_s) / 1e9
    raw_gbps = shard_bytes / statistics.median(raw_s) / 1e9
    return {
        "bench": "read", "requests": requests, "zstd_level": zstd_level, "files": len(files), "file_bytes": shard_bytes,
        "routing_bytes": sum(r.nbytes for r in records),
        "reader_gbps": round(reader_gbps, 4), "raw_http_gbps": round(raw_gbps, 4),
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
