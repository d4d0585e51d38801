"""`r3rdma bench transport`: r3rdma push throughput vs a raw ucxx send of the same bytes.

A server process (``python -m r3rdma.bench.transport_bench --serve``) listens with both a
:class:`UcxxServer` whose handler accepts and discards batches, and a raw ucxx sink. The client
process alternates rounds: ``UcxxClient.push`` of a batch of records of a given total size
(header, auth'd connection, per-request validation and CRC-32C check on the server, ack), and
``raw_push`` of a payload of the same size (one send + 8-byte ack). Same two processes, same
path, same bytes. Throughputs are medians over rounds; "ratio" is the median of per-round
ratios (a round's push and raw run back to back); the last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import select
import statistics
import subprocess
import sys

import numpy as np

from r3rdma.bench.common import run_from_args

__all__ = ["run_transport_bench", "add_arguments", "main"]


def records_of_size(total: int, *, seed: int, rollout_id: str = "bench"):
    """Requests of ~1-4k rows x 48 layers x 8 (Qwen3-30B geometry, uint8) adding up to ``total``
    bytes (the last one cut): rows of a small pool of synthetic requests reused under new ids,
    since sampling big arrays is slow."""
    from r3rdma.bench.synthetic import synthetic_records
    from r3rdma.records import RequestRecord

    records: list[RequestRecord] = []
    size = 0
    pool = synthetic_records(8, min_rows=1024, max_rows=4096, seed=seed)
    while size < total:
        base = pool[len(records) % len(pool)]
        rows = min(base.num_rows, max(1, (total - size) // (base.nbytes // base.num_rows)))
        records.append(RequestRecord(rollout_id, f"r{len(records)}", base.ids_TLK[:rows], base.layer_map, base.num_experts))
        size += records[-1].nbytes
    return records


async def _serve(secret: str) -> None:
    from r3rdma.transport import TransportLimits, UcxxServer, configure_ucx_env
    from r3rdma.transport.ucx_env import STORE_NODE_UCX_ENV

    configure_ucx_env(STORE_NODE_UCX_ENV)  # progress UCX as a store node does (both sinks)
    from r3rdma.transport.raw_baseline import RawSinkServer

    async def discard(_records) -> None:
        return None

    limits = TransportLimits(max_payload_bytes=1 << 30, timeout_s=120)
    server = UcxxServer(discard, secret=secret, limits=limits)
    address = await server.start()
    raw = RawSinkServer(max_bytes=1 << 30, timeout_s=120)
    raw_port = await raw.start()
    print(json.dumps({"push_port": address.port, "raw_port": raw_port}), flush=True)
    # Run until the parent closes our stdin.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await raw.stop()
    await server.stop(drain=False)


async def _client(
    push_port: int,
    raw_port: int,
    secret: str,
    sizes: list[int],
    rounds: int,
    iterations: int,
    bytes_per_round: int,
    progress: bool,
):
    from r3rdma.transport import TransportLimits, UcxxClient
    from r3rdma.transport.raw_baseline import raw_push

    limits = TransportLimits(max_payload_bytes=1 << 30, timeout_s=120)
    results = []
    async with UcxxClient("127.0.0.1", push_port, secret=secret, limits=limits) as client:
        for size in sizes:
            records = records_of_size(size, seed=size)
            nbytes = sum(r.nbytes for r in records)
            payload = np.concatenate([r.ids_TLK.reshape(-1) for r in records])
            push_s, raw_s = [], []
            for _ in range(2):  # warm-up both paths
                await client.push(records)
            # Rounds of a few pushes of 1 MiB last milliseconds and measured scheduler noise:
            # each round moves at least bytes_per_round (default 64 MiB) on each path.
            pushes = max(iterations, -(-bytes_per_round // nbytes))
            for _ in range(rounds):
                t0 = asyncio.get_running_loop().time()
                for _ in range(pushes):
                    await client.push(records)
                push_s.append(asyncio.get_running_loop().time() - t0)
                raw = await raw_push("127.0.0.1", raw_port, payload, pushes, warmup=1)
                raw_s.append(raw.seconds)
            push = nbytes * pushes / statistics.median(push_s) / 1e9
            rawg = nbytes * pushes / statistics.median(raw_s) / 1e9
            # Each round's push and raw timings are adjacent in time: their ratio cancels the
            # machine's drifts (on the 2-core VM the raw path alone is bimodal: BENCHMARKS.md);
            # the headline is the median of those per-round ratios.
            ratios = sorted(r / p for p, r in zip(push_s, raw_s))
            row = {
                "bytes": nbytes,
                "requests": len(records),
                "pushes_per_round": pushes,
                "push_gbps": round(push, 4),
                "raw_ucxx_gbps": round(rawg, 4),
                "ratio": round(statistics.median(ratios), 3),
                "ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)],
            }
            if progress:
                print(json.dumps(row), file=sys.stderr, flush=True)
            results.append(row)
    return results


def run_transport_bench(
    *, sizes_mb=(1, 8, 64), rounds: int = 5, iterations: int = 4, mb_per_round: float = 64, progress: bool = True
) -> dict:
    """Start the server process, then per size in ``sizes_mb`` (MiB): ``rounds`` rounds of pushes and
    raw sends of the same bytes (at least ``iterations`` and ``mb_per_round`` MiB each); return GB/s
    of both and their ratio per size, the last size headlined. Raises TimeoutError if the server
    does not start in 120 s."""
    secret = secrets.token_hex(32)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    server = subprocess.Popen(
        [sys.executable, "-m", "r3rdma.bench.transport_bench", "--serve", secret],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    stdin, stdout = server.stdin, server.stdout
    if stdin is None or stdout is None:  # both are pipes (PIPE above)
        raise RuntimeError("bench server started without its stdin / stdout pipes")
    try:
        ready, _, _ = select.select([stdout], [], [], 120)
        if not ready:
            raise TimeoutError("bench server did not start in 120 s")
        ports = json.loads(stdout.readline())
        sizes = [int(mb * (1 << 20)) for mb in sizes_mb]
        rows = asyncio.run(
            _client(
                ports["push_port"], ports["raw_port"], secret, sizes, rounds, iterations, int(mb_per_round * (1 << 20)), progress
            )
        )
    finally:
        stdin.close()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    main_row = rows[-1]  # the largest message: MB-sized batches are how pushes are made
    return {
        "bench": "transport",
        "path": "ucxx tcp loopback, host memory, 2 processes",
        "push_gbps": main_row["push_gbps"],
        "raw_ucxx_gbps": main_row["raw_ucxx_gbps"],
        "ratio": main_row["ratio"],
        "message_bytes": main_row["bytes"],
        "by_size": rows,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``r3rdma bench transport``: batch sizes, rounds, pushes and MiB per round."""
    parser.add_argument(
        "--sizes-mb", type=float, nargs="+", default=[1, 8, 64], help="batch sizes to measure; the last is headlined"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=4, help="pushes per round, at least")
    parser.add_argument("--mb-per-round", type=float, default=64, help="each round pushes at least this much per path")


def main(args: argparse.Namespace) -> int:
    """``r3rdma bench transport``: run, print the result as the last JSON line."""
    return run_from_args(run_transport_bench, args)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--serve":
    from r3rdma.transport.ucx_env import stop_ucxx

    try:
        asyncio.run(_serve(sys.argv[2]))
    finally:
        stop_ucxx()
