"""How a finished request's rows leave the capturer: as device rows, or staged to the host.

The capturer gathers a finished request's rows on the device (one kernel, no host sync) and
hands them to its sink in one of the ``transfer_mode`` forms (a string argument of
:class:`~r3rdma.capture.capturer.RoutingCapturer`):

- ``gpu_direct``: the gathered rows stay on the device as :class:`DeviceRows`, with an event
  the pusher waits on; the writer pushes the device buffer itself
  (:mod:`r3rdma.write.device_push`).
- ``staged``: an asynchronous D2H copy into pinned host memory (55 GB/s, :func:`stage_to_host`),
  then a host record; its rows are hashed in pinned memory before the push.

``auto`` asks the sink to measure both against a store node at start-up
(:func:`~r3rdma.write.device_push.probe_transfer_mode`) and keeps the faster. Without a node
to probe, ``auto`` means ``staged``: it is never much slower (a D2H copy into pinned memory
costs ~20 us per MB) and it is the only good choice without RDMA.

Pinned buffers come from torch's caching host allocator (``pin_memory=True``), which reuses a
block only after the copies recorded on it have completed, so a staging buffer is never
overwritten while a copy into it is in flight, and no ``cudaFreeHost`` (a device-wide sync)
runs on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from r3rdma.errors import ShapeMismatchError

__all__ = ["TRANSFER_MODES", "DeviceRows", "StagedRows", "stage_to_host"]

TRANSFER_MODES = ("auto", "gpu_direct", "staged")


class StagedRows:
    """An asynchronous copy of device rows into pinned host memory, with its completion event."""

    __slots__ = ("host", "event")

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self.host = host
        self.event = event

    def ready(self) -> bool:
        """True once the copy completed (never blocks)."""
        return self.event is None or self.event.query()

    def wait(self) -> np.ndarray:
        """Block this thread until the copy completed; return the host array (a view, no copy)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy()


def stage_to_host(rows: torch.Tensor, *, out: torch.Tensor | None = None, event: torch.cuda.Event | None = None) -> StagedRows:
    """Start copying ``rows`` into pinned host memory on the current stream; return at once.

    ``out``: the pinned buffer to copy into (else one from torch's caching host allocator);
    ``event``: the event to record after the copy (else a new one), for callers that reuse both.
    CPU tensors are returned as they are (already host memory, no event).
    """
    if rows.device.type != "cuda":
        return StagedRows(rows, None)
    if out is None:
        out = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    elif not out.is_pinned() or out.shape != rows.shape or out.dtype != rows.dtype:
        raise ShapeMismatchError(
            f"staging buffer must be pinned {rows.dtype} {tuple(rows.shape)}, got {out.dtype} {tuple(out.shape)}"
        )
    out.copy_(rows, non_blocking=True)
    if event is None:
        event = torch.cuda.Event()
    event.record()
    return StagedRows(out, event)


@dataclass(frozen=True, slots=True, eq=False)
class DeviceRows:
    """A finished request's rows on the device, plus what the store needs to know about them.

    ``ready`` is an event recorded on the producing stream after the rows were written; the
    sender waits on it before UCX reads the buffer.
    """

    #: Tells pipelines apart from host records without importing torch there.
    on_device: ClassVar[bool] = True

    rollout_id: str
    request_id: str
    ids_TLK: torch.Tensor
    layer_map: tuple[int, ...]
    num_experts: int
    ready: torch.cuda.Event | None = None
    start_row: int = 0
    final: bool = True
    total_rows: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the device rows (the push payload)."""
        return self.ids_TLK.numel() * self.ids_TLK.element_size()
