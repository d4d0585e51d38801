"""Optional range check of the router ids a capturer records (``RoutingCapturer(check_ids=...)``).

An id outside what the capturer stores (``0 .. num_experts - 1``, or ``0 .. len(expert_map) - 1``
physical ids with an ``expert_map``) would wrap in the narrow storage dtype and be stored as the
wrong expert (EPLB physical ids without an ``expert_map``). Two implementations of one small
interface, chosen once by :func:`id_range_check`: :class:`NoIdRangeCheck` (the default: every
hook is a no-op) and :class:`DeviceIdRangeCheck`, so the step path calls the hooks
unconditionally instead of branching on a flag.

How the real check works, without a host sync: ``record`` adds one ``aminmax`` reduction per
layer on the device (into this step's ``[L]`` pair), and the end of a step two in-place clamps
folding it into a running ``[L]`` pair of lowest and highest ids (chunked MoE: three small
kernels per chunk instead). That pair is read where a host read happens anyway: on a CPU device
at ``finish_request``; on CUDA from a pinned copy issued asynchronously at ``finish_request``
and read at a later ``finish_request`` once its event has completed (``Event.query``, no wait),
at ``flush`` and at ``set_expert_map`` (both synchronise already). A bad id raises
:class:`~r3rdma.errors.OutOfRangeError` naming the layer and the id; on CUDA it may surface a
few finishes after the step that produced it. What it costs: BENCHMARKS.md, "Capture overhead".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from r3rdma.errors import OutOfRangeError

__all__ = ["IdRangeCheck", "NoIdRangeCheck", "DeviceIdRangeCheck", "id_range_check"]


class IdRangeCheck(Protocol):
    """The hooks the step path calls on every record, step end and finish."""

    enabled: bool

    def set_limit(self, expert_map: torch.Tensor | None) -> None:
        """Ids recorded from now on are physical ids of ``expert_map``, or logical ids without one."""
        ...

    def on_record(self, moe: int, topk_ids_TK: torch.Tensor, router_rows: torch.Tensor | None) -> None:
        """Fold MoE layer ``moe``'s ids of this step (the ``router_rows`` among them, if given) into its range."""
        ...

    def on_chunk(self, moe: int, topk_ids_TK: torch.Tensor) -> None:
        """Fold one chunk of MoE layer ``moe``'s ids (chunked MoE) into its running range."""
        ...

    def end_step(self) -> None:
        """Fold the step's per-layer ranges into the running ones."""
        ...

    def check(self, *, block: bool) -> None:
        """Raise :class:`~r3rdma.errors.OutOfRangeError` if an id seen so far is out of range
        (``block``: wait for the device to say; otherwise only what has already arrived)."""
        ...

    def reset(self) -> None:
        """Forget the ranges seen so far (a bad id is reported once)."""
        ...


class NoIdRangeCheck:
    """The check turned off (the default): every hook does nothing."""

    enabled = False

    def set_limit(self, expert_map: torch.Tensor | None) -> None:
        """Nothing to limit: the check is off."""

    def on_record(self, moe: int, topk_ids_TK: torch.Tensor, router_rows: torch.Tensor | None) -> None:
        """Nothing recorded: the check is off."""

    def on_chunk(self, moe: int, topk_ids_TK: torch.Tensor) -> None:
        """Nothing recorded: the check is off."""

    def end_step(self) -> None:
        """Nothing to fold: the check is off."""

    def check(self, *, block: bool) -> None:
        """Never raises: the check is off."""

    def reset(self) -> None:
        """Nothing to forget: the check is off."""


class DeviceIdRangeCheck:
    """Running per-layer lowest / highest router id on the device, read without a sync."""

    enabled = True

    def __init__(self, *, layer_map: Sequence[int], num_experts: int, storage_dtype: np.dtype, device: torch.device) -> None:
        self.layer_map = tuple(layer_map)
        self.num_layers = len(self.layer_map)
        self.num_experts = num_experts
        self.storage_dtype = storage_dtype
        self.device = device
        self._cuda = device.type == "cuda"
        self._limit, self._physical = num_experts, False
        # Running lowest / highest router id per MoE layer since the last check (device).
        self._ids_lo_L = torch.zeros(self.num_layers, dtype=torch.int64, device=device)
        self._ids_hi_L = torch.zeros(self.num_layers, dtype=torch.int64, device=device)
        self._ids_probe: tuple[torch.Tensor, torch.cuda.Event] | None = None  # CUDA: copy in flight
        # This step's lowest / highest id per layer, in the router's dtype (one aminmax writes
        # both in place); None until the first record.
        self._step_L: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_limit(self, expert_map: torch.Tensor | None) -> None:
        """Ids from now on are physical ids of ``expert_map`` (or logical ones without)."""
        if expert_map is None:
            self._limit, self._physical = self.num_experts, False
        else:
            self._limit, self._physical = int(expert_map.numel()), True

    def on_record(self, moe: int, topk_ids_TK: torch.Tensor, router_rows: torch.Tensor | None) -> None:
        """One kernel: ``aminmax`` of the layer's ids straight into this step's ``[L]`` pair (folded at :meth:`end_step`)."""
        ids = topk_ids_TK if router_rows is None else topk_ids_TK.index_select(0, router_rows)
        if ids.numel() == 0:
            return
        step = self._step_L
        if step is None or step[0].dtype != ids.dtype or step[0].device != ids.device:
            if step is not None:
                self.end_step()
            step = self._step_L = (
                torch.zeros(self.num_layers, dtype=ids.dtype, device=ids.device),
                torch.zeros(self.num_layers, dtype=ids.dtype, device=ids.device),
            )
        lo_L, hi_L = step
        torch.aminmax(ids, out=(lo_L[moe], hi_L[moe]))

    def end_step(self) -> None:
        """Two kernels: fold this step's ``[L]`` pair into the running one. Layers not recorded
        this step hold last step's values: folding them again changes nothing."""
        if self._step_L is not None:
            lo_L, hi_L = self._step_L
            self._ids_lo_L.clamp_(max=lo_L.to(self._ids_lo_L.device, torch.int64))
            self._ids_hi_L.clamp_(min=hi_L.to(self._ids_hi_L.device, torch.int64))

    def on_chunk(self, moe: int, topk_ids_TK: torch.Tensor) -> None:
        """Device only: one reduction, two in-place clamps on 1-element views (no host sync)."""
        if topk_ids_TK.numel() == 0:
            return
        lo, hi = torch.aminmax(topk_ids_TK)
        self._ids_lo_L[moe : moe + 1].clamp_(max=lo.to(torch.int64))
        self._ids_hi_L[moe : moe + 1].clamp_(min=hi.to(torch.int64))

    def reset(self) -> None:
        """Zero the running and this step's ranges (a bad id is reported once; later ones afresh)."""
        for t in (self._ids_lo_L, self._ids_hi_L, *(self._step_L or ())):
            t.zero_()

    def check(self, *, block: bool) -> None:
        """Raise if a recorded id lay outside what the capturer stores.

        CPU: reads the running range at once. CUDA: reads the pinned copy issued earlier if it
        has landed (or, with ``block``, waits for it and reads the current range too), then
        issues the next copy; the engine thread never waits unless ``block``.
        """
        if not self._cuda:
            self._raise_bad_ids(self._ids_lo_L.numpy(), self._ids_hi_L.numpy())
            return
        if self._ids_probe is not None:
            host, event = self._ids_probe
            if block:
                event.synchronize()
            if block or event.query():
                self._ids_probe = None
                self._raise_bad_ids(host[0].numpy(), host[1].numpy())
        if block:
            both = torch.stack([self._ids_lo_L, self._ids_hi_L]).cpu()
            self._raise_bad_ids(both[0].numpy(), both[1].numpy())
        elif self._ids_probe is None:
            host = torch.empty((2, self.num_layers), dtype=torch.int64, pin_memory=True)
            host.copy_(torch.stack([self._ids_lo_L, self._ids_hi_L]), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._ids_probe = (host, event)

    def _raise_bad_ids(self, lo_L: np.ndarray, hi_L: np.ndarray) -> None:
        limit = self._limit
        bad = np.flatnonzero((lo_L < 0) | (hi_L >= limit))
        if bad.size:
            moe = int(bad[0])
            lo, hi = int(lo_L[moe]), int(hi_L[moe])
            self.reset()  # reported once; later records are checked afresh
            what = "physical ids (expert_map has " if self._physical else "ids (num_experts is "
            raise OutOfRangeError(
                f"layer {self.layer_map[moe]} (MoE layer {moe}) recorded router id {hi if hi >= limit else lo}, expected "
                f"0..{limit - 1}: {what}{limit}); stored in {self.storage_dtype} they would wrap to wrong experts "
                f"(EPLB physical ids without an expert_map?)"
                + ("" if bad.size == 1 else f"; layers {[self.layer_map[int(i)] for i in bad]} are all out of range")
            )


def id_range_check(
    enabled: bool, *, layer_map: Sequence[int], num_experts: int, storage_dtype: np.dtype, device: torch.device
) -> IdRangeCheck:
    """The real check when ``enabled``, else the no-op one."""
    if not enabled:
        return NoIdRangeCheck()
    return DeviceIdRangeCheck(layer_map=layer_map, num_experts=num_experts, storage_dtype=storage_dtype, device=device)
