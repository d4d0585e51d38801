"""What the routers of the trainer's Hugging Face model did, for ``r3rdma rl-loop``'s checks.

- :class:`~r3rdma.integrations.hf_routers.RoutingTap` (re-exported): forward hooks that keep the
  ids each MoE router hands to its experts (registered after
  :class:`~r3rdma.integrations.hf_router_replay.RouterReplay`'s hooks, it sees the replayed ids:
  what the experts really got); ``r3rdma verify`` uses the same.
- :class:`ReferenceRouting`: the routing a plain forward of one sequence computes (no batching,
  no cache, no replay): each router's top-k set from its logits, and the smallest gap between
  the k-th and (k+1)-th logit (what batching noise would have to cross to flip a decision).
  This is the reference the stored rows are compared with: it shares no code with the
  engine's capture.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from r3rdma.integrations.hf_routers import RoutingTap

__all__ = ["RoutingTap", "ReferenceRouting", "sorted_ids"]


def sorted_ids(ids_TLK: Any) -> np.ndarray:
    """Top-k ids sorted within each row (replay uses the set; engines order it their own way)."""
    return np.sort(np.asarray(ids_TLK, dtype=np.int64), axis=-1)


class ReferenceRouting:
    """Top-k sets of a plain forward of one sequence at a time, from the routers' own logits."""

    def __init__(self, model: torch.nn.Module, routers: list[Any]) -> None:
        self.model = model
        self.routers = routers
        self.top_k = routers[0].top_k
        self._logits: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    def _hook(self, i: int):
        def hook(_module, _args, output):
            logits = output[0] if isinstance(output, tuple) else output
            self._logits[i] = logits.detach().reshape(-1, logits.shape[-1]).float()

        return hook

    @torch.no_grad()
    def rows(self, tokens: list[int] | tuple[int, ...]) -> tuple[np.ndarray, float]:
        """``(sorted top-k ids [len(tokens) - 1, L, K], smallest top-k margin)``: the rows a
        request with these tokens must have stored (the last token never was an input)."""
        device = next(self.model.parameters()).device
        self._handles = [r.module.register_forward_hook(self._hook(r.moe_idx)) for r in self.routers]
        try:
            self._logits.clear()
            self.model(input_ids=torch.tensor([list(tokens[:-1])], device=device), use_cache=False)
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
        rows, margin = [], float("inf")
        for i in range(len(self.routers)):
            top = torch.topk(self._logits[i], self.top_k + 1, dim=-1)
            if top.values.shape[0]:
                margin = min(margin, float((top.values[:, self.top_k - 1] - top.values[:, self.top_k]).min()))
            rows.append(torch.sort(top.indices[:, : self.top_k], dim=-1).values)
        return torch.stack(rows, dim=1).cpu().numpy(), margin
