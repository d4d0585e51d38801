"""Replay layer, the framework-neutral core: what a replay is (the recorded ids of every row the
routers see, checked against a model's routers) and what it observed (live vs replayed). The
adapters that force those ids in a trainer's forward live in ``r3rdma.integrations``
(``hf_router_replay``: Hugging Face transformers; ``megatron``: Megatron-core)."""

from r3rdma.replay.batch import ReplayBatch
from r3rdma.replay.report import ReplayReport, choices_differ, routing_agreement

__all__ = ["ReplayBatch", "ReplayReport", "choices_differ", "routing_agreement"]
