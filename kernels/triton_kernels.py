"""Triton versions of the capture kernels (CUDA only; same semantics as :mod:`.reference`).

Imported lazily by :mod:`r3rdma.kernels` the first time a CUDA tensor asks for a custom
kernel, so importing r3rdma never imports triton. Every launch goes to torch's current
stream, takes no host synchronisation and is capturable in a CUDA graph (after a first,
eager call has compiled it).

Row copies (``write_step_rows`` without narrowing, ``gather_rows``) move whole rows as 32-bit
words when the row size allows it: a uint8 row of 48 layers x 8 experts is 96 words, so each
token is a few wide loads instead of 384 byte loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["record_layer", "write_step_rows", "gather_rows"]

_TILE = 4096  # elements per program


@triton.jit
def _record_layer_kernel(
    buf_ptr,
    ids_ptr,
    rows_ptr,
    emap_ptr,
    T,
    ids_s0,
    ids_s1,
    buf_s0,
    layer_off,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_MAP: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.arange(0, BLOCK_K)
    tm = t < T
    m = tm[:, None] & (k < K)[None, :]
    if HAS_ROWS:
        src = tl.load(rows_ptr + t, mask=tm, other=0).to(tl.int64)
    else:
        src = t.to(tl.int64)
    ids = tl.load(ids_ptr + src[:, None] * ids_s0 + k[None, :] * ids_s1, mask=m, other=0)
    if HAS_MAP:
        ids = tl.load(emap_ptr + ids.to(tl.int64), mask=m, other=0)
    dst = buf_ptr + t[:, None].to(tl.int64) * buf_s0 + layer_off + k[None, :]
    tl.store(dst, ids.to(buf_ptr.dtype.element_ty), mask=m)


@triton.jit
def _scatter_rows_kernel(
    table_ptr,
    slots_ptr,
    rows_ptr,
    idx_ptr,
    N,
    ROW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_IDX: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    im = i < N
    slot = tl.load(slots_ptr + i, mask=im, other=0).to(tl.int64)
    if HAS_IDX:
        src = tl.load(idx_ptr + i, mask=im, other=0).to(tl.int64)
    else:
        src = i.to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    m = im[:, None] & (r < ROW)[None, :]
    v = tl.load(rows_ptr + src[:, None] * ROW + r[None, :], mask=m)
    tl.store(table_ptr + slot[:, None] * ROW + r[None, :], v.to(table_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gather_rows_kernel(
    out_ptr,
    table_ptr,
    slots_ptr,
    N,
    ROW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    im = i < N
    slot = tl.load(slots_ptr + i, mask=im, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    m = im[:, None] & (r < ROW)[None, :]
    v = tl.load(table_ptr + slot[:, None] * ROW + r[None, :], mask=m)
    tl.store(out_ptr + i[:, None].to(tl.int64) * ROW + r[None, :], v, mask=m)


def _blocks(row: int) -> tuple[int, int]:
    block_r = triton.next_power_of_2(max(row, 1))
    block_n = max(1, min(256, _TILE // block_r))
    return block_n, block_r


def _words(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The tensors as [rows, words] int32 views when their rows are whole words, else None."""
    out = []
    for x in tensors:
        row_bytes = (x[0].numel() if x.shape[0] else x.numel()) * x.element_size()
        if not x.is_contiguous() or x.shape[0] == 0 or row_bytes % 4 or x.data_ptr() % 4:
            return None
        out.append(x.reshape(x.shape[0], -1).view(torch.uint8).view(torch.int32))
    return tuple(out)


def record_layer(buf_TLK, layer, topk_ids_TK, rows_T=None, expert_map=None) -> None:
    """``buf[t, layer] = expert_map[topk_ids[rows[t]]]`` narrowed to ``buf``'s dtype, in one launch
    (see :func:`.reference.record_layer`); ``buf`` must be contiguous ``[T, L, K]``."""
    T = int(rows_T.numel()) if rows_T is not None else int(topk_ids_TK.shape[0])
    if T == 0:
        return
    assert buf_TLK.is_contiguous() and buf_TLK.dim() == 3
    K = int(topk_ids_TK.shape[1])
    block_k = triton.next_power_of_2(K)
    block_t = max(1, min(1024, _TILE // block_k))
    grid = (triton.cdiv(T, block_t),)
    _record_layer_kernel[grid](
        buf_TLK,
        topk_ids_TK,
        rows_T if rows_T is not None else topk_ids_TK,
        expert_map if expert_map is not None else topk_ids_TK,
        T,
        topk_ids_TK.stride(0),
        topk_ids_TK.stride(1),
        buf_TLK.stride(0),
        layer * buf_TLK.stride(1),
        K=K,
        BLOCK_T=block_t,
        BLOCK_K=block_k,
        HAS_ROWS=rows_T is not None,
        HAS_MAP=expert_map is not None,
        num_warps=4,
    )


def write_step_rows(table_SLK, slots_T, rows_TLK, token_idx_T=None) -> None:
    """``table[slots[i]] = rows[token_idx[i]]`` for every i, in one launch (see
    :func:`.reference.write_step_rows`); ``table`` must be contiguous."""
    n = int(slots_T.numel())
    if n == 0:
        return
    assert table_SLK.is_contiguous()
    rows = rows_TLK.contiguous()
    table, src = table_SLK, rows
    if rows.dtype == table_SLK.dtype:
        words = _words(table_SLK, rows)
        if words is not None:
            table, src = words
    table = table.reshape(table.shape[0], -1)
    row = int(table.shape[1])
    block_n, block_r = _blocks(row)
    _scatter_rows_kernel[(triton.cdiv(n, block_n),)](
        table,
        slots_T,
        src,
        token_idx_T if token_idx_T is not None else slots_T,
        n,
        ROW=row,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        HAS_IDX=token_idx_T is not None,
        num_warps=4,
    )


def gather_rows(table_SLK, slots_T, out_TLK=None) -> torch.Tensor:
    """The rows of ``slots`` in order, packed ``[T, L, K]`` into ``out`` (allocated when None),
    in one launch (see :func:`.reference.gather_rows`); returns ``out``."""
    n = int(slots_T.numel())
    if out_TLK is None:
        out_TLK = torch.empty((n, *table_SLK.shape[1:]), dtype=table_SLK.dtype, device=table_SLK.device)
    if n == 0:
        return out_TLK
    assert table_SLK.is_contiguous() and out_TLK.is_contiguous()
    words = _words(table_SLK, out_TLK)
    table, out = words if words is not None else (table_SLK.reshape(table_SLK.shape[0], -1), out_TLK.reshape(n, -1))
    row = int(table.shape[1])
    block_n, block_r = _blocks(row)
    _gather_rows_kernel[(triton.cdiv(n, block_n),)](
        out,
        table,
        slots_T,
        n,
        ROW=row,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        num_warps=4,
    )
    return out_TLK
