"""Where the vLLM plug-in keeps its state, and what a response says about its routing's fate.

- One front-end state per engine, held by that engine's processors: two engines in one process
  share nothing, and the state goes with its engine (no table keyed by ``id(...)``, whose keys
  a later object can reuse).
- The messages between vLLM's processes (:mod:`r3rdma.integrations.vllm.messages`).
- ``"status": "failed"``: what the plug-in knows, when a response is made, about routing that
  will not be stored. A request's own commit comes after its output (the workers store it only
  once the scheduler freed it), so a response says "failed" only where that is already known:
  a request the engine cannot name, and with ``n > 1`` a sample whose commit failed before
  the last sample finished (a real engine below: the store refuses sample 0, sample 1 runs on).
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.vllm_available import require_vllm

require_vllm()  # vLLM itself is imported where a test needs it

from r3rdma.errors import InvalidIdError, StoreError  # noqa: E402
from r3rdma.integrations.vllm import frontend, messages  # noqa: E402
from r3rdma.integrations.vllm.scheduler import SchedulerState  # noqa: E402
from tests.vllm_in_process import engine_in_this_process  # noqa: E402

EOS = 2  # write_tiny_checkpoint's eos_token_id


def _engine(store_dir):
    """What vLLM's LLMEngine / AsyncLLM hold that the plug-in attaches to: their config and
    their input and output processors."""
    from vllm.config import VllmConfig

    config = VllmConfig(additional_config={"routing_replay": {"local_store_dir": str(store_dir), "rollout_id": "r"}})
    return SimpleNamespace(vllm_config=config, input_processor=SimpleNamespace(vllm_config=config),
                           output_processor=SimpleNamespace())


def _submit(engine, external_id, request_id=None, *, internal_id=None):
    """A request through the engine's front end as vLLM passes it: keyed under its external id,
    then admitted by the output processor under its internal one; returns its extra_args."""
    from vllm import SamplingParams

    args = {} if request_id is None else {"r3_request_id": request_id}
    request = SimpleNamespace(request_id=external_id, sampling_params=SamplingParams(extra_args=args))
    frontend.key_request(engine.input_processor, request)
    request.request_id = internal_id or f"{external_id}-internal"
    state = frontend.state_of(engine.output_processor)
    extra = state.admit(request, 0)
    state.mark(request.request_id, extra, None)
    return request.request_id


def test_each_engine_has_its_own_front_end_state_gone_with_it(tmp_path):
    a, b = _engine(tmp_path / "store"), _engine(tmp_path / "store")  # even on one store
    state_a, state_b = frontend.attach(a), frontend.attach(b)
    assert state_a is not state_b
    assert frontend.state_of(a.input_processor) is frontend.state_of(a.output_processor) is state_a

    done = _submit(a, "req-1", "x")
    with pytest.raises(InvalidIdError, match="'x' of rollout 'r' is taken by a request this engine is still running"):
        _submit(a, "req-2", "x")
    _submit(b, "req-1", "x")  # the other engine: its own ids
    state_a.forget(done, finished=True)
    with pytest.raises(InvalidIdError, match="'x' of rollout 'r' was used by an earlier request this engine finished"):
        _submit(a, "req-3", "x")
    assert state_b.running == {("r", "x"): 1} and not state_b.used

    gone = weakref.ref(state_a)
    del a, state_a
    gc.collect()
    assert gone() is None  # the state went with its engine


def test_an_engine_without_routing_replay_holds_no_state_and_refuses_r3_arguments(tmp_path):
    from vllm import SamplingParams
    from vllm.config import VllmConfig

    config = VllmConfig(additional_config={})
    engine = SimpleNamespace(vllm_config=config, input_processor=SimpleNamespace(vllm_config=config),
                             output_processor=SimpleNamespace())
    assert frontend.attach(engine) is None and frontend.state_of(engine.output_processor) is None
    plain = SimpleNamespace(request_id="a", sampling_params=SamplingParams(max_tokens=2))
    frontend.key_request(engine.input_processor, plain)
    assert not plain.sampling_params.extra_args
    named = SimpleNamespace(request_id="b", sampling_params=SamplingParams(extra_args={"r3_request_id": "b"}))
    with pytest.raises(InvalidIdError, match="routing replay is off for this engine"):
        frontend.key_request(engine.input_processor, named)


def test_stop_lengths_travel_in_the_abort_and_are_unpacked_by_the_engine_core():
    assert messages.split_aborts(["a", messages.stop_abort("b", 17), ("c", 3)]) == (["a", "b", "c"], {"b": 17, "c": 3})


def test_failures_ride_on_a_copy_of_the_step_output():
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    failed = (messages.FailedRouting("r", "x.0", "DuplicateRequestError: ..."),)
    out = messages.attach_failures(EMPTY_MODEL_RUNNER_OUTPUT, failed)
    assert messages.failures_of(out) == failed
    assert messages.failures_of(EMPTY_MODEL_RUNNER_OUTPUT) == ()  # vLLM's shared empty output untouched

    class Pending:  # vLLM's asynchronous output: resolved later, in the worker
        def get_output(self):
            return EMPTY_MODEL_RUNNER_OUTPUT

    assert messages.failures_of(messages.attach_failures(Pending(), failed).get_output()) == failed


def _freed(request_id, extra_args, *, prompt=4, total=7):
    from vllm.v1.request import RequestStatus

    return SimpleNamespace(request_id=request_id, status=RequestStatus.FINISHED_LENGTH_CAPPED, num_tokens=total,
                           num_prompt_tokens=prompt, sampling_params=SimpleNamespace(extra_args=extra_args))


def test_a_request_the_engine_cannot_name_is_failed_not_located():
    """A request that reached the engine core without the front end's checks, under an id that
    cannot be a storage path: its location says failed, and why (nothing is stored)."""
    from r3rdma.config import R3Config

    ledger = SchedulerState(R3Config(rollout_id="r"))
    loc = ledger.on_free(_freed("int-1", {"r3_request_id": "a/b"}))
    assert loc["status"] == "failed" and loc["request_id"] == "a/b" and "InvalidIdError" in loc["reason"]
    assert ledger.take()["int-1"].stored_id is None  # the workers store nothing


def test_a_sample_whose_sibling_failed_lists_it_failed():
    """n > 1: failures the workers reported reach the samples still running; the front end
    lists them failed in the final output and keeps its word to itself out of the response."""
    from r3rdma.config import R3Config

    ledger = SchedulerState(R3Config(rollout_id="r"))
    sample = {"r3_key": "fam", "r3_rollout_id": "r", "r3_sample_index": 0}
    first = ledger.on_free(_freed("int-0", sample))
    ledger.note_failures((messages.FailedRouting("r", "fam.0", "SegmentOverlapError: refused"),
                          messages.FailedRouting("r", "other.0", "elsewhere")))
    last = ledger.on_free(_freed("int-1", {**sample, "r3_sample_index": 1}))
    assert messages.SIBLINGS_FAILED not in first
    assert last[messages.SIBLINGS_FAILED] == {"fam.0": "SegmentOverlapError: refused"}

    state = frontend.FrontendState(R3Config(rollout_id="r"))
    parent = SimpleNamespace(request_id="p", n=2)
    for loc in (first, last):
        req_state = SimpleNamespace(request_id="int", parent_req=parent)
        params = state.final_params(req_state, None, {"r3_routing": loc})
    final = params["r3_routing"]
    assert messages.SIBLINGS_FAILED not in final
    assert final["samples"] == [
        {"rollout_id": "r", "request_id": "fam.0", "rows": 6, "key": "fam", "index": 0, "status": "failed",
         "reason": "SegmentOverlapError: refused"},
        {"rollout_id": "r", "request_id": "fam.1", "rows": 6, "key": "fam", "index": 1},
    ]


def _end_sample_zero_early():
    """The processor class below (built here: its base class is vLLM's, imported when a test
    runs, tests/vllm_available.py)."""
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class EndSampleZeroEarly(AdapterLogitsProcessor):
        """A logits processor (vLLM's per-request adapter): sample 0 of a recorded prompt ends with
        EOS after 2 tokens, every other sample never samples EOS, so the two end far apart."""

        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params):
            index = (params.extra_args or {}).get("r3_sample_index")
            if index is None:
                return None

            def steer(output_ids, logits):
                if index == 0 and len(output_ids) >= 2:
                    logits = torch.full_like(logits, float("-inf"))
                    logits[EOS] = 0.0
                elif index != 0:
                    logits[EOS] = float("-inf")
                return logits

            return steer

    return EndSampleZeroEarly


def test_a_sample_the_store_refused_is_failed_in_the_response(tmp_path):
    """A real engine: the store already holds other rows for sample 0's id (as a second engine
    naming the same rollout and id leaves it), so it refuses sample 0, which ends after 2
    tokens; sample 1 runs on for 200. The response lists sample 0 as failed, with the store's
    reason (the one flush_routing reports), and sample 1 without a status; sample 1 is stored."""
    from vllm import LLM, SamplingParams

    from r3rdma import RoutingReader
    from r3rdma.integrations.vllm import flush_routing, routing_location
    from r3rdma.integrations.vllm.checkpoint import write_tiny_checkpoint
    from r3rdma.records import RequestRecord
    from r3rdma.store.local_store import LocalRoutingStore

    model = str(write_tiny_checkpoint(tmp_path / "model", tokenizer=False))
    store_dir = tmp_path / "store"
    held = LocalRoutingStore(str(store_dir))
    held.commit([RequestRecord("st", "fam.0", np.zeros((3, 3, 4), dtype=np.uint8), (0, 2, 3), 16)])
    held.close()

    with engine_in_this_process():  # tests/vllm_in_process.py
        llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, gpu_memory_utilization=0.3,
                  skip_tokenizer_init=True, block_size=32, seed=0, logits_processors=[_end_sample_zero_early()],
                  additional_config={"routing_replay": {"local_store_dir": str(store_dir), "flush_interval_s": 0.01}})
    try:
        prompt = list(range(40, 60))
        (out,) = llm.generate([{"prompt_token_ids": prompt}],
                              SamplingParams(n=2, max_tokens=200, temperature=1.0, stop_token_ids=[EOS],
                                             extra_args={"r3_rollout_id": "st", "r3_request_id": "fam"}),
                              use_tqdm=False)
        lengths = {c.index: len(c.token_ids) for c in out.outputs}
        assert lengths[0] <= 3 and lengths[1] == 200, lengths  # 2 tokens, then the EOS the processor forces
        result = flush_routing(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
    (failure,) = result["failures"]
    assert (failure["rollout_id"], failure["request_id"]) == ("st", "fam.0")
    samples = out.kv_transfer_params["r3_routing"]["samples"]
    assert samples == [
        {"rollout_id": "st", "request_id": "fam.0", "rows": 20 + lengths[0] - 1, "key": "fam", "index": 0, "status": "failed",
         "reason": failure["reason"]},
        {"rollout_id": "st", "request_id": "fam.1", "rows": 20 + 200 - 1, "key": "fam", "index": 1},
    ]
    with pytest.raises(StoreError, match=r"st/fam\.0 \(.*\) will not be stored"):
        routing_location(out)
    assert RoutingReader(str(store_dir)).get("st", ["fam.1"])["fam.1"].shape[0] == 20 + 200 - 1


def test_process_roles_import_the_messages_not_each_other():
    """Each vLLM process role's module imports what they share (messages, settings), never
    another role's module (docs/ARCHITECTURE.md: one module per process role)."""
    import ast
    from pathlib import Path

    import r3rdma.integrations.vllm as package

    roles = {"frontend", "streaming", "scheduler", "worker"}
    for role in sorted(roles):
        tree = ast.parse((Path(package.__file__).parent / f"{role}.py").read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("r3rdma.integrations.vllm"):
                imported.add((node.module or "").rsplit(".", 1)[-1])
                imported.update(alias.name for alias in node.names)
        assert not imported & (roles - {role}), (role, sorted(imported & roles))


def test_a_streamed_sample_keeps_its_location_when_vllm_merges_outputs():
    """vLLM's AsyncLLM merges the outputs queued for one prompt when the stream reads slower
    than the engine makes them (``RequestOutput.add``) and keeps only the last output's
    ``kv_transfer_params``: sample 0's final output merged with sample 1's next tokens lost
    sample 0's location. The plug-in keeps it, and the stream's wrapper finds each finished
    choice's own entry in it."""
    from vllm.outputs import CompletionOutput, RequestOutput

    from r3rdma.integrations.vllm.plugin import _wrap
    from r3rdma.integrations.vllm.streaming import _keep_location, _sample_location

    _wrap(RequestOutput, "add", _keep_location)  # as streaming.install does once an AsyncLLM records routing
    loc0 = {"rollout_id": "r", "request_id": "k.0", "rows": 9, "key": "k", "index": 0}
    loc0 = {**loc0, "samples": [dict(loc0)]}

    def output(index, finish_reason, params=None):
        completion = CompletionOutput(index=index, text="", token_ids=[7], cumulative_logprob=None, logprobs=None,
                                      finish_reason=finish_reason)
        return RequestOutput("p", None, [1, 2], None, [completion], False, kv_transfer_params=params)

    queued = output(0, "length", {"r3_routing": loc0})
    queued.add(output(1, None), aggregate=True)  # sample 1 goes on
    assert queued.kv_transfer_params == {"r3_routing": loc0}
    assert _sample_location(loc0, 0) is loc0 and _sample_location(loc0, 1) is None
    both = {**loc0, "request_id": "k.1", "index": 1, "samples": [loc0["samples"][0], {**loc0["samples"][0], "request_id": "k.1", "index": 1}]}
    assert _sample_location(both, 0) == {**loc0["samples"][0], "samples": both["samples"]}


def test_a_preempted_speculative_request_keeps_the_positions_the_scheduler_counted():
    """Speculative decoding: at preemption the workers' input batch still holds the count from
    before the request's last step, which misses the drafts that step accepted (their rows then
    came from the recompute; seen on an H200). The scheduler notes its own count as it preempts
    (before vLLM resets it) and the workers keep exactly that many positions; without the note
    (a preemption the plug-in's scheduler side did not see) they fall back to the batch's."""
    from r3rdma.config import R3Config
    from r3rdma.integrations.vllm.worker import RunnerRecorder

    ledger = SchedulerState(R3Config(rollout_id="r"))
    ledger.on_preempt(SimpleNamespace(request_id="a", num_computed_tokens=9))
    assert ledger.take_preempted() == {"a": 9} and ledger.take_preempted() == {}

    batch = SimpleNamespace(req_id_to_index={"a": 0, "b": 1}, num_computed_tokens_cpu=np.array([6, 4]))
    runner = SimpleNamespace(input_batch=batch, vllm_config=SimpleNamespace(speculative_config=object()))
    recorder = RunnerRecorder(runner, R3Config(rollout_id="r"))
    kept = {}
    cap = SimpleNamespace(preempt_request=lambda rid, computed: kept.__setitem__(rid, computed))
    thread = SimpleNamespace(submit=lambda fn, *args, **kw: fn(*args, **kw))
    out = SimpleNamespace(preempted_req_ids={"a", "b"}, finished_req_ids=set(), **{messages.PREEMPTED_ATTR: {"a": 9}})
    recorder._lifecycle(cap, thread, out)
    assert kept == {"a": 9, "b": 4}  # a: the scheduler's count (the batch said 6); b: the batch's

    runner.vllm_config.speculative_config = None  # no drafts: every position it computed
    recorder._lifecycle(cap, thread, out)
    assert kept == {"a": None, "b": None}
