"""`r3rdma bench scale`: one RL step at realistic size, pushed, committed and read back.

Phases, in one program (progress on stderr, the last stdout line is JSON):

1. **Push.** A synthetic rollout (default 48 layers, top-8, 128 experts, lengths drawn
   uniformly from ``--min-rows``..``--max-rows``; rows are slices of one pool of skewed
   routing, :class:`~r3rdma.bench.synthetic.TiledRollout`, so 10 GB cost a few MB to make)
   goes through a :class:`RoutingWriter` to ``--nodes`` store-node processes over UCX, in
   ``--batch-mb`` batches. Each batch's ack latency is timed at the client (the writer's
   store is a :class:`StoreNodesClient` wrapped in a timer): ``push_ms_*``, against the
   requests already pushed. ``ingest_gbps``: routing bytes over first submit to last ack.
   ``node_ack_ms_mean``: the nodes' own arrival-to-durable mean (their ``/metrics``).
2. **Commit.** The same batches, in the same order, are committed in-process to a fresh
   :class:`LocalRoutingStore` and each ``commit`` is timed: the store's commit cost as the
   rollout grows (``commit_ms_*``; that root is deleted afterwards). ``commit_growth`` is the
   mean of the last 10% of commits over the mean of the first 10% (the rollout's very first
   commit, which creates it, left out); 1.0 means a commit costs the same at any rollout size.
   ``commit_growth_median``: the same windows' medians (robust to a few slow fsyncs).
3. **Open.** ``index_open_ms``: a fresh :class:`RoutingReader` (in a reader process) opening
   the committed rollout, ``reader.info(rollout)``, median of 3.
4. **Read.** ``--readers`` D trainer processes, started and warmed (imports done, reader
   built, the rollout's index read, one micro-batch read) before any clock starts, then
   released together. Scattered: DP rank r reads request ``i`` of the commit order where
   ``i % D == r``, in ``--micro-batch`` requests per ``get_packed`` (or ``prefetch`` where the
   reader has it), spread over nearly every batch array. Contiguous yardstick: D processes
   each read a contiguous 1/D of the same requests, same micro-batch shape.
   The two alternate ``--rounds`` times (a phase lasts seconds on a GPU host; one slow second
   of a shared host moved a lone pair's ratio by 0.2). ``dp_read_gbps`` /
   ``contiguous_read_gbps``: decoded routing bytes of all shares over the span from the first
   start to the last finish, summed over rounds; ``dp_ratio`` = scattered / contiguous
   (``dp_ratio_per_round`` for the spread).
   ``<phase>_node_cores`` / ``<phase>_reader_cores``: CPU cores the store nodes (their read
   workers included) and the readers kept busy over the phase; with the host's ``cpu_count``
   they say which side ran out. Then
   one process alone reads rank 0's share (``single_scattered_gbps``) and the same bytes
   contiguous (``single_contiguous_gbps``).
5. **Raw GET.** ``raw_get_gbps``: plain ``http.client`` GETs of every file of the rollout on
   the nodes (listed from their roots on disk), D worker processes, file bytes per second; the
   ceiling of what crosses the wire. ``stored_bytes`` relates file bytes to decoded bytes.

``--read-seconds`` caps each read phase (a reader stops after the micro-batch that crosses it
and its rate counts what it read; ``*_fraction`` says how much that was): an old reader can
spend minutes on scattered reads. ``--quick`` fits a 2-core machine in about 90 s.

The reader processes live in :mod:`r3rdma.bench.scale_readers`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, TypedDict

from r3rdma.bench.scale_readers import ReadPhases, open_index_ms, reader_worker
from r3rdma.bench.support import bar, emit, log, preset, run_phase, span_rate, stop_all, worker_context

__all__ = ["run_scale_bench", "add_arguments", "main", "QUICK", "FULL"]


class _Preset(TypedDict):
    """The sizes ``--quick`` and the full run set (each overridden by its own option)."""

    requests: int
    min_rows: int
    max_rows: int
    batch_mb: float
    readers: int
    read_seconds: float
    rounds: int


#: ``--quick``: the 2-core CPU machine, about 90 s. ``FULL``: a 16-core GPU host (~26 GB decoded).
QUICK: _Preset = {
    "requests": 16384,
    "min_rows": 8,
    "max_rows": 64,
    "batch_mb": 2.0,
    "readers": 8,
    "read_seconds": 5.0,
    "rounds": 2,
}
FULL: _Preset = {
    "requests": 16384,
    "min_rows": 500,
    "max_rows": 8000,
    "batch_mb": 8.0,
    "readers": 8,
    "read_seconds": 60.0,
    "rounds": 3,
}

_CURVE_POINTS = 128  # commit-time curves are binned to at most this many points in the JSON


def _growth(log: list[tuple[int, float]]) -> dict[str, float | None]:
    """First / last 10% means (the rollout's first commit left out) and their ratio (None where a
    first window's mean or median is 0)."""
    ms = [m for _, m in log[1:]] or [m for _, m in log]
    tenth = max(1, len(ms) // 10)
    first, last = statistics.fmean(ms[:tenth]), statistics.fmean(ms[-tenth:])
    # Medians of the same windows: one slow fsync among ten commits moves a mean, not these.
    first_med, last_med = statistics.median(ms[:tenth]), statistics.median(ms[-tenth:])
    return {
        "first": round(first, 3),
        "last": round(last, 3),
        "growth": round(last / first, 3) if first > 0 else None,
        "median": round(statistics.median(ms), 3),
        "growth_median": round(last_med / first_med, 3) if first_med > 0 else None,
    }


def _curve(log: list[tuple[int, float]]) -> list[list[float]]:
    """``[requests already stored, mean ms]`` over at most ``_CURVE_POINTS`` consecutive bins."""
    if not log:
        return []
    size = -(-len(log) // _CURVE_POINTS)
    return [[log[i][0], round(statistics.fmean(m for _, m in log[i : i + size]), 3)] for i in range(0, len(log), size)]


def _balanced(items: list[tuple[int, Any]], parts: int) -> list[list[Any]]:
    """Split (size, item) pairs into ``parts`` lists of similar total size (largest first)."""
    out: list[list[Any]] = [[] for _ in range(parts)]
    load = [0] * parts
    for size, item in sorted(items, key=lambda x: -x[0]):
        k = load.index(min(load))
        out[k].append(item)
        load[k] += size
    return out


def run_scale_bench(
    *,
    requests: int = FULL["requests"],
    min_rows: int = FULL["min_rows"],
    max_rows: int = FULL["max_rows"],
    layers: int = 48,
    top_k: int = 8,
    experts: int = 128,
    nodes: int = 2,
    replicas: int = 1,
    readers: int = FULL["readers"],
    batch_mb: float = FULL["batch_mb"],
    micro_batch: int = 16,
    read_seconds: float = FULL["read_seconds"],
    root: str | None = None,
    seed: int = 0,
    verify: bool = False,
    quick: bool = False,
    progress: bool = True,
    timeout: float = 900.0,
    http_workers: str = "auto",
    rounds: int = FULL["rounds"],
) -> dict[str, Any]:
    """Run every phase (module docstring); return the result dict (the JSON line).

    ``root`` keeps the nodes' data there (``<root>/node<i>``); by default a temporary
    directory is removed at the end. ``verify``: each reader returns the CRC-32C of every
    request it read, checked here against what was pushed (costs read time; for tests).
    ``read_seconds`` caps each read phase (0: no cap). ``http_workers``: the nodes'
    ``--http-workers`` (processes serving each node's HTTP port). ``rounds``: scattered and
    contiguous reads alternate this many times; rates are over all rounds."""
    from r3rdma.bench.synthetic import TiledRollout
    from r3rdma.store.process import new_token
    from r3rdma.testing.harness import spawn_nodes

    if readers < 1 or nodes < 1 or requests < readers or micro_batch < 1 or rounds < 1:
        raise ValueError(
            f"need readers >= 1, nodes >= 1, requests >= readers, micro_batch >= 1, rounds >= 1; got "
            f"{readers}, {nodes}, {requests}, {micro_batch}, {rounds}"
        )
    began = time.perf_counter()
    base = Path(root) if root else Path(tempfile.mkdtemp(prefix="r3rdma-bench-scale-"))
    base.mkdir(parents=True, exist_ok=True)
    rollout_id = "scale-0"
    token = new_token()
    node_procs: list = []
    workers: list = []
    result: dict[str, Any] = {"bench": "scale", "quick": quick, "cpu_count": os.cpu_count()}
    say = lambda message: log("scale", progress, message)  # noqa: E731
    try:
        say(f"starting {nodes} store nodes and {readers} reader processes")
        node_procs = spawn_nodes([base / f"node{i}" for i in range(nodes)], token, "--http-workers", str(http_workers))
        urls = [n.http_url for n in node_procs]
        ctx = worker_context()
        workers = [reader_worker(ctx, r, urls, node_procs[0].read_token) for r in range(readers)]  # start while we generate
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
        total_bytes = rollout.total_bytes
        for worker in workers:
            assert worker.recv(timeout)["event"] == "ready"
        phases_s = {"start": round(time.perf_counter() - began, 1)}
        say(f"{requests} requests, {int(rollout.lengths.sum())} rows, {total_bytes / 1e9:.3f} GB decoded")

        # 1. push through RoutingWriter -> StoreNodesClient -> nodes
        push_log, batches, push_s, (node_s, node_n) = _push(rollout, node_procs, token, replicas, batch_mb, progress)
        result["http_workers"] = node_procs[0].http_workers
        result.update(
            requests=requests,
            tokens=int(rollout.lengths.sum()),
            bytes=total_bytes,
            layers=layers,
            top_k=top_k,
            experts=experts,
            min_rows=min_rows,
            max_rows=max_rows,
            nodes=nodes,
            replicas=replicas,
            readers=readers,
            batch_mb=batch_mb,
            micro_batch=micro_batch,
        )
        push = _growth(push_log)
        result.update(
            commits=len(push_log),
            ingest_seconds=round(push_s, 3),
            ingest_gbps=round(total_bytes / push_s / 1e9, 4),
            push_ms_first=push["first"],
            push_ms_last=push["last"],
            push_growth=push["growth"],
            push_growth_median=push["growth_median"],
            push_ms_median=push["median"],
            node_ack_ms_mean=round(node_s / node_n * 1e3, 3) if node_n else None,
        )
        say(
            f"pushed in {push_s:.1f} s ({result['ingest_gbps']} GB/s), {len(push_log)} batches, "
            f"ack ms first {push['first']} last {push['last']}"
        )

        # 2. the same batches committed in-process, each commit timed
        mark = time.perf_counter()
        commit_log = _commit_inprocess(rollout, batches, base / "inproc", progress)
        commit = _growth(commit_log)
        phases_s["commit"] = round(time.perf_counter() - mark, 1)
        mark = time.perf_counter()
        result.update(
            commit_ms_first=commit["first"],
            commit_ms_last=commit["last"],
            commit_growth=commit["growth"],
            commit_growth_median=commit["growth_median"],
            commit_ms_median=commit["median"],
        )
        say(f"in-process commits: first {commit['first']} ms, last {commit['last']} ms, growth {commit['growth']}")

        # 3. a fresh reader opening the committed rollout
        result.update(open_index_ms(workers[0], rollout_id, requests, timeout))

        # 4. reads: scattered DP shares vs contiguous, D processes, then one alone
        from r3rdma.bench.rlstep_bench import contiguous_runs

        order = [rid for batch in batches for rid in batch]  # commit order
        assert sorted(order) == [rollout.request_id(i) for i in range(requests)]
        size = {rollout.request_id(i): rollout.nbytes(i) for i in range(requests)}
        D = readers

        def read_cmd(ids: list[str]) -> dict[str, Any]:
            return {
                "cmd": "read",
                "rollout": rollout_id,
                "seconds": read_seconds,
                "verify": verify,
                "batches": [ids[i : i + micro_batch] for i in range(0, len(ids), micro_batch)],
            }

        scattered = [order[r::D] for r in range(D)]
        contiguous = [order[r * requests // D : (r + 1) * requests // D] for r in range(D)]
        share0 = sum(size[rid] for rid in scattered[0])
        prefix = contiguous_runs(order, size, [share0, total_bytes - share0])[0]  # rank 0's bytes, consecutive
        # Scattered and contiguous alternate, round after round: a phase lasts a few seconds on a
        # GPU host, and one slow second of a shared host moved a single pair's ratio by 0.2.
        phases = [phase for _ in range(rounds) for phase in (("dp", workers, scattered), ("contiguous", workers, contiguous))]
        phases += [("single_scattered", workers[:1], [scattered[0]]), ("single_contiguous", workers[:1], [prefix])]
        verified = mismatched = 0
        reads = ReadPhases(node_procs, timeout)
        for name, group, assignment in phases:
            say(f"read phase {name}: {len(group)} process(es)")
            wanted = sum(size[rid] for ids in assignment for rid in ids)
            answers, (gbps, span, moved) = reads.run(name, group, [read_cmd(ids) for ids in assignment], wanted)
            result["reader_api"] = answers[0]["api"]
            if name in ("dp", "contiguous"):
                result[f"{name}_per_reader"] = [{"requests": a["requests"], "bytes": a["bytes"]} for a in answers]
            for answer in answers:
                for rid, crc in answer["crcs"].items():
                    verified += 1
                    mismatched += crc != rollout.record(int(rid[1:])).crc32c
            say(f"  {gbps:.3f} GB/s over {span:.2f} s ({moved / wanted:.0%} of {wanted / 1e9:.3f} GB)")
        for name, t in reads.totals.items():
            # Over all rounds of a phase: bytes over the summed spans, cores the nodes (their
            # read workers included) and the readers kept busy, readers' CPU per decoded GB.
            result[f"{name}_read_gbps" if name in ("dp", "contiguous") else f"{name}_gbps"] = round(reads.gbps(name), 4)
            result[f"{name}_seconds"] = round(t["span"], 3)
            result[f"{name}_fraction"] = round(t["moved"] / t["wanted"], 4)
            result[f"{name}_node_cores"] = round(t["node_cpu"] / max(t["wall"], 1e-9), 2)
            result[f"{name}_reader_cores"] = round(t["reader_cpu"] / max(t["span"], 1e-9), 2)
            result[f"{name}_reader_cpu_s_per_gb"] = round(t["reader_cpu"] / max(t["moved"] / 1e9, 1e-9), 3)
        result["read_rounds"] = rounds
        rates = [reads.totals[n]["rates"] for n in ("dp", "contiguous")]
        result["dp_ratio_per_round"] = [round(d / c, 3) for d, c in zip(*rates)]
        result["dp_ratio"] = round(result["dp_read_gbps"] / result["contiguous_read_gbps"], 3)
        result["single_ratio"] = round(result["single_scattered_gbps"] / result["single_contiguous_gbps"], 3)
        result["single_bytes"] = share0
        if verify:
            result.update(verified_requests=verified, verify_mismatches=mismatched)

        phases_s["reads"] = round(time.perf_counter() - mark, 1)
        mark = time.perf_counter()

        # 5. plain GETs of every file of the rollout, D processes
        files: list[tuple[int, tuple[str, str]]] = []
        warm: dict[str, str] = {}
        for node in node_procs:
            for path in (node.root / rollout_id).rglob("*"):
                if path.is_file() and not path.name.startswith("."):
                    files.append((path.stat().st_size, (node.http_url, str(path.relative_to(node.root)))))
            warm[node.http_url] = "zarr.json"  # the root's group document: connects without touching the rollout
        stored = sum(s for s, _ in files)
        say(f"raw GET: {len(files)} files, {stored / 1e9:.3f} GB")
        answers = run_phase(
            workers,
            [{"cmd": "raw", "files": share, "warm": warm, "seconds": read_seconds} for share in _balanced(files, D)],
            timeout,
        )
        gbps, span, moved = span_rate(answers)
        result.update(
            raw_get_gbps=round(gbps, 4),
            raw_get_seconds=round(span, 3),
            raw_get_fraction=round(moved / stored, 4),
            raw_get_files=len(files),
            stored_bytes=stored,
            dp_vs_raw=round(result["dp_read_gbps"] * stored / total_bytes / gbps, 3),
        )
        phases_s["raw_get"] = round(time.perf_counter() - mark, 1)
        phases_s["push"] = round(push_s, 1)
        result["phase_seconds"] = phases_s
        result["commit_curve"] = _curve(commit_log)
        result["push_curve"] = _curve(push_log)
        result["seconds"] = round(time.perf_counter() - began, 1)
        result["root"] = str(base) if root else None
        result["seed"] = seed
        return result
    finally:
        mark = time.perf_counter()
        stop_all(workers, node_procs, base if root is None else None)
        say(f"stopped in {time.perf_counter() - mark:.1f} s")


def _push(rollout, node_procs, token: str, replicas: int, batch_mb: float, progress: bool):
    """The rollout through one RoutingWriter -> StoreNodesClient: each batch's ``(requests
    already pushed, ack ms)``, the batches' request ids in ack order, the seconds from first
    submit to flushed, and the nodes' own commit ``(seconds, batches)`` over the push."""
    from r3rdma.bench.support import TimedCommits, node_samples, warm_connections
    from r3rdma.write import RoutingWriter, StoreNodesClient

    def node_commits() -> tuple[float, float]:
        samples = [node_samples(n) for n in node_procs]
        seconds, count = (sum(s.get(f"r3rdma_store_commit_seconds_{k}", 0.0) for s in samples) for k in ("sum", "count"))
        return seconds, count

    client = StoreNodesClient([n.push_url for n in node_procs], secret=token, replicas=replicas)
    try:
        warm_connections(client, rollout, "scale-warm", "")
        before = node_commits()
        timed = TimedCommits(client)
        batch_bytes = max(1, int(batch_mb * (1 << 20)))
        writer = RoutingWriter(timed, flush_bytes=batch_bytes, max_inflight_bytes=max(8 * batch_bytes, 512 << 20))
        with bar(progress, len(rollout), "push") as shown:
            t0 = time.perf_counter()
            for i in range(len(rollout)):
                writer.submit(rollout.record(i))
                if i % 256 == 255:
                    shown.update(256)
            writer.flush()
            seconds = time.perf_counter() - t0
        writer.close()
        after = node_commits()
    finally:
        client.close()
    log_ms, stored = [], 0
    for started, acked, ids in timed.log:
        log_ms.append((stored, (acked - started) * 1e3))
        stored += len(ids)
    return log_ms, [ids for _, _, ids in timed.log], seconds, (after[0] - before[0], after[1] - before[1])


def _commit_inprocess(rollout, batches: list[list[str]], path: Path, progress: bool) -> list[tuple[int, float]]:
    from r3rdma.store.local_store import LocalRoutingStore

    log_ms: list[tuple[int, float]] = []
    stored = 0
    try:
        with LocalRoutingStore(path) as store, bar(progress, len(rollout), "commit") as shown:
            for batch in batches:
                records = [rollout.record(int(rid[1:])) for rid in batch]  # CRCs computed outside the clock
                t0 = time.perf_counter()
                store.commit(records)
                log_ms.append((stored, (time.perf_counter() - t0) * 1e3))
                stored += len(records)
                shown.update(len(records))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return log_ms


# -- command line ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``r3rdma bench scale``: the preset, the rollout's shape, nodes and replicas, readers."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"2-core CPU machine, ~90 s: {QUICK['requests']} requests of {QUICK['min_rows']}-{QUICK['max_rows']} "
        f"rows, {QUICK['batch_mb']} MB batches, reads capped at {QUICK['read_seconds']} s a phase",
    )
    parser.add_argument("--requests", type=int, default=None, help=f"default {FULL['requests']}")
    parser.add_argument("--min-rows", type=int, default=None, help=f"default {FULL['min_rows']}")
    parser.add_argument(
        "--max-rows", type=int, default=None, help=f"default {FULL['max_rows']} (~26 GB decoded at 16384 requests)"
    )
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=1, help="nodes holding each request (1: the nodes share the rollout)")
    parser.add_argument("--readers", type=int, default=None, help=f"trainer (DP) reader processes, default {FULL['readers']}")
    parser.add_argument("--batch-mb", type=float, default=None, help=f"writer batch size, default {FULL['batch_mb']}")
    parser.add_argument("--micro-batch", type=int, default=16, help="requests per get_packed (or prefetch step)")
    parser.add_argument(
        "--read-seconds",
        type=float,
        default=None,
        help=f"cap of each read phase, 0: none (default {FULL['read_seconds']}, --quick {QUICK['read_seconds']})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"scattered and contiguous reads alternate this many times (default {FULL['rounds']}, --quick {QUICK['rounds']})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--http-workers",
        default="auto",
        help="each node's --http-workers (processes serving its HTTP port; auto: a quarter of the cores)",
    )
    parser.add_argument("--verify", action="store_true", help="check every request read against what was pushed (slower reads)")
    parser.add_argument("--root", default=None, help="keep the nodes' data here (default: a temporary directory, removed)")
    parser.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    parser.add_argument("--png", default=None, help="plot commit ms vs rollout size and the read rates to this PNG")
    parser.add_argument("--label", default=None, help="machine label of the plot")


def main(args: argparse.Namespace) -> int:
    """``r3rdma bench scale``: run the preset with the options given, print the JSON line."""
    result = run_scale_bench(
        **preset(args, QUICK, FULL),
        layers=args.layers,
        top_k=args.top_k,
        experts=args.experts,
        nodes=args.nodes,
        replicas=args.replicas,
        micro_batch=args.micro_batch,
        root=args.root,
        seed=args.seed,
        verify=args.verify,
        quick=args.quick,
        http_workers=args.http_workers,
    )
    if args.png:
        from r3rdma.bench.plots import plot_scale

        label = args.label or f"{os.cpu_count()} cores, {'--quick' if args.quick else 'full'}"
        result["png"] = plot_scale(result, Path(args.png), label)
    return emit(result, args.json_out)
