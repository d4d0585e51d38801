"""Capture from real transformers MoE models (tiny random-init configs, no downloads)."""

import numpy as np
import pytest
import torch

from r3rdma import LocalRoutingStore, RoutingReader, RoutingWriter
from r3rdma.errors import CaptureStateError, ShapeMismatchError
from r3rdma.cli.demo import make_requests
from r3rdma.integrations import find_moe_routers
from r3rdma.integrations.hf_capture import attach_capturer, capturer_for_model
from r3rdma.integrations.hf_rollout import BlockAllocator, HFRolloutDriver
from r3rdma.integrations.hf_models import build_model, tiny_deepseek_v3, tiny_olmoe, tiny_qwen3_moe
from r3rdma.cli.shadow import ShadowRecorder

FAMILIES = {
    "qwen3_moe": (tiny_qwen3_moe, [0, 2, 3]),      # mlp_only_layers=[1]: layer 1 dense
    "deepseek_v3": (tiny_deepseek_v3, [1, 2, 3]),  # first_k_dense_replace=1: layer 0 dense
    "olmoe": (tiny_olmoe, [0, 1, 2]),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_router_discovery_skips_dense_layers(family):
    make_config, layers = FAMILIES[family]
    routers = find_moe_routers(build_model(make_config()))
    assert [r.layer_idx for r in routers] == layers
    assert [r.moe_idx for r in routers] == list(range(len(layers)))


def test_model_without_router_refused():
    with pytest.raises(ShapeMismatchError, match="no module whose class name ends in 'TopKRouter'"):
        find_moe_routers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_store_read_matches_shadow_and_plain_forward(family, tmp_path):
    make_config, layers = FAMILIES[family]
    config = make_config()
    model = build_model(config, seed=1)
    requests = make_requests(7, vocab=config.vocab_size, seed=3, max_prompt=20, max_new=8)
    allocator = BlockAllocator(num_blocks=12, block_size=8)
    with LocalRoutingStore(tmp_path) as store, RoutingWriter(store) as writer:
        capturer = capturer_for_model(model, num_slots=allocator.num_slots, sink=writer, rollout_id="r")
        detach = attach_capturer(model, capturer)
        shadow = ShadowRecorder(model)
        outputs = HFRolloutDriver(model, capturer, allocator=allocator, batch_size=3, step_listeners=[shadow.on_step]).run(requests)
        detach()
        writer.flush()
    assert capturer.active_requests == 0
    reader = RoutingReader(tmp_path)
    assert reader.info("r").layer_map == tuple(layers)
    stored = reader.get("r", [o.request_id for o in outputs])
    for out in outputs:
        rows = len(out.prompt) + len(out.generated) - 1
        got = stored[out.request_id].numpy().astype(np.int64)
        np.testing.assert_array_equal(got, shadow.rows(out.request_id, rows))
    shadow.close()

    # Independent ground truth: an unbatched full-sequence forward of prompt + generated[:-1]
    # routes the same experts (as sets: top-k order may differ between kernels).
    out = outputs[0]
    seq = torch.tensor([list(out.prompt) + list(out.generated[:-1])])
    live = {}
    hooks = [r.module.register_forward_hook(lambda m, a, o, i=r.moe_idx: live.__setitem__(i, o[2])) for r in find_moe_routers(model)]
    with torch.no_grad():
        model(seq)
    for h in hooks:
        h.remove()
    plain = torch.stack([live[i] for i in range(len(layers))], dim=1).sort(-1).values
    got = stored[out.request_id].long().sort(-1).values
    agree = (plain == got).all(-1).float().mean().item()
    assert agree > 0.97, f"only {agree:.3f} of (token, layer) top-k sets agree with a plain forward"


def test_capture_detach_stops_recording():
    model = build_model(tiny_qwen3_moe())
    capturer = capturer_for_model(model, num_slots=16)
    detach = attach_capturer(model, capturer)
    capturer.begin_step(["a"], [0], [3], [0, 1, 2])
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    capturer.end_step()
    assert capturer.rows_captured == 3  # attached: every router recorded every token
    detach()
    capturer.begin_step(["a"], [3], [2], [3, 4])
    with torch.no_grad():
        model(torch.tensor([[4, 5]]))
    with pytest.raises(CaptureStateError, match=rf"without routing for MoE layers \[{', '.join(map(str, capturer.layer_map))}\]"):
        capturer.end_step()  # detached: no router recorded anything
    assert capturer.rows_captured == 3
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # no step announced, and no error: the hooks are gone
