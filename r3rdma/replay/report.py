"""What a replay observed: live (the trainer's own top-k) vs replayed routing.

Framework-neutral: :func:`routing_agreement` compares two routings of the same tokens, and an
adapter (:class:`~r3rdma.integrations.hf_router_replay.RouterReplay`) sums
:func:`choices_differ` over a forward's routers into a :class:`ReplayReport`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from r3rdma.errors import ShapeMismatchError

__all__ = ["ReplayReport", "choices_differ", "routing_agreement"]


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """Live (the trainer's own top-k) vs replayed routing over the recorded tokens of one forward.

    A decision is one (token, layer, slot) of the top-k; it differs when the replayed expert is
    not among the live top-k of that token and layer (order within the top-k is ignored).
    """

    num_layers: int
    top_k: int
    recorded_tokens: int
    unrecorded_tokens: int
    decisions: int
    decisions_differ: int
    tokens_any_layer_differ: int
    layer_decisions_differ: tuple[int, ...]

    @property
    def decisions_differ_frac(self) -> float:
        """Share of decisions that differ (0.0 without any decision)."""
        return self.decisions_differ / self.decisions if self.decisions else 0.0

    @property
    def tokens_any_layer_differ_frac(self) -> float:
        """Share of recorded tokens with a differing decision in at least one layer (0.0 without any)."""
        return self.tokens_any_layer_differ / self.recorded_tokens if self.recorded_tokens else 0.0


def routing_agreement(a_TLK: torch.Tensor, b_TLK: torch.Tensor) -> tuple[int, int, list[int]]:
    """``(decisions_differ, tokens_any_layer_differ, per-layer decisions_differ)`` between two
    routings of the same tokens, comparing top-k sets (order ignored)."""
    if a_TLK.shape != b_TLK.shape:
        raise ShapeMismatchError(f"routings differ in shape: {tuple(a_TLK.shape)} vs {tuple(b_TLK.shape)}")
    with torch.no_grad():
        differ_TLK = choices_differ(a_TLK.to(torch.int64), b_TLK.to(torch.int64).to(a_TLK.device))
        per_layer = differ_TLK.sum(dim=(0, 2))
        any_T = differ_TLK.flatten(1).any(-1)
        return int(per_layer.sum()), int(any_T.sum()), [int(x) for x in per_layer.tolist()]


def choices_differ(replayed: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` bool: ``replayed[..., k]`` is not among ``live[..., :]`` (order ignored)."""
    return ~(replayed.unsqueeze(-1) == live.unsqueeze(-2)).any(-1)
