"""Host vs CUDA payload buffers: the one place that knows the difference.

ucxx sends any object exposing the buffer protocol (host) or ``__cuda_array_interface__``
(device; UCX moves it GPU-direct when a CUDA transport is available, else stages it).
ucxx does **not** honour the CAI ``stream`` field: the producer must synchronise the stream
or event that wrote the buffer before calling ``push``; otherwise UCX may read stale bytes.

Receivers always land payloads in host memory (the store writes them to disk), so only the
send side ever sees a device buffer. A device payload still carries the sender's CRC-32C
per request (the wire requires it); ``r3rdma.write.device_push`` hashes a pinned host copy. The CPU test machine exercises the host path only.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import numpy as np

from r3rdma.errors import ShapeMismatchError

__all__ = ["PayloadBuffer", "is_device_buffer", "payload_nbytes", "to_host_uint8"]

#: A contiguous host buffer (numpy, bytes) or a CUDA array (cupy, torch.cuda).
PayloadBuffer: TypeAlias = Any


def is_device_buffer(buf: object) -> bool:
    """True for objects that expose ``__cuda_array_interface__`` (and so live on a GPU)."""
    return hasattr(buf, "__cuda_array_interface__")


def payload_nbytes(buf: PayloadBuffer) -> int:
    """Byte size of a contiguous payload; refuses strided device arrays."""
    if is_device_buffer(buf):
        cai = buf.__cuda_array_interface__
        itemsize = np.dtype(cai["typestr"]).itemsize
        shape = tuple(cai["shape"])
        n = int(np.prod(shape, dtype=np.int64)) * itemsize
        strides = cai.get("strides")
        if strides is not None and n:
            expected, acc = [], itemsize
            for dim in reversed(shape):
                expected.append(acc)
                acc *= dim
            if tuple(strides) != tuple(reversed(expected)):
                raise ShapeMismatchError(f"device payload must be C-contiguous, got strides {strides}")
        return n
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ShapeMismatchError("host payload must be C-contiguous")
    return view.nbytes


def to_host_uint8(buf: PayloadBuffer) -> np.ndarray:
    """A flat uint8 host view (or copy, for device buffers) of ``buf``.

    Used by the in-process loopback, which has no GPU-direct path. Device copies go
    through torch or cupy, whichever owns the array; nothing is imported otherwise.
    """
    if not is_device_buffer(buf):
        return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    mod = type(buf).__module__.split(".")[0]
    if mod == "torch":
        return buf.detach().contiguous().view(-1).cpu().numpy().view(np.uint8).reshape(-1)
    if mod == "cupy":
        return buf.get().view(np.uint8).reshape(-1)
    raise ShapeMismatchError(f"cannot copy a device buffer of type {type(buf).__name__} to host; pass a cupy or torch array")
