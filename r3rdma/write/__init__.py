"""Write layer: finished requests leave the engine in MB batches (:class:`RoutingWriter`) for a
store: the embedded local store, or store nodes over UCX (:class:`StoreNodesClient`)."""

from r3rdma.write.push_client import StoreNodesClient
from r3rdma.write.writer import RoutingWriter

__all__ = ["RoutingWriter", "StoreNodesClient"]
