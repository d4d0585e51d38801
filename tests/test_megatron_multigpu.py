"""Issue 18 on 2 GPUs: Megatron TP=2 with sequence parallel (and full activation recompute),
routing read from a store node over HTTP.

``torchrun --nproc-per-node 2`` runs this file as a worker (``--worker DIR``). Each rank builds
the same GPTModel MoE (local layer spec, bf16, tensor parallel 2, ``sequence_parallel=True``,
``moe_enable_routing_replay=True``); a rollout forward RECORDs each router's top-k over the
rank's sequence-parallel slice, the slices are all-gathered over the TP group into whole
micro-batch rows, and rank 0 stores each sequence's ``seq_len - 1`` rows (MoE layers) through
``RoutingWriter`` -> ``LocalRoutingStore``. Rank 0 then serves that root with the store node's
own read service (``make_http_app``, token auth, aiohttp ``AppRunner`` on 127.0.0.1 port 0);
each rank reads only its own sequence-parallel rows from it (``prefetch_routing(layout=)``:
``rank_rows``) with ``RoutingReader(["http://127.0.0.1:PORT"], token=...)``. Router weights
are perturbed; one forward + backward without replay must differ from the stored rows, and one
under ``MegatronReplay(layout=ParallelLayout.from_parallel_state(sequence_parallel=True))``
must route every recorded row of the rank's slice exactly as stored. Each rank prints a JSON line.
Norms: see :func:`allow_torch_norm_under_sequence_parallel` (no TransformerEngine here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
pytest.importorskip("megatron.core")

pytestmark = pytest.mark.multigpu

ROOT = Path(__file__).resolve().parents[1]
NUM_LAYERS, E, K = 6, 32, 8
MOE_FREQ = [0, 1, 1, 0, 1, 1]
LAYER_MAP = tuple(i for i, f in enumerate(MOE_FREQ) if f)
VOCAB, SEQ_LENGTH = 1024, 96
SEQ_LENS = {"q0": 96, "q1": 71, "q2": 40, "q3": 13}
ROLLOUT, TOKEN = "roll-tp2", "tp2-read-token"


def _serve(root: Path, token: str):
    """The store node's read service over ``root`` on 127.0.0.1:0, in a thread; returns (port, stop)."""
    import asyncio
    import inspect
    import threading

    from aiohttp import web

    from r3rdma.store.http_app import make_http_app
    from r3rdma.store.metrics import NodeMetrics

    loop = asyncio.new_event_loop()
    box: dict = {}
    ready = threading.Event()

    async def start():
        # the read token's keyword: ``token`` (older nodes) or ``read_token`` (with a separate admin token)
        params = inspect.signature(make_http_app).parameters
        auth = {"read_token": token, "admin_token": None} if "read_token" in params else {"token": token}
        runner = web.AppRunner(make_http_app(root, public_read=False, metrics=NodeMetrics(), **auth))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["runner"] = runner
        box["port"] = runner.addresses[0][1]

    def run():
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(start())
        except BaseException as e:  # surfaced by the caller
            box["error"] = e
        ready.set()
        if "error" not in box:
            loop.run_forever()

    thread = threading.Thread(target=run, daemon=True, name="tp2-http")
    thread.start()
    ready.wait(60)
    if "error" in box:
        raise box["error"]

    def stop():
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)

    return box["port"], stop


def start_nccl_worker() -> None:
    """A torchrun worker's start: its GPU, the NCCL process group, and megatron-core 0.16's
    router without TransformerEngine (``te_general_gemm`` must exist, as None)."""
    import torch.distributed as dist
    from megatron.core.transformer.moe import moe_utils

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    if moe_utils.__dict__.get("te_general_gemm", None) is None:
        moe_utils.te_general_gemm = None


def allow_torch_norm_under_sequence_parallel() -> None:
    """megatron-core 0.16's local-spec norm (``WrappedTorchNorm``, torch LayerNorm) asserts
    ``not sequence_parallel`` only because its weight gradients then need Megatron's
    sequence-parallel all-reduce; the forward (a LayerNorm over the rank's own rows) is the same.
    Without TransformerEngine or Apex there is no other norm, so build it with the flag off for
    the norm alone and mark its params ``sequence_parallel`` (what finalize_model_grads reads)."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__
    if getattr(original, "_r3rdma_sp", False):
        return

    def new(cls, config, *args, **kwargs):
        cfg = copy.copy(config)
        cfg.sequence_parallel = False
        norm = original(cls, cfg, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm

    new._r3rdma_sp = True
    WrappedTorchNorm.__new__ = staticmethod(new)


def worker(work: Path) -> None:
    import numpy as np
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    from megatron.core.transformer.transformer_config import TransformerConfig

    from r3rdma import LocalRoutingStore, RoutingReader, RoutingWriter
    from r3rdma.integrations.megatron import MegatronReplay, MicroBatch, ParallelLayout, prefetch_routing
    from r3rdma.records import RequestRecord

    start_nccl_worker()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    allow_torch_norm_under_sequence_parallel()
    rank, tp, tp_rank = dist.get_rank(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    cfg = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
        num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=128, moe_layer_freq=MOE_FREQ,
        moe_enable_routing_replay=True, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type="allgather", moe_router_dtype="fp32", moe_grouped_gemm=False,
        tensor_model_parallel_size=2, sequence_parallel=True,
        bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
    )
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    model = Float16Module(cfg, GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ_LENGTH).cuda())
    layout = ParallelLayout.from_parallel_state(sequence_parallel=True)
    assert (layout.tp_size, layout.tp_rank, layout.sequence_parallel) == (2, tp_rank, True)
    replay = MegatronReplay(model, layout=layout)
    assert [r.decoder_layer for r in replay.routers] == list(LAYER_MAP)

    ids = list(SEQ_LENS)
    b = len(ids)
    g = torch.Generator().manual_seed(5)  # same batch on every rank
    tokens = torch.randint(0, VOCAB, (b, SEQ_LENGTH), generator=g)
    loss_mask = torch.zeros(b, SEQ_LENGTH)
    for i, rid in enumerate(ids):
        tokens[i, SEQ_LENS[rid]:] = 0
        loss_mask[i, : SEQ_LENS[rid] - 1] = 1
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(SEQ_LENGTH).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(SEQ_LENGTH, SEQ_LENGTH, dtype=torch.bool), 1)[None, None]
    tokens, position_ids, mask, labels, loss_mask = (t.cuda() for t in (tokens, position_ids, mask, labels, loss_mask))
    n_full, n_local = SEQ_LENGTH * b, SEQ_LENGTH * b // tp

    # (1) rollout: RECORD over this rank's sequence-parallel slice; all-gather the slices (TP group)
    model.eval()
    for r in replay.routers:
        r.module.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        model(tokens, position_ids, mask)
    full = []
    for r in replay.routers:
        mine = r.module.router_replay.get_recorded_indices().to(torch.int64).contiguous()
        assert mine.shape == (n_local, K), mine.shape
        out = torch.empty((n_full, K), dtype=torch.int64, device=mine.device)
        dist.all_gather_into_tensor(out, mine, group=ps.get_tensor_model_parallel_group())
        full.append(out.cpu())
        r.module.router_replay.clear_indices()
        r.module.router_replay.clear_router_replay_action()
    rec_NLK = torch.stack(full, dim=1)  # [s * b, L, K]: the whole micro-batch, rows s-major

    # (2) rank 0 stores seq_len - 1 rows per sequence and serves the root over HTTP
    root = work / "root"
    stop = None
    port = [None]
    if rank == 0:
        store = LocalRoutingStore(root)
        writer = RoutingWriter(store)
        for i, rid in enumerate(ids):
            rows = torch.arange(SEQ_LENS[rid] - 1) * b + i
            writer.submit(RequestRecord(ROLLOUT, rid, rec_NLK[rows].numpy().astype(np.uint8), LAYER_MAP, E))
        writer.flush()
        writer.close()
        store.close()
        port[0], stop = _serve(root, TOKEN)
    dist.broadcast_object_list(port, src=0)
    url = f"http://127.0.0.1:{port[0]}"
    # Sequence parallel: each TP rank reads only the rows its routers see (rank_rows) and
    # replays them; the whole micro-batch is read apart, for the check below.
    reader = RoutingReader([url], token=TOKEN)
    ((_, routing),) = prefetch_routing(
        reader, ROLLOUT, [MicroBatch.padded(ids, [SEQ_LENS[i] for i in ids], seq_length=SEQ_LENGTH)], layout=layout
    )
    whole = reader.get_packed(ROLLOUT, ids)
    reader.close()
    try:
        RoutingReader([url], token="wrong").get_packed(ROLLOUT, ids[:1])
        bad_token_refused = False
    except Exception:
        bad_token_refused = True

    # expected: the stored rows in the router's row order, then this rank's SP slice
    cu = whole.cu_seqlens.tolist()
    packed = whole.ids_TLK.to(torch.int64).sort(dim=-1).values
    want = torch.zeros(n_full, len(LAYER_MAP), K, dtype=torch.int64)
    rec = torch.zeros(n_full, dtype=torch.bool)
    for i, rid in enumerate(ids):
        rows = torch.arange(SEQ_LENS[rid] - 1) * b + i
        assert cu[i + 1] - cu[i] == len(rows)
        want[rows] = packed[cu[i] : cu[i + 1]]
        rec[rows] = True
    assert torch.equal(want[rec], rec_NLK.sort(dim=-1).values[rec]), "HTTP read differs from what was recorded"
    sl = slice(tp_rank * n_local, (tp_rank + 1) * n_local)
    want_l, rec_l = want[sl], rec[sl]

    # perturb the routers: live routing now differs from the rollout's
    with torch.no_grad():
        gen = torch.Generator(device="cuda").manual_seed(99)
        for r in replay.routers:
            w = r.module.weight
            w.add_(torch.randn(w.shape, generator=gen, device=w.device, dtype=torch.float32).to(w.dtype) * 0.5 * w.float().std())

    # per router and phase (a forward, or its recompute in the backward): the experts it picked
    calls: dict[int, dict[str, list[torch.Tensor]]] = {i: {"forward": [], "recompute": []} for i in range(len(replay.routers))}

    def hook_for(i):
        def hook(_m, _a, output):
            rm = output[1].detach().bool()
            assert (rm.sum(dim=1) == K).all()
            phase = "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
            calls[i][phase].append(rm.nonzero()[:, 1].view(rm.shape[0], K).cpu())

        return hook

    handles = [r.module.register_forward_hook(hook_for(i)) for i, r in enumerate(replay.routers)]

    def differ(phase: str = "forward", expect_calls: int = 1) -> int:
        d = 0
        for i, r in enumerate(replay.routers):
            got = calls[i][phase]
            assert len(got) == expect_calls and all(c.shape == (n_local, K) for c in got), (phase, len(got))
            w = want_l[:, LAYER_MAP.index(r.decoder_layer)]
            d += sum(int((c[rec_l] != w[rec_l]).any(dim=1).sum()) for c in got)
        return d

    def clear_calls() -> None:
        for c in calls.values():
            c["forward"].clear()
            c["recompute"].clear()

    def loss():
        per_token = model(tokens, position_ids, mask, labels=labels)
        return (per_token.float() * loss_mask).sum() / loss_mask.sum()

    model.train()
    loss().backward()
    differ_live = differ()
    clear_calls()
    model.zero_grad(set_to_none=True)
    batch = MicroBatch.padded(ids, [SEQ_LENS[i] for i in ids], seq_length=SEQ_LENGTH)
    with replay.step():
        replay.load(routing, batch)
        lv = loss()
        lv.backward()
    differ_replay = differ()
    clear_calls()
    grads_ok = all(r.module.weight.grad is not None and torch.isfinite(r.module.weight.grad.float()).all() for r in replay.routers)

    # the same step under full activation recompute: the backward recomputes every router's
    # forward, which must pop the same routing from Megatron's FIFO (REPLAY_BACKWARD)
    model.zero_grad(set_to_none=True)
    cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers = "full", "uniform", 1
    with replay.step():
        replay.load(routing, batch)
        lr = loss()
        lr.backward()
        fifo_left = sum(len(r.module.router_replay.replay_backward_list) for r in replay.routers)
    cfg.recompute_granularity = cfg.recompute_method = cfg.recompute_num_layers = None
    differ_recompute = differ("forward") + differ("recompute")
    clear_calls()
    recompute_grads_ok = all(
        r.module.weight.grad is not None and torch.isfinite(r.module.weight.grad.float()).all() for r in replay.routers)
    for h in handles:
        h.remove()
    dist.barrier()
    if stop is not None:
        stop()
    print(json.dumps({
        "case": "tp2_sequence_parallel_http", "rank": rank, "tp_rank": tp_rank, "device": torch.cuda.get_device_name(),
        "url": url, "bad_token_refused": bad_token_refused,
        "rows_read": int(routing.cu_seqlens[-1]), "rows_stored": int(whole.cu_seqlens[-1]), "moe_layers": len(LAYER_MAP), "experts": E, "topk": K,
        "local_rows": n_local, "recorded_local_rows": int(rec_l.sum()), "decisions_compared": int(rec_l.sum()) * len(LAYER_MAP),
        "decisions_differ_without_replay": differ_live, "decisions_differ_with_replay": differ_replay,
        "loss_finite": bool(torch.isfinite(lv)), "router_grads_finite": grads_ok,
        "recompute_decisions_differ_with_replay": differ_recompute, "recompute_fifo_left": fifo_left,
        "recompute_loss_matches": bool(torch.allclose(lr.float(), lv.float(), rtol=1e-3, atol=1e-3)),
        "recompute_router_grads_finite": bool(recompute_grads_ok),
    }), flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def run_torchrun_2gpu(worker_file: str, work: Path) -> subprocess.CompletedProcess:
    """``worker_file --worker work`` under torchrun on 2 GPUs (NVLink multicast off); skips
    the calling test on a machine with fewer than 2."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(worker_file).resolve()), "--worker", str(work)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280, cwd=ROOT)


def test_tp2_sequence_parallel_replay_from_http_store(tmp_path):
    proc = run_torchrun_2gpu(__file__, tmp_path)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    ranks = sorted((json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")), key=lambda r: r["rank"])
    for r in ranks:
        print(json.dumps(r))
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["recorded_local_rows"] > 0 and r["bad_token_refused"]
        assert r["rows_read"] == r["recorded_local_rows"] < r["rows_stored"], r  # its own rows only
        assert r["decisions_differ_without_replay"] > 0, "perturbed routers still route as the rollout: proves nothing"
        assert r["decisions_differ_with_replay"] == 0
        assert r["loss_finite"] and r["router_grads_finite"]
        # full activation recompute: forward and recomputed forward both replay the stored rows
        assert r["recompute_decisions_differ_with_replay"] == 0 and r["recompute_fifo_left"] == 0, r
        assert r["recompute_loss_matches"] and r["recompute_router_grads_finite"], r


if __name__ == "__main__" and "--worker" in sys.argv:
    worker(Path(sys.argv[sys.argv.index("--worker") + 1]))
