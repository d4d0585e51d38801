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
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from r3rdma.bench.support import FileGetter, emit, rounds_bar as _rounds
from r3rdma.bench.synthetic import synthetic_records
from r3rdma.store.process import new_token, spawn_node

__all__ = ["run_read_bench", "add_arguments", "main"]


class _PlainGets:
    """Whole-file GETs with ``http.client`` (:class:`FileGetter`, one per thread, kept-alive
    connections), ``concurrency`` at a time from one thread pool."""

    def __init__(self, base: str, token: str, concurrency: int) -> None:
        self._base, self._token = base, token
        self._pool = ThreadPoolExecutor(concurrency)
        self._local = threading.local()
        self._getters: list[FileGetter] = []

    def close(self) -> None:
        self._pool.shutdown()
        for getter in self._getters:
            getter.close()

    def _one(self, path: str) -> int:
        getter = getattr(self._local, "getter", None)
        if getter is None:
            getter = self._local.getter = FileGetter(self._token)
            self._getters.append(getter)
        return getter.get(self._base, path)

    def get_all(self, paths: list[str]) -> int:
        return sum(self._pool.map(self._one, paths))


async def _aiohttp_gets(session, token: str, url: str, paths: list[str], concurrency: int = 10) -> int:
    """GET each file whole with aiohttp, ``concurrency`` at a time: on the kept session (warm), or
    on a session of its own (``session`` None: fresh)."""
    own = session is None
    if own:
        session = await _session(token)
    sem = asyncio.Semaphore(concurrency)

    async def one(path: str) -> int:
        async with sem, session.get(f"{url}/zarr/{path}") as response:
            response.raise_for_status()
            return len(await response.read())

    try:
        return sum(await asyncio.gather(*(one(p) for p in paths)))
    finally:
        if own:
            await session.close()


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
    plain = _PlainGets(url, token, concurrency=10) if warm else None
    loop = asyncio.new_event_loop()
    session = loop.run_until_complete(_session(token)) if warm else None
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
            gets = plain or _PlainGets(url, token, concurrency=10)  # fresh: new threads and connections
            try:
                assert gets.get_all(files[rollout]) == file_bytes[rollout]
            finally:
                if plain is None:
                    gets.close()
            client_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            moved = loop.run_until_complete(_aiohttp_gets(session, token, url, files[rollout]))
            assert moved == file_bytes[rollout], (moved, file_bytes[rollout])
            aiohttp_s.append(time.perf_counter() - t0)
            if progress:
                gbps = [file_bytes[rollout] / t[-1] / 1e9 for t in (reader_s, client_s, aiohttp_s)]
                print(f"round {rnd + 1}/{rounds}: reader {gbps[0]:.3f} GB/s, raw GET http.client {gbps[1]:.3f} GB/s, "
                      f"aiohttp {gbps[2]:.3f} GB/s", file=sys.stderr, flush=True)
    finally:
        if reader is not None:
            reader.close()
        if plain is not None:
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


async def _session(token: str):
    import aiohttp

    return aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"})


def add_arguments(parser) -> None:
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", default=None, help="scratch directory (default: temporary)")
    parser.add_argument("--zstd-level", type=int, default=3, help="compression of the store read (0: none; default: the store's)")
    parser.add_argument("--mode", choices=("warm", "fresh"), default="warm",
                        help="warm: one reader and kept-alive plain GETs across rounds (a trainer's steady state); "
                             "fresh: new ones each round")


def main(args) -> int:
    return emit(run_read_bench(requests=args.requests, rounds=args.rounds, root=args.root, zstd_level=args.zstd_level,
                               mode=args.mode))
