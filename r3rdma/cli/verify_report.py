"""What every ``r3rdma verify`` trainer path reports: the result value and the paper's table.

Shared by the Hugging Face path (:mod:`r3rdma.cli.verify`) and the Megatron path
(:mod:`r3rdma.cli.verify_megatron`), so neither imports the other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["RoutingTally", "VerifyResult", "report"]


@dataclass(slots=True)
class RoutingTally:
    """What one mode of a verify run's training forwards (no replay, or replay) measured, summed
    over micro-batches: routing vs recorded, and the sampled tokens' log-probabilities on both
    sides. ``layers_per_token``: per micro-batch, how many MoE layers differ for each token
    (the Hugging Face path's histogram; the Megatron path leaves it empty)."""

    moe_layers: int
    decisions_differ: int = 0
    tokens_any: int = 0
    layer: np.ndarray = field(init=False)  # differing decisions per MoE layer
    layers_per_token: list[np.ndarray] = field(default_factory=list)
    logp_train: list[float] = field(default_factory=list)
    logp_rollout: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layer = np.zeros(self.moe_layers, np.int64)


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """A verify run's measurements (``summary``, JSON-ready) and whether replay did what it should (``ok``)."""

    summary: dict[str, Any]
    ok: bool


def _table(s: dict[str, Any]) -> str:
    rows = [
        (
            "router decisions differing (vs rollout)",
            f"{s['router_decisions_differ']:.2%}",
            f"{s['router_decisions_differ_replay']:.2%}",
            "~10%",
        ),
        (
            "tokens differing in >= 1 layer",
            f"{s['tokens_any_layer_differ']:.2%}",
            f"{s['tokens_any_layer_differ_replay']:.2%}",
            "94%",
        ),
        ("train-inference KL (k3)", f"{s['kl_k3_no_replay']:.3e}", f"{s['kl_k3_replay']:.3e}", "1.5e-3 -> 7.5e-4"),
        (
            "extreme tokens (tau > 2 or < 1/2)",
            f"{s['extreme_ratio_tokens_no_replay']:.3%}",
            f"{s['extreme_ratio_tokens_replay']:.3%}",
            "~10x fewer",
        ),
        (
            "mean |logp_train - logp_rollout|",
            f"{s['mean_abs_logp_diff_no_replay']:.3e}",
            f"{s['mean_abs_logp_diff_replay']:.3e}",
            "",
        ),
    ]
    # Rows only this module's summary has (the Megatron path reports through the same table).
    if "mean_layers_differ_per_token" in s:
        rows.insert(
            2,
            (
                "mean differing layers per token",
                f"{s['mean_layers_differ_per_token']:.2f}",
                f"{s['mean_layers_differ_per_token_replay']:.2f}",
                "",
            ),
        )
    if s.get("abs_log_ratio_quantiles_no_replay"):
        q0, q1 = s["abs_log_ratio_quantiles_no_replay"], s["abs_log_ratio_quantiles_replay"]
        rows.append(("|log ratio| p99 / max", f"{q0['p99']:.2e}/{q0['max']:.2f}", f"{q1['p99']:.2e}/{q1['max']:.2f}", ""))
    w = max(len(r[0]) for r in rows)
    lines = [f"{'':{w}}  {'no replay':>12}  {'replay':>12}  paper (Qwen3-30B-A3B)"]
    lines += [f"{a:{w}}  {b:>12}  {c:>12}  {d}" for a, b, c, d in rows]
    return "\n".join(lines)


def report(result, title: str) -> int:
    """Print a verify result (title line, table, verdict, JSON last); the exit status."""
    s = result.summary
    print(f"{title}, {s['moe_layers']} MoE layers x {s['num_experts']} experts, top-{s['top_k']}, on {s['device']}")
    print(f"  rollout: {s['rollout']}; train: {s['train']}")
    print(f"  {s['requests']} requests, {s['routing_rows']} routing rows, {s['generated_tokens']} generated tokens")
    if s.get("heldout_loss_after_training") is not None:
        print(
            f"  trained checkpoint: held-out loss {s['heldout_loss_before_training']} -> "
            f"{s['heldout_loss_after_training']} nats/byte"
        )
    print(_table(s))
    print(
        "  "
        + (
            "OK: replay removes every routing difference and lowers the KL"
            if result.ok
            else "FAIL: replay left routing differences or did not lower the KL"
        )
    )
    print(json.dumps(s))
    return 0 if result.ok else 1
