"""The front-end side of the vLLM plug-in (the ``LLM`` / API-server process).

Two jobs the engine processes cannot do, because only the front end knows:

- **The stored id.** vLLM replaces a request's id by an internal one with a random suffix
  before the engine sees it, and fans ``n > 1`` out into child requests. When the front end
  turns a prompt into an engine request (still under its external id), the plug-in writes the
  id it will be stored under (the client's ``r3_request_id``, else vLLM's external request
  id) into the request's own copy of its sampling parameters' ``extra_args`` (``r3_key``), and
  each child's sample index (``r3_sample_index``). Ids are validated here, so a bad
  ``r3_request_id`` or ``r3_rollout_id`` is refused with the request (HTTP 400 on the
  server), not after the rollout; so is an id a running request, or a request this engine
  finished, already holds in the same rollout.
- **Stop strings.** The front end matches them, trims the output, and aborts the request in
  the engine. The plug-in sends the engine the number of tokens the client received inside
  that abort (:meth:`FrontendState.with_stop_lengths`), so the engine stores rows for exactly
  those tokens (:mod:`.scheduler`).

The bookkeeping lives in one :class:`FrontendState` per engine: built with vLLM's
``LLMEngine`` / ``AsyncLLM`` (:func:`attach`), held by that engine's input and output
processors (and each recorded request's ``RequestState``), gone with the engine. Two engines
in one process share nothing. What belongs to one ``n > 1`` prompt (its samples' locations)
is kept on vLLM's ``ParentRequest`` of that prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from copy import copy
from typing import TYPE_CHECKING, Any

from r3rdma.integrations.vllm.messages import FAILED, SIBLINGS_FAILED, location, stop_abort
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

if TYPE_CHECKING:
    from r3rdma.config import R3Config

__all__ = ["FrontendState", "attach", "child_params", "key_request", "state_of"]

_ATTR = "_r3"  # where vLLM's front-end objects hold their engine's FrontendState (None: routing replay off)
_SAMPLES_ATTR = "_r3_samples"  # on a ParentRequest (n > 1): its samples' locations so far, by index
_FAILED_ATTR = "_r3_failed"  # on a ParentRequest: stored id -> reason of its samples known not stored
_USED_ROLLOUTS = 16  # rollouts whose finished ids an engine remembers (an RL loop names one per step)


class FrontendState:
    """The front end's bookkeeping of one engine with routing replay on.

    - ``marked``: internal request id -> the ``extra_args`` of each recorded request while it
      runs (n > 1: each child).
    - ``running``: (rollout, stored id) -> how many recorded requests run under it: a second
      request under the same id while one runs is refused (one id for every prompt of a
      generate call would otherwise store one request and fail the others' commits after the
      rollout).
    - ``used``: (store, rollout) -> the stored ids of requests that finished in this engine (an
      aborted request's id stays free): a later request under one of them is refused at
      submission, since its commit would fail and its response point at the earlier request's
      rows. Keyed by the store; the last 16 rollouts are kept (~16k ids a step).
    - ``stop_lengths``: internal id -> the tokens the client received from a request a stop
      string ended, until its abort goes to the engine.
    """

    def __init__(self, config: R3Config) -> None:
        self.config = config
        self.store = _store_of(config)
        self.marked: dict[str, dict] = {}
        self.running: dict[tuple[str, str], int] = {}
        self.used: OrderedDict[tuple[str, str], set[str]] = OrderedDict()
        self.stop_lengths: dict[str, int] = {}

    # -- submission ------------------------------------------------------------------------

    def key(self, request: Any, params: Any) -> None:
        """Before vLLM assigns ``request`` its internal id: validate the ids it names and record
        the stored id in its own params."""
        from r3rdma.errors import InvalidIdError
        from r3rdma.ids import validate_id

        extra = dict(params.extra_args or {})
        key = str(extra.get(REQUEST_ARG, request.request_id))
        rollout = str(extra.get(ROLLOUT_ARG, self.config.rollout_id))
        try:
            validate_id(key, f"{REQUEST_ARG} (the id the request's routing is stored under)")
            validate_id(rollout, ROLLOUT_ARG)
        except InvalidIdError as e:
            raise _refused(e) from e
        extra[KEY_ARG], extra[ROLLOUT_ARG], extra[STORE_ARG] = key, rollout, self.store
        params.extra_args = extra  # this request's own clone of the caller's SamplingParams

    def admit(self, request: Any, index: int) -> dict | None:
        """When the output processor takes ``request`` (internal id; n > 1: each child, sample
        ``index``): refuse an id already running or finished in its rollout (once per prompt,
        at its first sample); returns the request's ``extra_args`` if it is recorded. Checked
        and counted in one step, so two requests submitted together cannot both pass."""
        from r3rdma.errors import InvalidIdError

        params = getattr(request, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        if KEY_ARG not in extra or request.request_id in self.marked:
            return None  # not recorded, or a streaming-input request's next chunk
        key, rollout = extra[KEY_ARG], extra[ROLLOUT_ARG]
        if index == 0 and self.running.get((rollout, key)):
            raise _refused(
                InvalidIdError(
                    f"{REQUEST_ARG} {key!r} of rollout {rollout!r} is taken by a request this engine is still running: "
                    f"each request needs its own id (one SamplingParams per prompt, each with its own extra_args "
                    f"{{{REQUEST_ARG!r}: ...}}), or leave {REQUEST_ARG} out to store under vLLM's request id"
                )
            )
        if index == 0 and key in self.used.get((extra.get(STORE_ARG, ""), rollout), ()) and not self.config.only_last_turn:
            raise _refused(
                InvalidIdError(
                    f"{REQUEST_ARG} {key!r} of rollout {rollout!r} was used by an earlier request this engine finished: its "
                    f"routing is stored under that id, and a second request cannot be stored there. Give each request its "
                    f"own id in a rollout (and each RL step its own {ROLLOUT_ARG})"
                )
            )
        return extra

    def mark(self, request_id: str, extra: dict, req_state: Any) -> None:
        """The output processor took the request: count it as running under its id."""
        self.marked[request_id] = extra
        where = (extra[ROLLOUT_ARG], extra[KEY_ARG])
        self.running[where] = self.running.get(where, 0) + 1
        if req_state is not None:
            setattr(req_state, _ATTR, self)  # its final output is made through it (make_request_output)

    # -- the final output ------------------------------------------------------------------

    def final_params(self, req_state: Any, stop_reason: Any, kv_transfer_params: Any) -> Any:
        """The ``kv_transfer_params`` of ``req_state``'s final output: the location the engine
        sent, or the one the front end names for a stop string; with n > 1 every sample's."""
        if isinstance(stop_reason, str):
            # A stop string matched: the detokenizer holds what the client receives (0.32
            # trimmed surplus tokens before this call; earlier releases send them all).
            self._note_stop_length(req_state)
            kv_transfer_params = self._stop_location(req_state.request_id, kv_transfer_params)
        return _with_sample_locations(req_state, kv_transfer_params)

    def _note_stop_length(self, req_state: Any) -> None:
        rid = req_state.request_id
        if rid in self.marked and req_state.detokenizer is not None:
            prompt = req_state.prompt_len or 0
            self.stop_lengths[rid] = int(prompt + req_state.detokenizer.num_output_tokens())

    def _stop_location(self, request_id: str, kv_transfer_params: Any) -> Any:
        """A request a stop string just ended: the engine learns of the stop only after this
        output is made, so the front end names the location (the one the engine stores it under)."""
        n = self.stop_lengths.get(request_id)
        extra = self.marked.get(request_id)
        if n is None or extra is None:
            return kv_transfer_params
        if LOCATION_KEY in (kv_transfer_params or {}):
            # The engine had finished the request itself (EOS or length in the same step): no abort
            # follows, and what it stored is what its location says.
            self.stop_lengths.pop(request_id, None)
            return kv_transfer_params
        return {**(kv_transfer_params or {}), LOCATION_KEY: location(extra, request_id, n - 1)}

    def with_stop_lengths(self, request_ids: list) -> list:
        """The stop-string aborts the output processor returns, each request this front end
        recorded as ``[id, tokens the client received]`` (:func:`~.messages.stop_abort`)."""
        if not self.stop_lengths:
            return request_ids
        lengths = self.stop_lengths
        return [stop_abort(rid, lengths.pop(rid)) if isinstance(rid, str) and rid in lengths else rid for rid in request_ids]

    # -- the end of a request --------------------------------------------------------------

    def forget(self, request_id: str, *, finished: bool) -> None:
        """Drop the bookkeeping of a request that left the engine (its running count); a
        ``finished`` one (not aborted) keeps its stored id taken in its rollout."""
        extra = self.marked.pop(request_id, None)
        if extra is None:
            return
        where = (extra[ROLLOUT_ARG], extra[KEY_ARG])
        count = self.running.get(where, 0) - 1
        if count > 0:
            self.running[where] = count
        else:
            self.running.pop(where, None)
        if finished:
            taken = (extra.get(STORE_ARG, ""), extra[ROLLOUT_ARG])
            used = self.used.get(taken)
            if used is None:
                used = self.used[taken] = set()
                while len(self.used) > _USED_ROLLOUTS:
                    self.used.popitem(last=False)
            used.add(extra[KEY_ARG])


def attach(engine: Any) -> FrontendState | None:
    """Give a new vLLM front end (``LLMEngine`` / ``AsyncLLM``) its :class:`FrontendState`,
    held by its input and output processors; None (held as such) when routing replay is off."""
    config = routing_config(engine.vllm_config)
    state = FrontendState(config) if config is not None else None
    setattr(engine.input_processor, _ATTR, state)
    setattr(engine.output_processor, _ATTR, state)
    return state


def state_of(processor: Any) -> FrontendState | None:
    """The :class:`FrontendState` of the engine ``processor`` (an input or output processor, a
    ``RequestState``) belongs to; None where routing replay is off."""
    return getattr(processor, _ATTR, None)


def key_request(input_processor: Any, request: Any) -> None:
    """Before vLLM assigns ``request`` its internal id: record the stored id in its params."""
    params = getattr(request, "sampling_params", None)
    if params is None:  # pooling requests carry no sampling params and route nothing to store
        return
    state = _input_state(input_processor)
    if state is not None:
        state.key(request, params)
        return
    from r3rdma.errors import InvalidIdError

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


def _input_state(input_processor: Any) -> FrontendState | None:
    """The input processor's engine state (:func:`attach`); one not built by an engine gets
    its own answer once: off, or an error if routing replay is on (its requests could not be
    followed to their outputs)."""
    try:
        return getattr(input_processor, _ATTR)
    except AttributeError:
        pass
    if routing_config(input_processor.vllm_config) is not None:
        from r3rdma.errors import ConfigError

        raise ConfigError(
            "routing replay is on, but this vLLM InputProcessor was not built by vLLM's LLMEngine or AsyncLLM, "
            "where r3rdma's plug-in keeps each engine's front-end state; build the engine through vllm.LLM, "
            "AsyncLLM or vLLM's server"
        )
    setattr(input_processor, _ATTR, None)
    return None


def child_params(params: Any, index: int) -> Any:
    """n > 1: the child's sampling parameters, carrying its sample index."""
    extra = getattr(params, "extra_args", None) or {}
    if KEY_ARG not in extra:
        return params
    params = copy(params)  # vLLM shares one child params object between children without a seed
    params.extra_args = {**extra, INDEX_ARG: int(index)}
    return params


def _with_sample_locations(req_state: Any, kv_transfer_params: Any) -> Any:
    """n > 1: a finishing sample's ``kv_transfer_params``, its location listing every sample
    finished so far (``"samples"``, by index): the last one's output is the one the client gets
    (offline and the server's response), which otherwise named that sample alone. A sample the
    engine reported as not stored (:data:`~.messages.SIBLINGS_FAILED`) is listed with
    ``"status": "failed"`` and the reason."""
    loc = (kv_transfer_params or {}).get(LOCATION_KEY)
    if loc is None:
        return kv_transfer_params
    parent = getattr(req_state, "parent_req", None)
    siblings = loc.get(SIBLINGS_FAILED)
    if siblings is not None:  # the engine core's word to the front end only: not the client's
        loc = {k: v for k, v in loc.items() if k != SIBLINGS_FAILED}
    if parent is None or "index" not in loc:
        return kv_transfer_params if siblings is None else {**kv_transfer_params, LOCATION_KEY: loc}
    samples = getattr(parent, _SAMPLES_ATTR, None)
    if samples is None:
        samples = {}
        setattr(parent, _SAMPLES_ATTR, samples)
    failed = getattr(parent, _FAILED_ATTR, None)
    if failed is None:
        failed = {}
        setattr(parent, _FAILED_ATTR, failed)
    failed.update(siblings or {})
    samples[int(loc["index"])] = {k: v for k, v in loc.items() if k != "samples"}
    listed = []
    for i in sorted(samples):
        sample = samples[i]
        reason = failed.get(sample["request_id"])
        listed.append(sample if reason is None else {**sample, "status": FAILED, "reason": reason})
    return {**kv_transfer_params, LOCATION_KEY: {**loc, "samples": listed}}


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
