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

import asyncio
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["run_scaling_bench", "add_arguments", "main"]


def _client_records(client: int, total_bytes: int, seed: int):
    from r3rdma.records import RequestRecord
    from r3rdma.bench.synthetic import synthetic_records

    # Gumbel sampling of big arrays is slow: draw a small pool once and reuse its rows under new ids.
    pool = synthetic_records(4, min_rows=1024, max_rows=2048, seed=seed)
    records, size, i = [], 0, 0
    while size < total_bytes:
        base = pool[i % len(pool)]
        records.append(RequestRecord(f"scale-c{client}", f"r{i:06d}", base.ids_TLK, base.layer_map, base.num_experts))
        size += base.nbytes
        i += 1
    return records


async def _client_main(address: str, token_file: str, client: int, total_bytes: int, batch_bytes: int) -> None:
    from r3rdma.transport import TransportLimits, UcxxClient, load_secret
    from r3rdma.records import batches_by_size
    from r3rdma.write.push_client import parse_node_url

    host, port = parse_node_url(address)
    records = _client_records(client, total_bytes, seed=client)
    warm = _client_records(client, 1, seed=client)[:1]
    warm = [type(warm[0])(f"scale-warm-c{client}", "w0", warm[0].ids_TLK, warm[0].layer_map, warm[0].num_experts)]
    limits = TransportLimits(max_payload_bytes=256 << 20, timeout_s=300)
    async with UcxxClient(host, port, secret=load_secret(token_file), limits=limits) as ucx:
        await ucx.push(warm)
        print(json.dumps({"event": "ready"}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        start = time.time()
        for batch in batches_by_size(records, batch_bytes, 10_000):
            await ucx.push(batch)
        end = time.time()
    print(json.dumps({"event": "done", "start": start, "end": end, "bytes": sum(r.nbytes for r in records),
                      "requests": len(records)}), flush=True)


def _read_json_line(proc: subprocess.Popen, timeout: float, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"{what}: no answer in {timeout} s")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{what} exited with {proc.wait()}")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue


def _run_n(n: int, base: Path, token_file: Path, total_bytes: int, batch_bytes: int, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    nodes: list[subprocess.Popen] = []
    clients: list[subprocess.Popen] = []
    try:
        addresses = []
        for i in range(n):
            root = base / f"n{n}" / f"node{i}"
            proc = subprocess.Popen([sys.executable, "-m", "r3rdma.store.cli", "--root", str(root), "--token-file", str(token_file)],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True, env=env)
            nodes.append(proc)
        for i, proc in enumerate(nodes):
            info = _read_json_line(proc, timeout, f"store node {i}")
            addresses.append(f"{info['host']}:{info['ucx_port']}")
        for i, address in enumerate(addresses):
            clients.append(subprocess.Popen(
                [sys.executable, "-m", "r3rdma.bench.scaling_bench", "--client", address, str(token_file), str(i),
                 str(total_bytes), str(batch_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
        for i, proc in enumerate(clients):
            _read_json_line(proc, timeout, f"client {i}")
        for proc in clients:  # all start together
            proc.stdin.write("go\n")
            proc.stdin.flush()
        done = [_read_json_line(proc, timeout, f"client {i}") for i, proc in enumerate(clients)]
    finally:
        for proc in clients:
            if proc.poll() is None:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for proc in nodes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in nodes:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(base / f"n{n}", ignore_errors=True)
    span = max(d["end"] for d in done) - min(d["start"] for d in done)
    total = sum(d["bytes"] for d in done)
    per_client = [round(d["bytes"] / (d["end"] - d["start"]) / 1e9, 4) for d in done]
    return {"nodes": n, "bytes": total, "seconds": round(span, 3), "aggregate_gbps": round(total / span / 1e9, 4),
            "per_client_gbps": per_client}


def run_scaling_bench(*, nodes: Sequence[int] = (1, 2, 4), mb_per_client: float = 48, batch_mb: float = 8,
                      rounds: int = 1, root: str | None = None, timeout: float = 300, progress: bool = True) -> dict[str, Any]:
    from tqdm.auto import tqdm

    base = Path(root or tempfile.mkdtemp(prefix="r3rdma-bench-scaling-"))
    base.mkdir(parents=True, exist_ok=True)
    token_file = base / "token"
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o600)
    total_bytes = int(mb_per_client * (1 << 20))
    batch_bytes = int(batch_mb * (1 << 20))
    runs: dict[int, list[dict[str, Any]]] = {}
    order = [n for _ in range(rounds) for n in nodes]  # interleave rounds so drift hits every N alike
    try:
        for n in tqdm(order, desc="scaling", disable=not (progress and sys.stderr.isatty()), file=sys.stderr):
            runs.setdefault(n, []).append(_run_n(n, base, token_file, total_bytes, batch_bytes, timeout))
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
    print(json.dumps(run_scaling_bench(nodes=args.nodes, mb_per_client=args.mb_per_client, batch_mb=args.batch_mb,
                                       rounds=args.rounds, root=args.root)))
    return 0


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "--client":
    asyncio.run(_client_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])))
