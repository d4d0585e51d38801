"""verl and slime hand-off: their routing tensors, read from r3rdma instead of the engine's reply.

Both stacks receive routing today inside the rollout engine's HTTP answer (base64 int32 for
slime, a numpy array through Ray for verl) and hand it to Megatron's router replay. The
functions here build the very tensors those trainers consume, from a :class:`RoutingReader`,
so a stack swaps its transport without touching its trainer:

- :func:`verl_routed_experts`: verl's batch field ``routed_experts``, int16
  ``[bs, prompt_length + response_length, L, K]``, laid out as verl's agent loop pads it
  (``verl/experimental/agent_loop/agent_loop.py`` 0.9.1, ``_agent_loop_postprocess``, lines
  785-809): the prompt is left-padded to ``prompt_length``, the response right-padded to
  ``response_length``, and a sample's rows start at ``start_pos = prompt_length - prompt_len``
  (where its first prompt token sits); pads and the last token hold 0, as in verl. verl replays
  every row but the last one, pads included (their outputs reach no loss); positions of a
  response with no rows (``allow_unrouted_tail=True``: tool output after the last generation)
  get the spread fill below, not 0, so that replaying them cannot pile their tokens on expert 0.
- :func:`verl_routed_experts_unpadded`: the per-sample form of ``AgentLoopOutput.as_dict``
  (same file, lines 129-141): int16 ``[prompt_len + response_len, L, K]``, rows from position
  0, trailing positions 0.
- :func:`slime_rollout_routed_experts`: slime's per-sample ``rollout_routed_experts``, int32
  ``[len(tokens) - 1, num_layers, top_k]`` over *all* decoder layers, as slime decodes the
  engine's answer (``slime/rollout/sglang_rollout.py``, ``np.frombuffer(..., dtype=np.int32)
  .reshape(len(sample.tokens) - 1, args.num_layers, args.moe_router_topk)``). r3rdma stores
  MoE layers only, with their decoder-layer indices (``layer_map``); dense layers get the spread
  fill below by default (``dense_fill``): slime's ``fill_routing_replay`` skips them
  (``slime/backends/megatron_utils/actor.py``: ``layer_id % moe_layer_freq != 0`` /
  ``moe_layer_freq[layer_id] == 0`` -> ``continue``), so their content is never replayed, but
  slime's ``validate_rollout_routed_experts_for_replay`` (THUDM/slime 8e3769f,
  ``slime/observability/rollout_data_utils.py``) checks *every* layer's column when
  ``moe_layer_freq`` is an int and top-k > 1, and refuses a column that is all zero.

Positions that have no routing but are replayed anyway get the *spread fill*: position ``p``
(within its sample) holds experts ``(p * K + j) % E`` for ``j < K`` in every layer: duplicate-free
within a row, spread over all experts, never all zero when ``K > 1`` (docs/REPLAY.md, "Rows never
computed": a zero fill sends every such token to expert 0).

Each call reads only the requests it is given (one rank's share), never the whole rollout.
A pipeline stage asks for its decoder layers with ``layers=``: the layer axis then holds those
layers alone, in the order given, and only the inner chunks holding their MoE layers are read
(``RoutingReader.get_packed(layers=...)``). No function here takes ``rows=`` (a
context-parallel rank's row spans): each returns whole, token-aligned samples, as its trainer
consumes them (verl's fixed ``[bs, prompt_length + response_length]`` window, ``as_dict``'s
``prompt_len + response_len`` positions, slime's ``len(tokens) - 1`` rows, which
``fill_routing_replay`` asserts), and the trainer splits them over its ranks itself; their
length checks also need every row. A rank that replays its own rows reads them with
``RoutingReader.get_numpy`` / ``collect(rows=cp_row_spans(...))``.
Checks, each with a message that says what was expected and what arrived:

- a request not committed: :class:`UnknownRequestError` (from the reader);
- a request whose stored rows begin after position 0 (only later turns stored):
  :class:`MissingRowsError`; those positions would otherwise replay expert 0;
- rows that do not match the token count (``prompt_len + response_len - 1``: the last sampled
  token is never a forward input): :class:`RowCountMismatchError` (a
  :class:`ShapeMismatchError`) naming the request; the routing is not the sample's (another
  request's stored under a reused id, a failed commit) or the lengths are wrong. Where a
  sample's exact count is known (slime always; verl unless its response was cut at
  ``response_length`` or ``allow_unrouted_tail`` is set, where only bounds are), the read
  passes it as ``RoutingReader.get_packed(expected_rows=...)``, so a wrong request is refused
  from the index, before any row is read; the other bounds are checked on the rows read;
- ids wider than the target dtype, a layer map that does not fit the trainer's layer count or
  MoE pattern, a top-k other than the trainer's: :class:`ShapeMismatchError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from r3rdma.errors import MissingRowsError, RowCountMismatchError, ShapeMismatchError
from r3rdma.read.layers import layer_list
from r3rdma.read.reader import PackedRouting, RoutingReader

__all__ = [
    "slime_moe_layers",
    "slime_rollout_routed_experts",
    "verl_routed_experts",
    "verl_routed_experts_unpadded",
]

_INT16_IDS = 1 << 15  # verl stores ids as int16: expert ids must stay below 32768


def slime_moe_layers(num_layers: int, moe_layer_freq: int | Sequence[int]) -> tuple[int, ...]:
    """Decoder layers slime (and Megatron) treat as MoE for ``moe_layer_freq``: an int ``f``
    marks every layer with ``layer_id % f == 0``; a list marks the layers whose entry is 1."""
    if isinstance(moe_layer_freq, bool) or not isinstance(moe_layer_freq, (int, list, tuple)):
        raise ShapeMismatchError(f"moe_layer_freq must be an int or a list of 0/1, got {moe_layer_freq!r}")
    if isinstance(moe_layer_freq, int):
        if moe_layer_freq < 1:
            raise ShapeMismatchError(f"moe_layer_freq must be >= 1, got {moe_layer_freq}")
        return tuple(i for i in range(num_layers) if i % moe_layer_freq == 0)
    if len(moe_layer_freq) != num_layers:
        raise ShapeMismatchError(f"moe_layer_freq lists {len(moe_layer_freq)} layers, the model has {num_layers}")
    return tuple(i for i, f in enumerate(moe_layer_freq) if f)


def slime_rollout_routed_experts(
    reader: RoutingReader,
    rollout_id: str,
    request_ids: Sequence[str],
    *,
    token_lens: Sequence[int],
    num_layers: int,
    top_k: int | None = None,
    moe_layer_freq: int | Sequence[int] | None = None,
    dense_fill: int | None = None,
    layers: Iterable[int] | None = None,
) -> list[np.ndarray]:
    """slime's ``Sample.rollout_routed_experts`` for each of ``request_ids``, in order.

    Args:
        reader: where the rollout was committed.
        rollout_id, request_ids: the samples to build (only these are read).
        token_lens: ``len(sample.tokens)`` of each sample (prompt + response); a sample must
            have exactly ``token_len - 1`` stored rows, as slime asserts in ``fill_routing_replay``
            (checked from the index before reading: else :class:`RowCountMismatchError`).
        num_layers: ``args.num_layers``, every decoder layer, dense ones included.
        top_k: ``args.moe_router_topk``, checked against the stored top-k when given.
        moe_layer_freq: the model's ``moe_layer_freq``; when given, the stored layer map must
            list exactly the layers slime replays.
        dense_fill: the dense layers' columns (slime never replays them). None (default): the
            spread fill, which slime's replay validator accepts; an int: that value everywhere
            (0 fails the validator when ``moe_layer_freq`` is an int and top-k > 1).
        layers: a pipeline stage's decoder layers (ids below ``num_layers``, a sequence or a
            range, dense ones included), or None: every decoder layer. The layer axis then holds
            these layers alone, in this order (column ``j``: decoder layer ``layers[j]``; dense
            ones get ``dense_fill`` as above), and only the chunks holding their MoE layers are
            read. The layer map is still checked whole against ``num_layers`` / ``moe_layer_freq``.

    Returns:
        int32 numpy arrays ``[token_len - 1, num_layers, top_k]`` (``len(layers)`` in place of
        ``num_layers`` with ``layers``; slime keeps numpy on the sample and calls
        ``torch.from_numpy`` in the actor). No ``rows=``: slime asserts ``len(tokens) - 1`` rows
        per sample and splits them over context-parallel ranks itself (module docstring).
    """
    request_ids = list(request_ids)
    token_lens = _lengths("token_lens", token_lens, len(request_ids), minimum=2)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ShapeMismatchError(f"num_layers must be an int >= 1, got {num_layers!r}")
    stage = _stage(reader, rollout_id, layers, num_layers)
    expected = {rid: n - 1 for rid, n in zip(request_ids, token_lens)}
    try:
        packed = _read_share(reader, rollout_id, request_ids, stage, expected)
    except RowCountMismatchError as e:
        rid, stored = e.request_id, e.stored
        if rid is None or rid not in expected or stored is None:
            raise
        raise _slime_count_error(rid, rollout_id, stored, expected[rid]) from e
    layer_map, stored_k, num_experts = _geometry(reader, rollout_id, packed, stage)
    _check_top_k(stored_k, top_k)
    _check_layer_map(layer_map, num_layers, moe_layer_freq)
    if num_experts > np.iinfo(np.int32).max:
        raise ShapeMismatchError(f"rollout {rollout_id!r} has {num_experts} experts; slime decodes int32 ids")
    out = []
    columns, width = (list(layer_map), num_layers) if stage is None else (stage.columns, len(stage.out_layers))
    for i, rid in enumerate(request_ids):
        rows = _rows(packed, i, rollout_id)
        want = token_lens[i] - 1
        if rows.shape[0] != want:  # a reader-like object that does not take expected_rows
            raise _slime_count_error(rid, rollout_id, rows.shape[0], want)
        if dense_fill is None:
            full = np.repeat(_spread(0, want, stored_k, num_experts)[:, None, :], width, axis=1).astype(np.int32)
        else:
            full = np.full((want, width, stored_k), dense_fill, dtype=np.int32)
        # widens uint8 (or the reader's int32) without wrapping; a stage with no MoE layer
        # read one layer only to check the row count, and keeps none of it
        full[:, columns] = rows.numpy()[:, : len(columns)]
        out.append(full)
    return out


def verl_routed_experts(
    reader: RoutingReader,
    rollout_id: str,
    request_ids: Sequence[str],
    *,
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    prompt_length: int,
    response_length: int,
    num_layers: int | None = None,
    top_k: int | None = None,
    allow_unrouted_tail: bool = False,
    layers: Iterable[int] | None = None,
) -> torch.Tensor:
    """verl's batch field ``routed_experts`` for ``request_ids``: int16
    ``[len(request_ids), prompt_length + response_length, L, K]``.

    Sample ``i`` (``prompt_lens[i]`` prompt tokens, ``response_lens[i]`` response tokens after
    verl's truncation to ``response_length``) occupies positions ``start_pos ..`` with
    ``start_pos = prompt_length - prompt_lens[i]``; row ``p`` of the request goes to position
    ``start_pos + p``. Left pad, right pad and the last token (never a forward input) hold 0,
    as in verl (agent_loop.py 797-809).

    Args:
        prompt_length, response_length: verl's ``rollout.prompt_length`` / ``response_length``.
        num_layers: None: ``L`` = the stored MoE layers (verl indexes by MoE ordinal when ``L``
            differs from the model's layer count, router_replay_utils.py 523); an int: ``L`` =
            every decoder layer, MoE layers at their ``layer_map`` index and dense layers 0 (the
            layout SGLang returns: ``reshape(-1, num_hidden_layers, topk)``).
        top_k: checked against the stored top-k when given.
        allow_unrouted_tail: a multi-turn sample whose response ends with tool output has no rows
            for those tokens; True accepts fewer rows than ``prompt_len + response_len - 1`` and
            gives those positions the spread fill (module docstring), else that is a
            :class:`ShapeMismatchError`. verl leaves them 0 (agent_loop.py 132-137) and its
            replay has no mask: it replays every row but the last, so zeros there would send
            each of those tokens to expert 0 K times; their outputs reach no loss (tool
            output is masked out of it), the spread keeps them from skewing expert load.
        layers: a pipeline stage's layers, as decoder layer ids (a sequence or a range), or
            None: all. The layer axis ``L`` then holds these layers alone, in this order, and
            only the chunks holding their MoE layers are read. With ``num_layers=None`` they
            must be MoE layers of the rollout (else :class:`ShapeMismatchError` from the
            reader); with ``num_layers`` any decoder layers below it, dense ones 0 as above.

    No ``rows=`` (a context-parallel rank's rows): the output's positions are verl's fixed
    ``prompt_length + response_length`` window, which verl's trainer splits over its ranks
    itself (module docstring).

    A request with more rows than ``prompt_len + response_len - 1`` is refused, except when the
    response was cut at ``response_length``: verl then keeps the first
    ``prompt_len + response_length`` rows (single_turn_agent_loop.py 99-101), and so does this.
    A refused count is a :class:`RowCountMismatchError` naming the request. A sample whose
    count is exact (response shorter than ``response_length``, no ``allow_unrouted_tail``) is
    checked from the index before anything is read (``get_packed(expected_rows=...)``); the
    others (only bounds known) on the rows read.
    """
    share = _verl_share(
        reader,
        rollout_id,
        request_ids,
        prompt_lens,
        response_lens,
        num_layers,
        top_k,
        layers,
        allow_unrouted_tail,
        prompt_length=prompt_length,
        response_length=response_length,
    )
    request_ids, prompt_lens, response_lens, packed = share.request_ids, share.prompt_lens, share.response_lens, share.packed
    out = torch.zeros((len(request_ids), prompt_length + response_length, share.width, share.top_k), dtype=torch.int16)
    for i, rid in enumerate(request_ids):
        rows = _verl_rows(
            packed, i, rid, rollout_id, prompt_lens[i], response_lens[i], response_length, allow_unrouted_tail, share.num_experts
        )
        start_pos = prompt_length - prompt_lens[i]
        _place(out[i, start_pos : start_pos + rows.shape[0]], rows, share.columns)
    return out


def verl_routed_experts_unpadded(
    reader: RoutingReader,
    rollout_id: str,
    request_ids: Sequence[str],
    *,
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    response_length: int,
    num_layers: int | None = None,
    top_k: int | None = None,
    allow_unrouted_tail: bool = False,
    layers: Iterable[int] | None = None,
) -> list[torch.Tensor]:
    """Per-sample int16 ``[prompt_len + response_len, L, K]``, as ``AgentLoopOutput.as_dict``
    aligns ``routed_experts`` (agent_loop.py 129-141): rows from position 0, the last token 0
    (an unrouted tail, with ``allow_unrouted_tail``: the spread fill).

    Arguments (``layers`` included: the layer axis then holds those layers alone) and checks
    as in :func:`verl_routed_experts` (no prompt padding here). No ``rows=``: these are
    ``AgentLoopOutput`` samples, which verl pads into its batch window and splits over
    context-parallel ranks itself (module docstring).
    """
    share = _verl_share(
        reader,
        rollout_id,
        request_ids,
        prompt_lens,
        response_lens,
        num_layers,
        top_k,
        layers,
        allow_unrouted_tail,
        response_length=response_length,
    )
    request_ids, prompt_lens, response_lens, packed = share.request_ids, share.prompt_lens, share.response_lens, share.packed
    out = []
    for i, rid in enumerate(request_ids):
        rows = _verl_rows(
            packed, i, rid, rollout_id, prompt_lens[i], response_lens[i], response_length, allow_unrouted_tail, share.num_experts
        )
        aligned = torch.zeros((prompt_lens[i] + response_lens[i], share.width, share.top_k), dtype=torch.int16)
        _place(aligned[: rows.shape[0]], rows, share.columns)
        out.append(aligned)
    return out


# -- internals --------------------------------------------------------------------------------


class _VerlShare(NamedTuple):
    request_ids: list[str]
    prompt_lens: list[int]
    response_lens: list[int]
    packed: PackedRouting | None
    columns: list[int] | None  # decoder-layer column of each stored MoE layer, or None: stored order
    width: int  # layers in the output
    top_k: int
    num_experts: int


def _verl_share(
    reader, rollout_id, request_ids, prompt_lens, response_lens, num_layers, top_k, layers, allow_unrouted_tail, **sizes: int
) -> _VerlShare:
    """Checked arguments and the caller's share of the rollout, read once (both verl layouts);
    ``sizes``: ``response_length``, and ``prompt_length`` for the padded layout. Samples must
    fit them (checked before the read). Samples whose row count is exact are read with it as
    ``expected_rows``: a wrong request fails before anything is read."""
    request_ids = list(request_ids)
    prompt_lens = _lengths("prompt_lens", prompt_lens, len(request_ids), minimum=1)
    response_lens = _lengths("response_lens", response_lens, len(request_ids), minimum=0)
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ShapeMismatchError(f"{name} must be an int >= 0, got {value!r}")
    response_length, prompt_length = sizes["response_length"], sizes.get("prompt_length")
    for rid, p, r in zip(request_ids, prompt_lens, response_lens):
        if prompt_length is not None and (p > prompt_length or r > response_length):
            raise ShapeMismatchError(
                f"request {rid!r}: prompt {p} / response {r} tokens do not fit "
                f"prompt_length {prompt_length} / response_length {response_length} (verl truncates the "
                f"response to response_length and refuses a prompt longer than prompt_length)"
            )
        if r > response_length:
            raise ShapeMismatchError(f"request {rid!r}: response of {r} tokens exceeds response_length {response_length}")
    # Exact counts only: a response cut at response_length may store more rows (verl keeps a
    # prefix), an unrouted tail fewer; those are bounds, checked on the rows read.
    expected = {
        rid: p + r - 1
        for rid, p, r in zip(request_ids, prompt_lens, response_lens)
        if r < response_length and not allow_unrouted_tail
    }
    stage = _stage(reader, rollout_id, layers, num_layers)
    try:
        packed = _read_share(reader, rollout_id, request_ids, stage, expected)
    except RowCountMismatchError as e:
        rid, stored = e.request_id, e.stored
        if rid is None or rid not in expected or stored is None:
            raise
        i = request_ids.index(rid)
        problem = _verl_count_error(
            rid, rollout_id, stored, prompt_lens[i], response_lens[i], response_length, allow_unrouted_tail
        )
        if problem is None:
            raise
        raise problem from e
    layer_map, stored_k, num_experts = _geometry(reader, rollout_id, packed, stage)
    _check_top_k(stored_k, top_k)
    columns = _verl_columns(layer_map, num_layers)
    width = len(layer_map) if num_layers is None else num_layers
    if stage is not None:
        # The stage's layers alone: MoE-only (num_layers None) reads exactly them, in order.
        columns = None if num_layers is None else stage.columns
        width = len(stage.out_layers)
    if num_experts > _INT16_IDS:
        raise ShapeMismatchError(
            f"rollout {rollout_id!r} has {num_experts} experts; verl's routed_experts is int16 (ids < {_INT16_IDS})"
        )
    return _VerlShare(request_ids, prompt_lens, response_lens, packed, columns, width, stored_k, num_experts)


class _Stage(NamedTuple):
    """A pipeline stage's slice of the layer axis (``layers=``)."""

    out_layers: list[int]  # decoder layer of each output column, in the caller's order
    read_layers: list[int]  # MoE layers read (decoder ids), in output order
    columns: list[int]  # output column of each read layer
    layer_map: tuple[int, ...]  # the rollout's whole layer map (checks see every stored layer)
    top_k: int
    num_experts: int


def _stage(reader: RoutingReader, rollout_id: str, layers: Iterable[int] | None, num_layers: int | None) -> _Stage | None:
    """``layers`` (checked as the reader checks them) as the output's columns and the MoE layers
    to read, from the rollout's geometry; None: every layer, the read unchanged.
    ``num_layers`` None: the output is MoE-only, so every layer must be stored (the reader
    names one that is not); an int: decoder layers below it, dense ones filled."""
    chosen = layer_list(layers)
    if chosen is None:
        return None
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1):
        raise ShapeMismatchError(f"num_layers must be an int >= 1 or None, got {num_layers!r}")
    info = reader.info(rollout_id)
    if num_layers is None:
        read = chosen  # a layer the rollout lacks: the reader's ShapeMismatchError
    else:
        outside = [layer for layer in chosen if not 0 <= layer < num_layers]
        if outside:
            raise ShapeMismatchError(f"layers {outside[:8]} are not decoder layers of a model of {num_layers} layers")
        read = [layer for layer in chosen if layer in info.layer_map]
    return _Stage(chosen, read, [chosen.index(layer) for layer in read], info.layer_map, info.top_k, info.num_experts)


def _read_share(
    reader: RoutingReader, rollout_id: str, request_ids: list[str], stage: _Stage | None, expected: dict[str, int]
) -> PackedRouting | None:
    """The share's rows (None for no request): every layer, or the stage's MoE layers. A stage
    of dense layers alone still reads one layer, the least a read can fetch: the checks of each
    sample's row count need its rows. ``expected``: the samples' exact row counts, checked by
    the reader from its index before anything is read (a reader-like object that is not a
    :class:`RoutingReader`, such as a test double, is asked without them: the callers check
    the rows read)."""
    if not request_ids:
        return None
    kwargs: dict[str, Any] = {}
    if stage is not None:
        kwargs["layers"] = stage.read_layers or stage.layer_map[:1]
    if expected and isinstance(reader, RoutingReader):
        kwargs["expected_rows"] = expected
    return reader.get_packed(rollout_id, request_ids, **kwargs)


def _slime_count_error(rid: str, rollout_id: str, n: int, want: int) -> RowCountMismatchError:
    """slime's refusal of a sample whose stored rows are not ``len(tokens) - 1``."""
    return RowCountMismatchError(
        f"request {rid!r} of rollout {rollout_id!r} has {n} routing rows; slime needs "
        f"len(tokens) - 1 = {want} (one per token that was a forward input: every token but the "
        f"last sampled one). Not this sample's routing: another request's stored under this id (a reused "
        f"request id), or a commit that failed; else wrong token_lens, or the sample was truncated/extended "
        f"after routing was stored",
        rollout_id=rollout_id,
        request_id=rid,
        expected=want,
        stored=n,
    )


def _verl_count_error(
    rid: str, rollout_id: str, n: int, prompt_len: int, response_len: int, response_length: int, allow_unrouted_tail: bool
) -> RowCountMismatchError | None:
    """verl's refusal of a sample storing ``n`` rows, or None where verl takes them: exactly
    ``prompt_len + response_len - 1``, more when the response was cut at ``response_length``
    (verl keeps a prefix), fewer with ``allow_unrouted_tail``."""
    want = prompt_len + response_len - 1
    if n > want and response_len != response_length:
        text = (
            f"request {rid!r} of rollout {rollout_id!r} has {n} routing rows, more than the "
            f"prompt {prompt_len} + response {response_len} - 1 = {want} positions that were forward inputs "
            f"(and the response was not cut at response_length {response_length}): wrong lengths or wrong request "
            f"(another request's routing stored under this id, e.g. a reused request id)"
        )
    elif n < want and not allow_unrouted_tail:
        text = (
            f"request {rid!r} of rollout {rollout_id!r} has {n} routing rows; prompt {prompt_len} + response "
            f"{response_len} tokens need {want} (every token but the last sampled one is a forward input). "
            f"Another request's routing stored under this id (a reused request id), a commit that failed, or "
            f"wrong lengths; or a multi-turn response ending with tool output, which has no rows for it: pass "
            f"allow_unrouted_tail=True to give those positions a spread, duplicate-free fill (verl replays them)"
        )
    else:
        return None
    return RowCountMismatchError(text, rollout_id=rollout_id, request_id=rid, expected=want, stored=n)


def _spread(first: int, count: int, top_k: int, num_experts: int) -> np.ndarray:
    """``[count, top_k]`` int64: position ``first + r`` holds experts ``((first + r) * K + j) % E``:
    K distinct ids per row (K <= E), every expert used as evenly as the rows allow, and a row is
    never all zero when K > 1."""
    positions = np.arange(first, first + count, dtype=np.int64)[:, None]
    return (positions * top_k + np.arange(top_k, dtype=np.int64)[None, :]) % max(1, num_experts)


def _place(target: torch.Tensor, rows: torch.Tensor, columns: list[int] | None) -> None:
    """Rows into an int16 slice: copy_ converts uint8/uint16/int32 (ids < 32768 checked)."""
    if columns is None:
        target.copy_(rows)
    else:
        # a stage of dense layers alone read one layer only for the row checks: none placed
        target[:, columns] = rows[:, : len(columns)].to(torch.int16)


def _lengths(name: str, values: Sequence[int], count: int, *, minimum: int) -> list[int]:
    values = list(values)
    if len(values) != count:
        raise ShapeMismatchError(f"{name} lists {len(values)} lengths for {count} requests")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
            raise ShapeMismatchError(f"{name} must hold ints >= {minimum}, got {v!r}")
    return [int(v) for v in values]


def _geometry(
    reader: RoutingReader, rollout_id: str, packed: PackedRouting | None, stage: _Stage | None = None
) -> tuple[tuple[int, ...], int, int]:
    """(layer_map, top_k, num_experts) of the rollout: from the stage's look at the index, from
    the read itself, or from the index when there is nothing to read (an empty share still gets
    correctly shaped outputs)."""
    if stage is not None:
        return stage.layer_map, stage.top_k, stage.num_experts
    if packed is not None:
        return packed.layer_map, int(packed.ids_TLK.shape[2]), packed.num_experts
    info = reader.info(rollout_id)
    return info.layer_map, info.top_k, info.num_experts


def _check_top_k(stored: int, wanted: int | None) -> None:
    if wanted is not None and wanted != stored:
        raise ShapeMismatchError(f"the trainer routes top-{wanted}; the rollout stores top-{stored}")


def _check_layer_map(layer_map: tuple[int, ...], num_layers: int, moe_layer_freq: int | Sequence[int] | None) -> None:
    if any(layer >= num_layers for layer in layer_map) or len(set(layer_map)) != len(layer_map):
        raise ShapeMismatchError(f"the stored layer map {list(layer_map)} does not fit a model of {num_layers} decoder layers")
    if moe_layer_freq is not None:
        expected = slime_moe_layers(num_layers, list(moe_layer_freq) if not isinstance(moe_layer_freq, int) else moe_layer_freq)
        if tuple(layer_map) != expected:
            raise ShapeMismatchError(
                f"the rollout stores MoE layers {list(layer_map)}; moe_layer_freq={moe_layer_freq!r} makes the "
                f"trainer replay layers {list(expected)}"
            )


def _verl_columns(layer_map: tuple[int, ...], num_layers: int | None) -> list[int] | None:
    """Where the stored layers go in verl's layer dimension (None: in stored order, MoE only)."""
    if num_layers is None:
        return None
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ShapeMismatchError(f"num_layers must be an int >= 1 or None, got {num_layers!r}")
    _check_layer_map(layer_map, num_layers, None)
    return list(layer_map)


def _rows(packed: PackedRouting | None, i: int, rollout_id: str) -> torch.Tensor:
    """Rows of the ``i``-th request of ``packed``; they must start at position 0."""
    assert packed is not None
    if packed.start_rows[i] != 0:
        raise MissingRowsError(
            f"request {packed.request_ids[i]!r} of rollout {rollout_id!r} is stored from position "
            f"{packed.start_rows[i]} on; positions 0..{packed.start_rows[i] - 1} have no routing rows "
            f"(only later turns were stored), and replaying them as zeros would send them to expert 0"
        )
    lo, hi = int(packed.cu_seqlens[i]), int(packed.cu_seqlens[i + 1])
    return packed.ids_TLK[lo:hi]


def _verl_rows(
    packed: PackedRouting | None,
    i: int,
    rid: str,
    rollout_id: str,
    prompt_len: int,
    response_len: int,
    response_length: int,
    allow_unrouted_tail: bool,
    num_experts: int,
) -> torch.Tensor:
    rows = _rows(packed, i, rollout_id)
    want = prompt_len + response_len - 1
    n = rows.shape[0]
    problem = _verl_count_error(rid, rollout_id, n, prompt_len, response_len, response_length, allow_unrouted_tail)
    if problem is not None:
        raise problem
    if n > want:  # verl cut the response at response_length and keeps prompt + response_length rows
        return rows[: prompt_len + response_length]
    if n < want:  # the unrouted tail: positions n .. want - 1, the spread fill in every stored layer
        tail = torch.from_numpy(_spread(n, want - n, rows.shape[2], num_experts))
        rows = torch.cat([rows.to(torch.int64), tail[:, None, :].expand(-1, rows.shape[1], -1)])
    return rows
