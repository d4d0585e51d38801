"""Pushes finished requests to store nodes: placement, replicas, failover, parallel pushes.

Placement is rendezvous (highest-random-weight) hashing of ``rollout_id/request_id`` over the
configured nodes: every client computes the same order without coordination, and when a node
is down only its requests move (to their next choice). A request that shares rows with another
(a record with a shared prefix) is placed by its *root source* instead: the request at the end
of its chain of sources (a sample of a sample of a prompt is placed by the prompt), so every
request of a chain lands on one replica set, where each node resolves each reference against
its own copy, and everything the client later pushes for that request (its rows inline after a
refused reference, a later turn of it) follows it there (:class:`Placement`). A record that
continues a request this client made durable before (a later turn, ``start_row > 0``) goes to
the nodes holding its earlier rows, and only to them: a node without them would hold the new
rows waiting forever for the rows before, a copy no reader can use.

With ``replicas`` R, a request goes to the first R nodes of its order and is durable only once
all R acked it. A batch is split by node and pushed to all of them in parallel; a node that
fails (transport error or timeout) is marked down for ``down_cooldown_s`` and its part of the
batch goes to the next node of each request's order that does not hold it yet, so R distinct
live nodes hold every request. When fewer than R nodes can take a request the commit raises
:class:`TransportError` naming it: never "durable" with fewer copies. The commit's other
requests are pushed all the same and are durable; the error lists the ones that are not
(``error.not_durable``, the records), which is all a :class:`~r3rdma.write.writer.RoutingWriter`
then reports failed. A request pushed twice (the first push failed after the node made it
durable) is accepted once by the store (identical bytes), and readers merge the nodes' indexes
and read any replica.

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
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from r3rdma.errors import AuthenticationError, ConfigError, R3Error, R3TimeoutError, TransportError
from r3rdma.records import RequestRecord, batches_by_size

if TYPE_CHECKING:
    from r3rdma.transport.base import TransportClient

__all__ = ["StoreNodesClient", "Placement", "rendezvous_order", "parse_node_url", "placement_key"]

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
    """What places ``record`` on its own (:func:`rendezvous_order`): ``rollout_id/request_id``,
    or, for a record with a ``shared_prefix``, its source's ``rollout_id/source_id``. A client
    places by :meth:`Placement.key`, which follows a chain of sources to its root. Device rows
    and deferred records carry no prefix."""
    shared = getattr(record, "shared_prefix", None)
    return f"{record.rollout_id}/{record.request_id if shared is None else shared.request_id}"


class Placement:
    """Which request places a record: its root source, as far as this client has seen the chain.

    A record with a shared prefix names its source, which may itself share rows with another
    request (a sample of a sample, a later prompt that hit a sample's blocks). Placed by its
    direct source, a sample of a sample went to that sample's rendezvous order, not to the
    nodes holding it (which follow the *prompt's* order): with 3 nodes and 2 replicas, 2 in 3
    such chains reached a node that lacked the source, which refused the reference; the rows
    then went inline to a third replica set (issue #50). So the client remembers, for each
    request it placed by a source, that source's root (the source's own root when it was
    placed by one, else the source), and places every record of the request by it: the
    reference, its rows inline when a node refused the reference, later turns appended to it.

    Remembered per client (every record of a request goes through one client: the capturer
    shares prefixes only with requests its own rank pushed, and pushes every turn of a stored
    id from one rank), for the last ``capacity`` requests placed by a source; a request
    forgotten (or a source pushed by another client) is placed by its direct source, as
    :func:`placement_key` does, and a node without that source takes the rows inline.

    It also remembers where each request's records were made durable (:meth:`stored`), so a
    record continuing one (:meth:`held`) goes to those nodes only: with a node of its replica
    set down, a later turn used to fail over to a node without the earlier turns, which held it
    pending forever, and the turn was reported durable on 2 nodes while one node could serve
    the conversation. Thread-safe.
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._roots: OrderedDict[tuple[str, str], str] = OrderedDict()  # (rollout, request) -> root request
        # (rollout, request) -> the nodes its records were made durable on, last ``capacity`` requests
        self._holders: OrderedDict[tuple[str, str], frozenset[str]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._roots)

    def key(self, record, *, learn: bool = True) -> str:
        """``rollout_id/<root request>`` of ``record`` (:func:`rendezvous_order`'s key).
        ``learn``: remember the root of a record with a shared prefix, so the request's later
        records follow it (False: only look, as :meth:`StoreNodesClient.replica_set` does)."""
        rollout, request = record.rollout_id, record.request_id
        shared = getattr(record, "shared_prefix", None)
        with self._lock:
            root = self._roots.get((rollout, request))
            if root is not None:
                self._roots.move_to_end((rollout, request))
            elif shared is not None:
                root = self._roots.get((rollout, shared.request_id), shared.request_id)
                if learn and root != request and self.capacity > 0:
                    self._roots[(rollout, request)] = root
                    if len(self._roots) > self.capacity:
                        self._roots.popitem(last=False)
        return f"{rollout}/{request if root is None else root}"

    def held(self, record) -> frozenset[str] | None:
        """The nodes ``record`` must go to, when it continues rows this client made durable
        (``start_row > 0``, no shared prefix: a later turn, the rest of a request): the nodes
        holding those rows. None for anything else, or a request not remembered."""
        if getattr(record, "shared_prefix", None) is not None or not getattr(record, "start_row", 0):
            return None
        with self._lock:
            return self._holders.get((record.rollout_id, record.request_id))

    def stored(self, record, nodes) -> None:
        """``record`` was made durable on ``nodes``: its request's later records follow it there."""
        if self.capacity <= 0:
            return
        key = (record.rollout_id, record.request_id)
        with self._lock:
            self._holders[key] = frozenset(nodes)
            self._holders.move_to_end(key)
            if len(self._holders) > self.capacity:
                self._holders.popitem(last=False)


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
        self._clients: dict[str, TransportClient] = {}
        self.placement = Placement()
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

        Raises :class:`TransportError` naming the requests fewer than ``replicas`` nodes could
        take (a record continuing a request: its earlier rows' nodes), once the others are
        durable; ``error.not_durable`` lists those records (the others are not reported durable
        by the raise, but they are: pushed again, they are duplicates)."""
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

        async def one(node: str) -> None:
            client = self._clients.get(node)
            if client is None:
                client = self._new_client(node)
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
        """The ``replicas`` nodes a record goes to while every node is up (placed by its root
        source, :class:`Placement`)."""
        return rendezvous_order(self.nodes, self.placement.key(record, learn=False))[: self.replicas]

    def _new_client(self, node: str) -> TransportClient:
        """A transport client of ``node`` (not connected yet): UCXX. Tests put another
        transport here (the in-process loopback)."""
        from r3rdma.transport import UcxxClient

        host, port = parse_node_url(node)
        return UcxxClient(host, port, secret=self._secret, limits=self._limits)

    # -- async core -------------------------------------------------------------------------

    async def _commit(self, records: list, device: bool = False) -> PushStats:
        # Per record (by position): the nodes that acked it. A node that fails is out for the
        # rest of this commit (and cools down for later ones); each record's missing copies go
        # to the next nodes of its rendezvous order that do not hold it yet. A record that
        # continues rows made durable before goes only to the nodes holding them.
        orders: list[list[str]] = []
        bound: dict[int, frozenset[str]] = {}  # records that continue rows held by these nodes
        for i, r in enumerate(records):
            # In order: a source earlier in the batch is placed (and its root learnt) before its samples.
            order = rendezvous_order(self.nodes, self.placement.key(r))
            held = self.placement.held(r)
            if held is not None:
                order = [n for n in order if n in held]
                bound[i] = held
            orders.append(order)
        holders: list[set[str]] = [set() for _ in records]
        failed: set[str] = set()
        short: list[int] = []  # records fewer than `replicas` nodes can take: given up, the others go on
        given_up: set[int] = set()
        failovers = 0
        errors: list[str] = []
        while True:
            now = time.monotonic()
            groups: dict[str, list[int]] = {}
            for i, order in enumerate(orders):
                need = self.replicas - len(holders[i])
                if need <= 0 or i in given_up:
                    continue
                free = [n for n in order if n not in failed and n not in holders[i]]
                # Nodes cooling down after a failure go last: tried only when too few others are left.
                free = [n for n in free if self._down_until.get(n, 0) <= now] + [
                    n for n in free if self._down_until.get(n, 0) > now
                ]
                if len(free) < need:
                    short.append(i)
                    given_up.add(i)
                    continue
                for node in free[:need]:
                    groups.setdefault(node, []).append(i)
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
        self.failovers += failovers
        durable = [i for i in range(len(records)) if i not in given_up]
        for i in durable:
            self.placement.stored(records[i], holders[i])
        total = sum(records[i].nbytes for i in durable)
        # Counted for the durable requests only (a copy of one that failed is no replica).
        copies = sum(len(holders[i]) for i in durable)
        self.requests_pushed += len(durable)
        self.bytes_pushed += total
        self.copies_pushed += copies
        self.bytes_sent += sum(records[i].nbytes * len(holders[i]) for i in durable)
        if short:
            error = TransportError(self._short_message(records, short, holders, failed, errors, bound))
            error.not_durable = [records[i] for i in short]  # type: ignore[attr-defined]
            raise error
        return PushStats(len(records), total, failovers, copies)

    def _short_message(
        self,
        records: list,
        short: list[int],
        holders: list[set[str]],
        failed: set[str],
        errors: list[str],
        bound: dict[int, frozenset[str]],
    ) -> str:
        def name(i: int) -> str:
            where = f"; its earlier rows are on {sorted(bound[i])}" if i in bound else ""
            return f"{records[i].rollout_id}/{records[i].request_id} ({len(holders[i])} of {self.replicas} copies{where})"

        names = [name(i) for i in short]
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        others = len(records) - len(short)
        return (
            f"{len(short)} of {len(records)} requests cannot be durable on {self.replicas} distinct store nodes: "
            f"{len(failed)} of {len(self.nodes)} nodes failed {sorted(failed)}; "
            f"not durable: {shown}"
            + (f" (the other {others} are)" if others else "")
            + ("; node errors: " + "; ".join(errors) if errors else "")
        )

    async def _push_node(self, node: str, records: list, device: bool = False) -> None:
        client = self._clients.get(node)
        if client is None:
            client = self._new_client(node)
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
