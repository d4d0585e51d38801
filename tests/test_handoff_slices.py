"""The verl / slime hand-off layouts, a pipeline stage's slice (``layers=``, issue #34): the
layer axis holds the stage's layers alone, equal to those columns of the whole layout (dense
fills included), and only the chunks holding the stage's MoE layers are fetched."""

import numpy as np
import pytest
import torch

from r3rdma import LocalRoutingStore, RoutingReader
from r3rdma.errors import ConfigError, ShapeMismatchError
from r3rdma.integrations.rl_frameworks import (
    slime_rollout_routed_experts,
    verl_routed_experts,
    verl_routed_experts_unpadded,
)
from r3rdma.records import RequestRecord
from r3rdma.store import batch_array

from .shard_fetches import count_shard_fetches

K, EXPERTS = 2, 16
LAYER_MAP = (1, 3, 4, 6, 7)  # MoE layers of an 8-layer model: 0, 2, 5 are dense
NUM_LAYERS = 8
PROMPT_LENGTH, RESPONSE_LENGTH = 40, 30
# (request id, prompt tokens, response tokens, stored rows): "tail" ends with unrouted tool output
SAMPLES = [("a", 40, 30, 69), ("b", 12, 30, 41), ("c", 33, 5, 37), ("tail", 20, 25, 30)]


@pytest.fixture
def rollout(tmp_path, monkeypatch):
    """One layer per inner chunk (32 rows): a stage's read skips the other layers' chunks."""
    monkeypatch.setattr(batch_array, "layers_per_chunk", lambda *_: 1)
    rng = np.random.default_rng(3)
    records = [
        RequestRecord("step", rid, rng.integers(0, EXPERTS, size=(rows, len(LAYER_MAP), K)).astype(np.uint8), LAYER_MAP, EXPERTS)
        for rid, _p, _r, rows in SAMPLES
    ]
    with LocalRoutingStore(tmp_path, chunk_rows=32, min_chunk_rows=32) as store:
        store.commit(records)
    return tmp_path


def _verl(reader, fn, **kwargs):
    ids = [s[0] for s in SAMPLES]
    sizes = {"prompt_length": PROMPT_LENGTH} if fn is verl_routed_experts else {}
    return fn(
        reader, "step", ids, prompt_lens=[s[1] for s in SAMPLES], response_lens=[s[2] for s in SAMPLES],
        response_length=RESPONSE_LENGTH, allow_unrouted_tail=True, **sizes, **kwargs,
    )


def _slime(reader, **kwargs):
    ids = [s[0] for s in SAMPLES[:3]]
    return slime_rollout_routed_experts(
        reader, "step", ids, token_lens=[s[3] + 1 for s in SAMPLES[:3]], num_layers=NUM_LAYERS, top_k=K, **kwargs
    )


def _columns(x, columns):
    return x[..., columns, :]


@pytest.mark.parametrize("layers", [range(3, 7), [6, 3], [5, 2], [0, 7, 1]])
@pytest.mark.parametrize("dense_fill", [None, 0])
def test_slime_stage_is_its_columns_of_the_whole(rollout, layers, dense_fill):
    with RoutingReader(rollout) as reader:
        whole = _slime(reader, dense_fill=dense_fill)
        stage = _slime(reader, dense_fill=dense_fill, layers=layers)
    for full, part in zip(whole, stage):
        assert part.dtype == np.int32 and part.shape == (full.shape[0], len(list(layers)), K)
        np.testing.assert_array_equal(part, _columns(full, list(layers)))


@pytest.mark.parametrize("fn", [verl_routed_experts, verl_routed_experts_unpadded])
def test_verl_stage_is_its_columns_of_the_whole(rollout, fn):
    def same(whole, part, columns):
        if fn is verl_routed_experts:
            assert part.dtype == torch.int16 and part.shape[2] == len(columns)
            assert torch.equal(part, _columns(whole, columns))
        else:
            for w, p in zip(whole, part):
                assert p.shape[1] == len(columns) and torch.equal(p, _columns(w, columns))

    with RoutingReader(rollout) as reader:
        # MoE-only layer axis (num_layers=None): a stage names MoE layers, by decoder id
        whole = _verl(reader, fn)
        same(whole, _verl(reader, fn, layers=[6, 1]), [3, 0])
        # every decoder layer (num_layers): a stage's decoder layers, dense ones 0
        whole = _verl(reader, fn, num_layers=NUM_LAYERS)
        same(whole, _verl(reader, fn, num_layers=NUM_LAYERS, layers=range(2, 6)), [2, 3, 4, 5])
        same(whole, _verl(reader, fn, num_layers=NUM_LAYERS, layers=[5]), [5])
    # the unrouted tail keeps its spread fill in the stage's MoE layers (not 0)
    tail = whole[3] if fn is verl_routed_experts_unpadded else whole[3, PROMPT_LENGTH - 20 :]
    assert tail[30:44, 3].any()


def test_stage_reads_only_its_layers_chunks(rollout, monkeypatch):
    fetched = count_shard_fetches(monkeypatch)
    with RoutingReader(rollout) as reader:
        _slime(reader)
    whole = sum(fetched)
    fetched.clear()
    with RoutingReader(rollout) as reader:
        _slime(reader, layers=range(0, 4))  # MoE layers 1 and 3: 2 of 5 layer chunks
    stage = sum(fetched)
    fetched.clear()
    with RoutingReader(rollout) as reader:
        _verl(reader, verl_routed_experts, num_layers=NUM_LAYERS, layers=[7])  # 1 of 5
    one = sum(fetched)
    assert 0 < stage < 0.6 * whole
    assert 0 < one < 0.35 * whole


def test_bad_stage_layers(rollout):
    with RoutingReader(rollout) as reader:
        with pytest.raises(ShapeMismatchError, match="no MoE layer 2"):
            _verl(reader, verl_routed_experts, layers=[1, 2])  # MoE-only axis: 2 is dense
        with pytest.raises(ShapeMismatchError, match=r"layers \[8\] are not decoder layers of a model of 8"):
            _slime(reader, layers=[7, 8])
        with pytest.raises(ShapeMismatchError, match="not decoder layers"):
            _verl(reader, verl_routed_experts_unpadded, num_layers=NUM_LAYERS, layers=[-1])
        with pytest.raises(ConfigError, match="repeat"):
            _slime(reader, layers=[3, 3])
        with pytest.raises(ConfigError, match="no layer"):
            _verl(reader, verl_routed_experts, layers=[])
        # the sample checks still hold on a stage's read
        with pytest.raises(ShapeMismatchError, match="slime needs"):
            slime_rollout_routed_experts(reader, "step", ["a"], token_lens=[60], num_layers=NUM_LAYERS, layers=[5])


def test_stage_over_http(rollout):
    from r3rdma.store.process import new_token, spawn_node

    node = spawn_node(rollout, new_token())
    try:
        with RoutingReader(rollout) as local, RoutingReader(node.http_url, token=node.read_token) as remote:
            want = _columns(_verl(local, verl_routed_experts, num_layers=NUM_LAYERS), [7, 4, 5])
            got = _verl(remote, verl_routed_experts, num_layers=NUM_LAYERS, layers=[7, 4, 5])
            assert torch.equal(got, want)
            for full, part in zip(_slime(local), _slime(remote, layers=[6, 0])):
                np.testing.assert_array_equal(part, _columns(full, [6, 0]))
    finally:
        node.stop()
