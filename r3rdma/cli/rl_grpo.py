"""GRPO for ``r3rdma rl-loop``: group-normalised advantages, packed training batches, the loss.

One optimizer step per rollout, on-policy (the samples were drawn from the weights being
trained, so the PPO ratio is 1 at the step and clipping never binds): the loss is
``-sum_t A_i * exp(logp_t - stopgrad(logp_t)) / T`` over every generated token ``t`` of the
trained samples (token mean over the batch, as DAPO), whose gradient is the policy gradient
``-A_i * grad logp_t / T``. ``A_i`` is the sample's reward minus its group's mean, divided by
the group's standard deviation (population std + 1e-6); groups whose samples all got the same
reward carry no signal and are left out of the batch (and their routing is not read). No KL
penalty against a reference policy.

Sequences are packed along tokens (``[1, T]``, position ids restarting at 0 for each; the
layout verl's trainer uses without padding), which is what
:meth:`~r3rdma.replay.ReplayBatch.packed` replays, in micro-batches of a bounded token count
whose gradients add up to the whole batch's (:func:`micro_batches`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Sample", "PackedBatch", "group_advantages", "micro_batches", "pack", "sampled_logprobs", "grpo_loss"]


@dataclass(frozen=True, slots=True)
class Sample:
    """One completion of a rollout: where its routing is stored, its tokens, the engine's
    log-probability of each generated token, its reward and advantage."""

    request_id: str
    group: int
    prompt: tuple[int, ...]
    generated: tuple[int, ...]
    engine_logprobs: tuple[float, ...]
    reward: float
    advantage: float = 0.0

    @property
    def tokens(self) -> tuple[int, ...]:
        """Prompt and generated tokens: what the trainer forwards."""
        return self.prompt + self.generated

    @property
    def rows(self) -> int:
        """Routing rows stored for it: every token that was a forward input (all but the last)."""
        return len(self.prompt) + len(self.generated) - 1


def group_advantages(rewards: list[float], groups: list[int], *, eps: float = 1e-6) -> list[float]:
    """``(r - mean(group)) / (std(group) + eps)`` per sample; 0 for a group with no spread."""
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(groups)
    out = np.zeros_like(r)
    for group in np.unique(g):
        members = g == group
        std = r[members].std()
        if std > 0:
            out[members] = (r[members] - r[members].mean()) / (std + eps)
    return [float(a) for a in out]


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """Samples packed along tokens: ``input_ids`` / ``position_ids`` ``[1, T]``, each sample's
    length and first row, and for every generated token the row whose logits predict it
    (``pred_rows``), the token (``targets``) and its sample's advantage (``advantages``)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    seq_lens: list[int]
    starts: list[int]
    pred_rows: torch.Tensor
    targets: torch.Tensor
    advantages: torch.Tensor
    engine_logprobs: torch.Tensor


def pack(samples: list[Sample]) -> PackedBatch:
    """Pack ``samples`` in order (their routing must be read in the same order)."""
    seqs = [s.tokens for s in samples]
    seq_lens = [len(t) for t in seqs]
    starts = np.cumsum([0, *seq_lens])[:-1].tolist()
    input_ids = torch.tensor([[t for s in seqs for t in s]], dtype=torch.long)
    position_ids = torch.cat([torch.arange(n) for n in seq_lens]).unsqueeze(0)
    pred: list[np.ndarray] = []
    targets: list[int] = []
    adv: list[float] = []
    engine: list[float] = []
    for s, start in zip(samples, starts):
        p = len(s.prompt)
        rows = start + np.arange(p - 1, p - 1 + len(s.generated))  # row r predicts the token at r + 1
        pred.append(rows)
        targets.extend(s.generated)
        adv.extend([s.advantage] * len(s.generated))
        engine.extend(s.engine_logprobs)
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        seq_lens=seq_lens,
        starts=[int(x) for x in starts],
        pred_rows=torch.from_numpy(np.concatenate(pred)) if pred else torch.zeros(0, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        advantages=torch.tensor(adv, dtype=torch.float32),
        engine_logprobs=torch.tensor(engine, dtype=torch.float64),
    )


def sampled_logprobs(logits_BTV: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """The trainer's log-probability (float32) of every generated token of ``batch``."""
    flat = logits_BTV.reshape(-1, logits_BTV.shape[-1])
    rows = flat[batch.pred_rows.to(flat.device)].float()
    return torch.log_softmax(rows, dim=-1).gather(1, batch.targets.to(flat.device)[:, None]).squeeze(1)


def grpo_loss(
    logp_N: torch.Tensor, batch: PackedBatch, *, total_tokens: int | None = None, old_logp_N: torch.Tensor | None = None
) -> torch.Tensor:
    """The on-policy GRPO loss of the module docstring: the sum over ``batch``'s generated tokens
    divided by ``total_tokens`` (default: this batch's; a micro-batch passes the whole batch's,
    so that accumulated micro-batch gradients are the whole batch's token mean).

    ``old_logp_N``: the log-probabilities the ratio is taken against (default: ``logp_N`` itself,
    detached: on-policy, ratio 1); the loss after an optimizer step, against the log-probabilities
    before it, says whether the step improved the objective."""
    old = logp_N.detach() if old_logp_N is None else old_logp_N.to(logp_N.device)
    ratio = torch.exp(logp_N - old)
    return -(batch.advantages.to(logp_N.device) * ratio).sum() / max(1, total_tokens or logp_N.numel())


def micro_batches(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    """``samples`` in order, cut into micro-batches of at most ``max_tokens`` tokens (a sample
    longer than that is a micro-batch of its own): packed attention is quadratic in a pack's length."""
    out: list[list[Sample]] = []
    size = 0
    for s in samples:
        n = len(s.tokens)
        if out and size + n <= max_tokens:
            out[-1].append(s)
            size += n
        else:
            out.append([s])
            size = n
    return out
