"""Issue 29 on 2 GPUs: Megatron pipeline parallel (PP=2, 1F1B) and interleaved virtual pipeline
(PP=2 x VPP=2), with and without full activation recompute, driven by Megatron's own schedules.

``torchrun --nproc-per-node 2`` runs this file as a worker (``--worker DIR``). Per case, each rank
builds its pipeline stage (or its two virtual chunks) of one GPTModel MoE (local layer spec, bf16,
8 decoder layers of which 5 are MoE, one chunk with none). The rollout is a forward-only pass of
``get_forward_backward_func()`` over 4 micro-batches with every router on ``RECORD``; a forward
hook keeps each router's top-k per micro-batch (a router sees micro-batches in order). The ranks
exchange their routers' records, rank 0 stores each request's ``seq_len - 1`` rows through
``RoutingWriter`` -> ``LocalRoutingStore`` and serves them with the store node's read service
over HTTP (token auth); each rank reads back its stage's layers alone with
``RoutingReader.get_packed(..., layers=replay.layers)``.

Router weights are then perturbed. Passes, each one whole schedule:
- live (no replay, forward only): the perturbed routers must differ from the stored rows;
- replay without recompute, then with ``recompute_granularity="full"``: ``forward_step_func``
  calls ``replay.load(routing, batch, chunk=model)`` for its micro-batch and chunk; every router
  forward, and every recomputed forward in the backward (Megatron's FIFO), must pick exactly the
  stored experts of the micro-batch it runs, and the router weights must get finite gradients.

The independent reference is the rollout's own ``RECORD`` output, gathered per (layer,
micro-batch) outside r3rdma; the replayed decisions are read off the routers' routing maps.
Each rank prints one JSON line per case; the test asserts on them.
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
pytest.importorskip("megatron.core")

pytestmark = pytest.mark.multigpu

ROOT = Path(__file__).resolve().parents[1]
NUM_LAYERS, E, K = 8, 32, 4
MOE_FREQ = [0, 0, 1, 1, 0, 1, 1, 1]  # with PP=2 x VPP=2, rank 0's first chunk (layers 0, 1) has no MoE layer
LAYER_MAP = tuple(i for i, f in enumerate(MOE_FREQ) if f)
VOCAB, SEQ_LENGTH, MB_SIZE, NUM_MB = 512, 64, 2, 4
CASES = {"pp2_1f1b": None, "pp2_vpp2_interleaved": 2}
TOKEN = "pp2-read-token"


def _case(work: Path, name: str, vpp: int | None) -> dict:
    import numpy as np
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    from megatron.core.transformer.transformer_config import TransformerConfig

    from r3rdma import LocalRoutingStore, RoutingReader, RoutingWriter
    from r3rdma.integrations.megatron import MegatronReplay, MicroBatch, ParallelLayout
    from r3rdma.records import RequestRecord
    from r3rdma.store import batch_array
    from tests.test_megatron_multigpu import _serve

    ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vpp)
    rank, pp_rank = dist.get_rank(), ps.get_pipeline_model_parallel_rank()
    cfg = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
        num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=64, moe_layer_freq=MOE_FREQ,
        moe_enable_routing_replay=True, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type="allgather", moe_router_dtype="fp32", moe_grouped_gemm=False,
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.bfloat16,
        bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
    )
    torch.manual_seed(1234 + pp_rank)
    tensor_parallel.model_parallel_cuda_manual_seed(1234 + pp_rank)
    chunks = []
    for v in range(vpp or 1):
        vp = v if vpp else None
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, vp_stage=vp)
        gpt = GPTModel(
            cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ_LENGTH,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=False, vp_stage=vp,
        )
        chunks.append(Float16Module(cfg, gpt.cuda()))
    replay = MegatronReplay(chunks, layout=ParallelLayout.from_parallel_state(sequence_parallel=False))
    mine = {r.decoder_layer: r for r in replay.routers}

    # the same data on both ranks: NUM_MB micro-batches of MB_SIZE right-padded sequences
    g = torch.Generator().manual_seed(11)
    lens = torch.randint(9, SEQ_LENGTH + 1, (NUM_MB, MB_SIZE), generator=g).tolist()
    lens[0][0] = SEQ_LENGTH
    mb_ids = [[f"m{m}s{i}" for i in range(MB_SIZE)] for m in range(NUM_MB)]
    tokens = torch.randint(0, VOCAB, (NUM_MB, MB_SIZE, SEQ_LENGTH), generator=g)
    loss_mask = torch.zeros(NUM_MB, MB_SIZE, SEQ_LENGTH)
    for m in range(NUM_MB):
        for i, n in enumerate(lens[m]):
            tokens[m, i, n:] = 0
            loss_mask[m, i, : n - 1] = 1
    labels = torch.roll(tokens, -1, dims=2)
    position_ids = torch.arange(SEQ_LENGTH).unsqueeze(0).expand(MB_SIZE, -1).cuda()
    mask = torch.triu(torch.ones(SEQ_LENGTH, SEQ_LENGTH, dtype=torch.bool), 1)[None, None].cuda()
    tokens, labels, loss_mask = tokens.cuda(), labels.cuda(), loss_mask.cuda()
    batches = [MicroBatch.padded(mb_ids[m], lens[m], seq_length=SEQ_LENGTH) for m in range(NUM_MB)]

    # per router: the top-k it picked, per call, split into forwards and recomputes in the backward
    calls: dict[int, dict[str, list[torch.Tensor]]] = {}

    def hook_for(layer):
        def hook(module, _args, output):
            in_backward = torch._C._current_graph_task_id() != -1
            if module.router_replay.router_replay_action is RouterReplayAction.RECORD:
                got = module.router_replay.get_recorded_indices().detach().sort(dim=-1).values
            else:
                rm = output[1].detach().bool()
                assert (rm.sum(dim=1) == K).all()
                got = rm.nonzero()[:, 1].view(rm.shape[0], K)
            calls[layer]["recompute" if in_backward else "forward"].append(got.cpu())

        return hook

    handles = [r.module.register_forward_hook(hook_for(d)) for d, r in mine.items()]
    replaying = {"on": False}
    routings: list = []

    def loss_fn(lm, out):
        loss = (out.float() * lm).sum() / lm.sum()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, model):
        m = next(data_iterator)
        if replaying["on"]:
            replay.load(routings[m], batches[m], chunk=model)
        out = model(tokens[m], position_ids, mask, labels=labels[m])
        return out, partial(loss_fn, loss_mask[m])

    def run_schedule(forward_only: bool) -> None:
        for d in mine:
            calls[d] = {"forward": [], "recompute": []}
        for c in chunks:
            c.train(not forward_only)
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter(range(NUM_MB)) for _ in chunks], model=chunks,
            num_microbatches=NUM_MB, seq_length=SEQ_LENGTH, micro_batch_size=MB_SIZE, forward_only=forward_only,
        )
        torch.cuda.synchronize()

    # (1) rollout: RECORD through the forward-only schedule
    for r in replay.routers:
        r.module.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        run_schedule(forward_only=True)
    for r in replay.routers:
        r.module.router_replay.clear_indices()
        r.module.router_replay.clear_router_replay_action()
    record = {d: [t.numpy() for t in calls[d]["forward"]] for d in mine}
    assert all(len(v) == NUM_MB for v in record.values()), {d: len(v) for d, v in record.items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    record_all = {d: v for part in gathered for d, v in part.items()}
    assert sorted(record_all) == list(LAYER_MAP), sorted(record_all)

    # (2) rank 0 stores seq_len - 1 rows per request and serves them over HTTP; both ranks read
    rollout = f"roll-{name}"
    root = work / name / "root"
    port, stop = [None], None
    if rank == 0:
        # one layer per inner chunk (the writer's rule would group these few small layers into
        # one), so each stage's read fetches only its layers' chunks over HTTP
        batch_array.layers_per_chunk = lambda *_: 1
        store = LocalRoutingStore(root)
        writer = RoutingWriter(store)
        for m in range(NUM_MB):
            for i, rid in enumerate(mb_ids[m]):
                rows = np.arange(lens[m][i] - 1) * MB_SIZE + i
                ids = np.stack([record_all[d][m][rows] for d in LAYER_MAP], axis=1).astype(np.uint8)
                writer.submit(RequestRecord(rollout, rid, ids, LAYER_MAP, E))
        writer.flush()
        writer.close()
        store.close()
        port[0], stop = _serve(root, TOKEN)
    dist.broadcast_object_list(port, src=0)
    reader = RoutingReader([f"http://127.0.0.1:{port[0]}"], token=TOKEN)
    # each stage reads its routers' layers alone (every virtual chunk's): in 1F1B rank 0 reads
    # decoder layers 2 and 3 of the 5 MoE layers
    routings.extend(reader.get_packed(rollout, mb_ids[m], layers=replay.layers) for m in range(NUM_MB))
    reader.close()
    assert all(r.layer_map == replay.layers == tuple(sorted(mine)) for r in routings), (replay.layers, sorted(mine))

    # expected per (my layer, micro-batch): the rollout's record, and which rows were recorded
    want = {d: [torch.from_numpy(record_all[d][m]).to(torch.int64).sort(dim=-1).values for m in range(NUM_MB)] for d in mine}
    recorded = []
    for m in range(NUM_MB):
        rec = torch.zeros(SEQ_LENGTH * MB_SIZE, dtype=torch.bool)
        for i, n in enumerate(lens[m]):
            rec[torch.arange(n - 1) * MB_SIZE + i] = True
        recorded.append(rec)

    def differ(phase: str) -> int:
        d_total = 0
        for d in mine:
            got = calls[d][phase]
            assert len(got) == NUM_MB, f"layer {d}: {len(got)} {phase} calls, expected {NUM_MB}"
            for m in range(NUM_MB):
                rec = recorded[m]
                d_total += int((got[m][rec] != want[d][m][rec]).any(dim=1).sum())
        return d_total

    # (3) perturb the routers; live routing now differs from the rollout's
    with torch.no_grad():
        gen = torch.Generator(device="cuda").manual_seed(99 + pp_rank)
        for r in replay.routers:
            w = r.module.weight
            w.add_(torch.randn(w.shape, generator=gen, device=w.device, dtype=torch.float32).to(w.dtype) * 0.5 * w.float().std())
    with torch.no_grad():
        run_schedule(forward_only=True)
    result = {"case": name, "rank": rank, "pp_rank": pp_rank, "vpp": vpp, "device": torch.cuda.get_device_name(),
              "chunks": len(chunks), "my_moe_layers": sorted(mine), "micro_batches": NUM_MB,
              "decisions_compared": sum(int(r.sum()) for r in recorded) * len(mine),
              "decisions_differ_without_replay": differ("forward")}

    # (4) replay, without and with full activation recompute
    replaying["on"] = True
    for recompute in (False, True):
        cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers = (
            ("full", "uniform", 1) if recompute else (None, None, None))
        for c in chunks:
            c.zero_grad(set_to_none=True)
        with replay.step():
            run_schedule(forward_only=False)
            fifo_left = sum(len(r.module.router_replay.replay_backward_list) for r in replay.routers)
        key = "recompute" if recompute else "no_recompute"
        result[f"{key}_decisions_differ_with_replay"] = differ("forward")
        result[f"{key}_recomputed_router_calls"] = sum(len(calls[d]["recompute"]) for d in mine)
        if recompute:
            result["recompute_decisions_differ_in_backward"] = differ("recompute")
            result["recompute_fifo_left"] = fifo_left
        result[f"{key}_router_grads_finite"] = all(
            r.module.weight.grad is not None and bool(torch.isfinite(r.module.weight.grad.float()).all()) for r in replay.routers)
    replaying["on"] = False
    cfg.recompute_granularity = cfg.recompute_method = cfg.recompute_num_layers = None
    for h in handles:
        h.remove()
    dist.barrier()
    if stop is not None:
        stop()
    ps.destroy_model_parallel()
    return result


def worker(work: Path) -> None:
    import torch.distributed as dist

    from tests.test_megatron_multigpu import start_nccl_worker

    start_nccl_worker()
    failed = False
    for name, vpp in CASES.items():
        try:
            print(json.dumps(_case(work, name, vpp)), flush=True)
        except Exception:
            failed = True
            print(json.dumps({"case": name, "rank": dist.get_rank(), "error": traceback.format_exc()[-3000:]}), flush=True)
            from megatron.core import parallel_state as ps

            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


def test_pipeline_and_virtual_pipeline_replay_with_recompute(tmp_path):
    from tests.test_megatron_multigpu import run_torchrun_2gpu

    proc = run_torchrun_2gpu(__file__, tmp_path)
    lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    for line in lines:
        print(json.dumps(line))
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert sorted((l["case"], l["rank"]) for l in lines) == sorted((c, r) for c in CASES for r in (0, 1))
    for r in lines:
        assert r["decisions_compared"] > 0 and r["decisions_differ_without_replay"] > 0, r
        assert r["no_recompute_decisions_differ_with_replay"] == 0 and r["no_recompute_recomputed_router_calls"] == 0, r
        assert r["recompute_decisions_differ_with_replay"] == 0 and r["recompute_decisions_differ_in_backward"] == 0, r
        assert r["recompute_recomputed_router_calls"] == NUM_MB * len(r["my_moe_layers"]) and r["recompute_fifo_left"] == 0, r
        assert r["no_recompute_router_grads_finite"] and r["recompute_router_grads_finite"], r
    # Megatron's layer offsets: PP=2 gives rank 0 layers 0-3; PP=2 x VPP=2 gives rank 0 layers
    # 0-1 (no MoE layer: its loads are no-ops) and 4-5, rank 1 layers 2-3 and 6-7
    layers = {(r["case"], r["pp_rank"]): r["my_moe_layers"] for r in lines}
    assert layers == {("pp2_1f1b", 0): [2, 3], ("pp2_1f1b", 1): [5, 6, 7],
                      ("pp2_vpp2_interleaved", 0): [5], ("pp2_vpp2_interleaved", 1): [2, 3, 6, 7]}, layers


if __name__ == "__main__" and "--worker" in sys.argv:
    worker(Path(sys.argv[sys.argv.index("--worker") + 1]))
