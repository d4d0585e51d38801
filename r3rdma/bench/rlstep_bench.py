"""`r3rdma bench rlstep`: one whole RL step on one host, as deployed, and the trainer's stall.

Processes (progress on stderr, the last stdout line is JSON):

- ``--nodes`` store-node processes (``--replicas`` copies of each request), started as the
  tests start them (:func:`r3rdma.testing.harness.spawn_nodes`).
- ``--engines`` engine processes, each a TP-owner rank with its own ``RoutingWriter`` over its
  own ``StoreNodesClient`` (:mod:`r3rdma.bench.rlstep_workers`). Request lengths are a
  long-tailed mix: a lognormal of rows (median ``--median-rows``, ``--sigma``) clipped to
  ``--min-rows``..``--max-rows``; each request goes to a random engine. Requests start
  together and decode at about the same rate, so a request finishes at a time proportional to
  its length times a uniform 0.5-1 factor (waiting for a batch slot, preemption), scaled so
  the last one finishes at ``--rollout-seconds``: many short requests early, the long tail
  last. Rows are slices of one :class:`~r3rdma.bench.synthetic.TiledRollout` pool, so GBs of
  routing cost a few MB to make.
- ``--trainers`` data-parallel ranks: rank ``r`` names its share up front (requests ``i`` with
  ``i % D == r``) with ``RoutingReader.collect`` when the step begins, reads it while the
  rollout runs, and once it is whole assembles its replay batch (``collector.packed()``) and
  notes ``time.time()``.

Measured (every ``time.time()`` on the one host's clock):

- ``rollout_seconds``: the first submit to the last acknowledged batch, over all engines.
- ``stall_seconds``: the last acknowledged request (max over engines) to the moment every
  trainer rank holds its whole share and its packed batch (max over ranks); what the trainer
  waits for routing after the rollout ends (``stall_vs_rollout``). ``stall_per_rank``: each
  rank's moment minus that last ack (negative: its share was whole before the rollout ended;
  a node indexes a request before the client has every replica's ack, so even the max can be).
  ``last_finish_to_ack_seconds``: the last planned finish to the last ack (the nodes' backlog);
  ``engine_late_seconds``: how far behind its schedule an engine submitted (CPU, backpressure).
- ``bytes_raw`` (decoded uint8 bytes of the rollout), ``bytes_stored`` (files under the nodes'
  roots for this rollout; ``bytes_stored_nodes``, ``bytes_stored_per_replica``).
- ``ingest_gbps_per_node``: decoded bytes each node made durable (its
  ``r3rdma_store_bytes_ingested`` counter; nodes hold ``replicas`` copies), mean over nodes, over
  the push span (``rollout_seconds``). While the nodes keep up this is the **offered** load
  (``offered_gbps_per_node``: the same bytes over ``--rollout-seconds``), not their capacity;
  ``--rollout-seconds 0`` pushes everything at once and measures what they take.
- ``index_open_ms``: after the step, a fresh reader in a fresh process opening the rollout
  (``info()``), median of 3 (``index_open_ms_first``: the first). The rollout's index is as big
  as its request count makes it: a 16k-request step is the "index at scale" case.
- After the step, the same ranks read again, ``--rounds`` times alternating: **scattered**, each
  rank re-reading its own share, and **contiguous** (the yardstick), each rank reading a
  contiguous run of the commit order with the same bytes as its share; both the same way
  (``prefetch`` of ``--micro-batch`` requests per ``get_packed``,
  :func:`~r3rdma.bench.rlstep_workers.worker_read`), so ``scattered_vs_contiguous`` compares
  like with like (the step's own
  collect reads as requests commit, paced by the rollout: it has no rate of its own).
  ``rank_read_gbps``: each rank's share bytes over its scattered read time;
  ``scattered_read_gbps`` / ``contiguous_read_gbps``: all bytes over first start to last end.
- Yardsticks of the same run, on the per-node ingested bytes: ``disk_write_gbps`` (plain
  sequential 8 MB writes to a file beside the nodes' roots, then fsync) and
  ``zstd_gbps_all_cores`` (zstd at the store's level, the store's chunk rows, chunks of the
  same synthetic routing compressed on ``os.cpu_count()`` threads, the faster of numcodecs in
  a thread pool and python-zstandard's ``multi_compress_to_buffer``). ``ingest_vs_yardstick`` = ingest_gbps_per_node /
  min(disk, zstd). With several nodes on one host a node has a share of the cores only, so this
  ratio understates a node's efficiency by up to ``nodes``. ``store_commit_gbps``: a node's
  write path alone (the same records committed in-process to a ``LocalRoutingStore`` through
  a ``RoutingWriter``, every core free, no transport) and ``store_vs_yardstick`` against the
  same min(disk, zstd): what a node could take on this host were the engines and TCP loopback
  not on its cores (on the H100 host the engine processes' UCX-over-TCP pushes used ~32 CPU
  seconds per GB, half the host).
- ``commit_growth``: the whole rollout committed again to a fresh ``LocalRoutingStore`` in
  ``--batch-mb`` batches, each ``commit`` timed: the mean of the last 10% of commits over the
  first 10% (the rollout's first commit, which creates it, left out; ``commit_ms_first`` /
  ``commit_ms_last``). 1.0: a commit costs the same however many requests the rollout holds.
  ``commit_growth_median``: the same windows' medians (a few slow fsyncs, or a snapshot merged
  meanwhile, move a mean of 14 commits, as in ``--quick``, not these).
- ``goals``: stall <= max(1 s, 2% of the rollout); index_open_ms <= 100; scattered_vs_contiguous
  >= 0.8; ingest >= 1 GB/s per node or >= 0.5 of the yardstick; store_write: the same for
  ``store_commit_gbps``; commit_growth <= 1.2.

``--quick`` (4096 requests of 16-2000 rows, median 120, 2 nodes, 2 engines, 4 trainers, a
20 s rollout, one read round) fits the 2-core CPU VM: 65-81 s wall there (2026-11-25, another
test suite running beside it). ``verify`` (tests): each rank hashes every request it collected
(CRC-32C), checked against what was pushed.
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from r3rdma.bench.support import (
    Worker,
    add_preset_arguments,
    bar,
    commit_in_batches,
    cpu_seconds,
    log,
    node_samples,
    run_from_args,
    run_phase,
    span_rate,
    stop_all,
    worker_context,
)

__all__ = [
    "run_rlstep_bench",
    "plan_rollout",
    "contiguous_runs",
    "disk_write_gbps",
    "zstd_gbps_all_cores",
    "add_arguments",
    "main",
    "QUICK",
    "FULL",
]


#: The sizes of a full run, a 16-core GPU host (~10 GB decoded, ~21 GB written with 2 replicas),
#: and of ``--quick``, the 2-core CPU machine (~0.3 GB decoded); each has its own option.
FULL: dict[str, Any] = {
    "requests": 16384,
    "min_rows": 100,
    "max_rows": 16000,
    "median_rows": 1000.0,
    "nodes": 4,
    "engines": 4,
    "trainers": 8,
    "rollout_seconds": 60.0,
    "batch_mb": 8.0,
    "rounds": 2,
}
QUICK: dict[str, Any] = {
    "requests": 4096,
    "min_rows": 16,
    "max_rows": 2000,
    "median_rows": 120.0,
    "nodes": 2,
    "engines": 2,
    "trainers": 4,
    "rollout_seconds": 20.0,
    "batch_mb": 2.0,
    "rounds": 1,
}

ROLLOUT_ID = "rlstep-0"


def _store_defaults() -> tuple[int, int]:
    """(zstd level, chunk rows) a store node writes with: LocalRoutingStore's defaults, read from
    its signature so the yardstick follows the store if they change."""
    from r3rdma.store.local_store import LocalRoutingStore

    params = inspect.signature(LocalRoutingStore.__init__).parameters
    return params["zstd_level"].default, params["chunk_rows"].default


def plan_rollout(
    requests: int, *, min_rows: int, max_rows: int, median_rows: float, sigma: float, rollout_seconds: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(rows, finish seconds) per request: a lognormal of rows clipped to ``min_rows..max_rows``;
    finish times proportional to length times a uniform 0.5-1 factor, the last at ``rollout_seconds``
    (module docstring)."""
    if not 1 <= min_rows <= max_rows or median_rows <= 0 or sigma < 0 or rollout_seconds < 0:
        raise ValueError(
            f"need 1 <= min_rows <= max_rows, median_rows > 0, sigma >= 0, rollout_seconds >= 0; got "
            f"{min_rows}, {max_rows}, {median_rows}, {sigma}, {rollout_seconds}"
        )
    rng = np.random.default_rng(seed + 2)
    rows = np.clip(np.rint(rng.lognormal(np.log(median_rows), sigma, size=requests)), min_rows, max_rows).astype(np.int64)
    score = rows * rng.uniform(0.5, 1.0, size=requests)
    return rows, rollout_seconds * score / score.max()


def disk_write_gbps(path: Path, nbytes: int, source: np.ndarray, block: int = 8 << 20) -> float:
    """GB/s of writing ``nbytes`` (blocks of ``source``'s bytes, in turn) sequentially to a new file
    at ``path``, fsync included; the file is removed."""
    buf = np.ascontiguousarray(source).reshape(-1).view(np.uint8).data  # a memoryview of its bytes
    blocks = [buf[i : i + block] for i in range(0, len(buf) - block + 1, block)] or [buf]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = k = 0
        t0 = time.perf_counter()
        while written < nbytes:
            written += os.write(fd, blocks[k % len(blocks)][: nbytes - written])
            k += 1
        os.fsync(fd)  # durable, as a node's commit is before its ack
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return written / seconds / 1e9


def zstd_gbps_all_cores(
    pool: np.ndarray, nbytes: int, *, chunk_rows: int, level: int, workers: int | None = None
) -> tuple[float, float]:
    """(GB/s, compressed / raw) of zstd at ``level`` compressing ``nbytes`` of ``pool``'s rows
    in chunks of ``chunk_rows`` rows on ``workers`` threads (default ``os.cpu_count()``), the
    faster of two ways: numcodecs' Zstd in a thread pool (it releases the GIL) and
    python-zstandard's ``multi_compress_to_buffer`` (the store's own: one call, its threads)."""
    import zstandard
    from numcodecs import Zstd

    codec = Zstd(level=level)
    chunks = [pool[i : i + chunk_rows] for i in range(0, len(pool) - chunk_rows + 1, chunk_rows)] or [pool]
    work = [chunks[k % len(chunks)] for k in range(max(1, -(-nbytes // chunks[0].nbytes)))]
    raw = sum(c.nbytes for c in work)
    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(workers) as threads:
        list(threads.map(codec.encode, chunks[:workers]))  # threads started, codec warm
        t0 = time.perf_counter()
        sizes = list(threads.map(lambda chunk: len(codec.encode(chunk)), work))
        pooled = raw / (time.perf_counter() - t0) / 1e9
    contiguous: list[bytes | bytearray | memoryview] = [np.ascontiguousarray(c).reshape(-1).view(np.uint8).data for c in work]
    t0 = time.perf_counter()
    zstandard.ZstdCompressor(level=level).multi_compress_to_buffer(contiguous, threads=workers)
    multi = raw / (time.perf_counter() - t0) / 1e9
    return max(pooled, multi), sum(sizes) / raw


def store_commit_gbps(path: Path, rollout, nbytes: int, *, batch_bytes: int) -> float:
    """GB/s of a store node's write path alone: ``rollout``'s first requests (``nbytes`` of
    them) committed to a :class:`LocalRoutingStore` at ``path`` (as a node commits what it
    receives: compressed, written, fsynced, indexed) through a :class:`RoutingWriter` of
    ``batch_bytes`` batches, no transport; the root is removed. What a node could ingest on
    this host's cores were the engines and the network not on them."""
    from r3rdma.bench.store_bench import ingest_seconds

    records, total = [], 0
    for i in range(len(rollout)):
        if total >= nbytes:
            break
        records.append(rollout.record(i))
        total += records[-1].nbytes
    return total / ingest_seconds(path, records, batch_bytes) / 1e9


def _bytes_ingested(node) -> float:
    """Decoded bytes the node made durable so far (its ``r3rdma_store_bytes_ingested`` counter)."""
    return node_samples(node)["r3rdma_store_bytes_ingested_total"]


def contiguous_runs(order: list[str], size: dict[str, int], share_bytes: list[int]) -> list[list[str]]:
    """``order`` cut into consecutive runs, run ``r`` about ``share_bytes[r]`` bytes (within one request)."""
    cum = np.cumsum([size[rid] for rid in order])
    cuts = [0] + [min(len(order), int(np.searchsorted(cum, t)) + 1) for t in np.cumsum(share_bytes)[:-1]] + [len(order)]
    cuts = [max(c, p) for c, p in zip(cuts, [0] + cuts[:-1])]  # non-decreasing
    return [order[a:b] for a, b in zip(cuts, cuts[1:])]


def run_rlstep_bench(
    *,
    requests: int = FULL["requests"],
    min_rows: int = FULL["min_rows"],
    max_rows: int = FULL["max_rows"],
    median_rows: float = FULL["median_rows"],
    sigma: float = 1.0,
    layers: int = 48,
    top_k: int = 8,
    experts: int = 128,
    nodes: int = FULL["nodes"],
    replicas: int = 2,
    engines: int = FULL["engines"],
    trainers: int = FULL["trainers"],
    rollout_seconds: float = FULL["rollout_seconds"],
    batch_mb: float = FULL["batch_mb"],
    micro_batch: int = 16,
    poll_s: float = 0.1,
    rounds: int = FULL["rounds"],
    root: str | None = None,
    seed: int = 0,
    verify: bool = False,
    quick: bool = False,
    progress: bool = True,
    timeout: float = 900.0,
    http_workers: str = "auto",
) -> dict[str, Any]:
    """Run the step, then the after-step reads and the yardsticks (module docstring); return the
    result dict (the JSON line). ``root`` keeps the nodes' data there (``<root>/node<i>``); by
    default a temporary directory is removed at the end. ``timeout`` bounds every wait on a
    process."""
    settings = dict(locals())  # the parameters, before anything else is bound here
    from multiprocessing.connection import wait as wait_any

    from r3rdma.bench.rlstep_workers import WARM_ROLLOUT, engine_main, trainer_main
    from r3rdma.bench.synthetic import TiledRollout
    from r3rdma.store.local_store import LocalRoutingStore
    from r3rdma.store.process import new_token
    from r3rdma.testing.harness import spawn_nodes

    if min(nodes, engines, trainers, micro_batch, rounds) < 1 or requests < trainers or not 1 <= replicas <= nodes:
        raise ValueError(
            f"need nodes, engines, trainers, micro_batch, rounds >= 1, requests >= trainers and "
            f"1 <= replicas <= nodes; got {nodes}, {engines}, {trainers}, {micro_batch}, {rounds}, "
            f"{requests}, {replicas}"
        )
    began = time.perf_counter()
    # The settings, reported with the figures (all but where the data lives and how the run is driven).
    result: dict[str, Any] = {"bench": "rlstep", "cpu_count": os.cpu_count()}
    result.update((k, v) for k, v in settings.items() if k not in ("root", "verify", "progress", "timeout"))
    result["rollout_seconds_planned"] = result.pop("rollout_seconds")
    lengths, finish_s = plan_rollout(
        requests,
        min_rows=min_rows,
        max_rows=max_rows,
        median_rows=median_rows,
        sigma=sigma,
        rollout_seconds=rollout_seconds,
        seed=seed,
    )
    rollout_kw: dict[str, Any] = dict(  # TiledRollout's arguments, here and in every engine process
        num_requests=requests,
        min_rows=min_rows,
        max_rows=max_rows,
        num_layers=layers,
        top_k=top_k,
        num_experts=experts,
        rollout_id=ROLLOUT_ID,
        seed=seed,
        lengths=lengths,
    )
    owner = np.random.default_rng(seed + 3).integers(0, engines, size=requests)  # which engine serves each request
    schedules = [
        sorted(((int(i), float(finish_s[i])) for i in np.flatnonzero(owner == e)), key=lambda x: x[1]) for e in range(engines)
    ]
    D = trainers
    shares = [[TiledRollout.request_id(i) for i in range(r, requests, D)] for r in range(D)]

    base = Path(root) if root else Path(tempfile.mkdtemp(prefix="r3rdma-bench-rlstep-"))
    base.mkdir(parents=True, exist_ok=True)
    token = new_token()
    node_procs: list = []
    procs: list[Worker] = []
    pending: dict[Any, tuple[str, Worker]] = {}  # during the step: processes not done yet
    say = lambda message: log("rlstep", progress, message)  # noqa: E731
    try:
        say(f"starting {nodes} store nodes, {engines} engines, {D} trainer ranks")
        node_procs = spawn_nodes([base / f"node{i}" for i in range(nodes)], token, "--http-workers", str(http_workers))
        result["http_workers"] = node_procs[0].http_workers
        read_token = node_procs[0].read_token
        urls = [n.http_url for n in node_procs]
        push_urls = [n.push_url for n in node_procs]
        ctx = worker_context()
        engine_procs = [
            Worker(
                ctx,
                e,
                engine_main,
                (e, push_urls, token, replicas, rollout_kw, schedules[e], batch_mb),
                f"r3rdma-rlstep-engine-{e}",
            )
            for e in range(engines)
        ]
        trainer_procs = [Worker(ctx, r, trainer_main, (r, urls, read_token), f"r3rdma-rlstep-trainer-{r}") for r in range(D)]
        procs = engine_procs + trainer_procs
        rollout = TiledRollout(**rollout_kw)  # here: sizes, the expected CRCs, the yardsticks' bytes
        size = {rollout.request_id(i): rollout.nbytes(i) for i in range(requests)}
        result.update(
            tokens=int(lengths.sum()),
            bytes_raw=rollout.total_bytes,
            rows_median=int(np.median(lengths)),
            rows_p99=int(np.percentile(lengths, 99)),
        )
        warm_ids = [rid for p in engine_procs for rid in p.recv(timeout)["warm"]]
        for p in trainer_procs:
            assert p.recv(timeout)["event"] == "ready"
        for p in trainer_procs:  # HTTP connections to every node up before the clock
            p.send({"cmd": "warm", "rollout": WARM_ROLLOUT, "ids": warm_ids})
        for p in trainer_procs:
            p.recv(timeout)
        result["phase_seconds"] = phases = {"start": round(time.perf_counter() - began, 1)}
        say(
            f"{requests} requests, {result['tokens']} rows (median {result['rows_median']}, p99 "
            f"{result['rows_p99']}), {rollout.total_bytes / 1e9:.3f} GB decoded over a {rollout_seconds} s rollout"
        )

        # -- the step ----------------------------------------------------------------------
        ingested0 = [_bytes_ingested(n) for n in node_procs]
        cpu0, wall0 = sum(cpu_seconds(n.proc.pid) for n in node_procs), time.perf_counter()
        for r, p in enumerate(trainer_procs):  # the step begins: each rank names its share
            p.send(
                {
                    "cmd": "collect",
                    "rollout": ROLLOUT_ID,
                    "ids": shares[r],
                    "poll_s": poll_s,
                    "verify": verify,
                    "timeout": timeout,
                }
            )
        t0 = time.time() + 0.2  # every engine has its go before the first request is due
        for p in engine_procs:
            p.send({"cmd": "go", "t0": t0})
        answers: dict[str, dict[int, dict[str, Any]]] = {"engine": {}, "trainer": {}}
        pending = {p.conn: ("engine", p) for p in engine_procs} | {p.conn: ("trainer", p) for p in trainer_procs}
        deadline = time.monotonic() + timeout
        with bar(progress, len(pending), "rl step", unit="proc") as shown:
            while pending:
                ready = wait_any(list(pending), timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise TimeoutError(f"rl step: {len(pending)} processes not done in {timeout} s")
                for conn in ready:
                    kind, p = pending.pop(conn)
                    answers[kind][p.rank] = answer = p.recv(timeout)
                    shown.update(1)
                    at = (answer["done"] if kind == "trainer" else answer["acks"][-1][0]) - t0
                    say(f"  {kind} {p.rank} done at {at:.2f} s")
        node_cpu = sum(cpu_seconds(n.proc.pid) for n in node_procs) - cpu0
        step_wall = time.perf_counter() - wall0
        ingested = [_bytes_ingested(n) - b for n, b in zip(node_procs, ingested0)]
        phases["step"] = round(step_wall, 1)

        eng = [answers["engine"][e] for e in range(engines)]
        ranks = [answers["trainer"][r] for r in range(D)]
        first = min(a["first_submit"] for a in eng if a["first_submit"] is not None)
        last_ack = max(a["acks"][-1][0] for a in eng if a["acks"])
        rollout_s = last_ack - first
        stall_per_rank = [a["done"] - last_ack for a in ranks]
        stall = max(stall_per_rank)
        ingest_nodes = [b / rollout_s / 1e9 for b in ingested]
        ingest = statistics.fmean(ingest_nodes)
        result.update(
            rollout_seconds=round(rollout_s, 3),
            stall_seconds=round(stall, 3),
            stall_vs_rollout=round(stall / rollout_s, 4),
            stall_per_rank=[round(s, 3) for s in stall_per_rank],
            last_finish_to_ack_seconds=round(last_ack - (t0 + float(finish_s.max())), 3),
            engine_late_seconds=round(max(a["late_s"] for a in eng), 3),
            engine_batches=sum(len(a["acks"]) for a in eng),
            ingest_gbps_per_node=round(ingest, 4),
            ingest_gbps_nodes=[round(g, 4) for g in ingest_nodes],
            offered_gbps_per_node=round(sum(ingested) / len(ingested) / rollout_seconds / 1e9, 4) if rollout_seconds else None,
            node_bytes_ingested=[int(b) for b in ingested],
            step_node_cores=round(node_cpu / step_wall, 2),
            step_engine_cpu_s=round(sum(a["cpu_s"] for a in eng), 2),
            step_trainer_cpu_s=round(sum(a["cpu_s"] for a in ranks), 2),
            collect_polls=[a["polls"] for a in ranks],
            collect_reads=[a["reads"] for a in ranks],
        )
        share_bytes = [sum(size[rid] for rid in share) for share in shares]
        complete = all(
            a["requests"] == len(s) and a["bytes"] == b and a["order_ok"] for a, s, b in zip(ranks, shares, share_bytes)
        )
        result["shares_complete"] = complete
        if verify:
            verified = mismatched = 0
            for a, share in zip(ranks, shares):
                mismatched += len(set(share) ^ set(a["crcs"]))
                for rid, crc in a["crcs"].items():
                    verified += 1
                    mismatched += rid not in size or crc != rollout.record(int(rid[1:])).crc32c
            result.update(verified_requests=verified, verify_mismatches=mismatched)
        say(f"rollout {rollout_s:.2f} s, stall {stall:.3f} s, ingest {ingest:.3f} GB/s per node")

        # -- a fresh reader in a fresh process opens the rollout ---------------------------
        mark = time.perf_counter()
        opener = Worker(ctx, D, trainer_main, (D, urls, read_token), "r3rdma-rlstep-opener")
        try:
            assert opener.recv(timeout)["event"] == "ready"
            opener.send({"cmd": "open", "rollout": ROLLOUT_ID, "repeat": 3})
            opened = opener.recv(timeout)
        finally:
            opener.stop()
        assert opened["requests"] == requests, (opened["requests"], requests)
        result.update(index_open_ms=round(statistics.median(opened["ms"]), 2), index_open_ms_first=round(opened["ms"][0], 2))
        phases["open"] = round(time.perf_counter() - mark, 1)

        # -- after the step: scattered shares vs contiguous runs, the same reads ------------
        mark = time.perf_counter()
        order = [rid for _, rid in sorted((t, rid) for a in eng for t, ids in a["acks"] for rid in ids)]  # commit order
        assert sorted(order) == sorted(size), "acknowledged requests differ from those planned"
        contiguous = contiguous_runs(order, size, share_bytes)

        def read_cmd(ids: list[str]) -> dict[str, Any]:
            batches = [ids[i : i + micro_batch] for i in range(0, len(ids), micro_batch)]
            return {"cmd": "read", "rollout": ROLLOUT_ID, "batches": batches}

        reads: dict[str, dict[str, Any]] = {name: {"bytes": 0, "span": 0.0, "rates": []} for name in ("scattered", "contiguous")}
        rank_bytes, rank_seconds = [0] * D, [0.0] * D
        for _ in range(rounds):
            for name, assignment in (("scattered", shares), ("contiguous", contiguous)):
                say(f"read phase {name}: {D} ranks")
                got = run_phase(trainer_procs, [read_cmd(ids) for ids in assignment], timeout)
                gbps, span, moved = span_rate(got)
                reads[name]["bytes"] += moved
                reads[name]["span"] += span
                reads[name]["rates"].append(gbps)
                if name == "scattered":
                    for r, a in enumerate(got):
                        rank_bytes[r] += a["bytes"]
                        rank_seconds[r] += a["end"] - a["start"]
                say(f"  {gbps:.3f} GB/s over {span:.2f} s")
        scattered_gbps, contiguous_gbps = (reads[n]["bytes"] / max(reads[n]["span"], 1e-9) / 1e9 for n in reads)
        rates = [reads[n]["rates"] for n in reads]
        result.update(
            rank_read_gbps=[round(b / max(s, 1e-9) / 1e9, 4) for b, s in zip(rank_bytes, rank_seconds)],
            scattered_read_gbps=round(scattered_gbps, 4),
            contiguous_read_gbps=round(contiguous_gbps, 4),
            scattered_vs_contiguous=round(scattered_gbps / contiguous_gbps, 3),
            scattered_vs_contiguous_per_round=[round(s / c, 3) for s, c in zip(*rates)],
            contiguous_bytes_per_rank=[sum(size[rid] for rid in run) for run in contiguous],
            share_bytes_per_rank=share_bytes,
        )
        phases["reads"] = round(time.perf_counter() - mark, 1)

        # -- what the nodes store, once stopped (a node snapshots an idle rollout's index later)
        stop_all(procs, node_procs, None)
        stored = [sum(f.stat().st_size for f in (n.root / ROLLOUT_ID).rglob("*") if f.is_file()) for n in node_procs]
        procs, node_procs = [], []
        result.update(
            bytes_stored=sum(stored),
            bytes_stored_nodes=stored,
            bytes_stored_per_replica=sum(stored) // replicas,
            stored_vs_raw=round(sum(stored) / replicas / rollout.total_bytes, 4),
        )

        # -- yardsticks: the per-node bytes written to this disk, and compressed on every core
        mark = time.perf_counter()  # engines and nodes stopped above: every core free for the yardsticks
        per_node = int(statistics.fmean(ingested))
        level, chunk_rows = _store_defaults()
        say(f"yardsticks: {per_node / 1e9:.3f} GB written to {base}, and zstd {level} on {os.cpu_count()} threads")
        disk = disk_write_gbps(base / "yardstick.bin", per_node, rollout.pool)
        zstd, ratio = zstd_gbps_all_cores(rollout.pool, per_node, chunk_rows=chunk_rows, level=level)
        store_gbps = store_commit_gbps(base / "yardstick-store", rollout, per_node, batch_bytes=int(batch_mb * 2**20))
        say("commit growth: the rollout committed again in-process, each commit timed")
        with LocalRoutingStore(base / "commit-growth") as store:
            commit_ms = commit_in_batches(store, rollout, range(requests), int(batch_mb * 2**20))[1:] or [0.0]
        shutil.rmtree(base / "commit-growth")
        tenth = max(1, len(commit_ms) // 10)  # the first commit (it creates the rollout) left out above
        first_ms, last_ms = statistics.fmean(commit_ms[:tenth]), statistics.fmean(commit_ms[-tenth:])
        result.update(
            disk_write_gbps=round(disk, 4),
            zstd_gbps_all_cores=round(zstd, 4),
            zstd_ratio=round(ratio, 4),
            zstd_level=level,
            chunk_rows=chunk_rows,
            yardstick_bytes=per_node,
            ingest_vs_yardstick=round(ingest / min(disk, zstd), 3),
            store_commit_gbps=round(store_gbps, 4),
            store_vs_yardstick=round(store_gbps / min(disk, zstd), 3),
            commits=len(commit_ms) + 1,
            commit_ms_first=round(first_ms, 3),
            commit_ms_last=round(last_ms, 3),
            commit_growth=round(last_ms / max(first_ms, 1e-9), 3),
            commit_growth_median=round(
                statistics.median(commit_ms[-tenth:]) / max(statistics.median(commit_ms[:tenth]), 1e-9), 3
            ),
        )
        phases["yardsticks"] = round(time.perf_counter() - mark, 1)

        result["goals"] = {
            "stall": stall <= max(1.0, 0.02 * rollout_s),
            "index_open": result["index_open_ms"] <= 100,
            "scattered_reads": result["scattered_vs_contiguous"] >= 0.8,
            "ingest": ingest >= 1.0 or result["ingest_vs_yardstick"] >= 0.5,
            "store_write": store_gbps >= 1.0 or result["store_vs_yardstick"] >= 0.5,
            "commit_growth": result["commit_growth"] <= 1.2,
        }
        result["seconds"] = round(time.perf_counter() - began, 1)
        result["root"] = str(base) if root else None
        return result
    finally:
        mark = time.perf_counter()
        for _, p in pending.values():
            # Failed mid-step: a rank still waits for its share and reads no stop until its
            # timeout; an engine may be pushing. Neither has anything left to report.
            p.proc.kill()
        stop_all(procs, node_procs, base if root is None else None)
        say(f"stopped in {time.perf_counter() - mark:.1f} s")


# -- command line ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``r3rdma bench rlstep``: the preset, the rollout's shape and timing, processes, reads."""
    quick = (
        f"2-core CPU machine, under 2 min: {QUICK['requests']} requests of {QUICK['min_rows']}-{QUICK['max_rows']} rows, "
        f"{QUICK['nodes']} nodes, {QUICK['engines']} engines, {QUICK['trainers']} trainers, a {QUICK['rollout_seconds']:g} s rollout"
    )
    helps = {
        "median_rows": "median of the lognormal of rows per request",
        "nodes": "store-node processes",
        "engines": "engine (TP-owner rank) processes",
        "trainers": "trainer DP rank processes",
        "rollout_seconds": "when the last request finishes (0: all at once)",
        "batch_mb": "each engine writer's batch size",
        "rounds": "after-step scattered / contiguous read rounds",
    }
    add_preset_arguments(parser, QUICK, FULL, quick, helps)
    parser.add_argument("--sigma", type=float, default=1.0, help="sigma of the lognormal of rows per request (log-rows)")
    parser.add_argument("--replicas", type=int, default=2, help="nodes holding each request")
    parser.add_argument("--micro-batch", type=int, default=16, help="requests per get_packed in the after-step reads")
    parser.add_argument("--poll-s", type=float, default=0.1, help="how often each rank's collector polls the index")
    parser.add_argument(
        "--verify", action="store_true", help="ranks hash every request collected, checked against what was pushed"
    )
    parser.add_argument("--root", default=None, help="keep the nodes' data here (default: a temporary directory, removed)")


def main(args: argparse.Namespace) -> int:
    """``r3rdma bench rlstep``: run the preset with the options given, print the JSON line (also to ``--json-out``)."""
    return run_from_args(run_rlstep_bench, args, QUICK, FULL)
