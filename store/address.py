"""Where a store node listens (a value shared by the node and the launcher of node processes)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NodeAddress"]


@dataclass(frozen=True, slots=True)
class NodeAddress:
    """A store node's host, its UCX push port and its HTTP read port."""

    host: str
    ucx_port: int
    http_port: int

    @property
    def push_url(self) -> str:
        """``host:port`` for UCX pushes (what ``StoreNodesClient`` takes)."""
        return f"{self.host}:{self.ucx_port}"

    @property
    def http_url(self) -> str:
        """Base URL of the read service (what ``RoutingReader`` takes)."""
        return f"http://{self.host}:{self.http_port}"
