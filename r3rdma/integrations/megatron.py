"""Replay stored routing through Megatron-core's ``RouterReplay`` (megatron-core >= 0.16).

Megatron gives every ``TopKRouter`` built with ``moe_enable_routing_replay=True`` one
``megatron.core.transformer.moe.router_replay.RouterReplay``; under ``REPLAY_FORWARD`` the
router's top-k is replaced by the ids set with ``set_target_indices([tokens, topk])`` and the
gate weights are gathered from the trainer's own scores (``scores.gather(1, ids)``), so the
router keeps its gradient. This module computes, for one micro-batch and one rank, the target
of each local router from a :class:`~r3rdma.read.reader.PackedRouting`:

- rows in the order the router sees them, ``logits.view(-1, E)`` of ``[s, b, E]`` logits:
  sequence-major (row ``s * b_size + b`` for a padded ``[b, s]`` batch, the packed token for
  THD), after the context-parallel split (each sequence cut into ``2 * cp`` chunks, rank ``r``
  keeps chunks ``r`` and ``2 * cp - 1 - r``), then the sequence-parallel split (TP rank ``r``
  keeps rows ``[r * N / tp, (r + 1) * N / tp)``);
- layers: each router's decoder layer (``router.layer_number - 1``, global: Megatron adds the
  pipeline and virtual-stage offset) looked up in the routing's ``layer_map``; a pipeline
  stage reads only its own (:attr:`MegatronReplay.layers`, passed as ``layers=`` to
  :func:`prefetch_routing` or the reader);
- rows the rollout never computed (each sequence's last ``unrecorded_tail`` tokens, padding):
  megatron-core 0.16 has no replay mask, so they get the spread, duplicate-free fill
  ``(row * k + j) % E`` with ``row`` the token's row in the unsplit micro-batch (never all
  zeros, never one constant expert).

:class:`MegatronReplay` refuses configurations where Megatron would route live without
saying so (router fusion, sinkhorn, replay not enabled, token dropping, MTP routers) and
forwards without routing. Install with ``pip install r3rdma[megatron]``.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from r3rdma.errors import ConfigError, ReplayError, ShapeMismatchError
from r3rdma.read.rows import cp_row_spans

try:
    from megatron.core.transformer.moe.router import Router, TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock, MultiTokenPredictionLayer
except ImportError as e:  # pragma: no cover - exercised only without megatron-core
    raise ImportError("r3rdma.integrations.megatron needs megatron-core >= 0.16: pip install r3rdma[megatron]") from e

__all__ = [
    "MegatronReplay",
    "MicroBatch",
    "ParallelLayout",
    "ReplayRouter",
    "cp_rows",
    "rank_rows",
    "local_routing_rows",
    "prefetch_routing",
]


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """Where this rank sits: tensor parallel (with or without sequence parallel) and context
    parallel. Pipeline and virtual stages need nothing here: the routers' layer numbers carry
    them (:attr:`MegatronReplay.layers`: the layers a stage reads). Sizes must agree with the
    routers' ``TransformerConfig`` (checked)."""

    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    cp_size: int = 1
    cp_rank: int = 0

    def __post_init__(self) -> None:
        for size, rank, name in ((self.tp_size, self.tp_rank, "tp"), (self.cp_size, self.cp_rank, "cp")):
            if size < 1 or not 0 <= rank < size:
                raise ConfigError(f"{name}_rank must be in [0, {name}_size), got rank {rank} of size {size}")

    @classmethod
    def from_parallel_state(cls, *, sequence_parallel: bool) -> ParallelLayout:
        """This rank's layout from ``megatron.core.parallel_state`` (initialised model parallel)."""
        from megatron.core import parallel_state as ps

        return cls(
            tp_size=ps.get_tensor_model_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            sequence_parallel=sequence_parallel,
            cp_size=ps.get_context_parallel_world_size(),
            cp_rank=ps.get_context_parallel_rank(),
        )


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch as the trainer packed it.

    ``seq_lens[i]``: tokens of sequence ``i`` in the trainer's input; the store holds
    ``seq_lens[i] - unrecorded_tail`` rows for it (1 by the format's definition: the last
    sampled token never was a rollout input; 0 if the trainer drops it). ``fmt="padded"``:
    tokens ``[b, seq_length]``, sequence ``i`` in batch row ``i``, right-padded.
    ``fmt="thd"``: sequences back to back, sequence ``i`` occupying
    ``[cu_seqlens_padded[i], cu_seqlens_padded[i + 1])`` (its tokens first, then its padding).
    """

    request_ids: tuple[str, ...]
    seq_lens: tuple[int, ...]
    fmt: Literal["padded", "thd"]
    seq_length: int
    cu_seqlens_padded: tuple[int, ...] | None = None
    unrecorded_tail: int = 1

    def __post_init__(self) -> None:
        if len(self.request_ids) != len(self.seq_lens) or not self.request_ids:
            raise ConfigError(f"need one seq_len per request id, got {len(self.request_ids)} ids, {len(self.seq_lens)} lengths")
        if self.unrecorded_tail < 0 or any(n <= self.unrecorded_tail - 1 or n < 1 for n in self.seq_lens):
            raise ConfigError(f"seq_lens must be >= max(1, unrecorded_tail={self.unrecorded_tail}), got {self.seq_lens}")
        if self.fmt == "padded":
            if max(self.seq_lens) > self.seq_length:
                raise ConfigError(f"a sequence of {max(self.seq_lens)} tokens does not fit seq_length {self.seq_length}")
        elif self.fmt == "thd":
            cu = self.cu_seqlens_padded
            if cu is None or len(cu) != len(self.seq_lens) + 1 or cu[0] != 0 or cu[-1] != self.seq_length:
                raise ConfigError(
                    f"cu_seqlens_padded must be [0, ..., seq_length={self.seq_length}] with one entry per sequence + 1, got {cu}"
                )
            if any(cu[i + 1] - cu[i] < n for i, n in enumerate(self.seq_lens)):
                raise ConfigError(
                    f"a padded sequence is shorter than its tokens: seq_lens {self.seq_lens}, cu_seqlens_padded {cu}"
                )
        else:
            raise ConfigError(f"fmt must be 'padded' or 'thd', got {self.fmt!r}")

    @classmethod
    def padded(
        cls, request_ids: Sequence[str], seq_lens: Sequence[int], seq_length: int, *, unrecorded_tail: int = 1
    ) -> MicroBatch:
        """A right-padded ``[b, seq_length]`` batch."""
        return cls(tuple(request_ids), tuple(int(n) for n in seq_lens), "padded", int(seq_length), None, unrecorded_tail)

    @classmethod
    def thd(
        cls,
        request_ids: Sequence[str],
        seq_lens: Sequence[int],
        *,
        cu_seqlens_padded: Sequence[int] | None = None,
        pad_to_multiple_of: int = 1,
        unrecorded_tail: int = 1,
    ) -> MicroBatch:
        """A packed batch. Give Megatron's ``cu_seqlens_padded``, or let each sequence be
        padded to a multiple of ``pad_to_multiple_of`` (``2 * cp * tp`` with CP and SP)."""
        seq_lens = tuple(int(n) for n in seq_lens)
        if cu_seqlens_padded is None:
            m = int(pad_to_multiple_of)
            cu = [0]
            for n in seq_lens:
                cu.append(cu[-1] + -(-n // m) * m)
        else:
            cu = [int(c) for c in cu_seqlens_padded]
        return cls(tuple(request_ids), seq_lens, "thd", cu[-1], tuple(cu), unrecorded_tail)


def _cp_positions(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Megatron's load-balanced CP split of one sequence dimension (utils.get_batch_on_this_cp_rank,
    TE thd_get_partitioned_indices): ``2 * cp`` chunks, this rank keeps ``r`` and ``2cp-1-r``."""
    if cp_size == 1:
        return torch.arange(length)
    if length % (2 * cp_size):
        raise ShapeMismatchError(f"context parallel {cp_size} needs lengths divisible by {2 * cp_size}, got {length}")
    c = length // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)
    return torch.cat([first, second])


def rank_rows(batches: Iterable[MicroBatch], layout: ParallelLayout) -> dict[str, list[tuple[int, int]]]:
    """Each request's rows this rank's routers see, for the reader's ``rows=`` (``prefetch``,
    ``get_numpy``): only the row chunks holding them are fetched. Context parallel: each
    sequence's ``2 * cp`` chunk split (a thd batch over each sequence's padded span, a padded
    batch over ``seq_length``); sequence parallel: this TP rank's contiguous share of the
    rank's flattened rows (``[s, b]`` for a padded batch, the packed sequences for thd), so a
    request may get one span, two or none. :func:`prefetch_routing` reads them with ``layout=``,
    and :meth:`MegatronReplay.load` takes routing read either way (whole, or these rows)."""
    out: dict[str, list[tuple[int, int]]] = {}
    sp = layout.sequence_parallel and layout.tp_size > 1
    for batch in batches:
        if not sp:  # context parallel alone: each sequence's two chunks (cp_row_spans)
            for i, (rid, n) in enumerate(zip(batch.request_ids, batch.seq_lens)):
                cu = batch.cu_seqlens_padded
                padded = batch.seq_length if batch.fmt == "padded" or cu is None else cu[i + 1] - cu[i]
                out[rid] = cp_row_spans(n - batch.unrecorded_tail, padded, layout.cp_size, layout.cp_rank)
            continue
        pos, seq, _ = _rank_positions(batch, layout)
        recorded = pos < (torch.tensor(batch.seq_lens) - batch.unrecorded_tail)[seq]
        kept_pos, kept_seq = pos[recorded].numpy(), seq[recorded].numpy()
        for i, rid in enumerate(batch.request_ids):
            mine = kept_pos[kept_seq == i]  # ascending: a rank keeps each sequence's positions in order
            cuts = np.flatnonzero(np.diff(mine) != 1) + 1
            out[rid] = [(int(run[0]), int(run[-1]) + 1) for run in np.split(mine, cuts) if run.size]
    return out


def cp_rows(batches: Iterable[MicroBatch], layout: ParallelLayout) -> dict[str, list[tuple[int, int]]]:
    """:func:`rank_rows` (the name it had before it split sequence-parallel rows too)."""
    return rank_rows(batches, layout)


def local_routing_rows(
    routing: Any, batch: MicroBatch, layout: ParallelLayout, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's routing rows for ``batch``: ``(ids_NLK, recorded_N)``.

    ``ids_NLK`` is in the stored dtype, rows in the order the rank's routers see them; rows with
    ``recorded_N`` False (never computed by the rollout, or padding) hold ``(row * K + j) % E``,
    ``row`` being the token's row in the unsplit micro-batch.
    """
    return _local_rows(routing, routing.ids_TLK, batch, layout, num_experts)


def _local_rows(
    routing: Any, ids_TLK: torch.Tensor, batch: MicroBatch, layout: ParallelLayout, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`local_routing_rows` of ``ids_TLK``: ``routing``'s rows, some of its layers
    (``routing`` gives the requests and their row spans)."""
    if tuple(routing.request_ids) != tuple(batch.request_ids):
        missing = [r for r in batch.request_ids if r not in set(routing.request_ids)]
        raise ReplayError(
            f"routing holds requests {list(routing.request_ids)[:5]}..., the micro-batch needs "
            f"{list(batch.request_ids)[:5]}... (missing: {missing[:5]}); routing must be read for exactly this micro-batch, in its order"
        )
    if any(routing.start_rows):
        raise ReplayError(
            f"requests stored from a later position (start_rows {routing.start_rows}) cannot be replayed over whole sequences"
        )
    cu = routing.cu_seqlens.tolist()
    stored = torch.tensor([cu[i + 1] - cu[i] for i in range(len(cu) - 1)], dtype=torch.long)
    expected = torch.tensor([n - batch.unrecorded_tail for n in batch.seq_lens], dtype=torch.long)
    pos, seq, row = _rank_positions(batch, layout)
    recorded = pos < expected[seq]
    # A request read whole holds row p at p. One read by this rank's rows (prefetch_routing(
    # layout=), rank_rows) holds exactly the recorded positions this rank keeps, ascending: the
    # k-th of them (in the rank's row order, ascending per request too) is its read row k.
    kept = torch.bincount(seq[recorded], minlength=len(batch.seq_lens))
    sliced = stored != expected
    if sliced.any():
        bad = [
            (rid, int(expected[i]), int(kept[i]), int(stored[i]))
            for i, rid in enumerate(batch.request_ids)
            if sliced[i] and stored[i] != kept[i]
        ]
        if bad:
            raise ShapeMismatchError(
                f"stored rows must be seq_len - unrecorded_tail ({batch.unrecorded_tail}), or this context-parallel / "
                f"sequence-parallel rank's rows of it (rank_rows); (request, whole, this rank's, read): {bad[:5]}"
            )
    offset = pos.clone()
    if sliced.any():
        at = torch.nonzero(recorded & sliced[seq]).squeeze(1)  # rows of sliced requests, in the rank's order
        s_at = seq[at]
        order = torch.argsort(s_at, stable=True)
        first = torch.cumsum(torch.bincount(s_at, minlength=len(batch.seq_lens)), 0)
        first = first - torch.bincount(s_at, minlength=len(batch.seq_lens))
        nth = torch.empty_like(at)
        nth[order] = torch.arange(len(at)) - first[s_at[order]]
        offset[at] = nth
    starts = torch.tensor(cu[:-1], dtype=torch.long)
    src = torch.where(recorded, starts[seq] + offset, 0)
    ids = ids_TLK
    n_layers, k = ids.shape[1], ids.shape[2]
    out = ids[src] if ids.shape[0] else torch.zeros((len(src), n_layers, k), dtype=ids.dtype)
    fill = (row[:, None] * k + torch.arange(k)[None, :]) % num_experts  # [N, K], distinct in a row when K <= E
    out = torch.where(recorded[:, None, None], out, fill[:, None, :].to(out.dtype))
    return out, recorded


def _rank_positions(batch: MicroBatch, layout: ParallelLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pos, seq, row)`` of each row this rank's routers see, in their order: the position
    in its sequence, the sequence's index in the batch, and the row in the unsplit micro-batch."""
    if batch.fmt == "padded":
        b = len(batch.seq_lens)
        s_local = _cp_positions(batch.seq_length, layout.cp_size, layout.cp_rank)
        s_local = _sp_slice(s_local, layout)
        pos = s_local.repeat_interleave(b)  # rows s-major: [s, b] flattened
        seq = torch.arange(b).repeat(len(s_local))
        return pos, seq, pos * b + seq
    cu_pad = batch.cu_seqlens_padded
    if cu_pad is None:  # MicroBatch refuses a thd batch without it
        raise ConfigError("a thd micro-batch needs cu_seqlens_padded, got None")
    parts = [_cp_positions(cu_pad[i + 1] - cu_pad[i], layout.cp_size, layout.cp_rank) for i in range(len(batch.seq_lens))]
    pos = torch.cat(parts)
    seq = torch.cat([torch.full((len(p),), i) for i, p in enumerate(parts)])
    keep = _sp_slice(torch.arange(len(pos)), layout)
    pos, seq = pos[keep], seq[keep]
    return pos, seq, torch.tensor(cu_pad[:-1])[seq] + pos


def _sp_slice(rows: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """Sequence parallel: TP rank r keeps the r-th of tp equal slices of the flattened rows
    (tensor_parallel.mappings._split_along_first_dim on [s, b, h])."""
    if not layout.sequence_parallel or layout.tp_size == 1:
        return rows
    if len(rows) % layout.tp_size:
        raise ShapeMismatchError(f"sequence parallel {layout.tp_size} needs local lengths divisible by it, got {len(rows)}")
    n = len(rows) // layout.tp_size
    return rows[layout.tp_rank * n : (layout.tp_rank + 1) * n]


@dataclass(frozen=True, slots=True)
class ReplayRouter:
    """One local router: its module name in the model, its 0-based decoder layer and the index
    of the model chunk (virtual pipeline stage) that holds it."""

    name: str
    decoder_layer: int
    module: Any
    chunk: int = 0


def _walk(module: Any, prefix: str, out: list, mtp: list, chunk: int) -> None:
    if isinstance(module, (MultiTokenPredictionBlock, MultiTokenPredictionLayer)):
        mtp.extend(f"{prefix}.{n}".strip(".") for n, m in module.named_modules() if isinstance(m, Router))
        return  # MTP layers restart layer numbering and were never recorded by the rollout
    if isinstance(module, Router):
        out.append((prefix, module, chunk))
        return
    for name, child in module.named_children():
        _walk(child, f"{prefix}.{name}" if prefix else name, out, mtp, chunk)


def _wrapped_chain(module: Any) -> list[Any]:
    """``module`` and the modules it wraps through ``.module`` (DDP, Float16Module, ...)."""
    chain = [module]
    while isinstance(getattr(chain[-1], "module", None), torch.nn.Module) and len(chain) < 8:
        chain.append(chain[-1].module)
    return chain


class MegatronReplay:
    """Drives the ``RouterReplay`` of every local MoE router of a Megatron model.

    ``model``: one module or the list of model chunks (virtual pipeline stages), walked in
    order; the routers' module order is the order of :attr:`routers`. ``mtp``: ``"error"``
    refuses a model with multi-token-prediction routers (their routing was never recorded);
    ``"live"`` leaves them on live top-k, on purpose. ``allow_token_dropping``: a capacity
    factor drops tokens after the replayed top-k, so training routes differently from the
    rollout; refused unless allowed. ``device``: where targets go (default: the current CUDA
    device, else CPU).

    :attr:`layers`: the decoder layers of the local routers (every chunk's): what this rank
    replays, so what it reads (``prefetch_routing(..., layers=replay.layers)``); a pipeline
    stage then fetches only the store's chunks holding its layers.

    Use: ``with replay.step():`` around one training step; per micro-batch, :meth:`load`
    before its forward (with virtual pipeline stages: per micro-batch and chunk, in the
    ``forward_step_func`` Megatron's schedule calls with that chunk). Recompute in the backward
    (Megatron's activation checkpointing) pops each router's FIFO (``REPLAY_BACKWARD``)
    automatically.
    """

    def __init__(
        self,
        model: Any,
        *,
        layout: ParallelLayout | None = None,
        mtp: Literal["error", "live"] = "error",
        allow_token_dropping: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        self.layout = layout or ParallelLayout()
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        found: list = []
        mtp_found: list = []
        for i, chunk in enumerate(chunks):
            _walk(chunk, f"chunk{i}" if len(chunks) > 1 else "", found, mtp_found, i)
        if mtp_found and mtp != "live":
            raise ConfigError(
                f"MTP routers {mtp_found[:3]} have no recorded routing; pass mtp='live' to route them live on purpose"
            )
        if not found:
            raise ConfigError("no MoE router found in the model (walked its modules)")
        routers = []
        for name, r, chunk in found:
            self._check_router(name, r, allow_token_dropping)
            routers.append(ReplayRouter(name, r.layer_number - 1, r, chunk))
        self.routers: tuple[ReplayRouter, ...] = tuple(routers)
        # The stage's decoder layers in stored (ascending) order; with virtual stages, every
        # chunk's, since one read serves all the chunks of a micro-batch.
        self.layers: tuple[int, ...] = tuple(sorted({r.decoder_layer for r in routers}))
        self._chunks = chunks
        self.topk = routers[0].module.topk
        self.num_experts = routers[0].module.config.num_moe_experts
        self.device = (
            torch.device(device)
            if device is not None
            else (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        )
        self._active = False
        self._lock = threading.Lock()
        # per router: a load() whose target no forward has taken yet (a forward must not reuse
        # an older load, nor one meant for another chunk)
        self._pending = [False] * len(self.routers)

    def _check_router(self, name: str, r: Any, allow_token_dropping: bool) -> None:
        cfg = r.config
        where = f"router {name!r}"
        if not isinstance(r, TopKRouter):
            raise ConfigError(f"{where} is a {type(r).__name__}; only TopKRouter consults RouterReplay")
        if cfg.moe_router_fusion:
            raise ConfigError(
                f"{where}: moe_router_fusion=True takes the fused top-k, which returns before RouterReplay is consulted"
            )
        if r.routing_type == "sinkhorn":
            raise ConfigError(f"{where}: moe_router_load_balancing_type='sinkhorn' never consults RouterReplay")
        if r.router_replay is None:
            raise ConfigError(f"{where} was built without moe_enable_routing_replay=True: it has no RouterReplay")
        if cfg.moe_expert_capacity_factor is not None and not allow_token_dropping:
            raise ConfigError(
                f"{where}: moe_expert_capacity_factor={cfg.moe_expert_capacity_factor} drops replayed tokens (allow_token_dropping=True to accept)"
            )
        if r.layer_number is None:
            raise ConfigError(f"{where} has no layer_number (not inside a TransformerLayer)")
        lay = self.layout
        if (cfg.tensor_model_parallel_size, cfg.context_parallel_size, bool(cfg.sequence_parallel)) != (
            lay.tp_size,
            lay.cp_size,
            lay.sequence_parallel,
        ):
            raise ConfigError(
                f"{where}: config has tp={cfg.tensor_model_parallel_size} cp={cfg.context_parallel_size} "
                f"sequence_parallel={cfg.sequence_parallel}, layout has tp={lay.tp_size} cp={lay.cp_size} sequence_parallel={lay.sequence_parallel}"
            )

    # -- per micro-batch ---------------------------------------------------------------------

    def targets(self, routing: Any, batch: MicroBatch, *, chunk: Any = None) -> torch.Tensor:
        """Host ``[num_routers, N, K]`` targets (stored dtype) for the routers of ``chunk`` (see
        :meth:`load`; all local routers by default), router order. Checks layer map, top-k,
        expert count and id range against the routers."""
        routers = [self.routers[i] for i in self._router_indices(chunk)]
        ids_TLK = routing.ids_TLK
        if ids_TLK.dim() != 3 or ids_TLK.shape[2] != self.topk:
            raise ShapeMismatchError(
                f"routers take top-{self.topk}, routing has shape {tuple(ids_TLK.shape)} (expected [T, L, {self.topk}])"
            )
        if len(routing.layer_map) != ids_TLK.shape[1]:
            raise ShapeMismatchError(f"layer_map has {len(routing.layer_map)} layers, ids have {ids_TLK.shape[1]}")
        if routing.num_experts != self.num_experts:
            raise ShapeMismatchError(f"routers have {self.num_experts} experts, routing was recorded with {routing.num_experts}")
        layer_of = {d: i for i, d in enumerate(routing.layer_map)}
        missing = [r.decoder_layer for r in routers if r.decoder_layer not in layer_of]
        if missing:
            raise ShapeMismatchError(
                f"MoE decoder layers {missing} of this stage are not in the routing's layer_map {list(routing.layer_map)}"
                f" (this rank's routers replay decoder layers {list(self.layers)}: read them all, e.g. "
                "prefetch_routing(..., layers=replay.layers), or every layer)"
            )
        # The chunk's layers first, then its rows: a read of every layer (or of every chunk's
        # layers) gathers only what these routers take.
        columns = [layer_of[r.decoder_layer] for r in routers]
        mine = ids_TLK if columns == list(range(ids_TLK.shape[1])) else ids_TLK[:, columns, :]
        sel, _ = _local_rows(routing, mine, batch, self.layout, self.num_experts)
        if sel.numel() and int(sel.max()) >= self.num_experts:
            raise ShapeMismatchError(f"recorded expert id {int(sel.max())} outside 0..{self.num_experts - 1}")
        return sel.permute(1, 0, 2)

    def _router_indices(self, chunk: Any) -> list[int]:
        """Indices into :attr:`routers` of one chunk: ``chunk`` is the chunk's index in the model
        list or the chunk module itself (what Megatron's schedule hands ``forward_step_func``)."""
        if chunk is None:
            if len(self._chunks) > 1:
                raise ConfigError(
                    f"the model has {len(self._chunks)} chunks (virtual pipeline stages): pass load(..., chunk=model) "
                    "with the chunk forward_step_func received, so only its routers take this micro-batch"
                )
            return list(range(len(self.routers)))
        if isinstance(chunk, int) and not isinstance(chunk, bool):
            index = chunk
            if not 0 <= index < len(self._chunks):
                raise ConfigError(f"chunk {index} out of range: the model has {len(self._chunks)} chunks")
        else:
            # The same module, or one wrapping the other (DDP / Float16Module keep the wrapped
            # module in ``.module``): the schedule hands over whatever list it was given.
            given = set(map(id, _wrapped_chain(chunk)))
            matches = [i for i, c in enumerate(self._chunks) if given & set(map(id, _wrapped_chain(c)))]
            if len(matches) != 1:
                raise ConfigError(
                    f"{type(chunk).__name__} is not one of the {len(self._chunks)} model chunks MegatronReplay was built with"
                )
            index = matches[0]
        return [i for i, r in enumerate(self.routers) if r.chunk == index]

    def load(self, routing: Any, batch: MicroBatch, *, chunk: Any = None) -> None:
        """Set the routers' targets for their next forward (one micro-batch): every local
        router, or with virtual pipeline stages those of ``chunk`` (index or module) alone.
        Megatron queues each target for recompute in the backward (a FIFO per router), so a
        chunk's routers must take only their own micro-batches, in their forward order.
        Targets are staged in pinned memory and copied with ``non_blocking`` on the current
        stream, widened to int64 on the device; the forward queued after it sees them."""
        if not self._active:
            raise ReplayError("MegatronReplay.load() outside `with replay.step():`; the targets would outlive the step")
        indices = self._router_indices(chunk)
        if not indices:
            return  # a chunk without MoE layers
        host = self.targets(routing, batch, chunk=chunk)
        if self.device.type == "cuda":
            host = host.contiguous().pin_memory()
            dev = host.to(self.device, non_blocking=True)
        else:
            dev = host.contiguous()
        dev = dev.to(torch.int64)
        with self._lock:
            for i, target in zip(indices, dev):
                self.routers[i].module.router_replay.set_target_indices(target)
                self._pending[i] = True

    # -- the step ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator[MegatronReplay]:
        """One training step: routers on ``REPLAY_FORWARD`` (recompute in the backward pops the
        FIFO, as ``REPLAY_BACKWARD``); on exit, also on an exception, targets and actions are
        cleared, so a later forward outside a step routes live (and visibly so)."""
        if self._active:
            raise ReplayError("MegatronReplay.step() is already active")
        self._active = True
        try:
            for i, r in enumerate(self.routers):
                rr = r.module.router_replay
                rr.clear_indices()
                rr.get_replay_topk = self._guard(i, r, rr)  # instance attribute shadows the method
                rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            yield self
        finally:
            for r in self.routers:
                rr = r.module.router_replay
                rr.__dict__.pop("get_replay_topk", None)
                rr.clear_indices()
                rr.clear_router_replay_action()
            self._pending = [False] * len(self.routers)
            self._active = False

    def _guard(self, index: int, router: ReplayRouter, rr: Any) -> Callable[..., Any]:
        original = type(rr).get_replay_topk.__get__(rr)

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            recompute = torch._C._current_graph_task_id() != -1  # inside autograd's backward
            action = rr.router_replay_action
            if action is RouterReplayAction.REPLAY_FORWARD and recompute:
                if not rr.replay_backward_list:
                    raise ReplayError(f"router {router.name!r}: recompute in the backward but no routing is left in its FIFO")
                target = rr.replay_backward_list[0]
                action = RouterReplayAction.REPLAY_BACKWARD
            elif action is RouterReplayAction.REPLAY_FORWARD:
                target = rr.target_topk_idx
                with self._lock:
                    if target is None or not self._pending[index]:
                        raise ReplayError(
                            f"router {router.name!r} ran a forward with no routing loaded for it "
                            "(call replay.load(routing, batch) before each micro-batch's forward)"
                        )
            else:
                return original(scores, topk, num_groups, group_topk, default_compute_topk)
            if tuple(target.shape) != (scores.shape[0], topk):
                raise ShapeMismatchError(
                    f"router {router.name!r} sees {scores.shape[0]} tokens x top-{topk}, target is {tuple(target.shape)}; "
                    "the MicroBatch / ParallelLayout does not describe this forward's tokens"
                )
            if not recompute:
                with self._lock:
                    self._pending[index] = False
            saved = rr.router_replay_action
            rr.router_replay_action = action
            try:
                return original(scores, topk, num_groups, group_topk, default_compute_topk)
            finally:
                rr.router_replay_action = saved

        return get_replay_topk


def prefetch_routing(
    reader: Any,
    rollout_id: str,
    batches: Iterable[MicroBatch],
    *,
    depth: int = 2,
    layers: Iterable[int] | None = None,
    layout: ParallelLayout | None = None,
    tp_group: Any = "auto",
) -> Iterator[tuple[MicroBatch, Any]]:
    """Yield ``(batch, routing)`` in order, reading the next ``depth`` micro-batches in the
    background while one trains (:meth:`RoutingReader.prefetch`: every batch's ids are checked
    against the index before anything is read, so a bad id fails before the step starts).

    ``layers``: the decoder layers to read, ``replay.layers`` for a pipeline stage (its
    routers' layers, every virtual chunk's): only the store's chunks holding them are fetched,
    and a layer the rollout lacks fails before the step starts. Default: every layer.

    ``layout``: with context or sequence parallelism, only the rows this rank's routers see
    (:func:`rank_rows`): the row chunks holding other ranks' rows are not fetched, and with
    sequence parallelism each TP rank reads its own share (no broadcast). ``replay.layout``.
    Default: every row.

    ``tp_group``: the ranks of a tensor-parallel group replay the same layers and rows, so one
    of them reads and broadcasts each micro-batch's routing to the others (``torch.distributed``
    ``broadcast_object_list``; a read that fails is raised on every rank of the group). Why the
    default: read by every TP rank, a step's routing leaves the store nodes TP times, 2x
    the bytes and 2.1x the wall time of one read per group at TP=2 in ``bench trainer-layout``
    (2x H100 host, BENCHMARKS.md). ``"auto"`` (default): megatron-core's TP group when
    ``layout.tp_size > 1`` and ``parallel_state`` is initialized, else every rank reads;
    None: every rank reads; or a process group. Ranks other than the group's first may pass
    ``reader=None``."""
    batches = list(batches)
    # layers= / rows= only when given: a reader-like object without slice reads keeps working
    kwargs: dict[str, Any] = {} if layers is None else {"layers": layers}
    sp = layout is not None and layout.sequence_parallel and layout.tp_size > 1
    if layout is not None and (layout.cp_size > 1 or sp):
        kwargs["rows"] = rank_rows(batches, layout)
    if sp:
        # Each TP rank replays its own rows: one read per group would fetch them all.
        if tp_group is not None and not (isinstance(tp_group, str) and tp_group == "auto"):
            raise ConfigError(
                "prefetch_routing: with sequence parallel each tensor-parallel rank reads its own rows "
                "(rank_rows); pass tp_group=None or 'auto', not a group to broadcast one rank's read in"
            )
        tp_group = None
    group = _tp_group(layout) if isinstance(tp_group, str) and tp_group == "auto" else tp_group
    if group is None:
        with reader.prefetch(rollout_id, [b.request_ids for b in batches], depth=depth, **kwargs) as routed:
            yield from zip(batches, routed)
        return
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0)
    if dist.get_rank() != src:
        for batch in batches:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=src, group=group)
            if isinstance(box[0], BaseException):
                raise box[0]
            yield batch, box[0]
        return
    try:
        if reader is None:  # raised on every rank of the group (below), not only here
            raise ConfigError("prefetch_routing: the first rank of the tensor-parallel group reads, so it needs a reader")
        with reader.prefetch(rollout_id, [b.request_ids for b in batches], depth=depth, **kwargs) as routed:
            for batch in batches:
                routing = next(routed)
                dist.broadcast_object_list([routing], src=src, group=group)
                yield batch, routing
    except GeneratorExit:
        raise
    except BaseException as e:
        # The other ranks wait in the broadcast for this micro-batch: they get the error too
        # (as a ReplayError naming it where the error itself does not pickle).
        try:
            pickle.loads(pickle.dumps(e))
            sent: BaseException = e
        except Exception:
            sent = ReplayError(f"prefetch_routing on the tensor-parallel group's first rank: {type(e).__name__}: {e}")
        dist.broadcast_object_list([sent], src=src, group=group)
        raise


def _tp_group(layout: ParallelLayout | None) -> Any:
    """megatron-core's tensor-parallel group when there is one to share reads in, else None."""
    if layout is None or layout.tp_size == 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return ps.get_tensor_model_parallel_group()
