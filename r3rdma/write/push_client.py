"""Pushes finished requests to store nodes: placement, failover, parallel pushes.

Placement is rendezvous (highest-random-weight) hashing of ``rollout_id/request_id`` over the
configured nodes: every client computes the same owner without coordination, and when a node
is down only its requests move (to their next choice). A batch is split by owner and pushed
to all owners in parallel; a node that fails (transport error or timeout) is marked down for
``down_cooldown_s`` and its part of the batch is retried on the next node of each request's
order. A request pushed twice (the first push failed after the node made it durable) is
accepted once by the store (identical bytes), and readers merge the nodes' indexes.

The client runs its own asyncio loop in a thread; ``commit`` is the blocking facade the
:class:`~r3rdma.write.writer.RoutingWriter` calls from its worker thread, never from the engine's
step path.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from r3rdma.errors import AuthenticationError, ConfigError, R3Error, R3TimeoutError, TransportError
from r3rdma.records import RequestRecord, batches_by_size

__all__ = ["StoreNodesClient", "rendezvous_order", "parse_node_url"]


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


@dataclass(frozen=True, slots=True)
class PushStats:
    requests: int
    bytes: int
    failovers: int


class StoreNodesClient:
    """Commits batches of records to the store nodes at ``urls`` (``host:ucx_port``)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        secret: bytes | str,
        limits=None,
        down_cooldown_s: float = 5.0,
        commit_timeout_s: float = 600.0,
    ) -> None:
        if not urls:
            raise ConfigError("StoreNodesClient needs at least one store node address")
        self.nodes = [f"{h}:{p}" for h, p in map(parse_node_url, urls)]
        if len(set(self.nodes)) != len(self.nodes):
            raise ConfigError(f"store node addresses repeat: {self.nodes}")
        from r3rdma.transport import TransportLimits

        self._secret = secret
        self._limits = limits or TransportLimits()
        self._down_until: dict[str, float] = {}
        self._cooldown = down_cooldown_s
        self._commit_timeout = commit_timeout_s
        self._clients: dict[str, object] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="r3rdma-push", daemon=True)
        self._thread.start()
        self.failovers = 0
        self.requests_pushed = 0
        self.bytes_pushed = 0

    # -- blocking facade --------------------------------------------------------------------

    def commit(self, records: Sequence[RequestRecord]) -> PushStats:
        """Push ``records``; return once every one is durable on some node."""
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
        :class:`~r3rdma.capture.transfer.ProbeResult`. The pushes are probe batches, which the
        node checks and acks without storing them. ``probe_kwargs`` (``probe_bytes``,
        ``probe_rounds``, ``min_gain``) go to :func:`~r3rdma.capture.transfer.probe_transfer_mode`."""
        from r3rdma.capture.transfer import probe_transfer_mode
        from r3rdma.transport import UcxxClient

        async def run():
            host, port = parse_node_url(self.nodes[0])
            client = UcxxClient(host, port, secret=self._secret, limits=self._limits)
            try:
                return await probe_transfer_mode(client, device=device, **probe_kwargs)
            finally:
                await client.close()

        return self._wait(run(), f"probing the transfer mode against {self.nodes[0]}")

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
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    def __enter__(self) -> "StoreNodesClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def owner(self, record: RequestRecord) -> str:
        """The node a record goes to while every node is up."""
        return rendezvous_order(self.nodes, f"{record.rollout_id}/{record.request_id}")[0]

    # -- async core -------------------------------------------------------------------------

    async def _commit(self, records: list, device: bool = False) -> PushStats:
        failed: set[str] = set()
        pending = records
        failovers = 0
        errors: list[str] = []
        while pending:
            now = time.monotonic()
            usable = [n for n in self.nodes if n not in failed and self._down_until.get(n, 0) <= now]
            if not usable:  # every node failed or cools down: try the cooling ones once more
                usable = [n for n in self.nodes if n not in failed]
            if not usable:
                raise TransportError(f"no store node accepted {len(pending)} requests: " + "; ".join(errors))
            groups: dict[str, list[RequestRecord]] = {}
            for record in pending:
                node = rendezvous_order(usable, f"{record.rollout_id}/{record.request_id}")[0]
                groups.setdefault(node, []).append(record)
            results = await asyncio.gather(*(self._push_node(n, g, device) for n, g in groups.items()), return_exceptions=True)
            pending = []
            for (node, group), result in zip(groups.items(), results):
                if _node_failure(result):
                    failed.add(node)
                    self._down_until[node] = time.monotonic() + self._cooldown
                    errors.append(f"{node}: {result}")
                    pending.extend(group)
                    failovers += 1
                elif isinstance(result, BaseException):
                    raise result  # typed store errors (duplicate, shape...) are not retried
        self.failovers += failovers
        total = sum(r.nbytes for r in records)
        self.requests_pushed += len(records)
        self.bytes_pushed += total
        return PushStats(len(records), total, failovers)

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
                    from r3rdma.capture.transfer import push_device_rows

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
