"""The front-end side of the vLLM plug-in (the ``LLM`` / API-server process).

Two jobs the engine processes cannot do, because only the front end knows:

- **The stored id.** vLLM replaces a request's id by an internal one with a random suffix
  before the engine sees it, and fans ``n > 1`` out into child requests. When the front end
  turns a prompt into an engine request (still under its external id), the plug-in writes the id it will be stored under (the client's
  ``r3_request_id``, else vLLM's external request id) into the request's own copy of its
  sampling parameters' ``extra_args`` (``r3_key``), and each child's sample index
  (``r3_sample_index``). Ids are validated here, so a bad ``r3_request_id`` or
  ``r3_rollout_id`` is refused with the request (HTTP 400 on the server), not after the rollout.
- **Stop strings.** The front end matches them, trims the output, and aborts the request in
  the engine. Just before that abort goes out, the plug-in sends the engine the number of
  tokens the client received inside that abort (:func:`with_stop_lengths`), so the engine
  stores rows for exactly those tokens (:mod:`.scheduler`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from r3rdma.integrations.vllm.settings import (
    CONFIG_KEY,
    INDEX_ARG,
    KEY_ARG,
    LOCATION_KEY,
    REQUEST_ARG,
    ROLLOUT_ARG,
    STORE_ARG,
    routing_config,
)

__all__ = [
    "key_request",
    "mark",
    "child_params",
    "note_stop_length",
    "stop_location",
    "with_sample_locations",
    "with_stop_lengths",
    "forget",
]

# Internal id -> extra_args of requests this front end marked for routing replay, and the final
# token counts of those a stop string ended (sent to the engine with their abort). Per process.
_MARKED: dict[str, dict] = {}
_STOP_LENGTHS: dict[str, int] = {}
# (rollout, stored id) -> how many marked requests still run under it: a second request under
# the same id while one runs is refused (one id for every prompt of a generate call would
# otherwise store one request and fail the others' commits after the rollout).
_RUNNING: dict[tuple[str, str], int] = {}
_COUNTED: set[str] = set()  # internal ids counted in _RUNNING (an n > 1 parent is not: its children are)
# (store, rollout) -> the stored ids of requests that finished in this front end (an aborted
# request's id stays free): a later request under one of them is refused at submission, since
# its commit would fail and its response point at the earlier request's rows. Keyed by the
# store, so engines of one process on other stores do not share ids. The last _USED_ROLLOUTS
# rollouts are kept (an RL loop names one per step; ~16k ids a step).
_USED: OrderedDict[tuple[str, str], set[str]] = OrderedDict()
# n > 1: parent request id -> sample index -> location, while its samples finish.
_SAMPLES: dict[str, dict[int, dict]] = {}
_USED_ROLLOUTS = 16
# id(vllm_config) -> (that config, its R3Config or None when routing replay is off); the config
# is kept so an id reused by a later engine's config is not mistaken for it.
_ENABLED: dict[int, tuple[Any, Any]] = {}


def _config_of(vllm_config: Any) -> Any:
    entry = _ENABLED.get(id(vllm_config))
    if entry is None or entry[0] is not vllm_config:
        entry = _ENABLED[id(vllm_config)] = (vllm_config, routing_config(vllm_config))
    return entry[1]


def key_request(input_processor: Any, request: Any) -> None:
    """Before vLLM assigns ``request`` its internal id: record the stored id in its params."""
    params = getattr(request, "sampling_params", None)
    if params is None:  # pooling requests carry no sampling params and route nothing to store
        return
    config = _config_of(input_processor.vllm_config)
    from r3rdma.errors import InvalidIdError
    from r3rdma.ids import validate_id

    if config is None:
        asked = sorted(k for k in (params.extra_args or {}) if k in (REQUEST_ARG, ROLLOUT_ARG))
        if asked:
            # The client expects its routing stored; an engine started without routing replay
            # (or with a typo in its key) would answer without storing anything.
            raise _refused(
                InvalidIdError(
                    f"the request names {', '.join(asked)}, but routing replay is off for this engine, so nothing would "
                    f"be stored: start vLLM with additional_config[{CONFIG_KEY!r}] (or R3_ENABLE_ROUTING_REPLAY=1), "
                    "or leave the r3_* arguments out"
                )
            )
        return

    extra = dict(params.extra_args or {})
    key = str(extra.get(REQUEST_ARG, request.request_id))
    rollout = str(extra.get(ROLLOUT_ARG, config.rollout_id))
    try:
        validate_id(key, f"{REQUEST_ARG} (the id the request's routing is stored under)")
        validate_id(rollout, ROLLOUT_ARG)
    except InvalidIdError as e:
        raise _refused(e) from e
    if _RUNNING.get((rollout, key)):
        raise _refused(
            InvalidIdError(
                f"{REQUEST_ARG} {key!r} of rollout {rollout!r} is taken by a request this engine is still running: "
                f"each request needs its own id (one SamplingParams per prompt, each with its own extra_args "
                f"{{{REQUEST_ARG!r}: ...}}), or leave {REQUEST_ARG} out to store under vLLM's request id"
            )
        )
    store = _store_of(config)
    if key in _USED.get((store, rollout), ()) and not config.only_last_turn:
        raise _refused(
            InvalidIdError(
                f"{REQUEST_ARG} {key!r} of rollout {rollout!r} was used by an earlier request this engine finished: its "
                f"routing is stored under that id, and a second request cannot be stored there. Give each request its "
                f"own id in a rollout (and each RL step its own {ROLLOUT_ARG})"
            )
        )
    extra[KEY_ARG], extra[ROLLOUT_ARG], extra[STORE_ARG] = key, rollout, store
    params.extra_args = extra  # this request's own clone of the caller's SamplingParams


def _store_of(config: Any) -> str:
    """The store a config's requests go to, as a short key (ids are taken per store and rollout)."""
    if config.routing_store_type == "local":
        return f"local:{config.local_store_dir}"
    return "nodes:" + ",".join(sorted(config.store_urls))


def _refused(error: Exception) -> Exception:
    """The client's error as vLLM's own validation error (HTTP 400 on the server), still an
    r3rdma ``InvalidIdError`` (a ``ValueError``) for offline callers."""
    from vllm.exceptions import VLLMValidationError

    from r3rdma.errors import InvalidIdError

    class RefusedRoutingId(VLLMValidationError, InvalidIdError):
        pass

    return RefusedRoutingId(str(error))


def mark(request: Any) -> None:
    """After vLLM assigned the internal id: remember the request as recorded (stop strings)."""
    params = getattr(request, "sampling_params", None)
    if params is not None and KEY_ARG in (params.extra_args or {}):
        _MARKED[request.request_id] = params.extra_args
        if (getattr(params, "n", 1) or 1) == 1:  # n > 1: its children run, counted in child_params
            _COUNTED.add(request.request_id)
            _running(params.extra_args, +1)


def _running(extra: dict, change: int) -> None:
    key = (extra[ROLLOUT_ARG], extra[KEY_ARG])
    count = _RUNNING.get(key, 0) + change
    if count > 0:
        _RUNNING[key] = count
    else:
        _RUNNING.pop(key, None)


def child_params(child_id: str, params: Any, index: int) -> Any:
    """n > 1: the child's sampling parameters, carrying its sample index."""
    extra = getattr(params, "extra_args", None) or {}
    if KEY_ARG not in extra:
        return params
    from copy import copy

    params = copy(params)  # vLLM shares one child params object between children without a seed
    params.extra_args = {**extra, INDEX_ARG: int(index)}
    _MARKED[child_id] = params.extra_args
    _COUNTED.add(child_id)
    _running(params.extra_args, +1)
    return params


def note_stop_length(req_state: Any) -> None:
    """A stop string ended ``req_state``: remember how many tokens the client got."""
    rid = req_state.request_id
    if rid in _MARKED and req_state.detokenizer is not None:
        prompt = req_state.prompt_len or 0
        _STOP_LENGTHS[rid] = int(prompt + req_state.detokenizer.num_output_tokens())


def stop_location(request_id: str, kv_transfer_params: Any) -> Any:
    """The final output's ``kv_transfer_params`` for a request a stop string just ended: the
    engine learns of the stop only after this output is made, so the front end names the
    location (the same one the engine stores it under)."""
    n = _STOP_LENGTHS.get(request_id)
    extra = _MARKED.get(request_id)
    if n is None or extra is None:
        return kv_transfer_params
    if LOCATION_KEY in (kv_transfer_params or {}):
        # The engine had finished the request itself (EOS or length in the same step): no abort
        # follows, and what it stored is what its location says.
        _STOP_LENGTHS.pop(request_id, None)
        return kv_transfer_params
    from r3rdma.integrations.vllm.scheduler import location

    return {**(kv_transfer_params or {}), LOCATION_KEY: location(extra, request_id, n - 1)}


def with_sample_locations(req_state: Any, kv_transfer_params: Any) -> Any:
    """n > 1: a finishing sample's ``kv_transfer_params``, its location listing every sample
    finished so far (``"samples"``, by index): the last one's output is the one the client gets
    (offline and the server's response), which otherwise named that sample alone."""
    parent = getattr(req_state, "parent_req", None)
    location = (kv_transfer_params or {}).get(LOCATION_KEY)
    if parent is None or location is None or "index" not in location:
        return kv_transfer_params
    samples = _SAMPLES.get(parent.request_id)
    if samples is None:
        while len(_SAMPLES) >= 4096:  # parents a sample of which was aborted never complete
            del _SAMPLES[next(iter(_SAMPLES))]
        samples = _SAMPLES[parent.request_id] = {}
    samples[int(location["index"])] = {k: v for k, v in location.items() if k != "samples"}
    listed = [samples[i] for i in sorted(samples)]
    if len(samples) >= int(getattr(parent, "n", 0) or 0):
        _SAMPLES.pop(parent.request_id, None)  # every sample finished: nothing more to list
    return {**kv_transfer_params, LOCATION_KEY: {**location, "samples": listed}}


def with_stop_lengths(request_ids: Any) -> Any:
    """An ABORT payload in which each request a stop string ended travels as ``[id, tokens]``.

    The engine core handles aborts ahead of everything else it queued (an eager abort queue),
    so the length must travel in the abort itself; the plug-in's ``EngineCore.abort_requests``
    unpacks it (:mod:`.scheduler`)."""
    if not _STOP_LENGTHS or not isinstance(request_ids, list):
        return request_ids
    return [[rid, _STOP_LENGTHS.pop(rid)] if isinstance(rid, str) and rid in _STOP_LENGTHS else rid for rid in request_ids]


def forget(request_id: str, *, finished: bool) -> None:
    """Drop the front end's bookkeeping of a request that left the engine (its running count,
    once); a ``finished`` one (not aborted) keeps its stored id taken in its rollout."""
    extra = _MARKED.pop(request_id, None)
    if extra is not None and request_id in _COUNTED:
        _COUNTED.discard(request_id)
        _running(extra, -1)
    if extra is not None and finished:
        where = (extra.get(STORE_ARG, ""), extra[ROLLOUT_ARG])
        used = _USED.get(where)
        if used is None:
            used = _USED[where] = set()
            while len(_USED) > _USED_ROLLOUTS:
                _USED.popitem(last=False)
        used.add(extra[KEY_ARG])
