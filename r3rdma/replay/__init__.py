"""Replay layer: force the recorded expert ids in the trainer's forward (gate weights from the
trainer's own logits, so the router keeps its gradient); model-specific hooks live in
``r3rdma.integrations``."""

from r3rdma.replay.router_replay import ReplayBatch, ReplayReport, RouterReplay, routing_agreement

__all__ = ["ReplayBatch", "ReplayReport", "RouterReplay", "routing_agreement"]
