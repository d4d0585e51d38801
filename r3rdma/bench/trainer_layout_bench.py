"""`r3rdma bench trainer-layout`: a stored RL step read by the ranks of a DP x TP x PP x CP trainer.

One program (progress on stderr, the last stdout line is JSON):

- **The step.** A synthetic rollout (default 48 layers, top-8, 128 experts; rows are slices of
  one :class:`~r3rdma.bench.synthetic.TiledRollout` pool) committed in random order (requests
  finish at random times, so a data-parallel share sits in nearly every batch array) to a
  :class:`~r3rdma.store.local_store.LocalRoutingStore` root, in ``--batch-mb`` batches, then
  served by a real store node over HTTP.
- **The ranks.** DP rank ``d`` trains requests ``i`` with ``i % DP == d``, in micro-batches of
  ``--micro-batch`` requests; pipeline stage ``p`` replays layers ``p*L/PP .. (p+1)*L/PP - 1``;
  context-parallel rank ``c`` replays the rows Megatron gives it (each sequence padded to a
  multiple of ``2*CP`` and cut in ``2*CP`` chunks, rank ``c`` keeping chunks ``c`` and
  ``2*CP-1-c``). What a rank **replays** is its stage's layers x its CP rows of its DP share
  (decoded bytes). Ranks are simulated by ``--processes`` reader processes, each running its
  ranks as threads, each rank with its own :class:`~r3rdma.read.reader.RoutingReader` (index
  read before the clock, as a trainer holds it before its step), all released together and
  reading through ``prefetch`` as a trainer does.
- **Reads, one phase each, same run, same step:**
  ``whole``: today's whole-micro-batch reads (``layers=None``), every rank;
  ``per_rank``: every rank reads its own slice (``layers=`` its stage's layers, ``rows=`` its
  CP rows), as without sequence parallel each TP rank would;
  ``tp_broadcast``: one rank per TP group reads the slice (counted once per TP group) and
  would broadcast it over the TP group (the broadcast itself, GPU to GPU, is not simulated);
  ``sequence_parallel``: every rank reads its stage's layers and the rows its routers see
  under sequence parallel (each micro-batch packed thd, padded to ``2*CP*TP``; the TP rank's
  share of its CP rows: :func:`~r3rdma.integrations.megatron.rank_rows`), which it replays.

Per phase: ``fetched_vs_replayed`` (one per reading rank: bytes that crossed HTTP for it over
the bytes it replays), ``fetched_bytes`` (all ranks) against ``stored_bytes`` (the rollout's
files), ``node_http_bytes`` (the node's own ``r3rdma_store_http_bytes`` counter over the phase:
what it served, which the ranks' counts must add up to), ``wall_seconds`` (first release to the
moment the last rank holds its routing), ``reader_cpu_s_per_gb`` (CPU seconds of the reader
processes over the phase, per GB of routing returned to the ranks). Per-rank fetched bytes are
the HTTP body bytes of every GET the rank's reader issued (its store wrapped in a counter).
The step's layout: ``chunk_rows`` and ``layers_per_chunk`` (the batch arrays' inner chunk
shapes), ``group_major_arrays`` of ``arrays`` (those laid out layer group major, format 4);
``--slice-layout`` stores the step as ``r3rdma-store --slice-layout`` does (chunks sized for
context-parallel pieces, long requests layer group major; default: the store's default
layout); ``--chunk-rows`` and ``--layers-per-chunk`` fix the chunk shape.

Goals, as booleans: every reading rank fetches <= 1.25x what it replays; total
fetched <= 1.25 x stored x TP (``per_rank``, no SP) or <= 1.25 x stored (``tp_broadcast``,
``sequence_parallel``);
reader CPU <= 1.5 core-seconds per GB returned. ``yardstick``: the reader CPU per GB of one
rank's reads made in the bench's own process by r3rdma's reader and by tensorstore (a C++ Zarr
reader, when installed) on the same node, one after the other. ``--quick`` fits a 2-core
machine in < 60 s.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

from r3rdma.bench.common import (
    Worker,
    add_options,
    add_preset_arguments,
    commit_in_batches,
    log,
    node_samples,
    run_from_args,
    run_phase,
    scratch_dir,
    serve,
    stop_all,
    wait_go,
    worker_context,
)
from r3rdma.read.rows import cp_row_spans

__all__ = ["run_trainer_layout_bench", "add_arguments", "main", "QUICK", "FULL", "cp_spans"]

_GOAL_PER_RANK = 1.25
_GOAL_TOTAL = 1.25
_GOAL_CPU_S_PER_GB = 1.5


#: The sizes of ``--quick``, the 2-core CPU machine, < 60 s (~20 MB decoded; requests long enough
#: for 1024-row chunks, so the store splits layers into groups as at full size), and of a full run,
#: a 16-core GPU host; each has its own option.
QUICK: dict[str, Any] = {"requests": 48, "min_rows": 600, "max_rows": 1600, "batch_mb": 4.0, "processes": 2}
FULL: dict[str, Any] = {"requests": 2048, "min_rows": 500, "max_rows": 8000, "batch_mb": 64.0, "processes": 8}


def cp_spans(rows: int, cp_size: int, cp_rank: int, unrecorded_tail: int = 1) -> list[tuple[int, int]]:
    """The stored rows of a request of ``rows`` stored rows that context-parallel rank
    ``cp_rank`` replays: its sequence (``rows + unrecorded_tail`` tokens) padded to a multiple
    of ``2 * cp_size`` (Megatron's thd padding with CP), split as
    :func:`~r3rdma.read.rows.cp_row_spans` says."""
    parts = 2 * cp_size
    return cp_row_spans(rows, -(-(rows + unrecorded_tail) // parts) * parts, cp_size, cp_rank)


def _sp_spans(
    micro_batches: list[list[str]], rows: dict[str, int], tp: int, tp_rank: int, cp: int, cp_rank: int
) -> dict[str, list[tuple[int, int]]]:
    """The stored rows of each request that rank (``tp_rank``, ``cp_rank``) replays under
    sequence parallel: each micro-batch packed thd (sequences of stored rows + 1 tokens padded
    to a multiple of ``2 * cp * tp``), as :func:`~r3rdma.integrations.megatron.rank_rows` says."""
    from r3rdma.integrations.megatron import MicroBatch, ParallelLayout, rank_rows

    layout = ParallelLayout(tp_size=tp, tp_rank=tp_rank, sequence_parallel=True, cp_size=cp, cp_rank=cp_rank)
    return rank_rows(
        [MicroBatch.thd(mb, [rows[r] + 1 for r in mb], pad_to_multiple_of=2 * cp * tp) for mb in micro_batches], layout
    )


# -- the reader processes -------------------------------------------------------------------------


def _counting_store(url: str, token: str, counter: list[int]):
    """A store node's read-only zarr store whose every GET adds its body bytes to ``counter[0]``
    (the reader's event loop is one thread: no lock needed)."""
    from zarr.storage import WrapperStore

    from r3rdma.read.sources import http_store

    class CountingStore(WrapperStore):
        async def get(self, key, prototype, byte_range=None):
            buffer = await self._store.get(key, prototype, byte_range)
            if buffer is not None:
                counter[0] += len(buffer)
            return buffer

        async def get_partial_values(self, prototype, key_ranges):
            buffers = await self._store.get_partial_values(prototype, key_ranges)
            counter[0] += sum(len(b) for b in buffers if b is not None)
            return buffers

        def __str__(self) -> str:
            return url

    return CountingStore(http_store(url, token, 60.0))


def _rank_main(conn, urls: list[str], token: str) -> None:
    """Body of a reader process: per ``read`` command, its ranks read concurrently (threads)."""
    os.dup2(2, 1)  # the parent's stdout ends with its JSON line
    from r3rdma.read.reader import RoutingReader

    conn.send({"event": "ready"})

    def read(cmd: dict[str, Any]) -> None:
        rollout = cmd["rollout"]
        ranks = []
        for task in cmd["ranks"]:
            counter = [0]
            reader = RoutingReader([_counting_store(u, token, counter) for u in urls], token=token, progress=False)
            reader.info(rollout)  # the index, held before the step's reads
            ranks.append((task, reader, counter))
        for _, _, counter in ranks:
            counter[0] = 0
        # The setup's garbage and the indexes just read collected before the clock: else a full
        # collection they trigger lands in whichever phase crosses the threshold (a full
        # collection of a reader process's heap can outlast a quick phase's reads: BENCHMARKS.md).
        gc.collect()
        out: list[dict[str, Any]] = [{} for _ in ranks]

        def run(i: int) -> None:
            task, reader, counter = ranks[i]
            returned = 0
            kwargs = {k: task[k] for k in ("layers", "rows") if task[k] is not None}
            with reader.prefetch(rollout, task["batches"], depth=2, **kwargs) as stream:
                for packed in stream:
                    returned += packed.ids_TLK.numel() * packed.ids_TLK.element_size()
            out[i] = {"rank": task["rank"], "fetched": counter[0], "returned": returned, "end": time.time()}

        wait_go(conn)
        cpu0 = time.process_time()
        start = time.time()
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ranks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cpu = time.process_time() - cpu0
        for _, reader, _ in ranks:
            reader.close()
        if any(not o for o in out):
            raise RuntimeError("a rank's read failed (see the traceback above)")
        conn.send({"event": "done", "start": start, "cpu_s": cpu, "ranks": out})

    serve(conn, {"read": read})


# -- the bench ------------------------------------------------------------------------------------


def _commit_step(rollout, path: Path, batch_mb: float, seed: int, chunk_rows: int | None, **store_options: Any) -> None:
    """The rollout committed in a random order (as requests finish) in ``batch_mb`` batches to a
    :class:`LocalRoutingStore` of ``store_options``; ``chunk_rows``: every batch array's rows per
    inner chunk (None: the store's rule)."""
    from r3rdma.store.local_store import LocalRoutingStore

    order = list(range(len(rollout)))
    random.Random(seed).shuffle(order)
    rows: dict[str, Any] = {} if chunk_rows is None else {"chunk_rows": chunk_rows, "min_chunk_rows": chunk_rows}
    with LocalRoutingStore(path, **rows, **store_options) as store:
        commit_in_batches(store, rollout, order, int(batch_mb * (1 << 20)))


def _chunk_layout(root: Path, rollout_id: str) -> dict[str, Any]:
    """The batch arrays' inner chunk shapes (rows and layers per chunk, from their
    ``zarr.json``) and how many lie layer group major in their shard (from the index parts)."""
    import json

    rows, layers, arrays, group_major = set(), set(), 0, 0
    for meta in (root / rollout_id).glob("*/zarr.json"):
        doc = json.loads(meta.read_text())
        if doc.get("node_type") == "array":
            shape = doc["codecs"][0]["configuration"]["chunk_shape"]
            rows.add(shape[0])
            layers.add(shape[1])
        for shard in doc.get("attributes", {}).get("r3rdma", {}).get("shards", {}).values():
            arrays += 1
            group_major += "chunk_sizes_group_major" in shard
    return {
        "layers_per_chunk": sorted(layers),
        "chunk_rows": sorted(rows),
        "arrays": arrays,
        "group_major_arrays": group_major,
    }


def run_trainer_layout_bench(
    *,
    requests: int = FULL["requests"],
    min_rows: int = FULL["min_rows"],
    max_rows: int = FULL["max_rows"],
    batch_mb: float = FULL["batch_mb"],
    processes: int = FULL["processes"],
    dp: int = 2,
    tp: int = 2,
    pp: int = 4,
    cp: int = 2,
    layers: int = 48,
    top_k: int = 8,
    experts: int = 128,
    micro_batch: int = 8,
    seed: int = 0,
    quick: bool = False,
    progress: bool = True,
    timeout: float = 900.0,
    http_workers: str = "auto",
    layers_per_chunk: int | None = None,
    chunk_rows: int | None = None,
    slice_layout: bool = True,
    zstd_level: int = 3,
) -> dict[str, Any]:
    """Commit the step, serve it, run the read phases (module docstring); the JSON dict."""
    from r3rdma.bench.synthetic import TiledRollout
    from r3rdma.read.reader import RoutingReader
    from r3rdma.store.process import new_token
    from r3rdma.testing.harness import spawn_nodes

    if min(dp, tp, pp, cp, processes, micro_batch) < 1 or layers % pp or requests < dp:
        raise ValueError(
            f"need dp, tp, pp, cp, processes, micro_batch >= 1, pp dividing layers and requests >= dp; got dp={dp} "
            f"tp={tp} pp={pp} cp={cp} processes={processes} micro_batch={micro_batch} layers={layers} requests={requests}"
        )
    began = time.perf_counter()
    say = lambda message: log("trainer-layout", progress, message)  # noqa: E731
    base = scratch_dir("r3rdma-bench-layout-")
    rollout_id = "layout-0"
    node_procs: list = []
    workers: list[Worker] = []
    try:
        rollout = TiledRollout(
            requests,
            min_rows=min_rows,
            max_rows=max_rows,
            num_layers=layers,
            top_k=top_k,
            num_experts=experts,
            rollout_id=rollout_id,
            seed=seed,
        )
        say(f"committing {requests} requests, {rollout.total_bytes / 1e6:.1f} MB decoded")
        store_options = {"layers_per_chunk": layers_per_chunk, "slice_layout": slice_layout, "zstd_level": zstd_level}
        _commit_step(rollout, base / "node0", batch_mb, seed, chunk_rows, **store_options)
        node_procs = spawn_nodes([base / "node0"], new_token(), "--http-workers", str(http_workers))
        node = node_procs[0]
        urls = [node.http_url]
        with RoutingReader(urls, token=node.read_token, progress=False) as reader:
            stored = sum(reader.stored_bytes(rollout_id).values())
        ctx = worker_context()
        workers = [Worker(ctx, p, _rank_main, (urls, node.read_token), f"r3rdma-layout-{p}") for p in range(processes)]
        for worker in workers:
            assert worker.recv(timeout)["event"] == "ready"
        ranks = _Ranks(rollout, dp=dp, tp=tp, pp=pp, cp=cp, micro_batch=micro_batch)
        result: dict[str, Any] = {
            "bench": "trainer-layout",
            "quick": quick,
            "cpu_count": os.cpu_count(),
            "layout": {"dp": dp, "tp": tp, "pp": pp, "cp": cp},
            "requests": requests,
            "tokens": int(rollout.lengths.sum()),
            "layers": layers,
            "top_k": top_k,
            "experts": experts,
            "micro_batch": micro_batch,
            "decoded_bytes": rollout.total_bytes,
            "stored_bytes": stored,
            "slice_layout": slice_layout,
            "zstd_level": zstd_level,
            **_chunk_layout(base / "node0", rollout_id),
            "processes": processes,
        }
        for name, tasks in ranks.phases().items():
            say(f"phase {name}: {len(tasks)} reading ranks in {processes} processes")
            replays = ranks.sp_replay_of if name == "sequence_parallel" else ranks.replay_of
            result[name] = phase = _read_phase(workers, rollout_id, tasks, replays, node, stored, timeout)
            say(
                f"  fetched {phase['fetched_bytes'] / 1e6:.1f} MB ({phase['fetched_bytes'] / stored:.2f}x stored), max per "
                f"rank {max(phase['fetched_vs_replayed']):.2f}x replayed, {phase['wall_seconds']:.2f} s, "
                f"{phase['reader_cpu_s_per_gb']} core-s/GB"
            )
        say("yardstick: one rank's reads in this process, r3rdma's reader against tensorstore")
        result["yardstick"] = _yardstick(node, base / "node0", rollout_id, ranks.shares[0], ranks.rows, range(0, ranks.per), cp)
        result["goals"] = _goals(result, stored, tp)
        result["whole_vs_per_rank_fetched"] = round(
            result["whole"]["fetched_bytes"] / max(result["per_rank"]["fetched_bytes"], 1), 2
        )
        result["seconds"] = round(time.perf_counter() - began, 1)
        result["seed"] = seed
        return result
    finally:
        stop_all(workers, node_procs, base)


class _Ranks:
    """The simulated trainer's ranks: what each reads in each phase and what it replays."""

    def __init__(self, rollout: Any, *, dp: int, tp: int, pp: int, cp: int, micro_batch: int) -> None:
        self.dp, self.tp, self.pp, self.cp = dp, tp, pp, cp
        self.rows = rows = {rollout.request_id(i): int(rollout.lengths[i]) for i in range(len(rollout))}
        self.shares = [[rid for rid in sorted(rows) if int(rid[1:]) % dp == d] for d in range(dp)]
        self.batches = [[share[i : i + micro_batch] for i in range(0, len(share), micro_batch)] for share in self.shares]
        self.per = len(rollout.layer_map) // pp  # decoder layers of a pipeline stage (equal stages, as Megatron splits them)
        self.grid = [(d, t, p, c) for d in range(dp) for t in range(tp) for p in range(pp) for c in range(cp)]
        self.sp_spans = {
            (d, t, c): _sp_spans(self.batches[d], rows, tp, t, cp, c) for d in range(dp) for t in range(tp) for c in range(cp)
        }
        row_bytes = self.per * rollout.row_bytes // len(rollout.layer_map)  # a stage's layers of one row

        def replayed(spans: dict[str, list[tuple[int, int]]]) -> int:
            return sum(hi - lo for rid_spans in spans.values() for lo, hi in rid_spans) * row_bytes

        self.replay_of = {self.rank(*g): replayed(self.cp_spans(g[0], g[3])) for g in self.grid}
        # Under sequence parallel a rank replays its TP share of its CP rows.
        self.sp_replay_of = {self.rank(*g): replayed(self.sp_spans[g[0], g[1], g[3]]) for g in self.grid}

    def rank(self, d: int, t: int, p: int, c: int) -> int:
        """The global rank of DP ``d``, TP ``t``, PP ``p``, CP ``c``."""
        return ((d * self.pp + p) * self.cp + c) * self.tp + t

    def cp_spans(self, d: int, c: int) -> dict[str, list[tuple[int, int]]]:
        """The stored rows CP rank ``c`` replays of each request of DP share ``d``."""
        return {rid: cp_spans(self.rows[rid], self.cp, c) for rid in self.shares[d]}

    def task(self, d: int, t: int, p: int, c: int, sliced: bool) -> dict[str, Any]:
        """A rank's read: its DP share's micro-batches, whole or its stage's layers x its CP rows."""
        return {
            "rank": self.rank(d, t, p, c),
            "batches": self.batches[d],
            "layers": list(range(p * self.per, (p + 1) * self.per)) if sliced else None,
            "rows": self.cp_spans(d, c) if sliced and self.cp > 1 else None,
        }

    def phases(self) -> dict[str, list[dict[str, Any]]]:
        """Each phase's reading ranks' tasks (module docstring)."""
        grid = self.grid
        return {
            "whole": [self.task(*g, sliced=False) for g in grid],
            "per_rank": [self.task(*g, sliced=True) for g in grid],
            "tp_broadcast": [self.task(*g, sliced=True) for g in grid if g[1] == 0],
            "sequence_parallel": [{**self.task(*g, sliced=True), "rows": self.sp_spans[g[0], g[1], g[3]]} for g in grid],
        }


def _read_phase(
    workers: list[Worker],
    rollout_id: str,
    tasks: list[dict[str, Any]],
    replays: dict[int, int],
    node: Any,
    stored: int,
    timeout: float,
) -> dict[str, Any]:
    """One phase: ``tasks`` spread over the reader processes, released together; its figures."""
    armed: list[float] = []  # what the node had served when the phase's ranks were all armed

    def served_bytes() -> float:
        return node_samples(node).get("r3rdma_store_http_bytes_total", 0.0)

    parts = [tasks[p :: len(workers)] for p in range(len(workers))]
    active = [p for p in range(len(workers)) if parts[p]]
    commands = [{"cmd": "read", "rollout": rollout_id, "ranks": parts[p]} for p in active]
    answers = run_phase([workers[p] for p in active], commands, timeout, on_armed=lambda: armed.append(served_bytes()))
    served = served_bytes() - armed[-1]
    ranks = sorted((r for a in answers for r in a["ranks"]), key=lambda r: r["rank"])
    fetched = sum(r["fetched"] for r in ranks)
    returned = sum(r["returned"] for r in ranks)
    cpu = sum(a["cpu_s"] for a in answers)
    wall = max(r["end"] for r in ranks) - min(a["start"] for a in answers)
    return {
        "reading_ranks": len(ranks),
        "fetched_vs_replayed": [round(r["fetched"] / max(replays[r["rank"]], 1), 3) for r in ranks],
        "fetched_bytes": fetched,
        "node_http_bytes": int(served),
        "returned_bytes": returned,
        "replayed_bytes": sum(replays[r["rank"]] for r in ranks),
        "fetched_vs_stored": round(fetched / stored, 3),
        "wall_seconds": round(wall, 3),
        "reader_cpu_s_per_gb": round(cpu / max(returned / 1e9, 1e-9), 3),
        "reader_cpu_s": round(cpu, 3),
    }


def _goals(result: dict[str, Any], stored: int, tp: int) -> dict[str, bool]:
    """The goals as booleans (module docstring)."""
    per_rank, broadcast, sp = result["per_rank"], result["tp_broadcast"], result["sequence_parallel"]
    return {
        "sequence_parallel_fetch_le_1_25x_replayed": max(sp["fetched_vs_replayed"]) <= _GOAL_PER_RANK,
        "sequence_parallel_total_le_1_25x_stored": sp["fetched_bytes"] <= _GOAL_TOTAL * stored,
        "per_rank_fetch_le_1_25x_replayed": max(per_rank["fetched_vs_replayed"]) <= _GOAL_PER_RANK,
        "tp_broadcast_fetch_le_1_25x_replayed": max(broadcast["fetched_vs_replayed"]) <= _GOAL_PER_RANK,
        "per_rank_total_le_1_25x_stored_x_tp": per_rank["fetched_bytes"] <= _GOAL_TOTAL * stored * tp,
        "tp_broadcast_total_le_1_25x_stored": broadcast["fetched_bytes"] <= _GOAL_TOTAL * stored,
        "reader_cpu_le_1_5_core_s_per_gb": per_rank["reader_cpu_s_per_gb"] <= _GOAL_CPU_S_PER_GB,
    }


def _yardstick(
    node: Any, root: Path, rollout_id: str, share: list[str], rows: dict[str, int], stage: range, cp: int
) -> dict[str, Any]:
    """Reader CPU per GB returned for one rank's reads (DP rank 0's share: ``whole``, and
    ``slice``: pipeline stage 0's layers x CP rank 0's rows), made in this process one after
    the other by r3rdma's reader and by tensorstore (C++, reading the batch arrays as FORMAT.md
    describes them, from the index parts on disk), over the same node. What a native Zarr
    reader costs on the same bytes: the yardstick for ``reader_cpu_s_per_gb``."""
    import json

    import numpy as np

    from r3rdma.read.reader import RoutingReader

    slices = {rid: cp_spans(rows[rid], cp, 0) for rid in share}
    out: dict[str, Any] = {"reads": "DP rank 0's share: whole, and stage 0's layers x CP rank 0's rows (slice)"}

    def timed(fn) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for name, sliced in (("whole", False), ("slice", True)):
            gc.collect()
            c0 = time.process_time()
            returned = fn(sliced)
            result[f"{name}_cpu_s_per_gb"] = round((time.process_time() - c0) / max(returned / 1e9, 1e-9), 3)
            result[f"{name}_bytes"] = returned
        return result

    with RoutingReader([node.http_url], token=node.read_token, progress=False) as reader:
        reader.info(rollout_id)

        def ours(sliced: bool) -> int:
            n = 0
            for i in range(0, len(share), 16):
                part = share[i : i + 16]
                got = reader.get_numpy(
                    rollout_id, part, layers=stage if sliced else None, rows={r: slices[r] for r in part} if sliced else None
                )
                n += sum(a.nbytes for a in got.values())
            return n

        out["r3rdma"] = timed(ours)
    try:
        import tensorstore as ts
    except ImportError:
        out["tensorstore"] = "not installed (pip install tensorstore, or the test extra)"
        return out
    segments: dict[str, list[dict[str, Any]]] = {}
    for part_file in sorted((root / rollout_id).glob("i*/zarr.json")):
        for rid, entry in json.loads(part_file.read_text())["attributes"]["r3rdma"]["requests"].items():
            segments[rid] = entry["segments"]
    kvstore = {"driver": "http", "base_url": f"{node.http_url}/zarr/", "headers": [f"Authorization: Bearer {node.read_token}"]}
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    arrays: dict[str, Any] = {}

    def theirs(sliced: bool) -> int:
        futures = []
        for rid in share:
            spans = slices[rid] if sliced else [(0, rows[rid])]
            for seg in segments[rid]:
                array = arrays.get(seg["array"])
                if array is None:
                    spec = {"driver": "zarr3", "kvstore": {**kvstore, "path": f"{rollout_id}/{seg['array']}/"}}
                    array = arrays[seg["array"]] = ts.open(spec, context=context).result()
                first, count = seg.get("start_row", 0), seg["rows"]
                for lo, hi in spans:
                    lo, hi = max(lo, first), min(hi, first + count)
                    if lo < hi:
                        at = seg["offset"] - first
                        cells = array[at + lo : at + hi, stage.start : stage.stop] if sliced else array[at + lo : at + hi]
                        futures.append(cells.read())
        return sum(np.asarray(f.result()).nbytes for f in futures)

    out["tensorstore"] = timed(theirs)
    return out


# -- command line ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``r3rdma bench trainer-layout``: the preset, the trainer's layout, the rollout's shape."""
    quick = f"2-core CPU machine, < 60 s: {QUICK['requests']} requests of {QUICK['min_rows']}-{QUICK['max_rows']} rows"
    helps = {"batch_mb": "commit batch size", "processes": "reader processes the ranks share"}
    add_preset_arguments(parser, run_trainer_layout_bench, QUICK, FULL, quick, helps)
    helps = {name: f"{name.upper()} size" for name in ("dp", "tp", "pp", "cp")} | {
        "micro_batch": "requests per micro-batch",
        "layers_per_chunk": "the store's layer group (r3rdma-store --layers-per-chunk; default: its rule)",
        "chunk_rows": "rows per inner chunk of every batch array (default: the store's rule)",
        "slice_layout": "store the step in the slice layout, the store's default (chunks for CP pieces, long requests layer "
        "group major); --no-slice-layout: in the whole-request layout, as r3rdma-store --no-slice-layout does",
        "zstd_level": "the store's zstd level (r3rdma-store --zstd-level; 0: chunks stored uncompressed, nothing to decode)",
    }
    add_options(
        parser, run_trainer_layout_bench, "dp tp pp cp micro_batch layers_per_chunk chunk_rows slice_layout zstd_level", helps
    )


def main(args: argparse.Namespace) -> int:
    """``r3rdma bench trainer-layout``: run the preset with the options given, print the JSON line."""
    return run_from_args(run_trainer_layout_bench, args, QUICK, FULL)
