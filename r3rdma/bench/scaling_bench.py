"""`r3rdma bench scaling`: N store nodes on one machine ingesting concurrently vs N x one node.

For each N (default 1, 2, 4) the bench starts N store-node processes (``r3rdma.store.cli``,
as ``scripts/start_store_nodes.sh`` does) and one pushing client process per node. Every
client prepares its records (synthetic Qwen3-30B-A3B-shaped routing, its own rollout),
connects and warms up, then all start on one signal and push ``--mb-per-client`` MB in
~8 MB batches (each acked only once durable: Zarr write + fsync + index). Aggregate
throughput is all bytes over the span from the first start to the last finish. The yardstick
is the N = 1 run of the same invocation: ``ratio = aggregate(N) / (N x aggregate(1))``; 1.0
is perfect scaling. Every process shares this machine's cores and disk, so on a small
machine the ratio shows the CPU (or disk) limit, not the store's. The last line is JSON.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from r3rdma.bench.support import Worker, emit, run_phase, serve, stop_all, wait_go, worker_context

__all__ = ["run_scaling_bench", "add_arguments", "main"]


def _client_main(conn, push_url: str, token: str, client: int, total_bytes: int, batch_bytes: int) -> None:
    """A pushing client: its records made and its connection up (one warm-up push), then on
    ``go`` every batch pushed, each acknowledged once durable, before the next."""
    os.dup2(2, 1)  # the parent's stdout ends with its JSON line
    from r3rdma.bench.support import records_of_size
    from r3rdma.records import batches_by_size
    from r3rdma.write import StoreNodesClient

    records = records_of_size(total_bytes, seed=client, rollout_id=f"scale-c{client}")
    nodes = StoreNodesClient([push_url], secret=token)

    def push(_cmd) -> None:
        nodes.commit(records_of_size(1, seed=client, rollout_id=f"scale-warm-c{client}"))
        wait_go(conn)
        start = time.time()
        for batch in batches_by_size(records, batch_bytes, 10_000):
            nodes.commit(batch)
        conn.send({"event": "done", "start": start, "end": time.time(), "bytes": sum(r.nbytes for r in records),
                   "requests": len(records)})

    conn.send({"event": "ready"})
    try:
        serve(conn, {"push": push})
    finally:
        nodes.close()


def _run_n(n: int, base: Path, token: str, total_bytes: int, batch_bytes: int, timeout: float) -> dict[str, Any]:
    from r3rdma.testing.harness import spawn_nodes

    nodes, clients = [], []
    try:
        nodes = spawn_nodes([base / f"n{n}" / f"node{i}" for i in range(n)], token)
        ctx = worker_context()
        clients = [Worker(ctx, i, _client_main, (node.push_url, token, i, total_bytes, batch_bytes),
                          f"r3rdma-scaling-client-{i}") for i, node in enumerate(nodes)]
        for client in clients:
            assert client.recv(timeout)["event"] == "ready"
        done = run_phase(clients, [{"cmd": "push"}] * n, timeout)  # all start together
    finally:
        stop_all(clients, nodes, base / f"n{n}")
    span = max(d["end"] for d in done) - min(d["start"] for d in done)
    total = sum(d["bytes"] for d in done)
    per_client = [round(d["bytes"] / (d["end"] - d["start"]) / 1e9, 4) for d in done]
    return {"nodes": n, "bytes": total, "seconds": round(span, 3), "aggregate_gbps": round(total / span / 1e9, 4),
            "per_client_gbps": per_client}


def run_scaling_bench(*, nodes: Sequence[int] = (1, 2, 4), mb_per_client: float = 48, batch_mb: float = 8,
                      rounds: int = 1, root: str | None = None, timeout: float = 300, progress: bool = True) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from r3rdma.store.process import new_token

    base = Path(root or tempfile.mkdtemp(prefix="r3rdma-bench-scaling-"))
    base.mkdir(parents=True, exist_ok=True)
    token = new_token()
    total_bytes = int(mb_per_client * (1 << 20))
    batch_bytes = int(batch_mb * (1 << 20))
    runs: dict[int, list[dict[str, Any]]] = {}
    order = [n for _ in range(rounds) for n in nodes]  # interleave rounds so drift hits every N alike
    try:
        for n in tqdm(order, desc="scaling", disable=not (progress and sys.stderr.isatty()), file=sys.stderr):
            runs.setdefault(n, []).append(_run_n(n, base, token, total_bytes, batch_bytes, timeout))
    finally:
        if root is None:
            shutil.rmtree(base, ignore_errors=True)
    rows = []
    for n in nodes:
        best = sorted(runs[n], key=lambda r: r["aggregate_gbps"])[len(runs[n]) // 2]  # median round
        rows.append(best)
    single = rows[nodes.index(1)]["aggregate_gbps"] if 1 in nodes else rows[0]["aggregate_gbps"] / nodes[0]
    for row in rows:
        row["ideal_gbps"] = round(row["nodes"] * single, 4)
        row["ratio"] = round(row["aggregate_gbps"] / (row["nodes"] * single), 3)
    return {"bench": "scaling", "path": "ucxx tcp loopback -> store node (zarr + fsync), one client process per node",
            "cpu_count": os.cpu_count(), "mb_per_client": mb_per_client, "batch_mb": batch_mb, "rounds": rounds,
            "single_node_gbps": single, "by_nodes": rows, "ratio": rows[-1]["ratio"]}


def add_arguments(parser) -> None:
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4], help="node counts to run (include 1: the yardstick)")
    parser.add_argument("--mb-per-client", type=float, default=48)
    parser.add_argument("--batch-mb", type=float, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--root", default=None, help="scratch directory (default: temporary)")


def main(args) -> int:
    return emit(run_scaling_bench(nodes=args.nodes, mb_per_client=args.mb_per_client, batch_mb=args.batch_mb,
                                  rounds=args.rounds, root=args.root))
