"""Read layer: trainers read committed routing (local root or store nodes over HTTP) as
per-request tensors or packed micro-batches."""

from r3rdma.read.reader import PackedRouting, RolloutInfo, RoutingReader

__all__ = ["PackedRouting", "RolloutInfo", "RoutingReader"]
