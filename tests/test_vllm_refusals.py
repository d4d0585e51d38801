"""The vLLM plug-in's start-up refusals, against vLLM's real classes without starting an engine:
a model with no MoE layer, Model Runner V2, speculative decoding under async scheduling, data
and pipeline parallelism, an unsupported vLLM version, a store node that cannot be reached or
refuses the secret, and how the plug-in is (not) switched on.

The configs are vLLM's own (``VllmConfig``, ``ModelConfig`` of a tiny local checkpoint,
``SchedulerConfig``, ``ParallelConfig``, ``SpeculativeConfig``, ``KVCacheConfig``), so a field
vLLM renames fails here: the gate reads each field by its name, without a default."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import socket
from types import SimpleNamespace

import pytest
import torch

from tests.vllm_available import require_vllm

require_vllm()  # vLLM itself is imported where a test needs it

from r3rdma.config import R3Config  # noqa: E402
from r3rdma.errors import AuthenticationError, ConfigError, TransportError  # noqa: E402
from r3rdma.integrations.vllm.settings import routing_config  # noqa: E402
from r3rdma.integrations.vllm.engine_gate import check_engine  # noqa: E402
from r3rdma.integrations.vllm.worker import RunnerRecorder  # noqa: E402
from r3rdma.kernels.record_op import new_step_buffer  # noqa: E402

from .store_nodes import new_token, start_node  # noqa: E402
from tests.vllm_in_process import engine_in_this_process  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny MoE checkpoint on disk (16 experts), as vLLM's ModelConfig reads one."""
    from r3rdma.integrations.vllm.checkpoint import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("refusal-model"), tokenizer=False))


@pytest.fixture(scope="module")
def model_config(model):
    from vllm.config import ModelConfig

    return ModelConfig(model=model, max_model_len=128, skip_tokenizer_init=True)


def _set(config, **fields):
    """Set fields of a vLLM config dataclass, each checked to be one of its fields by that name
    (a plain setattr would add a misspelled attribute silently)."""
    names = {f.name for f in dataclasses.fields(config)}
    for name, value in fields.items():
        assert name in names, f"{type(config).__name__} has no field {name!r}"
        setattr(config, name, value)
    return config


def _config(model_config, *, pp=1, dp=1, spec=None, async_scheduling=True):
    """vLLM's own config of an engine. Async scheduling is set after vLLM resolved it, as vLLM
    resolves it on a GPU (vLLM turns it off on CPU, where these tests run)."""
    from vllm.config import ParallelConfig, SchedulerConfig, VllmConfig

    config = VllmConfig(
        model_config=model_config,
        parallel_config=ParallelConfig(pipeline_parallel_size=pp, data_parallel_size=dp),
        scheduler_config=SchedulerConfig(
            max_model_len=128, is_encoder_decoder=False, max_num_batched_tokens=64, max_num_seqs=8
        ),
        speculative_config=_spec(model_config, spec),
        additional_config={},
    )
    _set(config.scheduler_config, async_scheduling=async_scheduling)
    return config


def _spec(model_config, method):
    """A real SpeculativeConfig: ngram (what the plug-in records) or a draft model (the tiny
    checkpoint drafting for itself: a method vLLM schedules asynchronously on a GPU)."""
    if method is None:
        return None
    from vllm.config import ParallelConfig, SpeculativeConfig

    common = dict(target_model_config=model_config, target_parallel_config=ParallelConfig())
    if method == "ngram":
        return SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=2, **common)
    return SpeculativeConfig(method=method, model=model_config.model, num_speculative_tokens=2, **common)


@pytest.fixture
def v2(monkeypatch):
    """vLLM's own decision forced to Model Runner V2 (its default on a GPU with Triton; vLLM
    falls back to V1 on CPU). monkeypatch refuses to set a property VllmConfig does not have."""
    from vllm.config import VllmConfig

    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: True))
    # vLLM's own refusal of V2 without Triton (the CPU build): skipped, so the config is built as on a GPU.
    monkeypatch.setattr(VllmConfig, "_validate_v2_model_runner", lambda self: None)


def _runner(config):
    return SimpleNamespace(vllm_config=config, device=torch.device("cpu"), max_num_tokens=64)


def _kv_config(num_blocks=4, block_size=32):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])


def test_a_model_without_moe_layers_is_refused_naming_it(tmp_path, model, model_config):
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    recorder = RunnerRecorder(_runner(_config(model_config)), R3Config(local_store_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match=re.escape(repr(model)) + r" \(Sequential\) has no MoE layer"):
        recorder.bind_model(dense)


@pytest.mark.parametrize(("config", "match"), [
    (dict(v2=True), "Model Runner V2.*VLLM_USE_V2_MODEL_RUNNER=0"),
    (dict(spec="draft_model"), "draft_model.*async_scheduling=False"),
    (dict(dp=2), "data_parallel_size=2"),
    (dict(pp=2), "pipeline_parallel_size=2"),
])
def test_what_the_plug_in_cannot_record_is_refused_by_name(config, match, model_config, request):
    if config.pop("v2", False):
        request.getfixturevalue("v2")
    vllm_config = _config(model_config, **config)
    with pytest.raises(ConfigError, match=match):
        check_engine(vllm_config)
    with pytest.raises(ConfigError, match=match):  # the worker checks again before binding
        RunnerRecorder(_runner(vllm_config), R3Config()).bind_model(torch.nn.Linear(2, 2))


def test_what_the_plug_in_records_passes(model_config):
    check_engine(_config(model_config))  # compiled or not, CUDA graphs or not: no compilation setting is refused
    check_engine(_config(model_config, spec="ngram", async_scheduling=False))
    check_engine(_config(model_config, spec="draft_model", async_scheduling=False))


_GONE = object()
_READ = ("use_v2_model_runner", "parallel_config", "speculative_config", "scheduler_config", "additional_config")


@pytest.mark.parametrize(("renamed", "named"), [
    (dict(use_v2_model_runner=_GONE), "VllmConfig.use_v2_model_runner"),
    (dict(parallel_config=_GONE), "VllmConfig.parallel_config"),
    (dict(speculative_config=_GONE), "VllmConfig.speculative_config"),
    (dict(scheduler_config=_GONE), "VllmConfig.scheduler_config"),
    (dict(parallel_config=SimpleNamespace(data_parallel_size=1)), "ParallelConfig.pipeline_parallel_size"),
    (dict(parallel_config=SimpleNamespace(pipeline_parallel_size=1)), "ParallelConfig.data_parallel_size"),
    (dict(scheduler_config=SimpleNamespace(max_num_batched_tokens=64)), "SchedulerConfig.async_scheduling"),
    (dict(additional_config=_GONE), "VllmConfig.additional_config"),
])
def test_a_field_vllm_renamed_stops_the_engine_naming_it(renamed, named, model_config):
    """The gate reads vLLM's fields without defaults: a config lacking one (as a release that
    renamed it would) is refused naming it, instead of the field reading as "not used" and an
    engine starting that the plug-in cannot record. Built from a real config, one field gone."""
    real = _config(model_config)
    fields = {name: renamed.get(name, getattr(real, name)) for name in _READ}
    config = SimpleNamespace(**{name: value for name, value in fields.items() if value is not _GONE})
    with pytest.raises(ConfigError, match=re.escape(f"reads {named} ") + ".* has no such field"):
        routing_config(config, env={}) if "additional_config" in renamed else check_engine(config)


def test_model_runner_v2_is_refused_in_the_users_process_before_the_engine_starts(tmp_path, monkeypatch):
    """vLLM's own decision forced to V2 (on a GPU with Triton it is the default; on CPU vLLM
    falls back to V1): ``LLM(...)`` raises at config time, naming how to turn V1 on, and the
    same engine without routing replay is not refused by the plug-in."""
    from vllm import LLM
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    from r3rdma.integrations.vllm.checkpoint import write_tiny_checkpoint
    from r3rdma.integrations.vllm.plugin import register

    register()  # vLLM loads the plug-in in this process when it builds an engine; here before that
    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: True))
    # vLLM's own refusal of V2 without Triton (the CPU build): skipped, so the config is built as on a GPU.
    monkeypatch.setattr(VllmConfig, "_validate_v2_model_runner", lambda self: None)
    model = str(write_tiny_checkpoint(tmp_path / "model", tokenizer=False))
    with pytest.raises(ConfigError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        LLM(model=model, gpu_memory_utilization=0.3, max_model_len=128, skip_tokenizer_init=True,
            additional_config={"routing_replay": {"local_store_dir": str(tmp_path / "store")}})
    config = EngineArgs(model=model, max_model_len=128, skip_tokenizer_init=True).create_engine_config()
    assert config.use_v2_model_runner  # the forced decision, and no refusal without routing replay


def test_unsupported_vllm_version_refuses_routing_replay_only():
    from r3rdma.integrations.vllm.plugin import SUPPORTED_VLLM, supported

    assert SUPPORTED_VLLM[0] == "0.26.0" and SUPPORTED_VLLM[-1] == "0.32.0"
    assert all(supported(v) and supported(v + "+cpu") for v in SUPPORTED_VLLM)
    assert not supported("0.25.1") and not supported("0.31.1") and not supported("0.33.0")


def _engine(additional_config):
    from vllm.config import VllmConfig

    return VllmConfig(additional_config=additional_config)


def test_routing_replay_is_off_unless_asked_for(tmp_path):
    off = _engine({})
    assert routing_config(off, env={}) is None
    assert routing_config(off, env={"R3_LOCAL_STORE_DIR": "/x"}) is None  # an R3_* variable alone does not turn it on
    on = routing_config(_engine({"routing_replay": {"local_store_dir": str(tmp_path)}}), env={})
    assert on is not None and on.local_store_dir == str(tmp_path)
    assert routing_config(off, env={"R3_ENABLE_ROUTING_REPLAY": "1", "R3_ROLLOUT_ID": "r"}).rollout_id == "r"
    assert routing_config(off, env={"R3_ROUTING_REPLAY_CONFIG": json.dumps({"rollout_id": "j"})}).rollout_id == "j"
    disabled = _engine({"routing_replay": {"enable_routing_replay": False}})
    assert routing_config(disabled, env={}) is None
    with pytest.raises(ConfigError, match="unknown routing replay config keys"):
        routing_config(_engine({"routing_replay": {"local_dir": "/x"}}), env={})


def _geometry(recorder):
    """What bind_model fixes from a model: two MoE layers, top-2 of 8 experts, a step buffer."""
    recorder.layer_map, recorder.top_k, recorder.num_experts = (0, 2), 2, 8
    recorder.step_buf = new_step_buffer(max_tokens=16, num_layers=2, top_k=2, num_experts=8, device="cpu")


def test_unreachable_store_node_fails_at_engine_start(tmp_path, monkeypatch, model_config):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("R3_STORE_TOKEN", new_token())
    config = R3Config(routing_store_type="store_nodes", store_urls=(f"127.0.0.1:{port}",))
    recorder = RunnerRecorder(_runner(_config(model_config)), config)
    _geometry(recorder)
    with pytest.raises(TransportError, match=f"0 of 1 store nodes answered.*127.0.0.1:{port}"):
        recorder.build(_kv_config())
    assert recorder.capturer is None


def test_a_refused_secret_fails_at_engine_start(tmp_path, monkeypatch, model_config):
    node = start_node(tmp_path / "node", new_token())
    try:
        monkeypatch.setenv("R3_STORE_TOKEN", new_token())  # not the node's
        recorder = RunnerRecorder(_runner(_config(model_config)),
                                  R3Config(routing_store_type="store_nodes", store_urls=(node.push_url,)))
        _geometry(recorder)
        with pytest.raises(AuthenticationError, match="refused the push secret"):
            recorder.build(_kv_config())
        monkeypatch.setenv("R3_STORE_TOKEN", node.token)
        recorder.build(_kv_config())  # the right secret: connected and authenticated now
        assert recorder.capturer is not None and recorder.capturer.num_slots == 4 * 32
        recorder.close()
    finally:
        node.stop(signal.SIGKILL)


def test_a_near_miss_of_the_config_key_is_refused_in_the_users_process(tmp_path):
    """``additional_config={"routing-replay": ...}`` (a dash) used to leave routing replay off
    without a word; it is refused when vLLM builds its config, naming the key meant."""
    from vllm import LLM

    from r3rdma.integrations.vllm.checkpoint import write_tiny_checkpoint

    model = str(write_tiny_checkpoint(tmp_path / "model", tokenizer=False))
    for key in ("routing-replay", "routingReplay", "routing_repaly"):
        with pytest.raises(ConfigError, match=rf"has the key '{key}', not 'routing_replay'.*additional_config\['routing_replay'\]"):
            LLM(model=model, gpu_memory_utilization=0.3, max_model_len=128, skip_tokenizer_init=True,
                additional_config={key: {"local_store_dir": str(tmp_path / "store")}})
    # An unrelated key is vLLM's business, not a near miss.
    assert routing_config(_engine({"routing": 1, "kv_hints": {}}), env={}) is None


def test_r3_arguments_on_an_engine_without_routing_replay_are_refused(tmp_path):
    """A client naming its routing's id on an engine that stores none gets an error (HTTP 400 on
    the server), not a response that silently stored nothing; without r3_* arguments the engine
    is untouched."""
    from vllm import LLM, SamplingParams

    from r3rdma.integrations.vllm.checkpoint import write_tiny_checkpoint

    model = str(write_tiny_checkpoint(tmp_path / "model", tokenizer=False))
    with engine_in_this_process():  # tests/vllm_in_process.py
        llm = LLM(model=model, gpu_memory_utilization=0.3, max_model_len=128, skip_tokenizer_init=True, enforce_eager=True,
                  block_size=32, num_gpu_blocks_override=8)
    try:
        with pytest.raises(ValueError, match=r"names r3_request_id, r3_rollout_id, but routing replay is off.*additional_config"):
            llm.generate([{"prompt_token_ids": [40, 41]}],
                         SamplingParams(max_tokens=2, extra_args={"r3_rollout_id": "s", "r3_request_id": "a"}), use_tqdm=False)
        out = llm.generate([{"prompt_token_ids": [40, 41]}], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2 and not (out[0].kv_transfer_params or {}).get("r3_routing")
    finally:
        llm.llm_engine.engine_core.shutdown()
