"""Gate weights of Hugging Face MoE routers at given expert ids (the replay score functions).

Replay (Megatron-LM ``router_replay.py`` semantics) replaces a router's top-k ids with recorded
ones and recomputes the gate weights from the trainer's own router logits: the router's score
function, gathered at the recorded ids, normalised exactly as that router normalises its own
top-k. Each function below is a line-for-line copy of the weight computation of one group of
transformers 5 router classes, with ``topk`` replaced by ``gather``; applied to the router's own
ids it returns the router's own weights bit for bit (``RouterReplay`` checks this on the first
call of every router, so a transformers upgrade that changes a router cannot go unnoticed).

Routers are looked up by class name. A class not listed raises :class:`ReplayError`: there is no
generic fallback, because a wrong normalisation would silently train a different model. Add a
family with :func:`register_gate_weights`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from r3rdma.errors import ReplayError

__all__ = ["GateWeightsFn", "gate_weights_fn", "register_gate_weights", "supported_router_classes"]

# (router module, router_logits [T, E], ids [T, K] int64) -> weights [T, K], as the router returns them.
GateWeightsFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _softmax_optional_norm(router: torch.nn.Module, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    # Qwen3MoeTopKRouter & co: softmax in fp32, top-k, divide by the sum if norm_topk_prob,
    # back to the logits' dtype.
    probs_TE = torch.nn.functional.softmax(logits_TE, dtype=torch.float, dim=-1)
    weights_TK = probs_TE.gather(1, ids_TK)
    if router.norm_topk_prob:
        weights_TK /= weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK.to(logits_TE.dtype)


def _softmax_always_norm_cast(router: torch.nn.Module, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    # Qwen3VLMoeTextTopKRouter & co: as above, always normalised.
    probs_TE = torch.nn.functional.softmax(logits_TE, dtype=torch.float, dim=-1)
    weights_TK = probs_TE.gather(1, ids_TK)
    weights_TK /= weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK.to(logits_TE.dtype)


def _softmax_always_norm_fp32(router: torch.nn.Module, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    # MixtralTopKRouter, MiniMaxTopKRouter: softmax of logits.float(), always normalised, left in fp32.
    probs_TE = torch.nn.functional.softmax(logits_TE.float(), dim=-1)
    weights_TK = probs_TE.gather(1, ids_TK)
    weights_TK /= weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK


def _sigmoid_grouped(router: torch.nn.Module, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    # DeepseekV3TopkRouter & co: sigmoid scores; the choice uses scores + e_score_correction_bias
    # and group-limited top-k, but the weights are the plain sigmoid scores gathered at the ids
    # (no bias), normalised with +1e-20 if norm_topk_prob, times routed_scaling_factor.
    scores_TE = logits_TE.sigmoid()
    weights_TK = scores_TE.gather(1, ids_TK)
    if router.norm_topk_prob:
        denominator = weights_TK.sum(dim=-1, keepdim=True) + 1e-20
        weights_TK /= denominator
    return weights_TK * router.routed_scaling_factor  # type: ignore[operator]  # a float; torch types Module attributes as Tensor | Module


_REGISTRY: dict[str, GateWeightsFn] = {}
for _name in (
    "Qwen3MoeTopKRouter",
    "Qwen2MoeTopKRouter",
    "OlmoeTopKRouter",
    "FlexOlmoTopKRouter",
    "Qwen3NextTopKRouter",
    "Qwen3OmniMoeThinkerTextTopKRouter",
    "Qwen3OmniMoeTalkerTextTopKRouter",
):
    _REGISTRY[_name] = _softmax_optional_norm
for _name in ("Qwen3VLMoeTextTopKRouter", "Qwen3_5MoeTopKRouter", "Qwen3OmniMoeTextTopKRouter"):
    _REGISTRY[_name] = _softmax_always_norm_cast
for _name in ("MixtralTopKRouter", "MiniMaxTopKRouter"):
    _REGISTRY[_name] = _softmax_always_norm_fp32
for _name in ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter", "Glm4MoeLiteTopkRouter", "Dots1TopkRouter"):
    _REGISTRY[_name] = _sigmoid_grouped


def register_gate_weights(router_class_name: str, fn: GateWeightsFn) -> None:
    """Teach replay a router family: ``fn(router, logits_TE, ids_TK)`` must return what the
    router's forward returns as ``router_scores`` when its top-k is ``ids_TK``."""
    _REGISTRY[router_class_name] = fn


def supported_router_classes() -> tuple[str, ...]:
    """Router class names replay has a gate-weight function for, sorted (built-in and registered)."""
    return tuple(sorted(_REGISTRY))


def gate_weights_fn(router: torch.nn.Module) -> GateWeightsFn:
    """The gate-weight function of ``router``'s class; :class:`ReplayError` if unknown."""
    name = type(router).__name__
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ReplayError(
            f"no replay gate-weight function for router class {name!r}; supported: "
            f"{', '.join(supported_router_classes())} (add one with register_gate_weights)"
        ) from None
