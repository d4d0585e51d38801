"""Reliability scenarios that kill or starve a node: :func:`crash_cycles` (two nodes, one
SIGKILLed at a random moment while clients push, GRPO groups sharing a prompt's rows among them:
every acknowledged request reads back bit-exact, nothing partial or foreign is visible,
unacknowledged batches are retried on the restarted node or the other one, and acknowledged ones
pushed again: the same bytes a no-op, other bytes refused), :func:`disk_full` (``RLIMIT_FSIZE``: a
clear ``StoreError``, nothing partial, the node keeps serving; after a restart without the limit
the batch goes in and earlier data is intact) and :func:`load` (N clients for T seconds: zero
loss, ack latency, node RSS against its in-flight budget)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from r3rdma.store.process import NodeProcess, new_token, spawn_node
from r3rdma.testing.harness import (
    LAYERS,
    TOP_K,
    _orphans,
    _owner,
    _shared_layout,
    _verify,
    _visible,
    make_record,
    make_sample,
    parse_sample_id,
)

# -- crash cycles ------------------------------------------------------------------------------


@dataclass
class _CrashStats:
    """What :func:`crash_cycles` counted; returned as a dict in this field order."""

    kill_cycles: int = 0
    acked_before_kill: int = 0  # acknowledged requests before the latest kill
    unacked_retried: int = 0  # requests
    retried_same_node: int = 0
    retried_other_node: int = 0
    idempotent_repushes: int = 0
    different_bytes_refused: int = 0
    orphan_arrays_after_kill: int = 0
    acked_lost: int = 0
    phantom: int = 0
    corrupt: int = 0
    pending_visible: int = 0  # requests stored in part, seen after a restart (a cut commit)
    # GRPO groups: samples sharing rows 0..P-1 of a source request (SharedPrefix records).
    shared_pushed: int = 0  # samples made (acknowledged or not)
    shared_in_source_batch: int = 0  # ... pushed in the batch of their source
    shared_acked: int = 0  # samples acknowledged (by reference or inline)
    shared_refused_missing_source: int = 0  # pushes refused by a node without the source (a retry elsewhere)
    shared_acked_inline: int = 0  # samples stored with their prefix rows inline after such a refusal
    shared_idempotent_repushes: int = 0
    shared_different_bytes_refused: int = 0
    shared_lost: int = 0  # acknowledged samples missing after a restart (also counted in acked_lost)
    shared_by_reference: int = 0  # at the end: visible samples whose prefix is the source's stored bytes
    shared_inline: int = 0  # ... whose prefix rows are stored inline
    errors: list[str] = field(default_factory=list)
    acked_total: int = 0


class _CrashRun:
    """The state of :func:`crash_cycles`: its two nodes, what was pushed and acknowledged where,
    and the counts; each step of a cycle is a method."""

    def __init__(self, work: Path, clients: int, seed: int, timeout_s: float, shared_fraction: float) -> None:
        from r3rdma.transport import TransportLimits

        self.rng = random.Random(seed)
        self.clients, self.shared_fraction = clients, shared_fraction
        self.token = new_token()
        self.roots = [work / "crash-a", work / "crash-b"]
        self.nodes = [spawn_node(r, self.token) for r in self.roots]
        self.limits = TransportLimits(timeout_s=timeout_s, ack_timeout_s=4 * timeout_s)
        self.acked: dict[tuple[str, str], int] = {}  # (rollout, request) -> crc32c (a sample's: its own rows')
        self.where: dict[tuple[str, str], int] = {}  # node that acked it
        self.inline: set[tuple[str, str]] = set()  # samples acked with their prefix rows inline
        self.pushed: set[tuple[str, str]] = set()
        self.stats = _CrashStats()

    def client(self, i: int) -> Any:
        """A new push connection to node ``i``."""
        from r3rdma.transport import UcxxClient

        return UcxxClient(self.nodes[i].host, self.nodes[i].ucx_port, secret=self.token, limits=self.limits)

    def grpo_group(self, rollout: str, source: Any) -> list[Any]:
        """1-3 samples sharing rows 0..P-1 of ``source`` (P random, a cut inside its segment or all of it)."""
        rng = self.rng
        return [make_sample(rollout, source.request_id, j, rng.randint(1, source.num_rows)) for j in range(rng.randint(1, 3))]

    def note_acked(self, group: list[Any], node: int, *, inlined: bool = False) -> None:
        """``group``'s final records acknowledged by ``node``."""
        for r in group:
            if not r.final:
                continue  # the prefix part of an inlined sample: its final record stands for it
            key = (r.rollout_id, r.request_id)
            if key not in self.acked and parse_sample_id(r.request_id) is not None:
                self.stats.shared_acked += 1
                if inlined:
                    self.inline.add(key)
            self.acked[key] = r.crc32c
            self.where[key] = node

    def legitimately_missing(self, group: list[Any], node: int) -> bool:
        """A sample refused for a missing source is legitimate only if ``node`` never
        acknowledged the source (the sample was retried on the other node); a source
        acknowledged there must still be there."""
        in_batch = {r.request_id for r in group}
        return any(
            self.where.get((r.rollout_id, r.shared_prefix.request_id)) != node
            for r in _samples_of(group)
            if r.shared_prefix.request_id not in in_batch
        )

    async def push_with_fallback(self, conn: Any, group: list[Any], node: int) -> None:
        """Push ``group``; a sample refused for its source missing on ``node`` is pushed again
        with its prefix rows inline (what RoutingWriter does), the batch's other records with it."""
        from r3rdma.errors import SharedRowsMissingError

        try:
            await conn.push(group)
        except SharedRowsMissingError as e:
            if not self.legitimately_missing(group, node):
                self.stats.errors.append(f"node {node} lost the acknowledged source of a sample: {e}")
                raise
            self.stats.shared_refused_missing_source += 1
            fallback = [x for r in group for x in (r.prefix_inlined() if r.shared_prefix is not None else [r])]
            await conn.push(fallback)
            self.stats.shared_acked_inline += len(_samples_of(group))
            self.note_acked(fallback, node, inlined=True)
            return
        self.note_acked(group, node)

    async def push_until_killed(self, cycle: int, victim: int, kill_after: int, jitter: float) -> list[tuple[list[Any], int]]:
        """``clients`` pushers to both nodes until node ``victim`` is SIGKILLed, ``jitter`` seconds
        after the ``kill_after``-th acknowledged batch; returns the (batch, owner) pairs not acknowledged."""
        from r3rdma.errors import R3Error

        acks = 0
        killed = asyncio.Event()
        unacked: list[tuple[list[Any], int]] = []
        loop = asyncio.get_running_loop()

        def kill() -> None:
            os.kill(self.nodes[victim].proc.pid, signal.SIGKILL)
            killed.set()

        async def send(conns: dict[int, Any], group: list[Any], i: int) -> None:
            nonlocal acks
            if killed.is_set() and i == victim:
                unacked.append((group, i))  # never sent: the node is gone
                return
            try:
                await self.push_with_fallback(conns[i], group, i)
            except R3Error as e:
                if i != victim:
                    self.stats.errors.append(f"survivor refused a push: {type(e).__name__}: {e}")
                unacked.append((group, i))
                return
            acks += 1
            if acks == kill_after:
                loop.call_later(jitter, kill)

        async def pusher(p: int) -> None:
            conns = {0: self.client(0), 1: self.client(1)}
            n = 0
            try:
                while not killed.is_set():
                    n = await self.push_batch(cycle, p, n, lambda group, i: send(conns, group, i), unacked)
            finally:
                for c in conns.values():
                    await c.close()

        await asyncio.gather(*(pusher(p) for p in range(self.clients)))
        return unacked

    async def push_batch(
        self, cycle: int, p: int, n: int, send: Callable[[list[Any], int], Any], unacked: list[tuple[list[Any], int]]
    ) -> int:
        """Pusher ``p``'s next batch (its requests numbered from ``n``), split by owner node and
        ``send``; returns the next request number.

        Some batches start a GRPO group: their first record is a source, and its samples go in
        the same batch or, once a node acknowledged the source, to that node (placed by the
        source's id, like StoreNodesClient)."""
        from r3rdma.write.push_client import placement_key

        rng, stats = self.rng, self.stats
        rollout = f"crash-{p % 3}"
        batch = [make_record(rollout, f"c{cycle}-p{p}-{n + j}") for j in range(rng.randint(1, 6))]
        n += len(batch)
        later: list[Any] = []
        if rng.random() < self.shared_fraction:
            samples = self.grpo_group(rollout, batch[0])
            stats.shared_pushed += len(samples)
            if rng.random() < 0.3:
                batch += samples
                stats.shared_in_source_batch += len(samples)
            else:
                later = samples
        groups: dict[int, list[Any]] = {}
        for r in batch + later:
            self.pushed.add((r.rollout_id, r.request_id))
        for r in batch:
            groups.setdefault(_owner(placement_key(r), 2), []).append(r)
        for i, group in groups.items():
            await send(group, i)
        if later:
            source = (batch[0].rollout_id, batch[0].request_id)
            if source in self.acked:
                await send(later, self.where[source])
            else:  # the source's node died before acknowledging it: the samples wait with it
                unacked.append((later, _owner(placement_key(later[0]), 2)))
        return n

    async def retry(self, unacked: list[tuple[list[Any], int]]) -> None:
        """Retry what was not acknowledged: the restarted node or the other one (which lacks
        the source of a sample pushed alone: refused, then pushed inline)."""
        from r3rdma.errors import R3Error

        stats = self.stats
        for group, i in unacked:
            target = i if self.rng.random() < 0.5 else 1 - i
            c = self.client(target)
            try:
                await self.push_with_fallback(c, group, target)
            except R3Error as e:
                stats.errors.append(f"retry refused: {type(e).__name__}: {e}")
                continue
            finally:
                await c.close()
            stats.unacked_retried += len(group)
            if target == i:
                stats.retried_same_node += len(group)
            else:
                stats.retried_other_node += len(group)

    async def repush_same_bytes(self, ro: str, rid: str, make: Callable[[int], list[Any]]) -> tuple[int, int]:
        """Push an acknowledged request again (a no-op), then with other bytes (refused);
        returns (accepted again, refused)."""
        from r3rdma.errors import DuplicateRequestError, R3Error

        c = self.client(self.where[(ro, rid)])
        try:
            await c.push(make(0))
            try:
                await c.push(make(1))
                self.stats.errors.append(f"different bytes for {ro}/{rid} were accepted")
                return 1, 0
            except DuplicateRequestError:
                return 1, 1
        except R3Error as e:
            self.stats.errors.append(f"idempotent re-push of {ro}/{rid} failed: {type(e).__name__}: {e}")
            return 0, 0
        finally:
            await c.close()

    def sample_as_acked(self, ro: str, rid: str) -> Callable[[int], list[Any]]:
        """The acknowledged form of sample ``rid`` (reference, or inline), of ``variant``."""
        parsed = parse_sample_id(rid)
        assert parsed is not None
        source, prefix = parsed
        index = int(rid.rsplit(":", 2)[1])

        def make(variant: int) -> list[Any]:
            record = make_sample(ro, source, index, prefix, variant=variant)
            return (record.prefix_inlined() or []) if (ro, rid) in self.inline else [record]

        return make

    async def check_idempotence(self) -> None:
        """Same bytes accepted again; different bytes for the same id refused (a plain request
        and a sample, each picked at random)."""
        stats = self.stats
        plain = sorted(k for k in self.acked if parse_sample_id(k[1]) is None)
        if plain:
            ro, rid = self.rng.choice(plain)
            again, refused = await self.repush_same_bytes(ro, rid, lambda variant: [make_record(ro, rid, variant=variant)])
            stats.idempotent_repushes += again
            stats.different_bytes_refused += refused
        shared = sorted(k for k in self.acked if parse_sample_id(k[1]) is not None)
        if shared:
            ro, rid = self.rng.choice(shared)
            again, refused = await self.repush_same_bytes(ro, rid, self.sample_as_acked(ro, rid))
            stats.shared_idempotent_repushes += again
            stats.shared_different_bytes_refused += refused

    async def verify(self) -> dict[str, int]:
        """Every acknowledged request is there, bit-exact (a sample: its source's rows 0..P-1,
        then its own); nothing partial or foreign. Counted into the stats; the check's counts."""
        check = await asyncio.to_thread(_verify, self.roots, self.acked, self.pushed)
        stats = self.stats
        stats.acked_lost += check["lost"]
        stats.phantom += check["phantom"]
        stats.corrupt += check["corrupt"]
        stats.pending_visible += check["pending"]
        stats.shared_lost += check["shared_lost"]
        return check

    async def cycle(self, cycle: int, cycles: int, log: Callable[[str], None]) -> None:
        """One cycle: push until a node is killed, restart it, check, retry, re-push."""
        rng, stats = self.rng, self.stats
        victim = rng.randrange(2)
        kill_after = rng.randint(1, 4 * self.clients)
        jitter = rng.uniform(0, 0.03)
        unacked = await self.push_until_killed(cycle, victim, kill_after, jitter)
        await asyncio.to_thread(self.nodes[victim].proc.wait, 30)
        stats.kill_cycles += 1
        stats.acked_before_kill = len(self.acked)
        stats.orphan_arrays_after_kill += _orphans(self.roots[victim])
        self.nodes[victim] = spawn_node(self.roots[victim], self.token)
        check = await self.verify()
        await self.retry(unacked)
        await self.check_idempotence()
        log(
            f"cycle {cycle + 1}/{cycles}: killed node {victim} after {kill_after} acks, "
            f"{len(self.acked)} acked so far ({stats.shared_acked} shared samples), {len(unacked)} batches retried, "
            f"check {check}"
        )


def _samples_of(group: list[Any]) -> list[Any]:
    return [r for r in group if r.shared_prefix is not None]


async def _crash_cycles(
    work: Path, cycles: int, clients: int, seed: int, timeout_s: float, shared_fraction: float, log: Callable[[str], None]
) -> dict[str, Any]:
    run = _CrashRun(work, clients, seed, timeout_s, shared_fraction)
    try:
        for cycle in range(cycles):
            await run.cycle(cycle, cycles, log)
        for node in run.nodes:
            node.stop()
        await run.verify()
        layout = _shared_layout(run.roots)
        run.stats.shared_by_reference, run.stats.shared_inline = layout["by_reference"], layout["inline"]
        run.stats.acked_total = len(run.acked)
        return asdict(run.stats)
    finally:
        for node in run.nodes:
            node.kill()


def crash_cycles(
    work: Path,
    cycles: int = 20,
    *,
    clients: int = 6,
    seed: int = 0,
    timeout_s: float = 3.0,
    shared_fraction: float = 0.5,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """SIGKILL a node ``cycles`` times under load; see the module docstring for the checks.

    ``shared_fraction``: the share of batches that start a GRPO group (a source and 1-3
    samples sharing its first rows, :func:`~r3rdma.testing.harness.make_sample`).
    """
    from r3rdma.transport import configure_ucx_env

    configure_ucx_env()
    return asyncio.run(_crash_cycles(Path(work), cycles, clients, seed, timeout_s, shared_fraction, log))


# -- disk full ---------------------------------------------------------------------------------


def disk_full(work: Path, *, limit: int = 256 << 10) -> dict[str, Any]:
    """A node under ``RLIMIT_FSIZE=limit``: an oversized batch fails cleanly, the node recovers."""
    from r3rdma.errors import StoreError
    from r3rdma.read.reader import RoutingReader
    from r3rdma.transport import TransportLimits
    from r3rdma.write.push_client import StoreNodesClient

    work = Path(work)
    root = work / "full"
    token = new_token()
    small = [make_record("df", f"small-{i}") for i in range(5)]
    # Incompressible and larger than the limit: its shard file cannot be written.
    big = make_record("df", "big", rows=(limit // (LAYERS * TOP_K)) * 2)
    big2 = make_record("df2", "big", rows=(limit // (LAYERS * TOP_K)) * 2)
    out: dict[str, Any] = {"limit_bytes": limit}
    limits = TransportLimits(timeout_s=10)
    node = spawn_node(root, token, fsize_limit=limit)
    try:
        with StoreNodesClient([node.push_url], secret=token, limits=limits) as client:
            client.commit(small)
            for rec in (big, big2):  # big2: a rollout whose very first batch fails
                try:
                    client.commit([rec])
                    out["error"] = None
                except StoreError as e:
                    out["error"] = f"{type(e).__name__}: {e}"
            visible = _visible([root])
            out["big_visible"] = "big" in visible.get("df", {}) or "big" in visible.get("df2", {})
            out["orphans"] = _orphans(root)
            out["temp_files"] = sum(1 for p in root.rglob(".*tmp*"))
            client.commit([make_record("df", "after-full")])  # keeps serving small batches
            out["served_after_full"] = True
    finally:
        node.stop()
    node = spawn_node(root, token)  # space is back
    try:
        with StoreNodesClient([node.push_url], secret=token, limits=limits) as client:
            client.commit([big, big2])
        with RoutingReader(str(root)) as reader:
            got = reader.get_numpy("df", [r.request_id for r in small] + ["big", "after-full"])
            out["intact_after_restart"] = all(np.array_equal(got[r.request_id], r.ids_TLK) for r in small + [big])
            out["intact_after_restart"] &= np.array_equal(reader.get_numpy("df2", ["big"])["big"], big2.ids_TLK)
    finally:
        node.stop()
    return out


# -- load --------------------------------------------------------------------------------------


async def _load(
    nodes: list[NodeProcess], clients: int, duration_s: float, batch: int, seed: int, timeout_s: float
) -> dict[str, Any]:
    from r3rdma.errors import R3Error
    from r3rdma.transport import TransportLimits, UcxxClient

    limits = TransportLimits(timeout_s=timeout_s, ack_timeout_s=4 * timeout_s)
    latencies: list[float] = []
    acked: dict[tuple[str, str], int] = {}
    failures: list[str] = []
    nbytes = 0
    rss_max = [0] * len(nodes)
    deadline = time.monotonic() + duration_s

    async def client(p: int) -> None:
        rng = random.Random(seed * 1000 + p)
        conns = [UcxxClient(n.host, n.ucx_port, secret=n.token, limits=limits) for n in nodes]
        k = 0
        try:
            while time.monotonic() < deadline:
                recs = [make_record(f"load-{p % 4}", f"p{p}-{k + j}", rows=rng.randint(64, 1024)) for j in range(batch)]
                k += batch
                groups: dict[int, list[Any]] = {}
                for r in recs:
                    groups.setdefault(_owner(f"{r.rollout_id}/{r.request_id}", len(nodes)), []).append(r)

                async def push(i: int, group: list[Any]) -> None:
                    nonlocal nbytes
                    t0 = time.perf_counter()
                    try:
                        await conns[i].push(group)
                    except R3Error as e:
                        failures.append(f"{type(e).__name__}: {e}")
                        return
                    latencies.append(time.perf_counter() - t0)
                    nbytes += sum(r.nbytes for r in group)
                    for r in group:
                        acked[(r.rollout_id, r.request_id)] = r.crc32c

                await asyncio.gather(*(push(i, g) for i, g in groups.items()))
                for i, n in enumerate(nodes):
                    rss_max[i] = max(rss_max[i], n.rss())
        finally:
            for c in conns:
                await c.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client(p) for p in range(clients)))
    seconds = time.perf_counter() - t0
    lat = np.array(latencies) if latencies else np.zeros(1)
    return {
        "clients": clients,
        "seconds": round(seconds, 2),
        "pushes": len(latencies),
        "requests": len(acked),
        "bytes": nbytes,
        "throughput_mb_s": round(nbytes / seconds / 1e6, 2),
        "requests_per_s": round(len(acked) / seconds, 1),
        "ack_p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 2),
        "ack_p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 2),
        "push_failures": failures[:10],
        "push_failure_count": len(failures),
        "_acked": acked,
        "rss_sampled_max": rss_max,
    }


def load(
    work: Path,
    *,
    clients: int = 32,
    duration_s: float = 60.0,
    batch: int = 32,
    inflight_mb: int = 64,
    seed: int = 0,
    timeout_s: float = 30.0,
    verify_bytes: bool = False,
) -> dict[str, Any]:
    """``clients`` clients push for ``duration_s`` to two nodes with ``--max-inflight-mb inflight_mb``."""
    from r3rdma.transport import configure_ucx_env

    configure_ucx_env()
    work = Path(work)
    token = new_token()
    roots = [work / "load-a", work / "load-b"]
    nodes = [spawn_node(r, token, "--max-inflight-mb", str(inflight_mb)) for r in roots]
    try:
        base = [n.rss() for n in nodes]
        out = asyncio.run(_load(nodes, clients, duration_s, batch, seed, timeout_s))
        peaks = [n.peak_rss() for n in nodes]
    finally:
        for n in nodes:
            n.stop()
    acked = out.pop("_acked")
    # Load records have random lengths: read back with CRC verification, compare CRCs with
    # what was acknowledged (bit-exact up to CRC-32C).
    check = _verify(roots, acked, set(acked), read_bytes=verify_bytes, exact=False)
    out.update(
        {
            "acked_lost": check["lost"],
            "corrupt": check["corrupt"],
            "phantom": check["phantom"],
            "inflight_budget_mb": inflight_mb,
            "node_rss_base_mb": [round(b / 2**20, 1) for b in base],
            "node_rss_peak_mb": [round(p / 2**20, 1) for p in peaks],
            "node_rss_growth_mb": max(round((p - b) / 2**20, 1) for p, b in zip(peaks, base)),
        }
    )
    out.pop("rss_sampled_max", None)
    return out
