"""Router replay in a Hugging Face transformers model's training forward (Rollout Routing Replay).

While a :class:`RouterReplay` is attached to a model, every MoE router returns the *recorded*
top-k expert ids instead of its own, with gate weights recomputed from the trainer's own router
logits by the router's score function (see :mod:`r3rdma.integrations.hf_replay`). The router
logits are untouched, so the router keeps receiving gradients (through the gate weights and any
auxiliary loss). These are Megatron-LM's ``RouterReplay`` semantics.

Typical use::

    routing = reader.get_packed(rollout_id, request_ids)
    batch = ReplayBatch.packed(routing, seq_lens=[len(t) for t in token_lists])
    with RouterReplay(model) as replay:
        replay.set_routing(batch)
        loss = loss_fn(model(input_ids=packed_ids, position_ids=packed_positions).logits)
        loss.backward()                      # recomputation (checkpointing) replays the same ids
        print(replay.last_report)            # live vs replayed top-k agreement of that forward

Tokens without a recorded row (padding; the last token of each sequence, which never was the
input of a rollout forward) must be declared by the caller when the :class:`ReplayBatch` is
built; only those use the router's live top-k. Nothing falls back silently: a router called with
no routing set, or with a token count, layer count, top-k or expert range that does not match,
raises. See docs/REPLAY.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from r3rdma.errors import ReplayError, ShapeMismatchError
from r3rdma.integrations.hf_replay import GateWeightsFn, gate_weights_fn
from r3rdma.integrations.hf_routers import MoeRouter, find_moe_routers
from r3rdma.replay import ReplayBatch, ReplayReport, choices_differ

__all__ = ["RouterReplay"]


@dataclass(slots=True)
class _ForwardTally:
    """What one forward's routers found, for its :class:`ReplayReport`: per MoE layer the number
    of recorded decisions whose live choice differs (None until that layer's router ran), and per
    token whether any layer differed so far."""

    layers: list[torch.Tensor | None]
    any_N: torch.Tensor | None = None


class RouterReplay:
    """Replays recorded routing in every MoE router of ``model`` (attached on construction).

    ``set_routing`` gives the ids of the next training forward(s); they stay in force until
    the next ``set_routing`` or ``clear`` so that activation recomputation in the backward
    (gradient checkpointing) consumes exactly the ids the forward used. Live ids used for
    unrecorded rows are pinned on the first router call after ``set_routing`` for the same
    reason. A router called while no routing is set raises :class:`ReplayError`; call
    :meth:`detach` (or leave the ``with`` block) to run the model without replay.

    Forward accounting: calls of ``track`` (default ``model``; pass the module you actually
    call) delimit a forward; each produces a :class:`ReplayReport` (``last_report``, and
    ``on_report`` if given). Router calls outside such a forward are recomputation: they replay
    but do not count (``recomputes``).

    Args:
        model: a transformers MoE model (routers found with :func:`find_moe_routers`).
        check_gate_weights: on each router's first call, check that the score function used
            for replay returns the router's own weights bit for bit at its own ids.
        on_report: called with each forward's :class:`ReplayReport`.
        track: the module whose calls delimit a forward (default ``model``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        check_gate_weights: bool = True,
        on_report: Callable[[ReplayReport], None] | None = None,
        track: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        self.routers: list[MoeRouter] = find_moe_routers(model)
        self._fns: list[GateWeightsFn] = [gate_weights_fn(r.module) for r in self.routers]
        self.layer_map = tuple(r.layer_idx for r in self.routers)
        self.top_k = self.routers[0].top_k
        self.num_experts = max(r.num_experts for r in self.routers)
        self.check_gate_weights = check_gate_weights
        self.on_report = on_report
        self._track = track if track is not None else model
        self._batch: ReplayBatch | None = None
        self._pinned: list[torch.Tensor | None] = [None] * len(self.routers)
        self._checked = [not check_gate_weights] * len(self.routers)
        self._depth = 0
        self._acc: _ForwardTally | None = None
        self.last_report: ReplayReport | None = None
        self.forwards = 0
        self.recomputes = 0
        self._handles: list = []
        self.attach()

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        """Whether the router hooks are in place (replay is on)."""
        return bool(self._handles)

    def attach(self) -> None:
        """Hook every router and the tracked module (done on construction; again after :meth:`detach`). Idempotent."""
        if self._handles:
            return
        self._handles = [r.module.register_forward_hook(self._router_hook(r)) for r in self.routers]
        self._handles.append(self._track.register_forward_pre_hook(self._begin_forward))
        self._handles.append(self._track.register_forward_hook(self._end_forward, always_call=True))

    def detach(self) -> None:
        """Remove the hooks: the model routes live again; the routing set stays for a later :meth:`attach`."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._depth = 0
        self._acc = None

    def __enter__(self) -> RouterReplay:
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- data -----------------------------------------------------------------------------------

    def set_routing(self, batch: ReplayBatch) -> None:
        """Replay ``batch`` in the following forwards (and their recomputation)."""
        if not isinstance(batch, ReplayBatch):
            raise TypeError(f"set_routing takes a ReplayBatch, got {type(batch).__name__}")
        batch.check_fits(layer_map=self.layer_map, top_k=self.top_k, num_experts=self.num_experts)
        device = next(self.routers[0].module.parameters()).device
        self._batch = batch.to(device)
        self._pinned = [None] * len(self.routers)

    def clear(self) -> None:
        """Forget the routing; a router called afterwards raises until ``set_routing``."""
        self._batch = None
        self._pinned = [None] * len(self.routers)

    # -- hooks ----------------------------------------------------------------------------------

    def _begin_forward(self, _module, _args) -> None:
        self._depth += 1
        if self._depth == 1:
            self._acc = _ForwardTally(layers=[None] * len(self.routers))

    def _end_forward(self, _module, _args, _output) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth:
            return
        acc, self._acc = self._acc, None
        if acc is None or self._batch is None or any(x is None for x in acc.layers):
            # No router ran, or the forward failed part-way: no report for it.
            return
        batch = self._batch
        per_layer = [int(x) if x is not None else 0 for x in acc.layers]
        n_rec = batch.num_recorded
        report = ReplayReport(
            num_layers=len(self.routers),
            top_k=self.top_k,
            recorded_tokens=n_rec,
            unrecorded_tokens=batch.num_tokens - n_rec,
            decisions=n_rec * len(self.routers) * self.top_k,
            decisions_differ=sum(per_layer),
            tokens_any_layer_differ=int(acc.any_N.sum()) if acc.any_N is not None else 0,
            layer_decisions_differ=tuple(per_layer),
        )
        self.forwards += 1
        self.last_report = report
        if self.on_report is not None:
            self.on_report(report)

    def _router_hook(self, router: MoeRouter):
        moe_idx = router.moe_idx
        fn = self._fns[moe_idx]

        def hook(module: torch.nn.Module, _args: object, output: tuple[torch.Tensor, ...]):
            batch = self._batch
            if batch is None:
                raise ReplayError(
                    f"router {router.name} (decoder layer {router.layer_idx}) ran with RouterReplay attached "
                    "but no routing set: call set_routing(...) or detach the replay"
                )
            logits_TE, scores_TK, live_TK = output
            if live_TK.shape[0] != batch.num_tokens:
                raise ShapeMismatchError(
                    f"router {router.name} saw {live_TK.shape[0]} token rows, the replay batch has "
                    f"{batch.num_tokens} (padded [B, S] batches have B * S rows, packed ones T)"
                )
            if live_TK.shape[1] != batch.top_k:
                raise ShapeMismatchError(f"router {router.name} returns top_k={live_TK.shape[1]}, routing has {batch.top_k}")
            if not self._checked[moe_idx]:
                # Under no_grad: the check must save no tensors for autograd, or activation
                # recomputation (which skips it) would save a different set than the forward.
                with torch.no_grad():
                    own = fn(module, logits_TE, live_TK)
                if own.dtype != scores_TK.dtype or not torch.equal(own, scores_TK):
                    raise ReplayError(
                        f"the replay gate-weight function for {type(module).__name__} does not reproduce the "
                        f"router's own weights at its own ids (max abs diff "
                        f"{(own.float() - scores_TK.float()).abs().max().item():.3g}, dtypes {own.dtype} vs "
                        f"{scores_TK.dtype}); the router's forward changed, update r3rdma.integrations.hf_replay"
                    )
                self._checked[moe_idx] = True
            ids_TK = self._pinned[moe_idx]
            if ids_TK is None:
                recorded_TK = batch.ids_NLK[:, moe_idx, :]
                ids_TK = torch.where(batch.recorded_N.unsqueeze(-1), recorded_TK, live_TK.to(torch.int64))
                self._pinned[moe_idx] = ids_TK
            acc = self._acc if self._depth > 0 else None  # None: recomputation, outside a tracked forward
            if acc is not None:
                with torch.no_grad():
                    rec = batch.recorded_N
                    differ_TK = choices_differ(ids_TK, live_TK) & rec.unsqueeze(-1)
                    acc.layers[moe_idx] = differ_TK.sum()
                    any_T = differ_TK.any(-1)
                    acc.any_N = any_T if acc.any_N is None else (acc.any_N | any_T)
            else:
                self.recomputes += 1
            weights_TK = fn(module, logits_TE, ids_TK)
            return (logits_TE, weights_TK, ids_TK)

        return hook
