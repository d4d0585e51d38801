"""Shared pieces of the reliability scenarios (``r3rdma bench reliability``, tests/test_reliability.py,
tests/test_fuzz.py...): deterministic records, what store roots show, token leaks, fixed ports, nodes
started in parallel. Store nodes themselves come from :mod:`r3rdma.store.process`."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r3rdma.store.process import NodeProcess, spawn_node

LAYERS, TOP_K, EXPERTS = 8, 4, 64

# -- records -----------------------------------------------------------------------------------


def make_record(
    rollout_id: str, request_id: str, *, variant: int = 0, rows: int | None = None, layers: int = LAYERS, top_k: int = TOP_K
):
    """A record whose bytes depend only on (rollout, request, variant): checkable after a crash."""
    from r3rdma.records import RequestRecord

    seed = zlib.crc32(f"{rollout_id}/{request_id}/{variant}".encode())
    rng = np.random.default_rng(seed)
    n = rows if rows is not None else int(8 + seed % 120)
    ids = rng.integers(0, EXPERTS, size=(n, layers, top_k), dtype=np.uint8)
    return RequestRecord(rollout_id, request_id, ids, tuple(range(layers)), EXPERTS)


def _owner(key: str, n: int) -> int:
    from r3rdma.write.push_client import rendezvous_order

    names = [f"node{i}" for i in range(n)]
    return names.index(rendezvous_order(names, key)[0])


def _visible(roots: Sequence[Path]) -> dict[str, dict[str, int]]:
    """rollout -> {request_id: crc32c} of every committed request under ``roots`` (merged)."""
    from r3rdma.store.rollout_index import load_index, read_file

    out: dict[str, dict[str, int]] = {}
    for root in roots:
        if not root.is_dir():
            continue
        for child in root.iterdir():
            index = load_index(child.name, read_file(child), str(root)) if child.is_dir() else None
            if index is not None:
                mine = out.setdefault(child.name, {})
                for rid, entry in index.requests.items():
                    mine[rid] = entry.segments[0].crc32c
    return out


def _verify(
    roots: Sequence[Path],
    acked: dict[tuple[str, str], int],
    pushed: set[tuple[str, str]],
    *,
    read_bytes: bool = True,
    exact: bool = True,
) -> dict[str, int]:
    """Check acknowledged requests against the roots; return loss / phantom / corrupt counts.

    Reads every visible request back through :class:`RoutingReader` (checksums verified) and
    compares its bytes with the deterministic record (``read_bytes``), else compares CRCs.
    """
    from r3rdma.read.reader import RoutingReader

    visible = _visible(roots)
    lost = sum(1 for (ro, rid) in acked if rid not in visible.get(ro, {}))
    phantom = sum(1 for ro, reqs in visible.items() for rid in reqs if (ro, rid) not in pushed)
    corrupt = 0
    with RoutingReader([str(r) for r in roots if r.is_dir()]) as reader:
        for ro, reqs in visible.items():
            ids = sorted(reqs)
            for i in range(0, len(ids), 256):
                part = ids[i : i + 256]
                if read_bytes:
                    got = reader.get_numpy(ro, part)  # CRC-32C of every segment verified
                    for rid in part:
                        # Records made with default rows are reproducible: compare the bytes.
                        if exact and not np.array_equal(got[rid], make_record(ro, rid).ids_TLK):
                            corrupt += 1
                for rid in part:
                    want = acked.get((ro, rid))
                    if want is not None and reqs[rid] != want:
                        corrupt += 1
    return {"lost": lost, "phantom": phantom, "corrupt": corrupt, "visible": sum(map(len, visible.values()))}


def _orphans(root: Path) -> int:
    """Batch arrays and index parts on disk the entry point does not count (what a crash
    mid-commit leaves)."""
    from r3rdma.store.layout import parse_array_name, read_group_attrs
    from r3rdma.store.rollout_index import check_entry, parse_part_name

    n = 0
    for child in root.iterdir() if root.is_dir() else []:
        if not child.is_dir():
            continue
        entry = check_entry(child.name, read_group_attrs(child / "zarr.json") or {}, str(root)) or {}
        counted = entry.get("parts", 0)
        n += sum(1 for a in child.iterdir() if (parse_array_name(a.name) or parse_part_name(a.name) or 0) > counted)
    return n


# -- auth / token hygiene ----------------------------------------------------------------------


def token_leaks(node: NodeProcess, *others: str) -> list[str]:
    """Places the node's secret, its HTTP tokens (or ``others``) appear in its log or its stdout."""
    text = node.log.read_text(errors="replace")
    return [t[:8] + "..." for t in (node.token, node.read_token, node.admin_token, *others) if t and t in text]


def free_port() -> int:
    """A TCP port free right now (for nodes started on fixed ports)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def unchecked_record(
    rollout_id: str, request_id: str, ids: np.ndarray, *, num_experts: int = EXPERTS, start_row: int = 0, crc32c: int = 0
) -> Any:
    """A RequestRecord built around its validation (what a buggy or foreign producer could hand over)."""
    from dataclasses import fields

    from r3rdma.records import RequestRecord

    record = object.__new__(RequestRecord)
    values = {
        "rollout_id": rollout_id,
        "request_id": request_id,
        "ids_TLK": ids,
        "layer_map": tuple(range(ids.shape[1])),
        "num_experts": num_experts,
        "start_row": start_row,
        "crc32c": crc32c,
        "final": True,
        "total_rows": None,
    }
    for f in fields(RequestRecord):
        object.__setattr__(record, f.name, values[f.name])
    return record


def _http_reader(nodes: Sequence[NodeProcess]) -> Any:
    from r3rdma.read.reader import RoutingReader

    return RoutingReader([n.http_url for n in nodes], token=nodes[0].read_token, timeout_s=10)


def spawn_nodes(roots: Sequence[Path], token: str, *extra: str) -> list[NodeProcess]:
    """One store node per root, sharing ``token`` and the extra CLI arguments, started in parallel; in ``roots`` order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(roots)) as pool:  # each start waits for the node's ready line
        return list(pool.map(lambda r: spawn_node(r, token, *extra), roots))
