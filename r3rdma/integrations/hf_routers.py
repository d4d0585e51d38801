"""Discovery of the MoE routers inside a Hugging Face transformers model.

transformers 5 gives every MoE family a router module (``Qwen3MoeTopKRouter``,
``OlmoeTopKRouter``, ``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ``DeepseekV3TopkRouter``, ...)
whose ``forward`` returns ``(router_logits, router_scores, router_indices)``. Capture and replay
attach to those modules with hooks, so no model code is edited. Dense layers inside a MoE model
(``mlp_only_layers``, ``first_k_dense_replace``, ``decoder_sparse_step``) have no router and are
simply absent from the layer map. :class:`RoutingTap` keeps, per forward, the ids each router
hands to its experts (what ``r3rdma verify`` and ``r3rdma rl-loop`` compare with the engine's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from r3rdma.errors import ShapeMismatchError

__all__ = ["MoeRouter", "RoutingTap", "find_moe_routers"]

# Class names of top-k routers in transformers 5 ("TopKRouter" and DeepSeek's "TopkRouter").
_ROUTER_CLASS = re.compile(r"Top[kK]Router$")
# The decoder layer index in a module path such as "model.layers.7.mlp.gate".
_LAYER_IN_PATH = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class MoeRouter:
    """One MoE router: which decoder layer it sits in, and its geometry."""

    layer_idx: int  # decoder layer index in the model
    moe_idx: int  # index among MoE layers (row axis L of the routing)
    name: str  # module path, e.g. "model.layers.3.mlp.gate"
    module: torch.nn.Module
    num_experts: int  # ids the router can emit (0 .. num_experts - 1)
    top_k: int


def find_moe_routers(model: torch.nn.Module) -> list[MoeRouter]:
    """Return the model's MoE routers ordered by decoder layer.

    Raises :class:`ShapeMismatchError` if the model has none, if two routers sit in one layer,
    or if routers disagree on top-k (a routing row is ``[L, K]`` with one K).
    """
    found: list[tuple[int, str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if not _ROUTER_CLASS.search(type(module).__name__):
            continue
        match = _LAYER_IN_PATH.search(name)
        if match is None:
            raise ShapeMismatchError(f"router {name!r} ({type(module).__name__}) is not inside a 'layers.<n>.' module path")
        found.append((int(match.group(1)), name, module))
    if not found:
        raise ShapeMismatchError(
            f"{type(model).__name__} has no module whose class name ends in 'TopKRouter'; is it a transformers >= 5 MoE model?"
        )
    found.sort(key=lambda item: item[0])
    layers = [layer for layer, _, _ in found]
    if len(set(layers)) != len(layers):
        raise ShapeMismatchError(f"more than one router per decoder layer: layers {layers}")
    routers = []
    for moe_idx, (layer, name, module) in enumerate(found):
        routers.append(
            MoeRouter(
                layer_idx=layer,
                moe_idx=moe_idx,
                name=name,
                module=module,
                # Plain int attributes of the router; torch types a Module's unknown attributes as Tensor | Module.
                num_experts=int(module.num_experts),  # type: ignore[arg-type]
                top_k=int(module.top_k),  # type: ignore[arg-type]
            )
        )
    top_ks = {r.top_k for r in routers}
    if len(top_ks) != 1:
        raise ShapeMismatchError(f"routers disagree on top_k: {sorted(top_ks)}")
    return routers


class RoutingTap:
    """Forward hooks on every MoE router of ``routers`` (``find_moe_routers``) keeping the ids
    each hands to its experts; :meth:`take` returns them as ``[N, L, K]`` (CPU, int64)."""

    def __init__(self, routers: list[Any]) -> None:
        self._out: dict[int, torch.Tensor] = {}
        self._n = len(routers)
        self._handles = [r.module.register_forward_hook(self._hook(r.moe_idx)) for r in routers]

    def _hook(self, i: int):
        def hook(_module, _args, output):
            self._out[i] = output[2].detach().to("cpu", torch.int64)

        return hook

    def take(self) -> torch.Tensor:
        """The last forward's ids ``[N, L, K]``; forgets them."""
        ids_NLK = torch.stack([self._out[i] for i in range(self._n)], dim=1)
        self._out.clear()
        return ids_NLK

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
