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


# A GRPO sample's id names its source and how many rows it shares with it, so its whole rows
# can be rebuilt from the id alone after a crash: "<source>:<index>:<prefix_rows>". A sample's
# source may be a sample itself (the id nests). Plain record ids of the scenarios hold no ':'.


def sample_id(source_id: str, index: int, prefix_rows: int) -> str:
    """The id of the ``index``-th sample sharing rows ``0 .. prefix_rows - 1`` of ``source_id``."""
    return f"{source_id}:{index}:{prefix_rows}"


def parse_sample_id(request_id: str) -> tuple[str, int] | None:
    """(source id, shared rows) of a :func:`sample_id`, or None for a plain record's id."""
    parts = request_id.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0], int(parts[2])


def make_sample(rollout_id: str, source_id: str, index: int, prefix_rows: int, *, variant: int = 0, copy: bool = True):
    """A sample sharing rows ``0 .. prefix_rows - 1`` of ``source_id`` (a :class:`SharedPrefix`
    record: only its own rows, from row ``prefix_rows`` on); ``copy``: with the client-side copy
    of the shared rows a writer falls back on (:meth:`RequestRecord.prefix_inlined`).

    Its own rows depend only on (rollout, sample id, variant), like :func:`make_record`'s.
    """
    from r3rdma.records import RequestRecord, SharedPrefix

    rid = sample_id(source_id, index, prefix_rows)
    own = make_record(rollout_id, rid, variant=variant).ids_TLK
    shared = expected_rows(rollout_id, source_id)
    if shared.shape[0] < prefix_rows:
        raise ValueError(f"source {source_id!r} has {shared.shape[0]} rows, fewer than the {prefix_rows} shared")
    prefix = SharedPrefix(source_id, prefix_rows, shared[:prefix_rows].copy() if copy else None)
    return RequestRecord(rollout_id, rid, own, tuple(range(LAYERS)), EXPERTS, start_row=prefix_rows, shared_prefix=prefix)


def expected_rows(rollout_id: str, request_id: str) -> np.ndarray:
    """The whole rows a reader must see for a request of :func:`make_record` (default rows) or
    :func:`make_sample`: a sample's are its source's rows ``0 .. P - 1``, then its own."""
    own = make_record(rollout_id, request_id).ids_TLK
    parsed = parse_sample_id(request_id)
    if parsed is None:
        return own
    source_id, prefix_rows = parsed
    return np.concatenate([expected_rows(rollout_id, source_id)[:prefix_rows], own])


def _owner(key: str, n: int) -> int:
    from r3rdma.write.push_client import rendezvous_order

    names = [f"node{i}" for i in range(n)]
    return names.index(rendezvous_order(names, key)[0])


def _indexes(roots: Sequence[Path]) -> list[tuple[Path, str, Any]]:
    """(root, rollout, RolloutIndex) of every rollout with an index under ``roots``."""
    from r3rdma.store.rollout_index import load_index, read_file

    out = []
    for root in roots:
        if not root.is_dir():
            continue
        for child in root.iterdir():
            index = load_index(child.name, read_file(child), str(root)) if child.is_dir() else None
            if index is not None:
                out.append((root, child.name, index))
    return out


def _visible(roots: Sequence[Path]) -> dict[str, dict[str, int]]:
    """rollout -> {request_id: crc32c} of every committed request under ``roots`` (merged).

    The CRC-32C is the request's last segment's: the rows its final record carried (a plain
    record's all; a shared-prefix sample's own rows, however its prefix was stored).
    """
    out: dict[str, dict[str, int]] = {}
    for _root, rollout, index in _indexes(roots):
        mine = out.setdefault(rollout, {})
        for rid, entry in index.requests.items():
            mine[rid] = entry.segments[-1].crc32c
    return out


def _pending(roots: Sequence[Path]) -> int:
    """Requests with stored parts that are not visible (a partial request) under ``roots``."""
    return sum(len(index.pending) for _root, _rollout, index in _indexes(roots))


def _shared_layout(roots: Sequence[Path]) -> dict[str, int]:
    """How the visible :func:`make_sample` requests are stored, per root holding them:
    ``by_reference`` (the first segment is the source's stored bytes: stored once) or
    ``inline`` (the sample's own copy of the prefix rows, a refused reference's fallback)."""
    out = {"by_reference": 0, "inline": 0}
    for _root, _rollout, index in _indexes(roots):
        for rid, entry in index.requests.items():
            parsed = parse_sample_id(rid)
            if parsed is None:
                continue
            source = index.requests.get(parsed[0])
            first = entry.segments[0]
            shared = source is not None and (first.array, first.offset) == (source.segments[0].array, source.segments[0].offset)
            out["by_reference" if shared else "inline"] += 1
    return out


def _verify(
    roots: Sequence[Path],
    acked: dict[tuple[str, str], int],
    pushed: set[tuple[str, str]],
    *,
    read_bytes: bool = True,
    exact: bool = True,
) -> dict[str, int]:
    """Check acknowledged requests against the roots; return loss / phantom / corrupt counts,
    ``pending`` (requests stored in part: a commit a crash cut would show here) and
    ``shared_lost`` (acknowledged :func:`make_sample` requests missing).

    Reads every visible request back through :class:`RoutingReader` (checksums verified) and
    compares its bytes with the deterministic record (``read_bytes``; a sample's whole rows,
    :func:`expected_rows`), else compares CRCs.
    """
    from r3rdma.read.reader import RoutingReader

    visible = _visible(roots)
    missing = [(ro, rid) for (ro, rid) in acked if rid not in visible.get(ro, {})]
    lost = len(missing)
    shared_lost = sum(1 for _ro, rid in missing if parse_sample_id(rid) is not None)
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
                        if exact and not np.array_equal(got[rid], expected_rows(ro, rid)):
                            corrupt += 1
                for rid in part:
                    want = acked.get((ro, rid))
                    if want is not None and reqs[rid] != want:
                        corrupt += 1
    return {
        "lost": lost,
        "phantom": phantom,
        "corrupt": corrupt,
        "pending": _pending(roots),
        "shared_lost": shared_lost,
        "visible": sum(map(len, visible.values())),
    }


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
        "shared_prefix": None,
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
