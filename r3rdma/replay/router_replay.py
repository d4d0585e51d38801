"""Router replay in the training forward (Rollout Routing Replay, trainer side).

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

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from r3rdma.errors import ReplayError, ShapeMismatchError
from r3rdma.integrations.hf_replay import GateWeightsFn, gate_weights_fn
from r3rdma.integrations.hf_routers import MoeRouter, find_moe_routers
from r3rdma.read.reader import PackedRouting

__all__ = ["ReplayBatch", "ReplayReport", "RouterReplay", "routing_agreement"]


# ---------------------------------------------------------------------------------------------
# What to replay
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class ReplayBatch:
    """Recorded ids for every row the routers of one training forward see.

    Routers see the batch flattened to ``N`` rows: ``B * S`` for a padded ``[B, S]`` batch
    (row ``b * S + s``), ``T`` for packed sequences in a ``[1, T]`` batch. ``ids_NLK[n, l]``
    are the experts of MoE layer ``l`` (``layer_map[l]`` is its decoder layer) for row ``n``;
    rows with ``recorded_N[n] == False`` have no recorded routing and use the router's live
    top-k (pinned on the first forward; see :class:`RouterReplay`). Build it with
    :meth:`padded`, :meth:`packed` or :meth:`from_ids`.
    """

    ids_NLK: torch.Tensor        # int64
    recorded_N: torch.Tensor     # bool
    layer_map: tuple[int, ...] | None = None
    num_experts: int | None = None

    def __post_init__(self) -> None:
        if self.ids_NLK.dim() != 3:
            raise ShapeMismatchError(f"ids_NLK must be [N, L, K], got shape {tuple(self.ids_NLK.shape)}")
        if self.recorded_N.shape != (self.ids_NLK.shape[0],) or self.recorded_N.dtype != torch.bool:
            raise ShapeMismatchError(
                f"recorded_N must be bool [{self.ids_NLK.shape[0]}], got {self.recorded_N.dtype} "
                f"{tuple(self.recorded_N.shape)}"
            )
        if self.layer_map is not None and len(self.layer_map) != self.ids_NLK.shape[1]:
            raise ShapeMismatchError(
                f"layer_map has {len(self.layer_map)} layers, ids_NLK {self.ids_NLK.shape[1]}"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.ids_NLK.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.ids_NLK.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.ids_NLK.shape[2])

    @property
    def num_recorded(self) -> int:
        return int(self.recorded_N.sum())

    def to(self, device: torch.device | str) -> "ReplayBatch":
        return ReplayBatch(self.ids_NLK.to(device), self.recorded_N.to(device), self.layer_map, self.num_experts)

    # -- builders -------------------------------------------------------------------------------

    @classmethod
    def from_ids(
        cls,
        ids_NLK: torch.Tensor,
        *,
        recorded_N: torch.Tensor | None = None,
        layer_map: Sequence[int] | None = None,
        num_experts: int | None = None,
    ) -> "ReplayBatch":
        """Ids already laid out as the routers' rows. ``recorded_N=None`` means every row is
        recorded. ``ids_NLK`` may also be ``[B, S, L, K]`` (flattened to ``B * S`` rows)."""
        if ids_NLK.dim() == 4:
            ids_NLK = ids_NLK.reshape(-1, *ids_NLK.shape[2:])
        if recorded_N is None:
            recorded_N = torch.ones(ids_NLK.shape[0], dtype=torch.bool, device=ids_NLK.device)
        else:
            recorded_N = recorded_N.reshape(-1).to(torch.bool)
        return cls(
            _as_int64(ids_NLK),
            recorded_N,
            tuple(int(x) for x in layer_map) if layer_map is not None else None,
            num_experts,
        )

    @classmethod
    def padded(
        cls,
        routing: PackedRouting | Sequence[torch.Tensor],
        attention_mask_BS: torch.Tensor,
        *,
        unrecorded_tail: int | Sequence[int] = 1,
        layer_map: Sequence[int] | None = None,
        num_experts: int | None = None,
    ) -> "ReplayBatch":
        """A padded ``[B, S]`` batch (left or right padding) of one request per row.

        ``routing`` holds request ``b``'s rows ``[rows_b, L, K]`` for batch row ``b`` (a
        :class:`PackedRouting` in batch order, or a list of tensors from ``RoutingReader.get``).
        The ``n_b`` real tokens of row ``b`` (``attention_mask_BS[b] == 1``, in order) are the
        request's positions ``0 .. n_b - 1``; exactly ``unrecorded_tail`` trailing tokens per
        sequence have no row (1 when the trainer feeds prompt + all generated tokens: the last
        sampled token never was a rollout input). ``rows_b != n_b - unrecorded_tail`` raises.
        Padding positions are unrecorded.
        """
        pieces, layer_map, num_experts = _pieces(routing, layer_map, num_experts)
        mask = attention_mask_BS.detach().to("cpu").bool()
        if mask.dim() != 2 or mask.shape[0] != len(pieces):
            raise ShapeMismatchError(
                f"attention_mask must be [B, S] with B = {len(pieces)} requests, got {tuple(mask.shape)}"
            )
        B, S = mask.shape
        tails = _tails(unrecorded_tail, B)
        L, K = _geometry(pieces)
        ids = torch.zeros((B, S, L, K), dtype=torch.int64)
        recorded = torch.zeros((B, S), dtype=torch.bool)
        for b, piece in enumerate(pieces):
            cols = mask[b].nonzero().squeeze(-1)
            rows = _expect_rows(piece, int(cols.numel()), tails[b], f"batch row {b}")
            ids[b, cols[:rows]] = piece.to(torch.int64)
            recorded[b, cols[:rows]] = True
        return cls(ids.reshape(B * S, L, K), recorded.reshape(B * S), layer_map, num_experts)

    @classmethod
    def packed(
        cls,
        routing: PackedRouting | Sequence[torch.Tensor],
        seq_lens: Sequence[int],
        *,
        unrecorded_tail: int | Sequence[int] = 1,
        total_tokens: int | None = None,
        layer_map: Sequence[int] | None = None,
        num_experts: int | None = None,
    ) -> "ReplayBatch":
        """Sequences packed along tokens (a ``[1, T]`` batch with position-id resets, or varlen
        ``cu_seqlens``), in the order of ``routing``.

        Sequence ``i`` has ``seq_lens[i]`` tokens and must have exactly
        ``seq_lens[i] - unrecorded_tail`` rows. ``total_tokens`` (default ``sum(seq_lens)``)
        may add trailing padding of the packed buffer, which is unrecorded.
        """
        pieces, layer_map, num_experts = _pieces(routing, layer_map, num_experts)
        if len(seq_lens) != len(pieces):
            raise ShapeMismatchError(f"{len(seq_lens)} seq_lens for {len(pieces)} requests of routing")
        tails = _tails(unrecorded_tail, len(pieces))
        total = sum(int(n) for n in seq_lens)
        if total_tokens is None:
            total_tokens = total
        if total_tokens < total:
            raise ShapeMismatchError(f"total_tokens {total_tokens} < sum(seq_lens) {total}")
        L, K = _geometry(pieces)
        ids = torch.zeros((total_tokens, L, K), dtype=torch.int64)
        recorded = torch.zeros(total_tokens, dtype=torch.bool)
        start = 0
        for i, (piece, n) in enumerate(zip(pieces, seq_lens)):
            rows = _expect_rows(piece, int(n), tails[i], f"sequence {i}")
            ids[start : start + rows] = piece.to(torch.int64)
            recorded[start : start + rows] = True
            start += int(n)
        return cls(ids, recorded, layer_map, num_experts)


def _as_int64(ids: torch.Tensor) -> torch.Tensor:
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ShapeMismatchError(f"routing ids must be an integer tensor, got {ids.dtype}")
    return ids.to(torch.int64)


def _pieces(routing, layer_map, num_experts):
    if isinstance(routing, PackedRouting):
        if any(s != 0 for s in routing.start_rows):
            bad = [r for r, s in zip(routing.request_ids, routing.start_rows) if s != 0]
            raise ReplayError(
                f"requests {bad[:5]} were stored from a later position (start_rows != 0); replay needs "
                "rows from position 0 of every sequence it trains on"
            )
        cu = routing.cu_seqlens.tolist()
        pieces = [routing.ids_TLK[cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]
        if layer_map is not None and tuple(layer_map) != tuple(routing.layer_map):
            raise ShapeMismatchError(f"layer_map {tuple(layer_map)} given, routing has {routing.layer_map}")
        return pieces, tuple(routing.layer_map), routing.num_experts
    if isinstance(routing, Mapping):
        raise TypeError("pass the routing tensors as a list in batch order, e.g. [got[r] for r in request_ids]")
    return list(routing), (tuple(layer_map) if layer_map is not None else None), num_experts


def _geometry(pieces: Sequence[torch.Tensor]) -> tuple[int, int]:
    if not pieces:
        raise ShapeMismatchError("no sequences to replay")
    shapes = {tuple(p.shape[1:]) for p in pieces}
    if len(shapes) != 1 or any(p.dim() != 3 for p in pieces):
        raise ShapeMismatchError(f"routing tensors must all be [rows, L, K] with one L, K; got {sorted(shapes)}")
    for p in pieces:
        _as_int64(p[:0])
    L, K = shapes.pop()
    return L, K


def _tails(unrecorded_tail: int | Sequence[int], n: int) -> list[int]:
    tails = [int(unrecorded_tail)] * n if isinstance(unrecorded_tail, int) else [int(t) for t in unrecorded_tail]
    if len(tails) != n or any(t < 0 for t in tails):
        raise ShapeMismatchError(f"unrecorded_tail must be one int >= 0 or {n} of them, got {unrecorded_tail!r}")
    return tails


def _expect_rows(piece: torch.Tensor, tokens: int, tail: int, what: str) -> int:
    rows = int(piece.shape[0])
    if rows != tokens - tail:
        raise ShapeMismatchError(
            f"{what}: {tokens} tokens with unrecorded_tail={tail} needs {tokens - tail} recorded rows, "
            f"routing has {rows}"
        )
    return rows


# ---------------------------------------------------------------------------------------------
# What replay observed
# ---------------------------------------------------------------------------------------------


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
        return self.decisions_differ / self.decisions if self.decisions else 0.0

    @property
    def tokens_any_layer_differ_frac(self) -> float:
        return self.tokens_any_layer_differ / self.recorded_tokens if self.recorded_tokens else 0.0

    def as_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "top_k": self.top_k,
            "recorded_tokens": self.recorded_tokens,
            "unrecorded_tokens": self.unrecorded_tokens,
            "decisions": self.decisions,
            "decisions_differ": self.decisions_differ,
            "decisions_differ_frac": self.decisions_differ_frac,
            "tokens_any_layer_differ": self.tokens_any_layer_differ,
            "tokens_any_layer_differ_frac": self.tokens_any_layer_differ_frac,
            "layer_decisions_differ": list(self.layer_decisions_differ),
        }


def routing_agreement(a_TLK: torch.Tensor, b_TLK: torch.Tensor) -> tuple[int, int, list[int]]:
    """``(decisions_differ, tokens_any_layer_differ, per-layer decisions_differ)`` between two
    routings of the same tokens, comparing top-k sets (order ignored)."""
    if a_TLK.shape != b_TLK.shape:
        raise ShapeMismatchError(f"routings differ in shape: {tuple(a_TLK.shape)} vs {tuple(b_TLK.shape)}")
    with torch.no_grad():
        differ_TLK = _differ(a_TLK.to(torch.int64), b_TLK.to(torch.int64).to(a_TLK.device))
        per_layer = differ_TLK.sum(dim=(0, 2))
        any_T = differ_TLK.flatten(1).any(-1)
        return int(per_layer.sum()), int(any_T.sum()), [int(x) for x in per_layer.tolist()]


def _differ(replayed: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    # [..., K] bool: replayed[..., k] is not among live[..., :].
    return ~(replayed.unsqueeze(-1) == live.unsqueeze(-2)).any(-1)


# ---------------------------------------------------------------------------------------------
# The hooks
# ---------------------------------------------------------------------------------------------


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
        self._acc: dict | None = None
        self.last_report: ReplayReport | None = None
        self.forwards = 0
        self.recomputes = 0
        self._handles: list = []
        self.attach()

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> None:
        if self._handles:
            return
        self._handles = [r.module.register_forward_hook(self._router_hook(r)) for r in self.routers]
        self._handles.append(self._track.register_forward_pre_hook(self._begin_forward))
        self._handles.append(self._track.register_forward_hook(self._end_forward, always_call=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._depth = 0
        self._acc = None

    def __enter__(self) -> "RouterReplay":
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- data -----------------------------------------------------------------------------------

    def set_routing(self, batch: ReplayBatch) -> None:
        """Replay ``batch`` in the following forwards (and their recomputation)."""
        if not isinstance(batch, ReplayBatch):
            raise TypeError(f"set_routing takes a ReplayBatch, got {type(batch).__name__}")
        if batch.num_layers != len(self.routers):
            raise ShapeMismatchError(
                f"model has {len(self.routers)} MoE layers (decoder layers {self.layer_map}), "
                f"routing has {batch.num_layers}"
            )
        if batch.layer_map is not None and tuple(batch.layer_map) != self.layer_map:
            raise ShapeMismatchError(f"model MoE layers are {self.layer_map}, routing's layer_map is {batch.layer_map}")
        if batch.top_k != self.top_k:
            raise ShapeMismatchError(f"model routers use top_k={self.top_k}, routing has top_k={batch.top_k}")
        if batch.num_experts is not None and batch.num_experts != self.num_experts:
            raise ShapeMismatchError(f"model routers have {self.num_experts} experts, routing was recorded with {batch.num_experts}")
        recorded = batch.ids_NLK[batch.recorded_N]
        if recorded.numel():
            lo, hi = int(recorded.min()), int(recorded.max())
            if lo < 0 or hi >= self.num_experts:
                raise ShapeMismatchError(
                    f"recorded expert ids span {lo}..{hi}, the model's routers accept 0..{self.num_experts - 1}"
                )
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
            self._acc = {"layers": [None] * len(self.routers), "any_N": None}

    def _end_forward(self, _module, _args, _output) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth:
            return
        acc, self._acc = self._acc, None
        if acc is None or self._batch is None or any(x is None for x in acc["layers"]):
            # No router ran, or the forward failed part-way: no report for it.
            return
        batch = self._batch
        per_layer = [int(x) if x is not None else 0 for x in acc["layers"]]
        n_rec = batch.num_recorded
        report = ReplayReport(
            num_layers=len(self.routers),
            top_k=self.top_k,
            recorded_tokens=n_rec,
            unrecorded_tokens=batch.num_tokens - n_rec,
            decisions=n_rec * len(self.routers) * self.top_k,
            decisions_differ=sum(per_layer),
            tokens_any_layer_differ=int(acc["any_N"].sum()) if acc["any_N"] is not None else 0,
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
            in_forward = self._depth > 0 and self._acc is not None
            if in_forward:
                with torch.no_grad():
                    rec = batch.recorded_N
                    differ_TK = _differ(ids_TK, live_TK) & rec.unsqueeze(-1)
                    self._acc["layers"][moe_idx] = differ_TK.sum()
                    any_T = differ_TK.any(-1)
                    self._acc["any_N"] = any_T if self._acc["any_N"] is None else (self._acc["any_N"] | any_T)
            else:
                self.recomputes += 1
            weights_TK = fn(module, logits_TE, ids_TK)
            return (logits_TE, weights_TK, ids_TK)

        return hook
