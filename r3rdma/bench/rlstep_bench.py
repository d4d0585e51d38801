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
  not on its cores (the engines' UCX-over-TCP pushes take a large share of them: BENCHMARKS.md).
- ``commit_growth``: the whole rollout committed again to a fresh ``LocalRoutingStore`` in
  ``--batch-mb`` batches, each ``commit`` timed: the mean of the last 10% of commits over the
  first 10% (the rollout's first commit, which creates it, left out; ``commit_ms_first`` /
  ``commit_ms_last``). 1.0: a commit costs the same however many requests the rollout holds.
  ``commit_growth_median``: the same windows' medians (a few slow fsyncs, or a snapshot merged
  meanwhile, move a mean of 14 commits, as in ``--quick``, not these).
- ``goals``: stall <= max(1 s, 2% of the rollout); index_open_ms <= 100; scattered_vs_contiguous
  >= 0.8; ingest >= 1 GB/s per node or >= 0.5 of the yardstick; store_write: the same for
  ``store_commit_gbps``; commit_growth <= 1.2.

``--quick`` (:data:`QUICK`) fits the 2-core CPU VM (its wall time: BENCHMARKS.md). ``verify``
(tests): each rank hashes every request it collected (CRC-32C), checked against what was pushed.
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from r3rdma.bench.common import (
    Worker,
    add_options,
    add_preset_arguments,
    bar,
    commit_in_batches,
    cpu_seconds,
    log,
    node_samples,
    run_from_args,
    run_phase,
    scratch_dir,
    span_rate,
    stop_all,
    tree_bytes,
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
_INGESTED = "r3rdma_store_bytes_ingested_total"  # a node's counter: decoded bytes it made durable


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
    if min(nodes, engines, trainers, micro_batch, rounds) < 1 or requests < trainers or not 1 <= replicas <= nodes:
        raise ValueError(
            f"need nodes, engines, trainers, micro_batch, rounds >= 1, requests >= trainers and "
            f"1 <= replicas <= nodes; got {nodes}, {engines}, {trainers}, {micro_batch}, {rounds}, "
            f"{requests}, {replicas}"
        )
    run = _StepRun(settings)
    try:
        run.start()
        run.step()
        run.open_index()
        run.read_rounds()
        run.stored()
        run.yardsticks()
        return run.finish()
    finally:
        run.stop()


class _StepRun:
    """One run of the bench, in the order :func:`run_rlstep_bench` calls its steps: the plan,
    the processes, and the result (the JSON line) each step adds its figures to."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from r3rdma.bench.synthetic import TiledRollout

        self.s = s = settings
        self.began = time.perf_counter()
        self.say = lambda message: log("rlstep", s["progress"], message)
        # The settings, reported with the figures (all but where the data lives and how the run is driven).
        self.result: dict[str, Any] = {"bench": "rlstep", "cpu_count": os.cpu_count()}
        self.result.update((k, v) for k, v in s.items() if k not in ("root", "verify", "progress", "timeout"))
        self.result["rollout_seconds_planned"] = self.result.pop("rollout_seconds")
        keys = ("min_rows", "max_rows", "median_rows", "sigma", "rollout_seconds", "seed")
        self.lengths, self.finish_s = plan_rollout(s["requests"], **{k: s[k] for k in keys})
        self.rollout_kw: dict[str, Any] = dict(  # TiledRollout's arguments, here and in every engine process
            num_requests=s["requests"],
            min_rows=s["min_rows"],
            max_rows=s["max_rows"],
            num_layers=s["layers"],
            top_k=s["top_k"],
            num_experts=s["experts"],
            rollout_id=ROLLOUT_ID,
            seed=s["seed"],
            lengths=self.lengths,
        )
        owner = np.random.default_rng(s["seed"] + 3).integers(0, s["engines"], size=s["requests"])  # each request's engine
        self.schedules = [
            sorted(((int(i), float(self.finish_s[i])) for i in np.flatnonzero(owner == e)), key=lambda x: x[1])
            for e in range(s["engines"])
        ]
        D = s["trainers"]
        self.shares = [[TiledRollout.request_id(i) for i in range(r, s["requests"], D)] for r in range(D)]
        self.base = scratch_dir("r3rdma-bench-rlstep-", s["root"])
        self.node_procs: list = []
        self.engines: list[Worker] = []
        self.trainers: list[Worker] = []
        self.pending: dict[Any, tuple[str, Worker]] = {}  # during the step: processes not done yet
        self.phases: dict[str, float] = {}

    def start(self) -> None:
        """Store nodes, engine and trainer processes up, connections warm, before any clock."""
        from r3rdma.bench.rlstep_workers import WARM_ROLLOUT, engine_main, trainer_main
        from r3rdma.bench.synthetic import TiledRollout
        from r3rdma.store.process import new_token
        from r3rdma.testing.harness import spawn_nodes

        s, result, D = self.s, self.result, self.s["trainers"]
        self.say(f"starting {s['nodes']} store nodes, {s['engines']} engines, {D} trainer ranks")
        token = new_token()
        node_dirs = [self.base / f"node{i}" for i in range(s["nodes"])]
        self.node_procs = spawn_nodes(node_dirs, token, "--http-workers", str(s["http_workers"]))
        result["http_workers"] = self.node_procs[0].http_workers
        self.read_token = self.node_procs[0].read_token
        self.urls = [n.http_url for n in self.node_procs]
        push_urls = [n.push_url for n in self.node_procs]
        self.ctx = worker_context()
        engine_args = [
            (e, push_urls, token, s["replicas"], self.rollout_kw, self.schedules[e], s["batch_mb"]) for e in range(s["engines"])
        ]
        self.engines = [Worker(self.ctx, e, engine_main, a, f"r3rdma-rlstep-engine-{e}") for e, a in enumerate(engine_args)]
        trainer_args = [(r, self.urls, self.read_token) for r in range(D)]
        self.trainers = [Worker(self.ctx, r, trainer_main, a, f"r3rdma-rlstep-trainer-{r}") for r, a in enumerate(trainer_args)]
        self.rollout = rollout = TiledRollout(**self.rollout_kw)  # here: sizes, the expected CRCs, the yardsticks' bytes
        self.size = {rollout.request_id(i): rollout.nbytes(i) for i in range(s["requests"])}
        result.update(
            tokens=int(self.lengths.sum()),
            bytes_raw=rollout.total_bytes,
            rows_median=int(np.median(self.lengths)),
            rows_p99=int(np.percentile(self.lengths, 99)),
        )
        warm_ids = [rid for p in self.engines for rid in p.recv(s["timeout"])["warm"]]
        for p in self.trainers:
            assert p.recv(s["timeout"])["event"] == "ready"
        for p in self.trainers:  # HTTP connections to every node up before the clock
            p.send({"cmd": "warm", "rollout": WARM_ROLLOUT, "ids": warm_ids})
        for p in self.trainers:
            p.recv(s["timeout"])
        result["phase_seconds"] = self.phases
        self.phases["start"] = round(time.perf_counter() - self.began, 1)
        self.say(
            f"{s['requests']} requests, {result['tokens']} rows (median {result['rows_median']}, p99 "
            f"{result['rows_p99']}), {rollout.total_bytes / 1e9:.3f} GB decoded over a {s['rollout_seconds']} s rollout"
        )

    def step(self) -> None:
        """The step: the ranks name their shares, the engines push on their schedules; every
        process's answer once it is done, and the step's figures."""
        from multiprocessing.connection import wait as wait_any

        s, timeout = self.s, self.s["timeout"]
        ingested0 = [node_samples(n)[_INGESTED] for n in self.node_procs]
        cpu0, wall0 = sum(cpu_seconds(n.proc.pid) for n in self.node_procs), time.perf_counter()
        for r, p in enumerate(self.trainers):  # the step begins: each rank names its share
            cmd = {"cmd": "collect", "rollout": ROLLOUT_ID, "ids": self.shares[r], "poll_s": s["poll_s"]}
            p.send(cmd | {"verify": s["verify"], "timeout": timeout})
        self.t0 = time.time() + 0.2  # every engine has its go before the first request is due
        for p in self.engines:
            p.send({"cmd": "go", "t0": self.t0})
        answers: dict[str, dict[int, dict[str, Any]]] = {"engine": {}, "trainer": {}}
        self.pending = {p.conn: ("engine", p) for p in self.engines} | {p.conn: ("trainer", p) for p in self.trainers}
        deadline = time.monotonic() + timeout
        with bar(s["progress"], len(self.pending), "rl step", unit="proc") as shown:
            while self.pending:
                ready = wait_any(list(self.pending), timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise TimeoutError(f"rl step: {len(self.pending)} processes not done in {timeout} s")
                for conn in ready:
                    kind, p = self.pending.pop(conn)
                    answers[kind][p.rank] = answer = p.recv(timeout)
                    shown.update(1)
                    at = (answer["done"] if kind == "trainer" else answer["acks"][-1][0]) - self.t0
                    self.say(f"  {kind} {p.rank} done at {at:.2f} s")
        node_cpu = sum(cpu_seconds(n.proc.pid) for n in self.node_procs) - cpu0
        step_wall = time.perf_counter() - wall0
        self.ingested = [node_samples(n)[_INGESTED] - b for n, b in zip(self.node_procs, ingested0)]
        self.phases["step"] = round(step_wall, 1)
        self.eng = [answers["engine"][e] for e in range(s["engines"])]
        self._step_figures([answers["trainer"][r] for r in range(s["trainers"])], node_cpu / step_wall)

    def _step_figures(self, ranks: list[dict[str, Any]], node_cores: float) -> None:
        """The step's figures from the engines' and ranks' answers (module docstring)."""
        eng, ingested = self.eng, self.ingested
        first = min(a["first_submit"] for a in eng if a["first_submit"] is not None)
        last_ack = max(a["acks"][-1][0] for a in eng if a["acks"])
        self.rollout_s = rollout_s = last_ack - first
        stall_per_rank = [a["done"] - last_ack for a in ranks]
        self.stall = stall = max(stall_per_rank)
        ingest_nodes = [b / rollout_s / 1e9 for b in ingested]
        self.ingest = ingest = statistics.fmean(ingest_nodes)
        planned = self.s["rollout_seconds"]
        self.result.update(
            rollout_seconds=round(rollout_s, 3),
            stall_seconds=round(stall, 3),
            stall_vs_rollout=round(stall / rollout_s, 4),
            stall_per_rank=[round(s, 3) for s in stall_per_rank],
            last_finish_to_ack_seconds=round(last_ack - (self.t0 + float(self.finish_s.max())), 3),
            engine_late_seconds=round(max(a["late_s"] for a in eng), 3),
            engine_batches=sum(len(a["acks"]) for a in eng),
            ingest_gbps_per_node=round(ingest, 4),
            ingest_gbps_nodes=[round(g, 4) for g in ingest_nodes],
            offered_gbps_per_node=round(sum(ingested) / len(ingested) / planned / 1e9, 4) if planned else None,
            node_bytes_ingested=[int(b) for b in ingested],
            step_node_cores=round(node_cores, 2),
            step_engine_cpu_s=round(sum(a["cpu_s"] for a in eng), 2),
            step_trainer_cpu_s=round(sum(a["cpu_s"] for a in ranks), 2),
            collect_polls=[a["polls"] for a in ranks],
            collect_reads=[a["reads"] for a in ranks],
        )
        self.share_bytes = [sum(self.size[rid] for rid in share) for share in self.shares]
        self.result["shares_complete"] = all(
            a["requests"] == len(s) and a["bytes"] == b and a["order_ok"] for a, s, b in zip(ranks, self.shares, self.share_bytes)
        )
        if self.s["verify"]:
            verified = mismatched = 0
            for a, share in zip(ranks, self.shares):
                mismatched += len(set(share) ^ set(a["crcs"]))
                for rid, crc in a["crcs"].items():
                    verified += 1
                    mismatched += rid not in self.size or crc != self.rollout.record(int(rid[1:])).crc32c
            self.result.update(verified_requests=verified, verify_mismatches=mismatched)
        self.say(f"rollout {rollout_s:.2f} s, stall {stall:.3f} s, ingest {ingest:.3f} GB/s per node")

    def open_index(self) -> None:
        """A fresh reader in a fresh process opens the rollout."""
        from r3rdma.bench.rlstep_workers import trainer_main

        mark, D, timeout = time.perf_counter(), self.s["trainers"], self.s["timeout"]
        opener = Worker(self.ctx, D, trainer_main, (D, self.urls, self.read_token), "r3rdma-rlstep-opener")
        try:
            assert opener.recv(timeout)["event"] == "ready"
            opener.send({"cmd": "open", "rollout": ROLLOUT_ID, "repeat": 3})
            opened = opener.recv(timeout)
        finally:
            opener.stop()
        assert opened["requests"] == self.s["requests"], (opened["requests"], self.s["requests"])
        self.result.update(index_open_ms=round(statistics.median(opened["ms"]), 2), index_open_ms_first=round(opened["ms"][0], 2))
        self.phases["open"] = round(time.perf_counter() - mark, 1)

    def read_rounds(self) -> None:
        """After the step: scattered shares against contiguous runs of the same bytes, the same reads."""
        mark, size, D, micro_batch = time.perf_counter(), self.size, self.s["trainers"], self.s["micro_batch"]
        order = [rid for _, rid in sorted((t, rid) for a in self.eng for t, ids in a["acks"] for rid in ids)]  # commit order
        assert sorted(order) == sorted(size), "acknowledged requests differ from those planned"
        contiguous = contiguous_runs(order, size, self.share_bytes)

        def read_cmd(ids: list[str]) -> dict[str, Any]:
            batches = [ids[i : i + micro_batch] for i in range(0, len(ids), micro_batch)]
            return {"cmd": "read", "rollout": ROLLOUT_ID, "batches": batches}

        reads: dict[str, dict[str, Any]] = {name: {"bytes": 0, "span": 0.0, "rates": []} for name in ("scattered", "contiguous")}
        rank_bytes, rank_seconds = [0] * D, [0.0] * D
        for _ in range(self.s["rounds"]):
            for name, assignment in (("scattered", self.shares), ("contiguous", contiguous)):
                self.say(f"read phase {name}: {D} ranks")
                got = run_phase(self.trainers, [read_cmd(ids) for ids in assignment], self.s["timeout"])
                gbps, span, moved = span_rate(got)
                reads[name]["bytes"] += moved
                reads[name]["span"] += span
                reads[name]["rates"].append(gbps)
                if name == "scattered":
                    for r, a in enumerate(got):
                        rank_bytes[r] += a["bytes"]
                        rank_seconds[r] += a["end"] - a["start"]
                self.say(f"  {gbps:.3f} GB/s over {span:.2f} s")
        scattered_gbps, contiguous_gbps = (reads[n]["bytes"] / max(reads[n]["span"], 1e-9) / 1e9 for n in reads)
        rates = [reads[n]["rates"] for n in reads]
        self.result.update(
            rank_read_gbps=[round(b / max(s, 1e-9) / 1e9, 4) for b, s in zip(rank_bytes, rank_seconds)],
            scattered_read_gbps=round(scattered_gbps, 4),
            contiguous_read_gbps=round(contiguous_gbps, 4),
            scattered_vs_contiguous=round(scattered_gbps / contiguous_gbps, 3),
            scattered_vs_contiguous_per_round=[round(s / c, 3) for s, c in zip(*rates)],
            contiguous_bytes_per_rank=[sum(size[rid] for rid in run) for run in contiguous],
            share_bytes_per_rank=self.share_bytes,
        )
        self.phases["reads"] = round(time.perf_counter() - mark, 1)

    def stored(self) -> None:
        """What the nodes store, once stopped (a node snapshots an idle rollout's index later)."""
        stop_all(self.engines + self.trainers, self.node_procs, None)
        stored = [tree_bytes(n.root / ROLLOUT_ID) for n in self.node_procs]
        self.engines, self.trainers, self.node_procs = [], [], []
        replicas = self.s["replicas"]
        self.result.update(
            bytes_stored=sum(stored),
            bytes_stored_nodes=stored,
            bytes_stored_per_replica=sum(stored) // replicas,
            stored_vs_raw=round(sum(stored) / replicas / self.rollout.total_bytes, 4),
        )

    def yardsticks(self) -> None:
        """The per-node bytes written to this disk and compressed on every core, a node's write
        path alone, and the commit cost against the rollout's size."""
        from r3rdma.store.local_store import LocalRoutingStore

        mark = time.perf_counter()  # engines and nodes stopped: every core free for the yardsticks
        base, rollout, batch_bytes = self.base, self.rollout, int(self.s["batch_mb"] * 2**20)
        per_node = int(statistics.fmean(self.ingested))
        params = inspect.signature(LocalRoutingStore).parameters  # a node's defaults: the yardstick follows the store
        level, chunk_rows = params["zstd_level"].default, params["chunk_rows"].default
        self.say(f"yardsticks: {per_node / 1e9:.3f} GB written to {base}, and zstd {level} on {os.cpu_count()} threads")
        disk = disk_write_gbps(base / "yardstick.bin", per_node, rollout.pool)
        zstd, ratio = zstd_gbps_all_cores(rollout.pool, per_node, chunk_rows=chunk_rows, level=level)
        self.store_gbps = store_gbps = store_commit_gbps(base / "yardstick-store", rollout, per_node, batch_bytes=batch_bytes)
        self.say("commit growth: the rollout committed again in-process, each commit timed")
        with LocalRoutingStore(base / "commit-growth") as store:
            commit_ms = commit_in_batches(store, rollout, range(self.s["requests"]), batch_bytes)[1:] or [0.0]
        shutil.rmtree(base / "commit-growth")
        tenth = max(1, len(commit_ms) // 10)  # the first commit (it creates the rollout) left out above
        first_ms, last_ms = statistics.fmean(commit_ms[:tenth]), statistics.fmean(commit_ms[-tenth:])
        median_growth = statistics.median(commit_ms[-tenth:]) / max(statistics.median(commit_ms[:tenth]), 1e-9)
        self.result.update(
            disk_write_gbps=round(disk, 4),
            zstd_gbps_all_cores=round(zstd, 4),
            zstd_ratio=round(ratio, 4),
            zstd_level=level,
            chunk_rows=chunk_rows,
            yardstick_bytes=per_node,
            ingest_vs_yardstick=round(self.ingest / min(disk, zstd), 3),
            store_commit_gbps=round(store_gbps, 4),
            store_vs_yardstick=round(store_gbps / min(disk, zstd), 3),
            commits=len(commit_ms) + 1,
            commit_ms_first=round(first_ms, 3),
            commit_ms_last=round(last_ms, 3),
            commit_growth=round(last_ms / max(first_ms, 1e-9), 3),
            commit_growth_median=round(median_growth, 3),
        )
        self.phases["yardsticks"] = round(time.perf_counter() - mark, 1)

    def finish(self) -> dict[str, Any]:
        """The goals, the run's seconds and where its data stays: the JSON line."""
        result = self.result
        result["goals"] = {
            "stall": self.stall <= max(1.0, 0.02 * self.rollout_s),
            "index_open": result["index_open_ms"] <= 100,
            "scattered_reads": result["scattered_vs_contiguous"] >= 0.8,
            "ingest": self.ingest >= 1.0 or result["ingest_vs_yardstick"] >= 0.5,
            "store_write": self.store_gbps >= 1.0 or result["store_vs_yardstick"] >= 0.5,
            "commit_growth": result["commit_growth"] <= 1.2,
        }
        result["seconds"] = round(time.perf_counter() - self.began, 1)
        result["root"] = str(self.base) if self.s["root"] else None
        return result

    def stop(self) -> None:
        """Every process ended, and a temporary base directory removed."""
        mark = time.perf_counter()
        for _, p in self.pending.values():
            # Failed mid-step: a rank still waits for its share and reads no stop until its
            # timeout; an engine may be pushing. Neither has anything left to report.
            p.proc.kill()
        stop_all(self.engines + self.trainers, self.node_procs, self.base if self.s["root"] is None else None)
        self.say(f"stopped in {time.perf_counter() - mark:.1f} s")


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
    add_preset_arguments(parser, run_rlstep_bench, QUICK, FULL, quick, helps)
    helps = {
        "sigma": "sigma of the lognormal of rows per request (log-rows)",
        "replicas": "nodes holding each request",
        "micro_batch": "requests per get_packed in the after-step reads",
        "poll_s": "how often each rank's collector polls the index",
        "verify": "ranks hash every request collected, checked against what was pushed",
        "root": "keep the nodes' data here (default: a temporary directory, removed)",
    }
    add_options(parser, run_rlstep_bench, "sigma replicas micro_batch poll_s verify root", helps)


def main(args: argparse.Namespace) -> int:
    """``r3rdma bench rlstep``: run the preset with the options given, print the JSON line (also to ``--json-out``)."""
    return run_from_args(run_rlstep_bench, args, QUICK, FULL)
