"""The scheduler side of the vLLM plug-in: how a request left the engine, told to the workers.

vLLM's workers learn only *that* a request left (``SchedulerOutput.finished_req_ids``), not
whether it finished or was aborted, nor its final length. The scheduler knows both when it
frees the request; :class:`SchedulerState` (one per vLLM ``Scheduler``, held by it) notes them
there and attaches them to the next scheduler output (``r3_finished``: request id ->
:class:`~.messages.FinishedRequest`), which vLLM pickles to the workers unchanged. Both sets
drain together in ``schedule()``, so each request in ``finished_req_ids`` has its entry.

Preemption: a preempted request keeps the rows it computed (the forwards that sampled its
tokens). Under speculative decoding only the scheduler knows how many positions that is when
it preempts (the workers' input batch is updated for the last step's accepted drafts only
with the next step), so :meth:`SchedulerState.on_preempt` notes the count just before vLLM
resets it, and the next scheduler output carries it (``r3_preempted``).

Stop strings: vLLM matches them in the front end, which trims the output to the stop string
and then *aborts* the request in the engine (which may have computed a few tokens more by
then). The front end of the plug-in (:mod:`.frontend`) sends the length the client received
inside that abort; such an abort is stored as a finished request of that length, so rows stay
``len(tokens) - 1`` of what the client holds.

The finished request's location goes back in ``kv_transfer_params["r3_routing"]`` of its
final output (``RequestOutput.kv_transfer_params``; the OpenAI server returns it in the
response body): ``{"rollout_id", "request_id", "rows"}``. The workers store a request only
after the scheduler freed it, so when its output is made nothing is known yet of its own
commit. What is known is said: a request the scheduler cannot name is ``"status": "failed"``
(:func:`~.messages.failed_location`), and a sample of ``n > 1`` carries the sibling samples
whose failure the workers reported before it finished (:data:`~.messages.SIBLINGS_FAILED`;
the workers report failures with each step's output, :meth:`SchedulerState.note_failures`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from r3rdma.config import R3Config
from r3rdma.errors import R3Error
from r3rdma.integrations.vllm.messages import (
    SIBLINGS_FAILED,
    FailedRouting,
    FinishedRequest,
    failed_location,
    location,
)
from r3rdma.integrations.vllm.settings import (
    INDEX_ARG,
    KEY_ARG,
    LOCATION_KEY,
    LOGGER_NAME,
    REQUEST_ARG,
    ROLLOUT_ARG,
    rollout_of,
    stored_request_id,
)

__all__ = ["SchedulerState", "LOCATION_KEY", "location"]

log = logging.getLogger(LOGGER_NAME)

# Failures the workers reported, kept for the samples still running beside them (n > 1): the
# newest this many (a rollout's failures are few; an engine whose store is gone fails them all).
_KEPT_FAILURES = 4096


class SchedulerState:
    """One scheduler's plug-in state: requests freed since the last ``schedule()``, the
    stop-string lengths the front end sent, and the failures the workers reported."""

    def __init__(self, config: R3Config) -> None:
        self.config = config
        self.pending: dict[str, FinishedRequest] = {}
        self.stop_lengths: dict[str, int] = {}
        self.preempted: dict[str, int] = {}  # request id -> positions computed when preempted
        # (rollout, stored id less its ".<index>") -> stored id -> reason: the failed samples
        # of each n > 1 family, found by a sibling that finishes later.
        self._failed: OrderedDict[tuple[str, str], dict[str, str]] = OrderedDict()

    def on_free(self, request: Any) -> dict[str, Any] | None:
        """Note how ``request`` left; return its routing location if it finished."""
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        total = self.stop_lengths.pop(rid, None)
        status = request.status
        finished = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
        if status == RequestStatus.FINISHED_ABORTED and total is not None:
            finished = True  # a stop string matched in the front end (see the module docstring)
        if total is None:
            total = request.num_tokens
        params = request.sampling_params
        if not finished or params is None:
            self.pending[rid] = FinishedRequest(None)
            return None
        prompt_len = int(request.num_prompt_tokens)
        extra = params.extra_args or {}
        try:
            stored = stored_request_id(extra, rid)
            rollout = rollout_of(extra, self.config.rollout_id)
        except R3Error as e:  # refused in the front end already; kept as a guard for other entry points
            log.error("r3rdma: request %s not stored: %s", rid, e)
            self.pending[rid] = FinishedRequest(None)
            named = extra.get(KEY_ARG, extra.get(REQUEST_ARG, rid))
            return failed_location(extra.get(ROLLOUT_ARG), str(named), f"{type(e).__name__}: {e}")
        generated = int(total) - prompt_len
        self.pending[rid] = FinishedRequest(stored, rollout, prompt_len, generated)
        loc = location(extra, rid, prompt_len + max(generated, 1) - 1, self.config.rollout_id)
        if extra.get(INDEX_ARG) is not None:
            siblings = self._failed.get((rollout, str(extra[KEY_ARG])))
            if siblings:
                loc[SIBLINGS_FAILED] = dict(siblings)
        return loc

    def note_failures(self, failures: tuple[FailedRouting, ...]) -> None:
        """Failures the workers reported with a step's output: kept for the samples of the same
        prompt that finish later (a request's own commit comes after its output is made)."""
        for f in failures:
            family = (f.rollout_id, f.request_id.rpartition(".")[0] or f.request_id)
            self._failed.setdefault(family, {})[f.request_id] = f.reason
            self._failed.move_to_end(family)
        while self._failed and len(self._failed) > _KEPT_FAILURES:
            self._failed.popitem(last=False)

    def on_preempt(self, request: Any) -> None:
        """Note how many positions ``request`` had computed, as vLLM is about to preempt it
        (its count drops to 0 then)."""
        self.preempted[request.request_id] = int(request.num_computed_tokens)

    def take_preempted(self) -> dict[str, int]:
        """The preempted requests noted since the last take (request id -> positions computed); empties them."""
        preempted, self.preempted = self.preempted, {}
        return preempted

    def take(self) -> dict[str, FinishedRequest]:
        """The requests freed since the last take (request id -> what the workers need to finish it); empties them."""
        pending, self.pending = self.pending, {}
        return pending

    def set_stop_lengths(self, lengths: dict[str, int], live: Any) -> None:
        """Final token counts of requests the front end stopped on a stop string."""
        for rid, n in lengths.items():
            if rid in live:  # already freed otherwise (it also ended in the engine): nothing to change
                self.stop_lengths[str(rid)] = int(n)
