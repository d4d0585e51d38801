"""What the vLLM plug-in's process roles tell each other, and how each travels.

Every value here crosses a process boundary inside a message vLLM already sends, so the front
end (:mod:`.frontend`), the engine core (:mod:`.scheduler`) and the workers (:mod:`.worker`)
import this module and never each other:

- front end -> engine core: the stored id, in the request's own ``SamplingParams.extra_args``
  (:mod:`.settings` names the keys); the tokens the client received from a request a stop
  string ended, inside the ABORT the front end sends (:func:`stop_abort`, unpacked by
  :func:`split_aborts`).
- engine core -> workers: how each freed request left (:class:`FinishedRequest`), in the next
  scheduler output (:data:`FINISHED_ATTR`, an extra attribute vLLM pickles with the rest); how
  many positions each preempted request had computed when it was preempted
  (:data:`PREEMPTED_ATTR`, the same way).
- workers -> engine core: requests whose routing the writer (or the capturer) could not
  store (:class:`FailedRouting`), on the step's model runner output (:data:`FAILED_ATTR`).
- engine core -> front end and client: where a finished request's routing goes
  (:func:`location`), in its final output's ``kv_transfer_params[LOCATION_KEY]``; with
  ``n > 1``, the sibling samples known to have failed (:data:`SIBLINGS_FAILED`, read and
  removed by the front end).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from r3rdma.integrations.vllm.settings import INDEX_ARG, KEY_ARG, LOCATION_KEY, rollout_of, stored_request_id

__all__ = [
    "FAILED_ATTR",
    "FINISHED_ATTR",
    "PREEMPTED_ATTR",
    "FAILED",
    "LOCATION_KEY",
    "SIBLINGS_FAILED",
    "FailedRouting",
    "FinishedRequest",
    "attach_failures",
    "failed_location",
    "failures_of",
    "location",
    "split_aborts",
    "stop_abort",
]

FINISHED_ATTR = "r3_finished"  # on vLLM's SchedulerOutput: request id -> FinishedRequest
# On vLLM's SchedulerOutput: request id -> positions it had computed when preempted (the
# scheduler's count, after the last step's rejected drafts were taken back; the workers' input
# batch is one step behind it under speculative decoding).
PREEMPTED_ATTR = "r3_preempted"
FAILED_ATTR = "r3_failed"  # on vLLM's ModelRunnerOutput: tuple of FailedRouting
# In a sample's location (n > 1), from the engine core to the front end only: stored id ->
# reason of each sibling sample whose routing the workers reported as not stored.
SIBLINGS_FAILED = "r3_siblings_failed"
FAILED = "failed"  # a location's "status" when its routing is known not to be stored


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """What the scheduler tells the workers about a request that left the engine (pickled into
    vLLM's scheduler output). ``stored_id`` None: aborted, store nothing."""

    stored_id: str | None
    rollout_id: str | None = None
    prompt_len: int = 0
    generated_len: int = 0


@dataclass(frozen=True, slots=True)
class FailedRouting:
    """A finished request whose routing the recording worker could not store, and why (its
    commit failed, the store refused it, or its rows could not be gathered)."""

    rollout_id: str
    request_id: str
    reason: str


def location(extra_args: Mapping[str, Any] | None, request_id: str, rows: int, default_rollout: str = "default") -> dict:
    """``kv_transfer_params["r3_routing"]``: where a finished request's routing is stored,
    ``{"rollout_id", "request_id", "rows"}`` (with ``n > 1`` also ``"key"`` and ``"index"``)."""
    args = extra_args or {}
    loc: dict[str, Any] = {
        "rollout_id": rollout_of(args, default_rollout),
        "request_id": stored_request_id(args, request_id),
        "rows": int(rows),
    }
    index = args.get(INDEX_ARG)
    if index is not None:  # n > 1: how the other samples of the same prompt are named
        loc["key"], loc["index"] = str(args[KEY_ARG]), int(index)
    return loc


def failed_location(rollout_id: str | None, request_id: str | None, reason: str) -> dict:
    """The location of a request whose routing is known, when its output is made, not to be
    stored: ``{"rollout_id", "request_id", "status": "failed", "reason"}``."""
    return {"rollout_id": rollout_id, "request_id": request_id, "status": FAILED, "reason": reason}


def stop_abort(request_id: str, tokens: int) -> list:
    """An ABORT item for a request a stop string ended: ``[id, tokens the client received]``.

    The engine core handles aborts ahead of everything else it queued (an eager abort queue),
    so the length travels inside the abort itself."""
    return [request_id, int(tokens)]


def split_aborts(items: Iterable[Any]) -> tuple[list[str], dict[str, int]]:
    """An ABORT payload as the engine core received it: the request ids, and the tokens the
    client received of those a stop string ended (:func:`stop_abort`)."""
    ids: list[str] = []
    lengths: dict[str, int] = {}
    for item in items:
        if isinstance(item, (list, tuple)):
            rid, tokens = item
            lengths[str(rid)] = int(tokens)
            item = rid
        ids.append(item)
    return ids, lengths


def attach_failures(output: Any, failures: tuple[FailedRouting, ...]) -> Any:
    """``output`` (a model runner's step output, or vLLM's asynchronous wrapper of one) carrying
    ``failures`` to the engine core. A copy: vLLM reuses one empty output object for idle steps."""
    if not failures or output is None:
        return output
    if hasattr(output, "get_output"):  # async scheduling: the step's output is resolved in the worker later
        resolve = output.get_output
        output.get_output = lambda: attach_failures(resolve(), failures)
        return output
    output = copy.copy(output)
    setattr(output, FAILED_ATTR, tuple(getattr(output, FAILED_ATTR, ())) + failures)
    return output


def failures_of(output: Any) -> tuple[FailedRouting, ...]:
    """The failures a model runner output carries (:func:`attach_failures`), else ``()``."""
    return getattr(output, FAILED_ATTR, ())
