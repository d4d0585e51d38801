"""Integrations with model libraries (Hugging Face transformers)."""

from r3rdma.integrations.hf_replay import GateWeightsFn, gate_weights_fn, register_gate_weights, supported_router_classes
from r3rdma.integrations.hf_routers import MoeRouter, find_moe_routers

__all__ = [
    "GateWeightsFn",
    "MoeRouter",
    "find_moe_routers",
    "gate_weights_fn",
    "register_gate_weights",
    "supported_router_classes",
]
