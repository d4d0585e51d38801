"""Store nodes in this process, for tests that need several and many times over (property tests).

Each node is a :class:`~r3rdma.store.node.StoreNode`'s ingest (group commit, batches refused
one by one, the local store writing its root) behind a
:class:`~r3rdma.transport.LoopbackServer`, and a :class:`~r3rdma.write.push_client.StoreNodesClient`
pushes to them over the loopback transport: the same protocol code as UCXX (hello, framing,
limits, typed error frames) and the client's own placement, replicas and failover, without UCX
or a subprocess (a UCX node over TCP loopback takes ~1 s to start; one of these costs a
``LocalRoutingStore``). Readers read the nodes' root directories. A node is killed by stopping
its server without draining: its connections close, new ones are refused, and the client
fails over as it would from a dead node.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from r3rdma.store.node import StoreNode
from r3rdma.transport import LoopbackClient, LoopbackServer, TransportLimits
from r3rdma.write.push_client import StoreNodesClient

__all__ = ["InProcessNodes", "LoopbackNodesClient"]

SECRET = "in-process-nodes-secret-0123456789abcdef"


class LoopbackNodesClient(StoreNodesClient):
    """A :class:`StoreNodesClient` whose node addresses name in-process loopback servers."""

    def __init__(self, urls, servers: dict[str, LoopbackServer], **kwargs) -> None:
        self._servers = servers
        super().__init__(urls, **kwargs)

    def _new_client(self, node: str) -> LoopbackClient:
        return LoopbackClient(self._servers[node], secret=self._secret, limits=self._limits)

    def run(self, coro, what: str = "in-process nodes"):
        """Run ``coro`` on the client's event loop (where the loopback servers serve)."""
        return self._wait(coro, what)


class InProcessNodes:
    """``n`` store nodes under ``root`` (``root/node<i>``) and a client of them with ``replicas``.

    ``client`` pushes; ``roots`` / ``live_roots()`` are what readers open. ``kill(i)`` stops
    node ``i`` (its root stays on disk, as a dead node's disk does). Close with :meth:`close`
    (or use it as a context manager)."""

    def __init__(
        self,
        root: Path,
        n: int,
        *,
        replicas: int,
        limits: TransportLimits | None = None,
        down_cooldown_s: float = 60.0,
    ) -> None:
        limits = limits or TransportLimits(timeout_s=10)
        self.roots = [Path(root) / f"node{i}" for i in range(n)]
        # Addresses are only names here (nothing listens on them): the client maps them to servers.
        self.urls = [f"127.0.0.1:{21000 + i}" for i in range(n)]
        self.nodes = [StoreNode(r, secret=SECRET, limits=limits) for r in self.roots]
        self.servers = {
            url: LoopbackServer(node._ingest, secret=SECRET, limits=limits) for url, node in zip(self.urls, self.nodes)
        }
        self.client = LoopbackNodesClient(
            self.urls, self.servers, secret=SECRET, replicas=replicas, limits=limits, down_cooldown_s=down_cooldown_s
        )
        self.dead: set[int] = set()

        async def start() -> None:
            for server in self.servers.values():
                await server.start()

        self.client.run(start())

    def kill(self, i: int) -> None:
        """Node ``i`` dies: its server stops without draining (a batch in flight may be durable
        on its disk, unacked)."""
        if i in self.dead:
            return
        self.dead.add(i)
        self.client.run(self.servers[self.urls[i]].stop(drain=False))

    def live(self) -> list[int]:
        """Indexes of the nodes not killed."""
        return [i for i in range(len(self.roots)) if i not in self.dead]

    def live_roots(self) -> list[str]:
        """Root directories of the live nodes that hold anything (a reader's sources)."""
        return [str(self.roots[i]) for i in self.live() if self.roots[i].exists()]

    def index_of(self, url: str) -> int:
        """The node index of a client address."""
        return self.urls.index(url)

    def close(self) -> None:
        """Stop every server, close the client and every node's store."""

        async def stop() -> None:
            for i, server in enumerate(self.servers.values()):
                if i not in self.dead:
                    await server.stop(drain=True)
            # A killed node's commits still finish on its disk (its store's threads): let its
            # tasks on this loop end before the loop does.
            for _ in range(100):  # a commit ending may start the task that acks it
                tasks = [t for node in self.nodes for t in (node._committer, *node._answering) if t is not None and not t.done()]
                if not tasks:
                    break
                await asyncio.wait(tasks, timeout=60)

        try:
            self.client.run(stop())
        finally:
            self.client.close()
            for node in self.nodes:
                node.store.close()

    def __enter__(self) -> InProcessNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
