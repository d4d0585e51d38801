"""Capture routing from a Hugging Face transformers MoE model with forward hooks on its routers."""

from __future__ import annotations

from typing import Callable

import torch

from r3rdma.capture.capturer import RoutingCapturer, RoutingSink
from r3rdma.integrations.hf_routers import MoeRouter, find_moe_routers

__all__ = ["attach_capturer", "capturer_for_model"]


def capturer_for_model(
    model: torch.nn.Module,
    *,
    num_slots: int,
    sink: RoutingSink | None = None,
    rollout_id: str = "default",
    device: str | torch.device | None = None,
    tp_group=None,
) -> RoutingCapturer:
    """A capturer shaped for ``model``'s MoE layers (layer map, top-k, expert count)."""
    routers = find_moe_routers(model)
    if device is None:
        device = next(model.parameters()).device
    return RoutingCapturer(
        layer_map=[r.layer_idx for r in routers],
        top_k=routers[0].top_k,
        num_experts=max(r.num_experts for r in routers),
        num_slots=num_slots,
        sink=sink,
        rollout_id=rollout_id,
        device=device,
        tp_group=tp_group,
    )


def attach_capturer(model: torch.nn.Module, capturer: RoutingCapturer) -> Callable[[], None]:
    """Hook every MoE router of ``model`` to ``capturer.record``; returns a function that detaches."""
    routers = find_moe_routers(model)
    layers = tuple(r.layer_idx for r in routers)
    if layers != capturer.layer_map:
        raise ValueError(f"model MoE layers {layers} differ from the capturer's layer_map {capturer.layer_map}")
    handles = [r.module.register_forward_hook(_hook(capturer, r)) for r in routers]

    def detach() -> None:
        for handle in handles:
            handle.remove()

    return detach


def _hook(capturer: RoutingCapturer, router: MoeRouter):
    layer_idx = router.layer_idx

    def hook(_module: torch.nn.Module, _args: object, output: tuple[torch.Tensor, ...]) -> None:
        # Routers return (router_logits, router_scores, router_indices); indices are [T, K].
        capturer.record(layer_idx, output[2])

    return hook
