"""The record path for compiled and CUDA-graphed models: one custom op into one fixed buffer.

A Python hook that knows about steps and requests cannot live inside a model that
``torch.compile`` traces or a CUDA graph replays: dynamo bakes Python state in at trace time,
and a replayed graph runs no Python at all. What survives both is what vLLM's own
routed-experts capture and SGLang's state capturer do: inside the model, only a tensor write
into one persistent buffer at offsets derived from shapes; everything that knows about
requests runs on the host before and after the forward.

Here that write is ``torch.ops.r3rdma.record_topk(buf_TLK, topk_ids_TK, layer)``: rows
``0 .. n - 1`` of MoE layer ``layer`` of ``buf_TLK`` take the router's ``n`` rows (narrowed to
the buffer's dtype), where ``n`` is what the router produced, padding included. It is a
registered custom op (``torch.library``), as vLLM's MoE ops are, so dynamo records one opaque
node instead of tracing into it, inductor calls it in place on the buffer (no functional copy
of the whole buffer), and a CUDA graph captures its one copy kernel against the buffer's fixed
address, repeated on every replay. The host then keeps only the step's real rows: rows of a
graph captured for 16 tokens and replayed for 11 are written but never stored.

:func:`new_step_buffer` makes the buffer (before the model is compiled or a graph captured);
:func:`record_hook` binds one layer's write, to be installed as the router's capture callback;
:class:`~r3rdma.capture.capturer.RoutingCapturer` takes the same buffer as ``step_buffer=``.
Importing this module registers the op; it needs torch only (no engine), so the GPU tests run
the exact path an engine plug-in installs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from r3rdma.errors import ShapeMismatchError

from .reference import table_dtype

__all__ = ["OP_NAME", "new_step_buffer", "record_hook", "record_topk", "unwritten_sentinel"]

OP_NAME = "r3rdma::record_topk"

_lib = torch.library.Library("r3rdma", "FRAGMENT")  # the registration lives as long as the module
# Tensor(a!): the op writes buf in place; dynamo and inductor keep it one in-place call.
_lib.define("record_topk(Tensor(a!) buf_TLK, Tensor topk_ids_TK, int layer) -> ()")


def _record_topk_impl(buf_TLK: torch.Tensor, topk_ids_TK: torch.Tensor, layer: int) -> None:
    # Rows past the buffer are padding a larger compiled range might carry (the host never
    # announces a step longer than the buffer): dropped, never an error inside a forward.
    n = min(int(topk_ids_TK.shape[0]), int(buf_TLK.shape[0]))
    buf_TLK[:n, layer].copy_(topk_ids_TK[:n])


# One implementation for every device: the copy is a plain torch op (one kernel on CUDA),
# which is what a CUDA graph should hold; launch cost does not exist inside a replay. Not the
# Triton record kernel of r3rdma.kernels: an engine warms up outside r3rdma's graph regime,
# so Triton would JIT-load its first kernel inside the engine's stream capture; and on the
# H200 (bench capture --record-path op, b64) it measured no less device time here.
_lib.impl("record_topk", _record_topk_impl, "CompositeExplicitAutograd")


@torch.library.register_fake(OP_NAME, lib=_lib)
def _record_topk_fake(buf_TLK: torch.Tensor, topk_ids_TK: torch.Tensor, layer: int) -> None:
    return None


record_topk = torch.ops.r3rdma.record_topk.default


def new_step_buffer(
    *, max_tokens: int, num_layers: int, top_k: int, num_experts: int, device: str | torch.device
) -> torch.Tensor:
    """The fixed step buffer ``[max_tokens, L, K]`` in the slot table's dtype for ``num_experts``.

    Size it from the engine's token budget per forward, padding included (vLLM: the larger of
    ``max_num_batched_tokens`` and the largest CUDA-graph capture size). Allocate it before the
    model is compiled or a graph is captured, and keep it alive as long as they are.
    """
    if max_tokens < 1 or num_layers < 1 or top_k < 1:
        raise ShapeMismatchError(f"need max_tokens, num_layers, top_k >= 1, got {max_tokens}, {num_layers}, {top_k}")
    return torch.zeros((max_tokens, num_layers, top_k), dtype=table_dtype(num_experts), device=device)


def _record(buf_TLK: torch.Tensor, layer: int, topk_ids_TK: torch.Tensor) -> None:
    torch.ops.r3rdma.record_topk(buf_TLK, topk_ids_TK, layer)


def record_hook(buf_TLK: torch.Tensor, layer: int) -> Callable[[torch.Tensor], None]:
    """``hook(topk_ids_TK)`` writing MoE layer ``layer`` (0-based index in the layer map, not
    the decoder layer) of ``buf_TLK``: a partial of a module function, which dynamo inlines to
    the one op call, holding no state that changes between steps."""
    if not 0 <= layer < buf_TLK.shape[1]:
        raise ShapeMismatchError(f"MoE layer index {layer} outside the step buffer's {buf_TLK.shape[1]} layers")
    return functools.partial(_record, buf_TLK, int(layer))


def unwritten_sentinel(buf_TLK: torch.Tensor, num_experts: int) -> int | None:
    """A value that marks a row no router wrote, or None when none can be told apart.

    Filled into the buffer before a step, a row that still holds it in every one of its K
    entries was not written: routers pick K distinct experts, so with K >= 2 no routed row is
    constant, and an id past ``num_experts - 1`` is never routed. (Stored bit patterns: int16
    holds uint16 ids, so -1 is 65535.)
    """
    top_k = int(buf_TLK.shape[2])
    value = {torch.uint8: 255, torch.int16: -1, torch.int32: -1}[buf_TLK.dtype]
    unsigned = value % (1 << (8 * buf_TLK.element_size()))
    if top_k >= 2 or unsigned >= num_experts:
        return value
    return None
