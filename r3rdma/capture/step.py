"""The step: what one forward computes, recorded layer by layer, ended into a frozen value.

:class:`StepRecorder` owns the open step (at most one at a time): ``begin_step``'s announcement
(which request and position each token is, and the KV slot it writes), validated; this TP
rank's share of the tokens; which MoE layers were recorded (for chunked MoE, how far); the
requests retired while it is open (overlap scheduling); the placeholder step a CUDA graph is
captured with; and, at the end, the TP all-gather (one per step) and the scatter of the kept
rows into the :class:`~r3rdma.capture.slot_table.SlotTable`.

``end()`` returns an :class:`EndedStep`, a frozen value the request ledger
(:mod:`r3rdma.capture.ledger`) commits, so the ledger never reads step internals.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch

from r3rdma.capture.id_check import IdRangeCheck
from r3rdma.capture.slot_table import SlotTable, host_int64
from r3rdma.errors import CaptureStateError, OutOfRangeError, ShapeMismatchError
from r3rdma.kernels import graph_regime

__all__ = ["EndedStep", "StepRecorder"]


class EndedStep(NamedTuple):
    """What an ended step wrote: enough for the ledger to map each request's positions to slots.

    ``token_idx`` lists the kept tokens (speculative decoding), None when every token was kept;
    ``slots`` are the kept tokens' slots and ``gen`` the generation every one of them has after
    this step's write (the slot table's number for the write); ``retired`` are requests that finished, aborted or were preempted while the
    step was open (their tokens keep no state); ``fewest`` is the least tokens any request
    announced (with ``total == len(request_ids)`` and 1, a decode step: token ``i`` is position
    ``starts[i]`` of request ``i``). A tuple: immutable, and cheap to make on the decode hot path.
    """

    request_ids: tuple[str, ...]
    starts: np.ndarray
    counts: np.ndarray
    total: int
    fewest: int
    token_idx: np.ndarray | None
    slots: np.ndarray
    gen: int
    retired: frozenset[str]

    @property
    def rows(self) -> int:
        """Rows the step kept (its kept tokens, one slot each)."""
        return int(self.slots.size)


_NONE_RETIRED: frozenset[str] = frozenset()


class _OpenStep:
    __slots__ = (
        "request_ids",
        "members",
        "retired",
        "starts",
        "counts",
        "fewest",
        "slots",
        "router_rows",
        "total",
        "recorded",
        "covered",
        "chunk",
        "base",
        "local",
    )

    def __init__(
        self,
        request_ids: tuple[str, ...],
        starts: np.ndarray,
        counts: np.ndarray,
        fewest: int,
        slots: np.ndarray,
        router_rows: torch.Tensor | None,
        num_layers: int,
        recorded: bool,
        *,
        chunk: int,
        base: int,
        local: int,
    ) -> None:
        self.request_ids = request_ids
        self.members: frozenset[str] | None = None  # built on the first retire (overlap scheduling)
        self.retired: set[str] | None = None
        self.starts = starts
        self.counts = counts
        self.fewest = fewest
        self.slots = slots
        self.router_rows = router_rows
        self.total = int(slots.shape[0])
        self.recorded = [recorded] * num_layers
        self.covered = [0] * num_layers  # tokens recorded so far per layer (chunked MoE)
        # This rank's share of the step's tokens (all of them without TP): its `local` tokens are
        # step-buffer rows from `base`, in shares of `chunk` rows per rank.
        self.chunk = chunk
        self.base = base
        self.local = local


class StepRecorder:
    """The open step, its per-layer records, graph capture, and the TP all-gather at its end.

    ``tp_group`` is the tensor-parallel group whose ranks split each step's MoE tokens (see
    :class:`~r3rdma.capture.capturer.RoutingCapturer`); ``expert_map`` (set by the capturer)
    maps physical to logical expert ids in ``record``. ``steps`` and ``collectives`` count
    steps ended with a token and all-gathers issued.
    """

    def __init__(
        self,
        *,
        table: SlotTable,
        layer_map: tuple[int, ...],
        top_k: int,
        ids: IdRangeCheck,
        tp_group: torch.distributed.ProcessGroup | None,
    ) -> None:
        self.table = table
        self.layer_map = layer_map
        self.num_layers = len(layer_map)
        self.top_k = top_k
        self.ids = ids
        self.expert_map: torch.Tensor | None = None
        self._moe_index = {layer: i for i, layer in enumerate(layer_map)}
        self.tp_group = tp_group
        if tp_group is not None:
            import torch.distributed as dist

            self.tp_rank, self.tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
        else:
            self.tp_rank, self.tp_size = 0, 1
        self.open: _OpenStep | None = None
        self._ones = np.ones(0, dtype=np.int64)  # a decode step's token counts (see _same_counts)
        self.steps = 0
        self.collectives = 0

    @property
    def is_open(self) -> bool:
        """Whether a step is open (between ``begin`` and ``end``, or inside :meth:`graph_capture`)."""
        return self.open is not None

    def begin(
        self,
        request_ids: Sequence[str],
        start_positions: Sequence[int] | np.ndarray,
        num_tokens: Sequence[int] | np.ndarray | int,
        slots_T: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        router_rows: torch.Tensor | None,
        graphed: bool,
    ) -> None:
        """Validate and open a step (see :meth:`RoutingCapturer.begin_step`)."""
        if self.open is not None:
            raise CaptureStateError("begin_step called twice without end_step")
        if len(request_ids) != len(start_positions):
            raise ShapeMismatchError(
                f"request_ids and start_positions must have one entry per request; got "
                f"{len(request_ids)} and {len(start_positions)}"
            )
        slots = host_int64(slots_T)
        starts = np.asarray(start_positions, dtype=np.int64).reshape(-1)
        n = starts.shape[0]
        if isinstance(num_tokens, int | np.integer):
            # Every request computes as many tokens (a decode step: 1): no reductions over the
            # batch (each numpy call on the engine's step path costs microseconds, with the
            # caches cold from the forward).
            fewest = int(num_tokens)
            total = fewest * n
            counts = self._same_counts(n, fewest)
        else:
            counts = np.asarray(num_tokens, dtype=np.int64).reshape(-1)
            if counts.shape[0] != n:
                raise ShapeMismatchError(
                    f"request_ids, start_positions, num_tokens must have one entry per request; got "
                    f"{len(request_ids)}, {n}, {counts.shape[0]}"
                )
            total = int(counts.sum()) if n else 0
            fewest = int(counts.min()) if n else 0
        if slots.shape != (total,):
            raise ShapeMismatchError(f"slots_T must have one slot per token: {total} tokens, got shape {tuple(slots.shape)}")
        if fewest < 0 or (n and starts.min() < 0):
            raise ShapeMismatchError(f"num_tokens and start_positions must be >= 0, got {fewest} and {starts.min()}")
        self.table.check_slots(slots)
        self.table.check_distinct(slots)
        if router_rows is not None and tuple(router_rows.shape) != (total,):
            raise ShapeMismatchError(f"router_rows must have shape ({total},), got {tuple(router_rows.shape)}")
        if graphed:
            if self.table.fixed_step_rows and router_rows is not None:
                raise CaptureStateError(
                    "begin_step(router_rows=...) with a fixed step_buffer: the model writes its "
                    "router's rows itself, so there is nothing to select"
                )
            captured = self.table.graph_for(total)
            if captured is None and self.table.fixed_step_rows:
                raise ShapeMismatchError(
                    f"a step of {total} tokens does not fit the fixed step buffer of {self.table.fixed_step_rows} rows"
                )
            if captured is None:
                raise CaptureStateError(
                    f"begin_step(graphed=True) with {total} tokens, but graph_capture() was used for "
                    f"{self.table.graph_token_counts()} tokens only"
                )
            if captured != self.table.graph_key(router_rows is not None):
                raise CaptureStateError(
                    "begin_step(graphed=True): the step buffers moved or router_rows use differs since "
                    "graph_capture(); capture the graph again"
                )
        # A replay writes every layer itself: the step starts with each one recorded.
        step = self._open_step(tuple(request_ids), starts, counts, fewest, slots, router_rows, graphed, recorded=graphed)
        if graphed:
            step.covered = [step.local] * self.num_layers
        self.open = step

    def _same_counts(self, n: int, count: int) -> np.ndarray:
        """``n`` requests of ``count`` tokens each as an array (read-only, cached for decode steps)."""
        if count != 1:
            return np.full(n, count, dtype=np.int64)
        if self._ones.size < n:
            self._ones = np.ones(max(n, 2 * self._ones.size), dtype=np.int64)
            self._ones.flags.writeable = False
        return self._ones[:n]

    def _open_step(
        self,
        request_ids: tuple[str, ...],
        starts: np.ndarray,
        counts: np.ndarray,
        fewest: int,
        slots: np.ndarray,
        router_rows: torch.Tensor | None,
        graphed: bool,
        *,
        recorded: bool = False,
    ) -> _OpenStep:
        total = int(slots.shape[0])
        chunk = -(-total // self.tp_size)  # tokens per TP rank (the last may have fewer)
        self.table.reserve_step(chunk * self.tp_size)
        base = self.tp_rank * chunk
        local = max(0, min(chunk, total - base))
        step = _OpenStep(
            request_ids,
            starts,
            counts,
            fewest,
            slots,
            router_rows,
            self.num_layers,
            recorded,
            chunk=chunk,
            base=base,
            local=local,
        )
        if router_rows is not None and self.tp_size > 1:
            step.router_rows = router_rows[step.base : step.base + step.local]
        if router_rows is not None and graphed:
            # A graph reads router rows from a fixed address: copy them there (device to device).
            rows_view = self.table.router_rows_view(step.local)
            if step.router_rows is not None:
                rows_view.copy_(step.router_rows, non_blocking=True)
            step.router_rows = rows_view
        return step

    @contextlib.contextmanager
    def graph_capture(self, num_tokens: int, *, router_rows: bool = False) -> Iterator[None]:
        """A placeholder step for capturing a forward in a CUDA graph (see :meth:`RoutingCapturer.graph_capture`)."""
        if self.open is not None:
            raise CaptureStateError("graph_capture() inside an open step")
        if num_tokens < 1:
            raise ShapeMismatchError(f"graph_capture needs num_tokens >= 1, got {num_tokens}")
        slots = np.zeros(num_tokens, dtype=np.int64)
        rows = None
        if router_rows:
            rows = torch.arange(num_tokens, device=self.table.device)
        step = self._open_step((), np.zeros(0, np.int64), np.zeros(0, np.int64), 0, slots, rows, graphed=router_rows)
        self.open = step
        try:
            with graph_regime():
                yield
        finally:
            self.open = None
        self.table.remember_graph(num_tokens, router_rows)

    def record(self, layer_idx: int, topk_ids_TK: torch.Tensor, token_offset: int | None) -> None:
        """One MoE layer's top-k ids into the step buffer (see :meth:`RoutingCapturer.record`)."""
        step = self.open
        if step is None:
            raise CaptureStateError(f"record(layer {layer_idx}) called outside begin_step/end_step")
        moe = self._moe_index.get(layer_idx)
        if moe is None:
            raise OutOfRangeError(f"layer {layer_idx} is not a captured MoE layer; layer_map is {self.layer_map}")
        if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[1] != self.top_k:
            raise ShapeMismatchError(f"layer {layer_idx}: expected top-k ids [T, {self.top_k}], got {tuple(topk_ids_TK.shape)}")
        total, base = step.local, step.base
        if token_offset is not None:
            if step.router_rows is not None:
                raise CaptureStateError("record(token_offset=...) cannot be combined with begin_step(router_rows=...)")
            done = step.covered[moe]
            n = int(topk_ids_TK.shape[0])
            if step.recorded[moe] or token_offset != done or done + n > total:
                raise CaptureStateError(
                    f"layer {layer_idx}: chunk of {n} rows at token_offset {token_offset}, but {done} of the "
                    f"{total} tokens this rank routes were recorded so far (chunks must be in order and cover them once)"
                )
            self.ids.on_chunk(moe, topk_ids_TK)
            self.table.record(base + done, n, moe, topk_ids_TK, None, self.expert_map)
            step.covered[moe] = done + n
            step.recorded[moe] = step.covered[moe] == total
            return
        n_rows = topk_ids_TK.shape[0] if step.router_rows is None else step.router_rows.shape[0]
        if n_rows != total:
            raise ShapeMismatchError(
                f"layer {layer_idx}: the step announced {total} tokens{'' if self.tp_size == 1 else ' for this TP rank'} "
                f"but the router produced {topk_ids_TK.shape[0]} rows"
                + ("" if step.router_rows is None else " (after router_rows selection)")
            )
        if step.recorded[moe] or step.covered[moe]:
            raise CaptureStateError(f"layer {layer_idx} recorded twice in one step (chunked MoE? pass token_offset)")
        step.recorded[moe] = True
        step.covered[moe] = total
        self.ids.on_record(moe, topk_ids_TK, step.router_rows)
        self.table.record(base, total, moe, topk_ids_TK, step.router_rows, self.expert_map)

    def retire(self, request_id: str) -> None:
        """``request_id`` finished, aborted or was preempted: if the open step includes it, its
        tokens there keep no state (overlap scheduling: the engine may launch step N+1 with the
        request in it before it learns the request finished at step N)."""
        step = self.open
        if step is None:
            return
        if step.members is None:
            step.members = frozenset(step.request_ids)
        if request_id in step.members:
            if step.retired is None:
                step.retired = set()
            step.retired.add(request_id)

    def cancel(self) -> None:
        """Drop the open step without ending it: nothing of it reaches the slot table."""
        self.open = None

    def end(self, accepted_T: Sequence[bool] | np.ndarray | None) -> EndedStep | None:
        """Close the step: all-gather under TP, scatter the kept rows into the slot table.

        Returns what was written, or None when no token was kept.
        """
        step = self.open
        if step is None:
            raise CaptureStateError("end_step called without begin_step")
        self.open = None
        if step.local and not all(step.recorded):
            missing = [self.layer_map[i] for i, done in enumerate(step.recorded) if not done]
            raise CaptureStateError(
                f"step ended without routing for MoE layers {missing} (a router skipped its hook, or a chunked "
                "MoE layer did not cover every token?)"
            )
        if step.local:
            self.ids.end_step()
        if step.total:
            self.steps += 1
            if self.tp_group is not None:
                self._gather(step)
        token_idx = None
        slots = step.slots
        if accepted_T is not None:
            keep = np.asarray(accepted_T, dtype=bool)
            if keep.shape != (step.total,):
                raise ShapeMismatchError(f"accepted_T must have {step.total} entries, got shape {keep.shape}")
            token_idx = np.flatnonzero(keep)
            if token_idx.size == step.total:
                token_idx = None  # every token accepted: the plain path
            else:
                slots = slots[token_idx]
        if slots.size == 0:
            return None
        gen = self.table.write_step(slots, step.total, token_idx)
        return EndedStep(
            step.request_ids,
            step.starts,
            step.counts,
            step.total,
            step.fewest,
            token_idx,
            slots,
            gen,
            frozenset(step.retired) if step.retired else _NONE_RETIRED,
        )

    def _gather(self, step: _OpenStep) -> None:
        """One all-gather per step: every rank's share of every layer's rows, as raw bytes.

        Bytes because NCCL has no int16; the collective runs in place on the step buffer
        (rank r's share already sits at ``[r*c, (r+1)*c)``), so nothing is copied around it.
        """
        import torch.distributed as dist

        c = step.chunk
        buf = self.table.step_buf
        out = buf[: c * self.tp_size].view(torch.uint8)
        mine = buf[step.base : step.base + c].view(torch.uint8)
        # torch 2.13 renamed all_gather_into_tensor to all_gather_single (same semantics).
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        all_gather(out, mine, group=self.tp_group)
        self.collectives += 1
