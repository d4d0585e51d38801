"""Pushes of a finished request's rows that are still on the GPU, and the probe that picks how.

The capturer hands the writer :class:`~r3rdma.capture.transfer.DeviceRows` (``gpu_direct``);
the push client sends them here with one ``push_packed`` per batch:

- ``gpu_direct``: the packed device buffer itself is the UCX payload (``PackedBatch`` with a
  CUDA payload). UCX moves it with GPUDirect RDMA on InfiniBand, or cuda_ipc between GPUs of
  one host; over TCP it stages device memory internally, slowly (0.44 GB/s measured on the GPU
  machines here, against 1.1+ GB/s for host buffers).
- ``staged``: the packed buffer is copied to pinned host memory first (the probe's other arm).

``auto`` measures both against a store node at start-up (:func:`probe_transfer_mode`, with
probe batches that the node checks, acks and never stores) and keeps the faster; without a
node to probe the capturer stages (:mod:`r3rdma.capture.transfer`).

Every request carries the sender's CRC-32C (the wire requires it; a frame that arrives short
or corrupted then fails as ``CorruptDataError`` at the node instead of being stored). It is
computed on the host: the packed buffer is also copied to pinned memory (an async D2H copy at
tens of GB/s, ~20 us per MB) and that copy is hashed (crc32c, ~10+ GB/s, in a worker thread,
GIL released) while the device buffer itself is what UCX sends. Both copies come from the same
packed bytes after the same event, so the checksum is end to end for the bytes UCX reads.
(A device CRC-32C kernel would save the copy; none exists in torch, and the copy is small
next to a GPU-direct push over TCP.)

The producing stream is synchronised before the bytes are sent: ucxx ignores the stream of
``__cuda_array_interface__`` (transport/device.py). The wait happens on the pusher's thread
(an event recorded after the gather), never on the engine's step path.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from r3rdma.capture.transfer import DeviceRows, stage_to_host
from r3rdma.errors import ConfigError, ShapeMismatchError
from r3rdma.records import buffer_checksum, routing_dtype

__all__ = ["ProbeResult", "pack_device_rows", "checksum_packed", "push_device_rows", "probe_transfer_mode"]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What :func:`probe_transfer_mode` measured (GB/s = 1e9 bytes/s, whole push incl. ack)."""

    mode: str
    gpu_direct_gbps: float
    staged_gbps: float
    nbytes: int
    rounds: int

    def to_json(self) -> dict:
        """The result as a JSON object: mode, both rates in GB/s (3 decimals), probe bytes and rounds."""
        return {
            "mode": self.mode,
            "gpu_direct_gbps": round(self.gpu_direct_gbps, 3),
            "staged_gbps": round(self.staged_gbps, 3),
            "probe_bytes": self.nbytes,
            "rounds": self.rounds,
        }


def _meta(item: DeviceRows, offset: int, crc: int | None):
    from r3rdma.transport import RecordMeta

    ids = item.ids_TLK
    dtype = routing_dtype(item.num_experts)
    if ids.element_size() != dtype.itemsize or ids.dim() != 3:
        raise ShapeMismatchError(
            f"request {item.request_id}: rows must be [T, L, K] of {dtype}, got {ids.dtype} {tuple(ids.shape)}"
        )
    return RecordMeta(
        item.rollout_id,
        item.request_id,
        int(ids.shape[0]),
        int(ids.shape[1]),
        int(ids.shape[2]),
        dtype.name,
        item.num_experts,
        tuple(item.layer_map),
        item.start_row,
        crc,
        offset,
        item.final,
        item.total_rows,
    )


def pack_device_rows(items: Sequence[DeviceRows]) -> tuple[tuple, torch.Tensor]:
    """Concatenate the requests' rows into one contiguous uint8 buffer on their device.

    Returns (metas, payload). Runs on the current stream; record an event after it. On the
    CPU the metas carry each request's CRC-32C; on a GPU their ``crc32c`` is ``None`` (hashing
    needs the bytes on the host): fill it with :func:`checksum_packed` over a host copy of
    ``payload`` before pushing (:func:`push_device_rows` does); the transport refuses a batch
    without sender checksums.
    """
    if not items:
        raise ShapeMismatchError("pack_device_rows needs at least one request")
    metas, offset = [], 0
    for item in items:
        metas.append(_meta(item, offset, None))
        offset += item.nbytes
    device = items[0].ids_TLK.device
    if len(items) == 1 and items[0].ids_TLK.is_contiguous():
        payload = items[0].ids_TLK.reshape(-1).view(torch.uint8)
    else:
        payload = (
            torch.cat([i.ids_TLK.contiguous().reshape(-1).view(torch.uint8) for i in items])
            if offset
            else torch.empty(0, dtype=torch.uint8, device=device)
        )
    if device.type != "cuda":
        return checksum_packed(metas, payload.numpy()), payload
    return tuple(metas), payload


def checksum_packed(metas: Sequence, host_payload: np.ndarray) -> tuple:
    """``metas`` with each request's CRC-32C over its bytes in ``host_payload`` (the packed
    payload, or its host copy: flat uint8, the bytes UCX sends)."""
    from dataclasses import replace

    flat = np.asarray(host_payload).reshape(-1).view(np.uint8)
    end = metas[-1].offset + metas[-1].nbytes if metas else 0
    if flat.nbytes != end:
        raise ShapeMismatchError(f"packed payload holds {flat.nbytes} bytes but its metas describe {end}")
    return tuple(replace(m, crc32c=buffer_checksum(flat[m.offset : m.offset + m.nbytes])) for m in metas)


async def push_device_rows(client, items: Sequence[DeviceRows], mode: str, *, probe: bool = False):
    """Push requests whose rows are on the GPU with one ``push_packed``; return the ack.

    ``gpu_direct``: the packed device buffer is the payload. ``staged``: it is copied to pinned
    host memory first. In both cases the thread that pushes waits (in a worker thread, so the
    event loop keeps running) for the producing stream before UCX reads any byte, and every
    request carries its CRC-32C, computed over the pinned copy (``gpu_direct`` makes one for
    that purpose only; see the module docstring). ``probe``
    marks the batch as a transfer probe: the receiver checks and acks it, and stores nothing.
    """
    from r3rdma.transport import PackedBatch

    if mode not in ("gpu_direct", "staged"):
        raise ConfigError(f"push_device_rows needs a resolved mode (gpu_direct or staged), got {mode!r}")
    device = items[0].ids_TLK.device if items else torch.device("cpu")
    if device.type != "cuda":
        metas, payload = pack_device_rows(items)  # hashed already (host bytes)
        return await client.push_packed(PackedBatch(metas, payload.numpy(), probe))
    with torch.cuda.device(device):  # this thread's current device may be another GPU
        for item in items:
            if item.ready is not None:
                item.ready.wait()  # GPU-side wait: the packing below runs after each gather
        metas, payload = pack_device_rows(items)
        # Both modes: a pinned copy to hash (and, staged, to send). Its event is recorded
        # after the copy, which runs after the packing on this stream, so once it completed
        # the device payload is complete too (ucxx ignores the CAI stream).
        staged = stage_to_host(payload)

    def host_and_checksums() -> tuple[np.ndarray, tuple]:
        host = staged.wait()
        return host, checksum_packed(metas, host)

    host, metas = await asyncio.to_thread(host_and_checksums)
    return await client.push_packed(PackedBatch(metas, host if mode == "staged" else payload, probe))


async def probe_transfer_mode(
    client, *, device: torch.device | str | None = None, probe_bytes: int = 8 << 20, probe_rounds: int = 5, min_gain: float = 1.1
) -> ProbeResult:
    """Push the same bytes both ways to ``client`` (a TransportClient) and pick the faster.

    The pushes are probe batches (``PackedBatch.probe``): any server, a store node included,
    receives and checksums them like other batches, acks them, and hands nothing to its
    handler, so nothing is stored. Times whole pushes, acks included: what the pipeline would
    pay per batch.

    Args:
        device: where the probe rows live (default: the current CUDA device).
        probe_bytes: payload size of each push (MB-sized: pushes are batched to MBs).
        probe_rounds: pushes per path after one warm-up each; the medians are compared.
        min_gain: ``gpu_direct`` is chosen only when it is this much faster than ``staged``
            (the staged path also frees device memory sooner).
    """
    if probe_bytes < 1 or probe_rounds < 1:
        raise ConfigError(f"probe_bytes and probe_rounds must be >= 1, got {probe_bytes}, {probe_rounds}")
    if min_gain <= 0:
        raise ConfigError(f"min_gain must be > 0, got {min_gain}")
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    layers, k = 48, 8
    rows = max(1, probe_bytes // (layers * k))
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, 128, (rows, layers, k), generator=gen, device=device).to(torch.uint8)
    item = DeviceRows("transfer-probe", "probe", ids, tuple(range(layers)), 128)  # ids: any valid ones

    async def once(mode: str) -> float:
        t0 = time.perf_counter()
        await push_device_rows(client, [item], mode, probe=True)
        return time.perf_counter() - t0

    for mode in ("gpu_direct", "staged"):  # warm-up: registration caches, pinned blocks
        await once(mode)
    times: dict[str, list[float]] = {"gpu_direct": [], "staged": []}
    for _ in range(probe_rounds):  # interleaved, so drift hits both alike
        for mode in times:
            times[mode].append(await once(mode))
    nbytes = ids.numel()
    gbps = {m: nbytes / statistics.median(t) / 1e9 for m, t in times.items()}
    mode = "gpu_direct" if gbps["gpu_direct"] >= min_gain * gbps["staged"] else "staged"
    return ProbeResult(mode, gbps["gpu_direct"], gbps["staged"], nbytes, probe_rounds)
