"""Pushes finished requests to store nodes: placement, replicas, failover, parallel pushes.

Placement is rendezvous (highest-random-weight) hashing of ``rollout_id/request_id`` over the
configured nodes (a record with a shared prefix hashes its source's id, :func:`placement_key`,
so it lands on the nodes that hold the rows it shares): every client computes the same order without coordination, and when a node
is down only its requests move (to their next choice). With ``replicas`` R, a request goes to
the first R nodes of its order and is durable only once all R acked it. A batch is split by
node and pushed to all of them in parallel; a node that fails (transport error or timeout) is
marked down for ``down_cooldown_s`` and its part of the batch goes to the next node of each
request's order that does not hold it yet, so R distinct live nodes hold every request. When
fewer than R nodes can take a request the commit raises :class:`TransportError` naming it:
never "durable" with fewer copies. A request pushed twice (the first push failed after the
node made it durable) is accepted once by the store (identical bytes), and readers merge the
nodes' indexes and read any replica.

The client runs its own asyncio loop in a thread; ``commit`` is the blocking facade the
:class:`~r3rdma.write.writer.RoutingWriter` calls from its worker thread, never from the engine's
step path.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from r3rdma.errors import AuthenticationError, ConfigError, R3Error, R3TimeoutError, TransportError
from r3rdma.records import RequestRecord, batches_by_size

if TYPE_CHECKING:
    from r3rdma.transport import UcxxClient

__all__ = ["StoreNodesClient", "rendezvous_order", "parse_node_url", "placement_key"]

log = logging.getLogger("r3rdma")


def parse_node_url(url: str) -> tuple[str, int]:
    """``host:port`` (UCX push address) -> (host, port)."""
    host, sep, port = url.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"store node address must be host:port, got {url!r}")
    return host, int(port)


def rendezvous_order(nodes: Sequence[str], key: str) -> list[str]:
    """Nodes ordered by preference for ``key`` (highest hash weight first)."""

    def weight(node: str) -> int:
        return int.from_bytes(hashlib.blake2b(f"{node}\0{key}".encode(), digest_size=8).digest(), "big")

    return sorted(nodes, key=weight, reverse=True)


def placement_key(record) -> str:
    """What places ``record`` (:func:`rendezvous_order`): ``rollout_id/request_id``, or, for a
    record with a ``shared_prefix``, its source's ``rollout_id/source_id``: a sample goes to the
    nodes (the replica set) that hold the rows it shares, where each replica resolves them
    against its own copy of the source. Device rows and deferred records carry no prefix."""
    shared = getattr(record, "shared_prefix", None)
    return f"{record.rollout_id}/{record.request_id if shared is None else shared.request_id}"


@dataclass(frozen=True, slots=True)
class PushStats:
    requests: int
    bytes: int
    failovers: int
    copies: int = 0  # requests x replicas acked (each request once per node that holds it)


class StoreNodesClient:
    """Commits batches of records to the store nodes at ``urls`` (``host:ucx_port``).

    ``replicas``: how many nodes hold each request (default 2 with two or more nodes, else 1;
    1..len(urls)). A commit returns once every request is durable on that many distinct nodes.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        secret: bytes | str,
        limits=None,
        down_cooldown_s: float = 5.0,
        commit_timeout_s: float = 600.0,
        replicas: int | None = None,
    ) -> None:
        if not urls:
            raise ConfigError("StoreNodesClient needs at least one store node address")
        self.nodes = [f"{h}:{p}" for h, p in map(parse_node_url, urls)]
        if len(set(self.nodes)) != len(self.nodes):
            raise ConfigError(f"store node addresses repeat: {self.nodes}")
        if replicas is None:
            replicas = 2 if len(self.nodes) >= 2 else 1
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= len(self.nodes):
            raise ConfigError(f"replicas must be an int in 1..{len(self.nodes)} (the nodes configured), got {replicas!r}")
        self.replicas = replicas
        from r3rdma.transport import TransportLimits

        self._secret = secret
        self._limits = limits or TransportLimits()
        self._down_until: dict[str, float] = {}
        self._cooldown = down_cooldown_s
        self._commit_timeout = commit_timeout_s
        self._clients: dict[str, UcxxClient] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="r3rdma-push", daemon=True)
        self._thread.start()
        self.failovers = 0
        self.requests_pushed = 0  # requests durable on ``replicas`` nodes
        self.bytes_pushed = 0  # their routing bytes, counted once
        self.copies_pushed = 0  # requests x nodes that acked them (replicas included)
        self.bytes_sent = 0  # routing bytes acked by nodes, every copy counted

    # -- blocking facade --------------------------------------------------------------------

    def commit(self, records: Sequence[RequestRecord]) -> PushStats:
        """Push ``records``; return once every one is durable on ``replicas`` distinct nodes.

        Raises :class:`TransportError` naming the requests when fewer than ``replicas`` nodes
        could take them (nothing of this commit is then reported durable)."""
        records = list(records)
        return self._wait(self._commit(records), f"pushing {len(records)} requests")

    def commit_device(self, items) -> PushStats:
        """Push :class:`~r3rdma.capture.transfer.DeviceRows` GPU-direct: the device buffers are the UCX
        payload (each item's ``ready`` event is waited on first). Same placement and failover
        as :meth:`commit`."""
        items = list(items)
        return self._wait(self._commit(items, device=True), f"pushing {len(items)} requests")

    def probe_transfer_mode(self, device=None, **probe_kwargs):
        """Measure GPU-direct against staged pushes to the first store node; return a
        :class:`~r3rdma.write.device_push.ProbeResult`. The pushes are probe batches, which the
        node checks and acks without storing them. ``probe_kwargs`` (``probe_bytes``,
        ``probe_rounds``, ``min_gain``) go to :func:`~r3rdma.write.device_push.probe_transfer_mode`."""
        from r3rdma.transport import UcxxClient
        from r3rdma.write.device_push import probe_transfer_mode

        async def run():
            host, port = parse_node_url(self.nodes[0])
            client = UcxxClient(host, port, secret=self._secret, limits=self._limits)
            try:
                return await probe_transfer_mode(client, device=device, **probe_kwargs)
            finally:
                await client.close()

        return self._wait(run(), f"probing the transfer mode against {self.nodes[0]}")

    def check(self, timeout_s: float = 10.0) -> list[str]:
        """Connect to every node and authenticate (the push handshake); return the nodes that
        answered. For engines to fail at start-up, not at the end of a rollout.

        Raises :class:`AuthenticationError` when a node refuses the secret (the same secret
        goes to every node, so one refusal is a configuration error), and
        :class:`TransportError` when fewer than ``replicas`` nodes answer within
        ``timeout_s``, naming each node's error. The connections stay open for the pushes."""
        from r3rdma.transport import UcxxClient

        async def one(node: str) -> None:
            client = self._clients.get(node)
            if client is None:
                host, port = parse_node_url(node)
                client = UcxxClient(host, port, secret=self._secret, limits=self._limits)
            try:
                await asyncio.wait_for(client.connect(), timeout_s)
            except BaseException:
                await client.close()
                raise
            self._clients[node] = client

        async def run() -> list[object]:
            return await asyncio.gather(*(one(n) for n in self.nodes), return_exceptions=True)

        results = self._wait(run(), f"connecting to the store nodes {self.nodes}")
        for node, result in zip(self.nodes, results):
            if isinstance(result, AuthenticationError):
                raise AuthenticationError(f"store node {node} refused the push secret: {result}") from result
        errors = {n: r for n, r in zip(self.nodes, results) if isinstance(r, BaseException)}
        live = [n for n in self.nodes if n not in errors]
        if len(live) < self.replicas:
            detail = "; ".join(f"{n}: {type(e).__name__}: {e or f'no answer in {timeout_s:.0f} s'}" for n, e in errors.items())
            raise TransportError(
                f"{len(live)} of {len(self.nodes)} store nodes answered within {timeout_s:.0f} s, but each request "
                f"needs {self.replicas} (replicas); {detail}"
            )
        return live

    def nodes_down(self) -> list[str]:
        """The nodes in failover cool-down now (a push to them failed in the last
        ``down_cooldown_s``; new requests go to their next choice meanwhile)."""
        now = time.monotonic()
        return [n for n in self.nodes if self._down_until.get(n, 0) > now]

    def _wait(self, coro, what: str):
        """Run ``coro`` on the client's loop; block for its result up to the commit timeout."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self._commit_timeout)
        except TimeoutError as e:
            future.cancel()
            raise R3TimeoutError(f"{what} took over {self._commit_timeout} s") from e

    def close(self) -> None:
        """Close every node connection and stop the client's loop thread; calling it again does nothing."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    def __enter__(self) -> StoreNodesClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def owner(self, record: RequestRecord) -> str:
        """The node a record goes to first while every node is up."""
        return self.replica_set(record)[0]

    def replica_set(self, record: RequestRecord) -> list[str]:
        """The ``replicas`` nodes a record goes to while every node is up."""
        return rendezvous_order(self.nodes, placement_key(record))[: self.replicas]

    # -- async core -------------------------------------------------------------------------

    async def _commit(self, records: list, device: bool = False) -> PushStats:
        # Per record (by position): the nodes that acked it. A node that fails is out for the
        # rest of this commit (and cools down for later ones); each record's missing copies go
        # to the next nodes of its rendezvous order that do not hold it yet.
        orders = [rendezvous_order(self.nodes, placement_key(r)) for r in records]
        holders: list[set[str]] = [set() for _ in records]
        failed: set[str] = set()
        failovers = 0
        copies = 0
        sent = 0
        errors: list[str] = []
        while True:
            now = time.monotonic()
            groups: dict[str, list[int]] = {}
            short: list[int] = []
            for i, order in enumerate(orders):
                need = self.replicas - len(holders[i])
                if need <= 0:
                    continue
                free = [n for n in order if n not in failed and n not in holders[i]]
                # Nodes cooling down after a failure go last: tried only when too few others are left.
                free = [n for n in free if self._down_until.get(n, 0) <= now] + [
                    n for n in free if self._down_until.get(n, 0) > now
                ]
                if len(free) < need:
                    short.append(i)
                    continue
                for node in free[:need]:
                    groups.setdefault(node, []).append(i)
            if short:
                self.failovers += failovers
                raise TransportError(self._short_message(records, short, holders, failed, errors))
            if not groups:
                break
            results = await asyncio.gather(
                *(self._push_node(n, [records[i] for i in idx], device) for n, idx in groups.items()), return_exceptions=True
            )
            for (node, idx), result in zip(groups.items(), results):
                if _node_failure(result):
                    failed.add(node)
                    self._down_until[node] = time.monotonic() + self._cooldown
                    errors.append(f"{node}: {result}")
                    failovers += 1
                    log.warning(
                        "r3rdma: store node %s failed a push of %d requests (%s: %s); they go to the next nodes "
                        "of their order, and the node is tried last for %.0f s",
                        node,
                        len(idx),
                        type(result).__name__,
                        result,
                        self._cooldown,
                    )
                elif isinstance(result, BaseException):
                    self.failovers += failovers
                    raise result  # typed store errors (duplicate, shape...) are not retried
                else:
                    for i in idx:
                        holders[i].add(node)
                    copies += len(idx)
                    sent += sum(records[i].nbytes for i in idx)
        self.failovers += failovers
        total = sum(r.nbytes for r in records)
        self.requests_pushed += len(records)
        self.bytes_pushed += total
        self.copies_pushed += copies
        self.bytes_sent += sent
        return PushStats(len(records), total, failovers, copies)

    def _short_message(
        self, records: list, short: list[int], holders: list[set[str]], failed: set[str], errors: list[str]
    ) -> str:
        names = [f"{records[i].rollout_id}/{records[i].request_id} ({len(holders[i])} of {self.replicas} copies)" for i in short]
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        return (
            f"{len(short)} of {len(records)} requests cannot be durable on {self.replicas} distinct store nodes: "
            f"{len(failed)} of {len(self.nodes)} nodes failed {sorted(failed)}; "
            f"the commit failed, none of it is reported durable: {shown}"
            + ("; node errors: " + "; ".join(errors) if errors else "")
        )

    async def _push_node(self, node: str, records: list, device: bool = False) -> None:
        from r3rdma.transport import UcxxClient

        client = self._clients.get(node)
        if client is None:
            host, port = parse_node_url(node)
            client = UcxxClient(host, port, secret=self._secret, limits=self._limits)
            self._clients[node] = client
        try:
            for chunk in batches_by_size(records, self._limits.max_payload_bytes, self._limits.max_records):
                if device:
                    from r3rdma.write.device_push import push_device_rows

                    await push_device_rows(client, chunk, "gpu_direct")
                else:
                    await client.push(chunk)
        except BaseException as e:
            if not _node_failure(e):
                raise
            self._clients.pop(node, None)
            await client.close()
            raise

    async def _close_all(self) -> None:
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.close()


def _node_failure(error: object) -> bool:
    """Errors that mean "this node is unreachable now" (fail over), not "this data is refused"."""
    if isinstance(error, AuthenticationError):
        return False  # a wrong secret is a configuration error, the same on every node
    if isinstance(error, (TransportError, R3TimeoutError)):
        return True
    return isinstance(error, OSError) and not isinstance(error, R3Error)
