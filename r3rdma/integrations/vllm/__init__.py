"""r3rdma inside vLLM: a plug-in that records every MoE layer's top-k experts for every token
vLLM computes and stores each finished request in r3rdma, no vLLM source change.

Installed with r3rdma (entry point ``vllm.general_plugins``: ``r3rdma``), switched on per
engine by one config (:mod:`.settings`)::

    llm = LLM(model=..., additional_config={"routing_replay": {"local_store_dir": "/data/r3",
                                                                "rollout_id": "step-0042"}})
    outs = llm.generate(prompts, [SamplingParams(max_tokens=256, extra_args={"r3_request_id": f"s{i}"})
                                  for i in range(len(prompts))])
    result = flush_routing(llm)              # every finished request durable in the store, or failed
    assert result["failed"] == 0, result["failures"]
    routing_location(outs[0])                # [("step-0042", "s0")]

The modules, by the vLLM process they act in: :mod:`.frontend` (stored ids, stop strings;
one state object per engine) and :mod:`.streaming` (the location in a streamed response),
:mod:`.scheduler` (how each request left the engine), :mod:`.worker` (the capture itself);
:mod:`.messages` holds what those processes tell each other, :mod:`.plugin` installs them.
docs/INTEGRATION.md ("vLLM") has the details.
"""

from __future__ import annotations

from typing import Any

from r3rdma.integrations.vllm.plugin import SUPPORTED_VLLM, register
from r3rdma.integrations.vllm.settings import CONFIG_KEY, LOCATION_KEY, REQUEST_ARG, ROLLOUT_ARG

__all__ = ["SUPPORTED_VLLM", "CONFIG_KEY", "REQUEST_ARG", "ROLLOUT_ARG", "register", "flush_routing", "routing_location"]


def flush_routing(llm: Any, timeout: float | None = None) -> dict[str, Any]:
    """Wait until the routing of every request ``llm`` finished is durable (committed and
    visible to readers) or its commit failed; return the recording worker's counters,
    cumulative since the engine started (JSON-friendly).

    ``stored`` (finished requests handed to the writer), ``aborted``, ``failed`` (requests
    whose routing could not be stored) and ``failures``: each of those as
    ``{"rollout_id": ..., "request_id": ..., "reason": "<error type>: <message>"}``. A failed
    commit is not raised: the engine goes on serving, the writer logs it when it fails (logger
    ``r3rdma``), and it is counted here. Check it before training on the step::

        result = flush_routing(llm)
        assert result["failed"] == 0, result["failures"]

    On an engine that serves several steps, compare with the counts from before the step.
    Returns once every commit succeeded or failed; with store nodes down, a commit that must
    connect to one fails (or fails over) only after the push client's connect timeout.
    ``timeout``: seconds to wait at most (raises past it); None waits for every commit.
    ``llm``: a ``vllm.LLM`` with routing replay on."""
    core = llm.llm_engine.engine_core
    if hasattr(core, "call_utility"):  # the engine core in its own process (vLLM's default)
        results = core.call_utility("r3_flush", timeout)
    else:  # VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core in this process
        results = core.engine_core.r3_flush(timeout)
    results = [r for r in results if r is not None]
    if not results:
        from r3rdma.errors import ConfigError

        raise ConfigError(
            "no vLLM worker records routing: routing replay is off for this engine "
            f"(additional_config[{CONFIG_KEY!r}] or R3_* variables; see r3rdma.integrations.vllm)"
        )
    return results[0]


def routing_location(output: Any) -> list[tuple[str, str]]:
    """``(rollout_id, request_id)`` under which each completion of a finished
    ``RequestOutput`` is stored, in ``output.outputs`` order; read them with
    ``RoutingReader.get(rollout_id, [request_id])`` once committed
    (``RoutingReader.wait_committed``, or ``flush_routing`` on the engine side).

    From the location the engine returned in ``kv_transfer_params["r3_routing"]``: with
    ``n > 1`` it lists every sample (``"samples"``, each ``{"rollout_id", "request_id",
    "rows", "key", "index"}``; sample ``i`` is stored as ``<key>.<i>``). Empty when nothing
    was stored (routing replay off, request aborted). A location (or sample) marked
    ``"status": "failed"`` was known, when the output was made, not to be stored: raises
    :class:`~r3rdma.errors.StoreError` naming each such sample and why. No ``"status"`` means
    its commit was not known yet (it comes after the output).
    """
    params = getattr(output, "kv_transfer_params", None) or {}
    location = params.get(LOCATION_KEY)
    if location is None:
        return []
    failed = [s for s in (location, *location.get("samples", ())) if s.get("status") == "failed"]
    if failed:
        from r3rdma.errors import StoreError

        raise StoreError(
            "the engine knew when it answered that the routing of "
            + "; ".join(f"{s.get('rollout_id')}/{s.get('request_id')} ({s.get('reason')})" for s in failed)
            + " will not be stored"
        )
    rollout = location["rollout_id"]
    if "index" not in location:
        return [(rollout, location["request_id"])]
    named = {int(s["index"]): s["request_id"] for s in location.get("samples", ())}
    return [(rollout, named.get(c.index, f"{location['key']}.{c.index}")) for c in output.outputs]
