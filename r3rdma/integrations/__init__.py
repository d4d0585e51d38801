"""Integrations: r3rdma's layers wired into the engines and trainers that use them.

Hugging Face transformers (``hf_*``: router discovery, capture hooks, rollout drivers, replay),
Megatron-core replay (``megatron``), the vLLM plug-in (``vllm``), the verl / slime hand-off
layouts (``rl_frameworks``), and the pipeline an :class:`~r3rdma.config.R3Config` names, built
(``builders``). Importing this package loads only the Hugging Face router helpers below.
"""

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
