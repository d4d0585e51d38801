"""Torch reference implementations of the capture kernels.

These are the semantics every custom kernel must match bit-for-bit (parity tests compare
against them). All run on CPU or CUDA without a host synchronisation: indices are tensors on
the table's device, and nothing reads a value back to the host.
"""

from __future__ import annotations

import torch

__all__ = ["table_dtype", "write_step_rows", "gather_rows"]


def table_dtype(num_experts: int) -> torch.dtype:
    """Slot-table dtype for ids ``0 .. num_experts - 1``.

    uint8 up to 256 experts; int16 up to 65536, holding uint16 bit patterns (torch has no
    indexing kernels for uint16; the narrowing cast wraps modulo 2**16, and the host side
    reinterprets the bytes as uint16); int32 beyond.
    """
    if num_experts <= 1 << 8:
        return torch.uint8
    if num_experts <= 1 << 16:
        return torch.int16
    return torch.int32


def write_step_rows(table_SLK: torch.Tensor, slots_T: torch.Tensor, rows_TLK: torch.Tensor) -> None:
    """``table[slots[t]] = rows[t]`` for every token t of the step (slots unique)."""
    table_SLK.index_copy_(0, slots_T, rows_TLK.to(table_SLK.dtype))


def gather_rows(table_SLK: torch.Tensor, slots_T: torch.Tensor) -> torch.Tensor:
    """The rows of ``slots`` in order, packed: ``[T, L, K]``."""
    return table_SLK.index_select(0, slots_T)
