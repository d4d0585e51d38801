"""`r3rdma bench store`: local-store ingest vs a raw zarr write of the same arrays, same run.

Ingest is the engine's path: records submitted to a :class:`RoutingWriter`, batched, written
as Zarr, fsynced, indexed, until ``flush`` returns. The yardstick writes the same batches as
Zarr arrays with the same codecs, chunks and shards via plain ``zarr.create_array`` with zarr's
default settings (no index, no fsync: ``raw_zarr_gbps``, ``ratio``); the store runs with the
whole-request layout (``slice_layout=False``), whose chunk rows are the yardstick's (the slice
layout's smaller chunks: ``bench trainer-layout``, ``bench rlstep``). Two more yardsticks: the
same writes, each array's files and directories fsynced before the next
(``raw_zarr_fsync_gbps``, ``ratio_vs_durable``: what durability alone costs on this disk), and
the same writes with ``write_empty_chunks=True`` as the store writes them
(``raw_zarr_no_scan_gbps``, ``ratio_vs_no_scan``: zarr then skips its per-chunk "all fill
value?" scan, which never skips a chunk of a batch array; what is left is r3rdma's own work:
placement, index parts, fsync, batching). Rounds alternate between the four; the median of
each is reported.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import zarr
from zarr.storage import LocalStore

from r3rdma.bench.common import add_options, run_from_args, scratch_dir
from r3rdma.bench.common import rounds_bar as _rounds
from r3rdma.bench.synthetic import synthetic_records
from r3rdma.records import batches_by_size
from r3rdma.store.layout import fsync_paths, tree_paths
from r3rdma.store.local_store import LocalRoutingStore, zarr_codecs
from r3rdma.write.writer import RoutingWriter

__all__ = ["run_store_bench", "ingest_seconds"]


def ingest_seconds(path: Path, records, flush_bytes: int, **store_options) -> float:
    """Seconds to ingest ``records`` into a new :class:`LocalRoutingStore` at ``path`` (its
    ``store_options``) through a :class:`RoutingWriter` of ``flush_bytes`` batches, until ``flush``
    returns (every request compressed, written, fsynced, indexed); the root is removed."""
    try:
        t0 = time.perf_counter()
        with LocalRoutingStore(path, **store_options) as store, RoutingWriter(store, flush_bytes=flush_bytes) as writer:
            for record in records:
                writer.submit(record)
            writer.flush()
        return time.perf_counter() - t0
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_store_bench(
    *,
    requests: int = 96,
    rounds: int = 3,
    flush_bytes: int = 8 << 20,
    zstd_level: int = 3,
    chunk_rows: int = 1024,
    root: str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Ingest ``requests`` synthetic requests through a RoutingWriter into a LocalRoutingStore, and
    write the same batches as plain zarr arrays (three yardsticks), ``rounds`` times alternating;
    return GB/s of each (medians) and the ratios. ``root``: scratch directory (default: temporary)."""
    records = synthetic_records(requests, seed=seed)
    total = sum(r.nbytes for r in records)
    base = scratch_dir("r3rdma-bench-store-", root)
    ingest_s: list[float] = []
    raw_s: list[float] = []
    raw_sync_s: list[float] = []
    raw_no_scan_s: list[float] = []
    for rnd in _rounds(rounds, "store"):
        ingest_s.append(
            ingest_seconds(
                base / f"ingest-{rnd}", records, flush_bytes, zstd_level=zstd_level, chunk_rows=chunk_rows, slice_layout=False
            )
        )

        for durable, scan, times in ((False, True, raw_s), (True, True, raw_sync_s), (False, False, raw_no_scan_s)):
            d = base / f"raw-{rnd}"
            t0 = time.perf_counter()
            raw_store = LocalStore(d)
            for n, batch in enumerate(batches_by_size(records, flush_bytes)):
                data = np.concatenate([r.ids_TLK for r in batch])
                rows, layers, k = data.shape
                chunk = min(chunk_rows, rows)
                zarr.create_array(
                    raw_store,
                    name=f"bench/a{n}",
                    data=data,
                    chunks=(chunk, layers, k),
                    shards=(-(-rows // chunk) * chunk, layers, k),
                    compressors=zarr_codecs(zstd_level),
                    fill_value=0,
                    config={"write_empty_chunks": not scan},
                )
                if durable:  # the same array, on disk before the next one: what an ack promises
                    fsync_paths(tree_paths(d / "bench" / f"a{n}") + [d / "bench"])
            times.append(time.perf_counter() - t0)
            shutil.rmtree(d)
        if progress:
            print(
                f"round {rnd + 1}/{rounds}: ingest {total / ingest_s[-1] / 1e9:.3f} GB/s, raw zarr {total / raw_s[-1] / 1e9:.3f} "
                f"GB/s, raw zarr + fsync {total / raw_sync_s[-1] / 1e9:.3f} GB/s, raw zarr without the empty-chunk "
                f"scan {total / raw_no_scan_s[-1] / 1e9:.3f} GB/s",
                flush=True,
            )
    shutil.rmtree(base, ignore_errors=True)
    ingest = total / statistics.median(ingest_s) / 1e9
    raw = total / statistics.median(raw_s) / 1e9
    raw_sync = total / statistics.median(raw_sync_s) / 1e9
    raw_no_scan = total / statistics.median(raw_no_scan_s) / 1e9
    return {
        "bench": "store",
        "requests": requests,
        "bytes": total,
        "rounds": rounds,
        "ingest_gbps": round(ingest, 4),
        "raw_zarr_gbps": round(raw, 4),
        "ratio": round(ingest / raw, 3),
        "raw_zarr_fsync_gbps": round(raw_sync, 4),
        "ratio_vs_durable": round(ingest / raw_sync, 3),
        "raw_zarr_no_scan_gbps": round(raw_no_scan, 4),
        "ratio_vs_no_scan": round(ingest / raw_no_scan, 3),
        "zstd_level": zstd_level,
        "flush_bytes": flush_bytes,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``r3rdma bench store``: requests, rounds, scratch directory."""
    add_options(parser, run_store_bench, "requests rounds root", {"root": "scratch directory (default: temporary)"})


def main(args: argparse.Namespace) -> int:
    """``r3rdma bench store``: run, print the result as the last JSON line."""
    return run_from_args(run_store_bench, args)
