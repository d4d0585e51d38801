"""The reference the vLLM tests compare stored routing with: Hugging Face transformers.

Why this reference is independent and exact enough to compare bit for bit:
- It shares no code with the plug-in or r3rdma's capture path: it runs the checkpoint vLLM
  loaded through ``transformers`` (its own Qwen3-MoE implementation), one sequence at a time,
  the whole sequence in one forward without a KV cache (so no batching, chunking, prefix cache
  or preemption), and reads each MoE layer's router logits with a forward hook on the router.
- Row p is the routing of the forward whose input is token p (docs/FORMAT.md), so the reference
  forwards ``tokens[:-1]``: ``prompt + output`` as the client received them, minus the last
  sampled token, which never was an input.
- Numerics: both sides in float32. Measured on this checkpoint family (random Qwen3-MoE,
  hidden 128, 16 experts, top-4): vLLM on CPU (float32) and transformers pick the same top-4
  set for every token and layer; the margin between the 4th and 5th logit is what any batch-
  composition drift would have to cross, and :func:`reference_routing` reports it.
- The order of ids within a row is an implementation detail (vLLM's CPU router uses
  ``topk(sorted=False)``), and replay uses the set, so rows are compared sorted.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["HFReference"]


class HFReference:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        cfg = self.model.config
        self.top_k = cfg.num_experts_per_tok
        self.layers = [i for i in range(cfg.num_hidden_layers) if i not in set(cfg.mlp_only_layers or [])]
        self._logits: dict[int, torch.Tensor] = {}
        for i in self.layers:
            gate = self.model.model.layers[i].mlp.gate
            gate.register_forward_hook(self._hook(i))

    def _hook(self, layer: int):
        def hook(_module, _inputs, output):
            logits = output[0] if isinstance(output, tuple) else output
            self._logits[layer] = logits.detach().reshape(-1, logits.shape[-1]).float()
        return hook

    @torch.no_grad()
    def routing(self, tokens: list[int]) -> tuple[np.ndarray, float]:
        """Sorted top-k ids ``[len(tokens) - 1, L, K]`` and the smallest top-k margin seen."""
        inputs = torch.tensor([tokens[:-1]], dtype=torch.long)
        self._logits.clear()
        self.model(input_ids=inputs, use_cache=False)
        rows, margin = [], float("inf")
        for layer in self.layers:
            logits = self._logits[layer]
            top = torch.topk(logits, self.top_k + 1, dim=-1)
            margin = min(margin, float((top.values[:, self.top_k - 1] - top.values[:, self.top_k]).min()))
            rows.append(torch.sort(top.indices[:, : self.top_k], dim=-1).values)
        return torch.stack(rows, dim=1).numpy(), margin


def sorted_rows(ids_TLK) -> np.ndarray:
    return np.sort(np.asarray(ids_TLK, dtype=np.int64), axis=-1)
