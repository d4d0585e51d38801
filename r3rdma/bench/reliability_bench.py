"""``r3rdma bench reliability``: crash, fuzz, auth, disk-full and load figures, one JSON line last.

Each part runs real store nodes (``r3rdma-store`` subprocesses) on loopback and checks its own
invariant; the tests (tests/test_reliability*.py, tests/test_fuzz*.py) call the same functions
with smaller sizes. docs/RELIABILITY.md states what is guaranteed and how each part tests it.

This module is the driver (options, the run, the JSON); the scenarios live beside it, one
module per group, each saying what its scenarios check: :mod:`~r3rdma.testing.crash` (crash
cycles under SIGKILL, disk full, load), :mod:`~r3rdma.testing.fuzz` (protocol and HTTP
fuzzers), :mod:`~r3rdma.testing.failover` (a replica's node lost, bad records, multi-turn,
restarts on the same ports, stalled senders, replicas ingest; ``--quick``: smaller sizes), over
:mod:`~r3rdma.testing.harness` (records, checks).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from r3rdma.bench.common import emit
from r3rdma.store.process import new_token, spawn_node
from r3rdma.testing.crash import crash_cycles, disk_full, load
from r3rdma.testing.failover import failover_figures
from r3rdma.testing.fuzz import fuzz_http, fuzz_node, gen_frame
from r3rdma.testing.harness import token_leaks

__all__ = ["add_arguments", "main"]


# -- CLI -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``r3rdma bench reliability``: crash cycles, fuzz sizes, load clients and seconds, seed."""
    parser.add_argument("--kill-cycles", type=int, default=20)
    parser.add_argument("--crash-clients", type=int, default=6)
    parser.add_argument("--frames", type=int, default=10000, help="protocol messages to fuzz")
    parser.add_argument("--http-requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=32, help="load: concurrent pushing clients")
    parser.add_argument("--duration-s", type=float, default=60.0, help="load: seconds")
    parser.add_argument("--inflight-mb", type=int, default=64, help="load: each node's --max-inflight-mb")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller sizes for the failover parts (replicas, bad records, multi-turn, restart, "
        "stalled senders, replicas ingest ratio): under a minute; the other parts take "
        "their own options above",
    )


def main(args: argparse.Namespace) -> int:
    """``r3rdma bench reliability``: every part in turn on loopback nodes in a scratch directory;
    progress on stderr, the figures as the last JSON line."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="r3-reliability-", dir=args.workdir) as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        crash = crash_cycles(work / "crash", args.kill_cycles, clients=args.crash_clients, seed=args.seed, log=log)
        log(f"crash: {crash}")
        node = spawn_node(work / "fuzz" / "root", new_token(), "--max-payload-mb", "8", "--timeout-s", "1")
        try:
            rng = random.Random(args.seed)
            frames = [gen_frame(rng, i) for i in range(args.frames)]
            fz = fuzz_node(node, frames)
            log(f"fuzz: {fz.frames} frames, outcomes {fz.outcomes}")
            http = fuzz_http(node, args.http_requests, seed=args.seed)
            leaks = token_leaks(node)
        finally:
            node.kill()
        full = disk_full(work / "disk")
        log(f"disk full: {full}")
        ld = load(work / "load", clients=args.clients, duration_s=args.duration_s, inflight_mb=args.inflight_mb, seed=args.seed)
        log(f"load: {ld}")
        failover = failover_figures(work / "failover", quick=args.quick, seed=args.seed, log=log)
    result = {
        "bench": "reliability",
        "kill_cycles": crash["kill_cycles"],
        "acked_before_kills": crash["acked_total"],
        "unacked_retried": crash["unacked_retried"],
        "acknowledged_lost": crash["acked_lost"] + ld["acked_lost"],
        "partial_or_corrupt_visible": sum(crash[k] + ld.get(k, 0) for k in ("phantom", "corrupt", "pending_visible")),
        "frames_fuzzed": fz.frames,
        "fuzz_untyped_replies": len(fz.untyped),
        "fuzz_hangs": fz.hangs,
        "fuzz_legit_pushes": fz.legit_pushes,
        "fuzz_legit_failures": len(fz.legit_failures),
        "fuzz_node_rss_growth_mb": round((fz.rss_max - fz.rss_start) / 2**20, 1),
        "http_requests_fuzzed": http["requests"],
        "http_failures": len(http["failures"]),
        "crashes": int(fz.node_crashed) + int(http["node_crashed"]),
        "token_leaks": len(leaks),
        "disk_full_clear_error": bool(full.get("error")) and not full["big_visible"] and full["orphans"] == 0,
        "disk_full_recovered": bool(full.get("intact_after_restart")),
        "clients": ld["clients"],
        "load_seconds": ld["seconds"],
        "throughput_mb_s": ld["throughput_mb_s"],
        "requests_per_s": ld["requests_per_s"],
        "ack_p50_ms": ld["ack_p50_ms"],
        "ack_p99_ms": ld["ack_p99_ms"],
        "load_push_failures": ld["push_failure_count"],
        "inflight_budget_mb": ld["inflight_budget_mb"],
        "node_rss_growth_mb": ld["node_rss_growth_mb"],
        **failover,
        "total_seconds": round(time.perf_counter() - t0, 1),
    }
    return emit(result)
