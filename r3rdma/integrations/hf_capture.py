"""Capture routing from a Hugging Face transformers MoE model with forward hooks on its routers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from r3rdma.capture.capturer import RoutingCapturer, RoutingSink
from r3rdma.errors import ShapeMismatchError
from r3rdma.integrations.hf_routers import MoeRouter, find_moe_routers

__all__ = ["attach_capturer", "capturer_for_model", "model_geometry"]


def model_geometry(model: torch.nn.Module) -> tuple[tuple[int, ...], int, int]:
    """``(layer_map, top_k, num_experts)`` of ``model``'s MoE routers, as a capturer takes them.

    ``layer_map``: decoder-layer index of each router, in order (dense layers absent);
    ``num_experts``: the largest router's expert count (ids it can emit). Raises
    :class:`ShapeMismatchError` as :func:`find_moe_routers` does (no router, top-k disagree).
    """
    routers = find_moe_routers(model)
    return tuple(r.layer_idx for r in routers), routers[0].top_k, max(r.num_experts for r in routers)


def capturer_for_model(
    model: torch.nn.Module,
    *,
    num_slots: int,
    sink: RoutingSink | None = None,
    rollout_id: str = "default",
    device: str | torch.device | None = None,
    tp_group=None,
    **capturer_kwargs: Any,
) -> RoutingCapturer:
    """A capturer shaped for ``model``'s MoE layers (layer map, top-k, expert count).

    ``device`` defaults to the model's; ``capturer_kwargs`` (``pin_memory``, ``transfer_mode``,
    ``expert_map``, ``owns_sink``) go to :class:`RoutingCapturer` as they are.
    """
    layer_map, top_k, num_experts = model_geometry(model)
    if device is None:
        device = next(model.parameters()).device
    return RoutingCapturer(
        layer_map=layer_map,
        top_k=top_k,
        num_experts=num_experts,
        num_slots=num_slots,
        sink=sink,
        rollout_id=rollout_id,
        device=device,
        tp_group=tp_group,
        **capturer_kwargs,
    )


def attach_capturer(model: torch.nn.Module, capturer: RoutingCapturer) -> Callable[[], None]:
    """Hook every MoE router of ``model`` to ``capturer.record``; returns a function that detaches."""
    routers = find_moe_routers(model)
    layers = tuple(r.layer_idx for r in routers)
    if layers != capturer.layer_map:
        raise ShapeMismatchError(f"capturer's layer_map is {capturer.layer_map}, but the model's MoE layers are {layers}")
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
