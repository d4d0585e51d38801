"""An independent record of routing, for end-to-end checks of the capture path.

Plain forward hooks log each router's top-k ids per forward; the driver's step map says which
router row belongs to which request position. Nothing here touches the slot table, the
capturer or the store, so agreement with what the reader returns checks all of them.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from r3rdma.integrations.hf_rollout import StepInfo
from r3rdma.integrations.hf_routers import find_moe_routers

__all__ = ["ShadowRecorder"]


class ShadowRecorder:
    """Forward hooks on ``model``'s MoE routers that keep each request position's top-k ids, per layer.

    Register :meth:`on_step` as the rollout driver's step listener; :meth:`close` removes the hooks.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = find_moe_routers(model)
        self._rows: dict[str, dict[int, np.ndarray]] = defaultdict(dict)  # request -> position -> [L, K]
        self._step: StepInfo | None = None
        self._layer_out: dict[int, np.ndarray] = {}
        self._handles = [r.module.register_forward_hook(self._hook(r.moe_idx)) for r in self.routers]

    def on_step(self, info: StepInfo) -> None:
        """Step listener: called before each forward with its token map."""
        self._flush()
        self._step = info

    def _hook(self, moe_idx: int):
        def hook(_m, _a, output):
            self._layer_out[moe_idx] = output[2].detach().cpu().numpy().copy()

        return hook

    def _flush(self) -> None:
        info, self._step = self._step, None
        if info is None:
            return
        stacked = np.stack([self._layer_out[i] for i in range(len(self.routers))], axis=1)  # [rows, L, K]
        self._layer_out.clear()
        rows = info.router_rows.numpy()
        t = 0
        for rid, start, count in zip(info.request_ids, info.start_positions, info.num_tokens):
            for p in range(start, start + count):
                self._rows[rid][p] = stacked[rows[t]]
                t += 1

    def rows(self, request_id: str, num_rows: int) -> np.ndarray:
        """Rows ``0 .. num_rows - 1`` of a request as int64 ``[rows, L, K]``; KeyError if any is missing."""
        self._flush()
        per_pos = self._rows[request_id]
        return np.stack([per_pos[p] for p in range(num_rows)]).astype(np.int64)

    def close(self) -> None:
        """Remove the router hooks; rows already recorded stay readable."""
        for handle in self._handles:
            handle.remove()
