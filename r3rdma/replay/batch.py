"""What to replay: the recorded expert ids of every row the MoE routers of one training forward see.

A :class:`ReplayBatch` lays out stored routing (a :class:`~r3rdma.read.packed.PackedRouting`
or per-request tensors) as the routers' rows, padded or packed, with the rows that have no
recorded routing marked (padding; the last token of each sequence, which never was the input
of a rollout forward): the caller declares them, nothing falls back silently. It checks
itself against a model's routers (:meth:`ReplayBatch.check_fits`); the framework adapters in
:mod:`r3rdma.integrations` force its ids in the forward. See docs/REPLAY.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from r3rdma.errors import ReplayError, ShapeMismatchError
from r3rdma.read.reader import PackedRouting

__all__ = ["ReplayBatch"]


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

    ids_NLK: torch.Tensor  # int64
    recorded_N: torch.Tensor  # bool
    layer_map: tuple[int, ...] | None = None
    num_experts: int | None = None

    def __post_init__(self) -> None:
        if self.ids_NLK.dim() != 3:
            raise ShapeMismatchError(f"ids_NLK must be [N, L, K], got shape {tuple(self.ids_NLK.shape)}")
        if self.recorded_N.shape != (self.ids_NLK.shape[0],) or self.recorded_N.dtype != torch.bool:
            raise ShapeMismatchError(
                f"recorded_N must be bool [{self.ids_NLK.shape[0]}], got {self.recorded_N.dtype} {tuple(self.recorded_N.shape)}"
            )
        if self.layer_map is not None and len(self.layer_map) != self.ids_NLK.shape[1]:
            raise ShapeMismatchError(f"layer_map has {len(self.layer_map)} layers, ids_NLK {self.ids_NLK.shape[1]}")

    @property
    def num_tokens(self) -> int:
        """Rows the routers see (``N``)."""
        return int(self.ids_NLK.shape[0])

    @property
    def num_layers(self) -> int:
        """MoE layers (``L``)."""
        return int(self.ids_NLK.shape[1])

    @property
    def top_k(self) -> int:
        """Experts per row and layer (``K``)."""
        return int(self.ids_NLK.shape[2])

    @property
    def num_recorded(self) -> int:
        """Rows with recorded routing (the others use the router's live top-k)."""
        return int(self.recorded_N.sum())

    def to(self, device: torch.device | str) -> ReplayBatch:
        """The same batch with its tensors on ``device``."""
        return ReplayBatch(self.ids_NLK.to(device), self.recorded_N.to(device), self.layer_map, self.num_experts)

    def check_fits(self, *, layer_map: Sequence[int], top_k: int, num_experts: int) -> None:
        """Raise :class:`ShapeMismatchError` unless this batch fits a model whose MoE routers sit
        in decoder layers ``layer_map``, choose ``top_k`` experts each and accept ids
        ``0 .. num_experts - 1``."""
        layer_map = tuple(layer_map)
        if self.num_layers != len(layer_map):
            raise ShapeMismatchError(
                f"model has {len(layer_map)} MoE layers (decoder layers {layer_map}), routing has {self.num_layers}"
            )
        if self.layer_map is not None and tuple(self.layer_map) != layer_map:
            raise ShapeMismatchError(f"model MoE layers are {layer_map}, routing's layer_map is {self.layer_map}")
        if self.top_k != top_k:
            raise ShapeMismatchError(f"model routers use top_k={top_k}, routing has top_k={self.top_k}")
        if self.num_experts is not None and self.num_experts != num_experts:
            raise ShapeMismatchError(f"model routers have {num_experts} experts, routing was recorded with {self.num_experts}")
        recorded = self.ids_NLK[self.recorded_N]
        if recorded.numel():
            lo, hi = int(recorded.min()), int(recorded.max())
            if lo < 0 or hi >= num_experts:
                raise ShapeMismatchError(f"recorded expert ids span {lo}..{hi}, the model's routers accept 0..{num_experts - 1}")

    # -- builders -------------------------------------------------------------------------------

    @classmethod
    def from_ids(
        cls,
        ids_NLK: torch.Tensor,
        *,
        recorded_N: torch.Tensor | None = None,
        layer_map: Sequence[int] | None = None,
        num_experts: int | None = None,
    ) -> ReplayBatch:
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
    ) -> ReplayBatch:
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
            raise ShapeMismatchError(f"attention_mask must be [B, S] with B = {len(pieces)} requests, got {tuple(mask.shape)}")
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
    ) -> ReplayBatch:
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


def _pieces(
    routing: PackedRouting | Sequence[torch.Tensor], layer_map: Sequence[int] | None, num_experts: int | None
) -> tuple[list[torch.Tensor], tuple[int, ...] | None, int | None]:
    """Per-request routing tensors in batch order, with the layer map and expert count to keep
    (the routing's own when it is a :class:`PackedRouting`, else the caller's)."""
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
            f"{what}: {tokens} tokens with unrecorded_tail={tail} needs {tokens - tail} recorded rows, routing has {rows}"
        )
    return rows
