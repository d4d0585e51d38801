"""Capture kernels: recording a layer's routing, writing a step into the slot table, gathering
a request's rows.

``reference`` holds the torch implementations that define the semantics; ``triton_kernels``
holds custom CUDA kernels with the same semantics. The functions exported here dispatch: a
custom kernel runs only for CUDA tensors, only when triton is importable, and only for the
operations and regimes where it measured faster than the reference (``CUSTOM_WINS_*``, from
``r3rdma bench kernels`` on an H100; numbers in BENCHMARKS.md). Everything else, and every
CPU tensor, runs the reference.

``R3_KERNELS`` (or :func:`set_kernel_backend`) overrides the choice: ``auto`` (default, the
table), ``torch`` (reference everywhere), ``triton`` (custom kernels for every CUDA call).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from types import ModuleType
from typing import Literal

import torch

from r3rdma.errors import ConfigError

from . import reference
from .reference import table_dtype

__all__ = [
    "CUSTOM_WINS_EAGER",
    "CUSTOM_WINS_GRAPHED",
    "gather_rows",
    "graph_regime",
    "kernel_backend",
    "record_layer",
    "set_kernel_backend",
    "table_dtype",
    "write_step_rows",
]

#: Where the custom kernel beat the torch reference (``auto`` mode), measured by
#: ``r3rdma bench kernels`` on an H100 (BENCHMARKS.md). Two regimes:
#:
#: - inside a CUDA graph (``torch.cuda.is_current_stream_capturing()``) launch cost is gone and
#:   device time decides: the Triton kernels took 1.2-2.5x less device time for
#:   ``record_layer``, 1.7-4.7x for ``write_step_rows``, 1.2-4x for ``gather_rows``;
#: - launched eagerly from Python, Triton's launcher costs ~34 us of CPU per call against
#:   ~10-15 us for one torch op, so the reference wins, except ``record_layer`` with an EPLB
#:   ``expert_map`` (three torch ops, 45 us, against one Triton kernel, 34 us).
CUSTOM_WINS_GRAPHED: dict[str, bool] = {"record_layer": True, "write_step_rows": True, "gather_rows": True}
CUSTOM_WINS_EAGER: dict[str, bool] = {
    "record_layer_expert_map": True,
    "record_layer": False,
    "write_step_rows": False,
    "gather_rows": False,
}

_BACKENDS = ("auto", "torch", "triton")
_graph_regime = 0  # > 0 inside graph_regime(): choose as if capturing a CUDA graph
_backend: str | None = None  # None: read R3_KERNELS on first use
_triton: ModuleType | Literal[False] | None = None  # False: tried and unavailable


def set_kernel_backend(backend: str | None) -> None:
    """Choose ``auto`` / ``torch`` / ``triton`` for this process (None: back to ``R3_KERNELS``)."""
    global _backend
    if backend is not None and backend not in _BACKENDS:
        raise ConfigError(f"kernel backend must be one of {_BACKENDS}, got {backend!r}")
    _backend = backend


def kernel_backend() -> str:
    """The backend in force: argument of :func:`set_kernel_backend`, then ``R3_KERNELS``, then ``auto``."""
    if _backend is not None:
        return _backend
    env = os.environ.get("R3_KERNELS", "auto").strip().lower() or "auto"
    if env not in _BACKENDS:
        raise ConfigError(f"R3_KERNELS must be one of {_BACKENDS}, got {env!r}")
    return env


@contextlib.contextmanager
def graph_regime():
    """Choose kernels as for a CUDA graph inside this block, also in the eager warm-up forwards
    before the capture, so that the kernels the graph will hold are compiled before it."""
    global _graph_regime
    _graph_regime += 1
    try:
        yield
    finally:
        _graph_regime -= 1


def _custom_module() -> ModuleType | None:
    global _triton
    if _triton is None:
        try:
            _triton = importlib.import_module(".triton_kernels", __name__)
        except ImportError:  # no triton on this machine: the reference serves every call
            _triton = False
    return _triton or None


def _impl(op: str, tensor: torch.Tensor) -> ModuleType:
    if tensor.device.type != "cuda":
        return reference
    backend = kernel_backend()
    if backend == "torch":
        return reference
    if backend == "auto":
        graphed = _graph_regime > 0 or torch.cuda.is_current_stream_capturing()
        wins = CUSTOM_WINS_GRAPHED if graphed else CUSTOM_WINS_EAGER
        if not wins.get(op, False):
            return reference
    return _custom_module() or reference


def record_layer(
    buf_TLK: torch.Tensor,
    layer: int,
    topk_ids_TK: torch.Tensor,
    rows_T: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> None:
    """``buf[t, layer] = expert_map[topk_ids[rows[t]]]``, narrowed (see :func:`reference.record_layer`)."""
    op = "record_layer_expert_map" if expert_map is not None else "record_layer"
    _impl(op, buf_TLK).record_layer(buf_TLK, layer, topk_ids_TK, rows_T, expert_map)


def write_step_rows(
    table_SLK: torch.Tensor,
    slots_T: torch.Tensor,
    rows_TLK: torch.Tensor,
    token_idx_T: torch.Tensor | None = None,
) -> None:
    """``table[slots[i]] = rows[token_idx[i]]`` (see :func:`reference.write_step_rows`)."""
    _impl("write_step_rows", table_SLK).write_step_rows(table_SLK, slots_T, rows_TLK, token_idx_T)


def gather_rows(table_SLK: torch.Tensor, slots_T: torch.Tensor, out_TLK: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of ``slots`` in order, packed ``[T, L, K]`` (see :func:`reference.gather_rows`)."""
    return _impl("gather_rows", table_SLK).gather_rows(table_SLK, slots_T, out_TLK)
