"""Torch reference implementations of the capture kernels.

These are the semantics every custom kernel must match bit-for-bit (parity tests compare
against them). All run on CPU or CUDA without a host synchronisation: indices are tensors on
the table's device, and nothing reads a value back to the host.

Narrowing (int64 router ids -> uint8 / int16 / int32 storage) is a plain integer cast: it
wraps modulo 2**bits, exactly like ``Tensor.to``. Ids never exceed the storage range in
practice (the dtype is chosen from ``num_experts``).
"""

from __future__ import annotations

import torch

__all__ = ["table_dtype", "record_layer", "write_step_rows", "gather_rows"]


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


def record_layer(
    buf_TLK: torch.Tensor,
    layer: int,
    topk_ids_TK: torch.Tensor,
    rows_T: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> None:
    """``buf[t, layer] = expert_map[topk_ids[rows[t]]]`` narrowed to ``buf``'s dtype, for t < T.

    ``T`` is ``rows_T.numel()`` when ``rows_T`` is given (the router also saw padding rows),
    else ``topk_ids_TK.shape[0]``. ``expert_map`` (EPLB) maps physical replica ids to logical
    expert ids; None is the identity.
    """
    ids = topk_ids_TK if rows_T is None else topk_ids_TK.index_select(0, rows_T)
    if expert_map is not None:
        ids = torch.take(expert_map, ids.to(torch.int64))
    buf_TLK[: ids.shape[0], layer].copy_(ids)


def write_step_rows(
    table_SLK: torch.Tensor,
    slots_T: torch.Tensor,
    rows_TLK: torch.Tensor,
    token_idx_T: torch.Tensor | None = None,
) -> None:
    """``table[slots[i]] = rows[token_idx[i]]`` for every i (slots unique).

    Without ``token_idx`` every row is written, ``table[slots[t]] = rows[t]``; with it only the
    listed tokens are (speculative decoding keeps accepted tokens only), and ``slots`` holds
    one slot per listed token.
    """
    rows = rows_TLK if token_idx_T is None else rows_TLK.index_select(0, token_idx_T)
    table_SLK.index_copy_(0, slots_T, rows.to(table_SLK.dtype))


def gather_rows(table_SLK: torch.Tensor, slots_T: torch.Tensor, out_TLK: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of ``slots`` in order, packed: ``[T, L, K]`` (into ``out`` when given)."""
    if out_TLK is None:
        return table_SLK.index_select(0, slots_T)
    return torch.index_select(table_SLK, 0, slots_T, out=out_TLK)
