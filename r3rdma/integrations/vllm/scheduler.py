"""The scheduler side of the vLLM plug-in: how a request left the engine, told to the workers.

vLLM's workers learn only *that* a request left (``SchedulerOutput.finished_req_ids``), not
whether it finished or was aborted, nor its final length. The scheduler knows both when it
frees the request; :class:`FinishLedger` notes them there and attaches them to the next
scheduler output (``r3_finished``: request id -> :class:`~.worker.FinishedRequest`), which
vLLM pickles to the workers unchanged. Both sets drain together in ``schedule()``, so each
request in ``finished_req_ids`` has its entry.

Stop strings: vLLM matches them in the front end, which trims the output to the stop string
and then *aborts* the request in the engine (which may have computed a few tokens more by
then). The front end of the plug-in (:mod:`.frontend`) sends the length the client received
inside that abort; such an abort is stored as a finished request of that length, so rows stay
``len(tokens) - 1`` of what the client holds.

The finished request's location goes back in ``kv_transfer_params["r3_routing"]`` of its
final output (``RequestOutput.kv_transfer_params``; the OpenAI server returns it in the
response body): ``{"rollout_id", "request_id", "rows"}``.
"""

from __future__ import annotations

import logging
from typing import Any

from r3rdma.config import R3Config
from r3rdma.errors import R3Error
from r3rdma.integrations.vllm.settings import INDEX_ARG, KEY_ARG, LOCATION_KEY, LOGGER_NAME, rollout_of, stored_request_id
from r3rdma.integrations.vllm.worker import FinishedRequest

__all__ = ["FinishLedger", "LOCATION_KEY", "location"]

log = logging.getLogger(LOGGER_NAME)


def location(extra_args: dict, request_id: str, rows: int, default_rollout: str = "default") -> dict:
    """``kv_transfer_params["r3_routing"]``: where a finished request's routing is stored."""
    loc = {
        "rollout_id": rollout_of(extra_args, default_rollout),
        "request_id": stored_request_id(extra_args, request_id),
        "rows": int(rows),
    }
    index = extra_args.get(INDEX_ARG)
    if index is not None:  # n > 1: how the other samples of the same prompt are named
        loc["key"], loc["index"] = str(extra_args[KEY_ARG]), int(index)
    return loc


class FinishLedger:
    """Per scheduler: requests freed since the last ``schedule()``, and stop-string lengths."""

    def __init__(self, config: R3Config) -> None:
        self.config = config
        self.pending: dict[str, FinishedRequest] = {}
        self.stop_lengths: dict[str, int] = {}

    def on_free(self, request: Any) -> dict[str, Any] | None:
        """Note how ``request`` left; return its routing location if it will be stored."""
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
        try:
            extra = params.extra_args
            stored = stored_request_id(extra, rid)
            rollout = rollout_of(extra, self.config.rollout_id)
        except R3Error as e:  # refused in the front end already; kept as a guard for other entry points
            log.error("r3rdma: request %s not stored: %s", rid, e)
            self.pending[rid] = FinishedRequest(None)
            return None
        generated = int(total) - prompt_len
        self.pending[rid] = FinishedRequest(stored, rollout, prompt_len, generated)
        return location(extra or {}, rid, prompt_len + max(generated, 1) - 1, self.config.rollout_id)

    def take(self) -> dict[str, FinishedRequest]:
        """The requests freed since the last take (request id -> what the workers need to finish it); empties the ledger."""
        pending, self.pending = self.pending, {}
        return pending

    def set_stop_lengths(self, lengths: dict[str, int], live: Any) -> None:
        """Final token counts of requests the front end stopped on a stop string."""
        for rid, n in lengths.items():
            if rid in live:  # already freed otherwise (it also ended in the engine): nothing to change
                self.stop_lengths[str(rid)] = int(n)
