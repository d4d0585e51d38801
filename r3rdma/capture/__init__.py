"""Capture layer: the engine's step path (router hook, slot table, TP all-gather), the
request/slot ledger, and the hand-off of finished rows off the GPU (staged or GPU-direct)."""

from r3rdma.capture.capturer import RoutingCapturer, RoutingSink, num_routing_rows

__all__ = ["RoutingCapturer", "RoutingSink", "num_routing_rows"]
