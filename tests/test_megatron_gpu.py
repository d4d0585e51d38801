"""Issue 18, GPU evidence: stored routing replayed through a REAL megatron-core GPTModel MoE.

A GPTModel (local layer spec, no TransformerEngine; 8 decoder layers, 3 of them dense via
``moe_layer_freq``; 32 experts, top-8; bf16; ``moe_enable_routing_replay=True``) runs a
"rollout" forward whose routers RECORD their top-k. The recorded ids of each sequence
(``seq_len - 1`` rows, MoE layers only, ``layer_map`` = MoE decoder-layer indices) go through
``RoutingWriter`` -> ``LocalRoutingStore`` and come back with ``RoutingReader.get_packed``. The
router weights are then perturbed, so live routing differs from the rollout; one training step
(forward + backward) under ``MegatronReplay.step()`` / ``load()`` must route every recorded row
of every MoE layer exactly as stored, and the routers must get gradients. The recompute variant
(``recompute_granularity='full'``) also checks the routing of the recomputed forward run in the
backward (``REPLAY_BACKWARD``). Each case prints one JSON summary line (``pytest -s``).
"""

from __future__ import annotations

import json
import socket
import time
import warnings

import numpy as np
import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
pytest.importorskip("megatron.core")

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.transformer.transformer_config import TransformerConfig

from r3rdma import LocalRoutingStore, RoutingReader, RoutingWriter
from r3rdma.integrations.megatron import MegatronReplay, MicroBatch
from r3rdma.records import RequestRecord

pytestmark = pytest.mark.gpu

NUM_LAYERS, E, K = 8, 32, 8
MOE_FREQ = [0, 1, 1, 0, 1, 1, 1, 0]  # decoder layers 0, 3, 7 dense
LAYER_MAP = tuple(i for i, f in enumerate(MOE_FREQ) if f)
VOCAB, SEQ_LENGTH = 1024, 96
SEQ_LENS = {"q0": 96, "q1": 71, "q2": 40, "q3": 13}  # right-padded [b=4, 96] batch
ROLLOUT = "roll-gpu"
DEVICE = "cuda"  # a CPU dry run (gating patched) sets "cpu"
DISPATCHER = "alltoall"  # the alltoall dispatcher makes CUDA streams: a CPU dry run takes "allgather"
POS_EMB = "rope"  # rope puts its table on the current CUDA device: a CPU dry run takes "learned_absolute"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def megatron_world():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if moe_utils.__dict__.get("te_general_gemm", None) is None:
        moe_utils.te_general_gemm = None  # without TransformerEngine the name is undefined and gating crashes
    torch.cuda.set_device(0)
    own_pg = not torch.distributed.is_initialized()
    if own_pg:
        torch.distributed.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, device_id=torch.device("cuda", 0)
        )
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    RouterReplay.clear_global_router_replay_instances()
    if own_pg:
        torch.distributed.destroy_process_group()


def build_model(*, recompute: bool, seed: int = 1234) -> Float16Module:
    kw = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} if recompute else {}
    cfg = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
        num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=128, moe_layer_freq=MOE_FREQ,
        moe_enable_routing_replay=True, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type=DISPATCHER, moe_router_dtype="fp32", moe_grouped_gemm=False,
        bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=False, use_cpu_initialization=DEVICE == "cpu", **kw,
    )
    torch.manual_seed(seed)
    if DEVICE == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    model = GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ_LENGTH, position_embedding_type=POS_EMB)
    return Float16Module(cfg, model.to(DEVICE))  # bf16 as Megatron trains it (weights cast, fp32 loss)


def batch_tensors(ids):
    b = len(ids)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (b, SEQ_LENGTH), generator=g)
    loss_mask = torch.zeros(b, SEQ_LENGTH)
    for i, rid in enumerate(ids):
        tokens[i, SEQ_LENS[rid]:] = 0  # right padding
        loss_mask[i, : SEQ_LENS[rid] - 1] = 1
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(SEQ_LENGTH).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(SEQ_LENGTH, SEQ_LENGTH, dtype=torch.bool), 1)[None, None]  # True = masked
    return [t.to(DEVICE) for t in (tokens, position_ids, mask, labels, loss_mask)]


class RouterTap:
    """Forward hooks on every router: the top-k each call chose (from its routing_map), and
    whether the call ran inside autograd's backward (activation recompute)."""

    def __init__(self, replay: MegatronReplay):
        self.calls: dict[int, list[tuple[bool, torch.Tensor]]] = {i: [] for i in range(len(replay.routers))}
        self.handles = [r.module.register_forward_hook(self._hook(i)) for i, r in enumerate(replay.routers)]

    def _hook(self, i):
        def hook(module, args, output):
            _, routing_map = output
            rm = routing_map.detach().bool()
            assert (rm.sum(dim=1) == K).all(), "a row without exactly top-k experts"
            ids = rm.nonzero()[:, 1].view(rm.shape[0], K)  # sorted per row
            self.calls[i].append((torch._C._current_graph_task_id() != -1, ids.cpu()))

        return hook

    def clear(self):
        for v in self.calls.values():
            v.clear()

    def remove(self):
        for h in self.handles:
            h.remove()


def expected_rows(routing, ids, b):
    """From what the store returned: per stored layer, sorted ids [N, K] in the router's row order
    (s-major over the padded [b, S] batch) and the recorded mask [N]."""
    cu = routing.cu_seqlens.tolist()
    packed = routing.ids_TLK.to(torch.int64).sort(dim=-1).values  # [T, L, K]
    want = torch.zeros(SEQ_LENGTH * b, len(LAYER_MAP), K, dtype=torch.int64)
    rec = torch.zeros(SEQ_LENGTH * b, dtype=torch.bool)
    for i, rid in enumerate(ids):
        n = SEQ_LENS[rid] - 1
        assert cu[i + 1] - cu[i] == n
        rows = torch.arange(n) * b + i
        want[rows] = packed[cu[i] : cu[i + 1]]
        rec[rows] = True
    return want, rec


def diff_count(calls_by_router, replay, want, rec, *, backward: bool) -> tuple[int, int]:
    """(differing (row, layer) decisions, compared decisions) over recorded rows."""
    layer_of = {d: li for li, d in enumerate(LAYER_MAP)}
    diff = total = 0
    for i, r in enumerate(replay.routers):
        got = [ids for bwd, ids in calls_by_router[i] if bwd == backward]
        assert len(got) == 1, f"router {r.name}: {len(got)} calls (backward={backward})"
        w = want[:, layer_of[r.decoder_layer]]
        d = (got[0][rec] != w[rec]).any(dim=1)
        diff += int(d.sum())
        total += int(rec.sum())
    return diff, total


def loss_of(model, tensors):
    tokens, position_ids, mask, labels, loss_mask = tensors
    per_token = model(tokens, position_ids, mask, labels=labels)  # [b, s]
    return (per_token.float() * loss_mask).sum() / loss_mask.sum()


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute_full"])
def test_gptmodel_moe_replays_stored_routing(megatron_world, tmp_path, recompute):
    t0 = time.perf_counter()
    ids = list(SEQ_LENS)
    b = len(ids)
    model = build_model(recompute=recompute)
    replay = MegatronReplay(model)
    assert [r.decoder_layer for r in replay.routers] == list(LAYER_MAP)
    assert replay.topk == K and replay.num_experts == E
    tensors = batch_tensors(ids)

    # (1) rollout: the routers RECORD their top-k
    model.eval()
    for r in replay.routers:
        r.module.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        model(*tensors[:3])
    recorded = [r.module.router_replay.get_recorded_indices().detach().cpu() for r in replay.routers]  # [N, K] each
    for r in replay.routers:
        r.module.router_replay.clear_indices()
        r.module.router_replay.clear_router_replay_action()
    assert all(x.shape == (SEQ_LENGTH * b, K) for x in recorded)

    # (2) the recorded ids of each sequence (n - 1 rows, MoE layers) through the store
    rec_NLK = torch.stack(recorded, dim=1)  # [N, L, K], rows s-major
    store = LocalRoutingStore(tmp_path / "root")
    writer = RoutingWriter(store)
    for i, rid in enumerate(ids):
        rows = torch.arange(SEQ_LENS[rid] - 1) * b + i
        writer.submit(RequestRecord(ROLLOUT, rid, rec_NLK[rows].numpy().astype(np.uint8), LAYER_MAP, E))
    writer.flush()
    writer.close()
    store.close()
    reader = RoutingReader(tmp_path / "root")
    routing = reader.get_packed(ROLLOUT, ids)
    reader.close()
    want, rec = expected_rows(routing, ids, b)
    assert torch.equal(want[rec], rec_NLK.sort(dim=-1).values[rec])  # the store returned what was recorded

    # perturb the routers: live routing now differs from the rollout's
    with torch.no_grad():
        g = torch.Generator(device=DEVICE).manual_seed(99)
        for r in replay.routers:
            w = r.module.weight
            w.add_(torch.randn(w.shape, generator=g, device=w.device, dtype=torch.float32).to(w.dtype) * 0.5 * w.float().std())
    model.train()
    tap = RouterTap(replay)
    try:
        # without replay: live routing, forward + backward
        loss_of(model, tensors).backward()
        differ_live, compared = diff_count(tap.calls, replay, want, rec, backward=False)
        model.zero_grad(set_to_none=True)
        tap.clear()

        # (3) one training step under replay
        batch = MicroBatch.padded(ids, [SEQ_LENS[i] for i in ids], seq_length=SEQ_LENGTH)
        with replay.step():
            replay.load(routing, batch)
            loss = loss_of(model, tensors)
            loss.backward()
            leftover = [len(r.module.router_replay.replay_backward_list) for r in replay.routers]
        differ_replay, _ = diff_count(tap.calls, replay, want, rec, backward=False)
        differ_recompute = diff_count(tap.calls, replay, want, rec, backward=True)[0] if recompute else None
        pads = [ids_[~rec] for i in tap.calls for bwd, ids_ in tap.calls[i] if not bwd]
    finally:
        tap.remove()

    assert torch.isfinite(loss)
    assert differ_live > 0, "perturbed routers still route as the rollout: the test proves nothing"
    assert differ_replay == 0
    if recompute:
        assert differ_recompute == 0
        assert leftover == [0] * len(replay.routers)  # every recompute popped its FIFO entry
    for r in replay.routers:
        gw = r.module.weight.grad
        assert gw is not None and torch.isfinite(gw.float()).all() and gw.float().abs().sum() > 0, r.name
    for p in pads:  # never-recorded rows (each sequence's last token, padding): duplicate-free spread fill
        assert (p[:, 1:] != p[:, :-1]).all() and len(torch.unique(p)) == E
    for r in replay.routers:  # the step cleared everything
        rr = r.module.router_replay
        assert rr.router_replay_action is None and rr.target_topk_idx is None and rr.replay_backward_list == []

    summary = {
        "case": "recompute_full" if recompute else "plain",
        "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
        "layers": NUM_LAYERS, "moe_layers": len(LAYER_MAP), "experts": E, "topk": K, "dtype": "bf16",
        "tokens": SEQ_LENGTH * b, "recorded_rows": int(rec.sum()), "decisions_compared": compared,
        "decisions_differ_without_replay": differ_live, "decisions_differ_with_replay": differ_replay,
        "decisions_differ_in_recompute": differ_recompute,
        "router_grad_norm": round(float(sum(r.module.weight.grad.float().norm() ** 2 for r in replay.routers) ** 0.5), 6),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    print(json.dumps(summary))
