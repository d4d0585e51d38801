"""`r3rdma bench groups`: GRPO groups stored with shared prefixes (the prompt rows once) vs
every sample whole, the same rows through the real write path (a ``RoutingWriter`` over a
``StoreNodesClient``, store-node processes, ``--replicas`` copies), same run. Reported per
layout: ``stored_vs_ideal`` (distinct rows the index points at over the rows that exist, P +
the samples' own rows per group), disk bytes, ingest seconds and reads of whole groups (one
``get_packed`` each, us per returned row), checked equal between the layouts."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from r3rdma.bench.common import add_options, log, run_from_args, scratch_dir, stop_all, tree_bytes
from r3rdma.bench.synthetic import routing_pool
from r3rdma.records import RequestRecord, SharedPrefix

__all__ = ["run_group_bench", "plan_groups", "rows_stored"]


def plan_groups(groups: int, *, n: int, median_prompt: int, median_answer: int, seed: int) -> list[tuple[int, list[int]]]:
    """Per group: (prompt rows P, each sample's own rows). A sample of ``P + G`` tokens has
    ``P + G - 1`` rows: ``P`` computed by the prefill, ``G - 1`` by its decode steps."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(median_prompt), 0.8, groups), 16, 8 * median_prompt).astype(int)
    answers = np.clip(rng.lognormal(np.log(median_answer), 0.8, (groups, n)), 2, 8 * median_answer).astype(int)
    return [(int(p), [int(g) - 1 for g in row]) for p, row in zip(prompts, answers)]


def _records(rollout: str, plan, pool: np.ndarray, shared: bool) -> list[RequestRecord]:
    """Every sample's record in finish order (a group's first sample first); the same rows for
    both layouts (drawn from ``pool`` by a running offset)."""
    out, at = [], 0
    for gi, (p, own) in enumerate(plan):
        start = at % (len(pool) - p)
        prompt, at = pool[start : start + p], at + p
        for si, g in enumerate(own):
            start = (at + 7 * si) % (len(pool) - g)
            rows = pool[start : start + g]
            rid = f"g{gi}-{si}"
            if si == 0 or not shared:
                out.append(RequestRecord(rollout, rid, np.concatenate([prompt, rows]), tuple(range(pool.shape[1])), 128))
            else:
                ref = SharedPrefix(f"g{gi}-0", p, ids_TLK=prompt)  # the group's first sample
                out.append(RequestRecord(rollout, rid, rows, tuple(range(pool.shape[1])), 128, start_row=p, shared_prefix=ref))
    return out


def rows_stored(path: Path) -> int:
    """Distinct rows the rollout at ``path`` stores: the rows its index's segments point at, each
    row of an array once however many segments cover it, read from the index parts' attributes
    as any Zarr reader would (docs/FORMAT.md), not through r3rdma's reader."""
    import zarr

    group = zarr.open_group(path, mode="r")
    covered: dict[str, set[int]] = {}
    parts: Any = group.attrs["r3rdma"]
    for part in range(1, int(parts["parts"]) + 1):
        index: Any = group[f"i{part:08d}"].attrs["r3rdma"]
        for entry in index["requests"].values():
            for s in entry["segments"]:
                covered.setdefault(s["array"], set()).update(range(s["offset"], s["offset"] + s["rows"]))
    return sum(len(rows) for rows in covered.values())


def run_group_bench(
    *, groups=64, n=8, median_prompt=1000, median_answer=300, layers=48, nodes=2, replicas=2, seed=0, progress=True
) -> dict:
    """Both layouts of one GRPO-shaped rollout through store nodes; the figures above (top-8 of
    128 experts, uint8)."""
    from r3rdma import RoutingReader
    from r3rdma.store.process import new_token
    from r3rdma.testing.harness import spawn_nodes
    from r3rdma.write import RoutingWriter, StoreNodesClient

    plan = plan_groups(groups, n=n, median_prompt=median_prompt, median_answer=median_answer, seed=seed)
    pool = routing_pool(1 << 16, num_layers=layers, top_k=8, seed=seed)
    ideal_rows = sum(p + sum(own) for p, own in plan)
    base = scratch_dir("r3rdma-bench-groups-")
    token = new_token()
    procs = spawn_nodes([base / f"node{i}" for i in range(nodes)], token)
    result: dict = {"bench": "groups", "groups": groups, "n": n, "ideal_rows": ideal_rows, "replicas": replicas}
    try:
        reads: dict[str, list] = {}
        for layout in ("whole", "shared"):
            records = _records(layout, plan, pool, shared=layout == "shared")
            sent = sum(r.num_rows for r in records)
            log("groups", progress, f"{layout}: {len(records)} samples, {sent * pool[0].nbytes / 1e9:.2f} GB of rows sent")
            t0 = time.perf_counter()
            with StoreNodesClient([p.push_url for p in procs], secret=token, replicas=replicas) as client:
                with RoutingWriter(client) as writer:
                    for r in records:
                        writer.submit(r)
                    writer.flush()
                    failed = writer.requests_failed
            ingest = time.perf_counter() - t0
            disk = sum(tree_bytes(p.root / layout) for p in procs) / replicas
            stored = sum(rows_stored(p.root / layout) for p in procs) / replicas
            with RoutingReader([p.http_url for p in procs], token=procs[0].read_token, progress=False) as reader:
                us, got = [], []
                for gi, (_, own) in enumerate(plan):
                    ids = [f"g{gi}-{si}" for si in range(len(own))]
                    t0 = time.perf_counter()
                    packed = reader.get_packed(layout, ids)
                    us.append(1e6 * (time.perf_counter() - t0) / max(1, packed.ids_TLK.shape[0]))
                    got.append((packed.ids_TLK.numpy(), packed.cu_seqlens.tolist()))
            reads[layout] = got
            result[layout] = {
                "rows_sent": sent,
                "rows_stored_per_replica": stored,
                "stored_vs_ideal": round(stored / ideal_rows, 3),
                "disk_bytes_per_replica": int(disk),
                "ingest_s": round(ingest, 3),
                "read_us_per_row": round(statistics.median(us), 3),
                "failed": failed,
            }
        mismatched = sum(not (np.array_equal(a[0], b[0]) and a[1] == b[1]) for a, b in zip(reads["whole"], reads["shared"]))
        if mismatched:
            raise AssertionError(f"{mismatched} groups read differently from the shared layout than from the whole one")
    finally:
        stop_all([], procs, base)
    whole, shared = result["whole"], result["shared"]
    return result | {
        "stored_vs_ideal": shared["stored_vs_ideal"],
        "disk_whole_vs_shared": round(whole["disk_bytes_per_replica"] / max(1, shared["disk_bytes_per_replica"]), 2),
        "ingest_whole_vs_shared": round(whole["ingest_s"] / shared["ingest_s"], 2),
        "read_per_row_shared_vs_whole": round(shared["read_us_per_row"] / whole["read_us_per_row"], 2),
        "goal_stored_vs_ideal": 1.1,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``r3rdma bench groups``."""
    helps = {
        "groups": "prompts, each sampled --n times",
        "n": "samples per prompt (GRPO group size)",
        "median_prompt": "median prompt rows (lognormal, long-tailed)",
        "median_answer": "median answer tokens per sample",
    }
    add_options(parser, run_group_bench, "groups n median_prompt median_answer layers nodes replicas seed", helps)


def main(args: argparse.Namespace) -> int:
    """``r3rdma bench groups``: run, print the result as the last JSON line."""
    return run_from_args(run_group_bench, args)
