"""`r3rdma verify --trainer megatron`: the R3 measurement with a real megatron-core GPTModel MoE.

The rollout runs on the Megatron model itself: a ``GPTModel`` (local layer spec, no
TransformerEngine) in bf16 (``Float16Module``) generates token by token (full-sequence forwards
of a right-padded batch, no KV cache), its routers on ``RouterReplayAction.RECORD``. Each
sampled token's log-probability and each position's routing come from the forward in which that
position was first an input, so the stored routing is exactly what produced the rollout's
log-probabilities. The rows (``seq_len - 1`` per sequence, MoE layers only) go through
``RoutingWriter`` -> ``LocalRoutingStore`` and come back with ``RoutingReader.get_packed``.

The training forward uses the same weights in fp32: a second ``GPTModel`` built with fp32 params
that loads the bf16 model's state dict. It runs over another batch composition (requests
reordered and regrouped, right-padded), once routing live and once under
:class:`~r3rdma.integrations.megatron.MegatronReplay`. The metrics are those of the HF path
(``r3rdma.cli.verify``): router decisions / tokens differing from the rollout's, KL k3 of the
sampled tokens' log-probabilities, extreme-token fraction. Needs a CUDA GPU and megatron-core.
"""

from __future__ import annotations

import math
import shutil
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from r3rdma.cli.verify_report import RoutingTally, VerifyResult, report

__all__ = ["main", "run_verify_megatron"]


class MegatronVerifyUnavailable(SystemExit):
    """No CUDA device or no megatron-core: the Megatron path cannot run here."""


def _require(device: str, allow_cpu: bool) -> None:
    if not allow_cpu and (not device.startswith("cuda") or not torch.cuda.is_available()):
        raise MegatronVerifyUnavailable(
            f"r3rdma verify --trainer megatron needs a CUDA GPU (device {device!r}, "
            f"cuda available: {torch.cuda.is_available()}); use --trainer hf on CPU"
        )
    try:
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise MegatronVerifyUnavailable(f"r3rdma verify --trainer megatron needs megatron-core >= 0.16: {e}") from e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_world(device: str):
    """torch.distributed (world size 1 unless already initialised) and Megatron's model parallel
    state (TP = PP = 1). Returns a cleanup callable."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    if moe_utils.__dict__.get("te_general_gemm", None) is None:
        moe_utils.te_general_gemm = None  # undefined without TransformerEngine; the router reads it
    own_pg = not torch.distributed.is_initialized()
    if own_pg:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device).index or 0)
            torch.distributed.init_process_group(
                "nccl",
                init_method=f"tcp://127.0.0.1:{_free_port()}",
                rank=0,
                world_size=1,
                device_id=torch.device(device if ":" in device else "cuda:0"),
            )
        else:
            torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    own_mp = not parallel_state.model_parallel_is_initialized()
    if own_mp:
        parallel_state.initialize_model_parallel(1, 1)

    def cleanup() -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()
        if own_mp:
            parallel_state.destroy_model_parallel()
        if own_pg:
            torch.distributed.destroy_process_group()

    return cleanup


def _config(*, bf16: bool, num_layers: int, hidden_size: int, num_experts: int, top_k: int, moe_layer_freq, device: str):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=2 * hidden_size,
        num_attention_heads=8,
        num_moe_experts=num_experts,
        moe_router_topk=top_k,
        moe_ffn_hidden_size=128,
        moe_layer_freq=list(moe_layer_freq),
        moe_enable_routing_replay=True,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type="alltoall" if device.startswith("cuda") else "allgather",
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        use_cpu_initialization=not device.startswith("cuda"),
    )


def _gpt(cfg, *, vocab_size: int, max_len: int, device: str, seed: int):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    torch.manual_seed(seed)
    if device.startswith("cuda"):
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    return GPTModel(
        cfg,
        spec,
        vocab_size=vocab_size,
        max_sequence_length=max_len,
        position_embedding_type="rope" if device.startswith("cuda") else "learned_absolute",
        share_embeddings_and_output_weights=False,
    ).to(device)


def fan_in_init(model: torch.nn.Module, *, num_layers: int, seed: int, logit_gain: float) -> None:
    """Megatron parameter names, the HF path's scheme (see ``r3rdma.cli.verify.fan_in_init``):
    N(0, 1/fan_in) weights, N(0, 1) embeddings, output layer N(0, gain^2/hidden), routers
    N(0, 4/hidden), residual-stream writers (``linear_proj``, ``linear_fc2``) scaled by
    ``1/sqrt(2 * num_layers)``. Megatron's default (std 0.02) leaves routing nearly irrelevant
    to the logits."""
    gen = torch.Generator(device="cpu").manual_seed(seed + 12345)
    depth_scale = 1.0 / math.sqrt(2 * num_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:
                continue
            fan_in = param.shape[-1]
            if "word_embeddings" in name or "position_embeddings" in name:
                std = 1.0
            elif name.startswith("output_layer"):
                std = logit_gain / math.sqrt(fan_in)
            elif name.endswith("router.weight"):
                std = 2.0 / math.sqrt(fan_in)
            elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                std = depth_scale / math.sqrt(fan_in)
            else:
                std = 1.0 / math.sqrt(fan_in)
            param.copy_((torch.randn(param.shape, generator=gen) * std).to(param.device, param.dtype))


class _Tap:
    """Forward hooks on routers: the top-k each one handed to its experts (sorted per row)."""

    def __init__(self, routers, top_k: int) -> None:
        self.out: dict[int, torch.Tensor] = {}
        self.k = top_k
        self.handles = [r.module.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]
        self.n = len(routers)

    def _hook(self, i: int):
        def hook(_m, _a, output):
            rm = output[1].detach().bool()
            self.out[i] = rm.nonzero()[:, 1].view(rm.shape[0], self.k).cpu()

        return hook

    def take(self) -> torch.Tensor:
        ids = torch.stack([self.out[i] for i in range(self.n)], dim=1)  # [N, L, K]
        self.out.clear()
        return ids

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _padded(seqs, device: str):
    width = max(len(s) for s in seqs)
    tokens = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = torch.tensor(s)
    position_ids = torch.arange(width).unsqueeze(0).expand(len(seqs), -1)
    mask = torch.triu(torch.ones(width, width, dtype=torch.bool), 1)[None, None]  # True = masked
    return tokens.to(device), position_ids.to(device), mask.to(device), width


@dataclass(slots=True)
class _Rollout:
    """The rollout's sequences (prompt and sampled tokens) and sampled tokens' log-probabilities
    by request, its forward count and wall time."""

    seqs_of: dict[str, list[int]] = field(default_factory=dict)
    logp: dict[str, dict[int, float]] = field(default_factory=dict)
    forwards: int = 0
    seconds: float = 0.0


def run_verify_megatron(
    *,
    num_requests: int = 16,
    rollout_batch_size: int = 8,
    train_batch_size: int = 3,
    seed: int = 0,
    min_prompt: int = 8,
    max_prompt: int = 48,
    min_new: int = 8,
    max_new: int = 32,
    num_layers: int = 8,
    num_experts: int = 64,
    top_k: int = 8,
    hidden_size: int = 512,
    vocab_size: int = 8192,
    logit_gain: float = 4.0,
    root: str | None = None,
    device: str = "cuda",
    _allow_cpu: bool = False,
):
    """Rollout (Megatron bf16, RECORD) -> store -> fp32 Megatron forwards without / with replay."""
    _require(device, _allow_cpu)
    from r3rdma.cli.demo import make_requests

    if num_experts > 256:
        raise SystemExit("r3rdma verify --trainer megatron: at most 256 experts (uint8 routing ids)")
    started = time.perf_counter()
    cleanup = _init_world(device)
    moe_layer_freq = [0] + [1] * (num_layers - 1)  # first layer dense, as DeepSeek-V3
    layer_map = tuple(i for i, f in enumerate(moe_layer_freq) if f)
    geo = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_experts": num_experts,
        "top_k": top_k,
        "moe_layer_freq": moe_layer_freq,
        "device": device,
    }
    own_root = root is None
    root = root or tempfile.mkdtemp(prefix="r3rdma-verify-megatron-")
    rollout_id = "verify-megatron-0"
    try:
        rollout_model, rollout_replay, train_model, replay = _models(
            geo, vocab_size=vocab_size, max_len=max_prompt + max_new + 1, seed=seed, logit_gain=logit_gain
        )
        assert [r.decoder_layer for r in rollout_replay.routers] == list(layer_map)
        requests = make_requests(
            num_requests,
            vocab=vocab_size,
            seed=seed,
            min_prompt=min_prompt,
            max_prompt=max_prompt,
            min_new=min_new,
            max_new=max_new,
        )
        rollout = _roll_out(
            rollout_model,
            rollout_replay.routers,
            requests,
            root,
            rollout_id,
            layer_map,
            num_experts=num_experts,
            batch_size=rollout_batch_size,
            device=device,
            seed=seed,
        )
        del rollout_model, rollout_replay
        tally, rows_total, info, train_s = _train_forwards(
            train_model,
            replay,
            requests,
            rollout,
            root,
            rollout_id,
            len(layer_map),
            top_k=top_k,
            batch_size=train_batch_size,
            device=device,
            seed=seed,
        )
    finally:
        cleanup()
        if own_root:
            shutil.rmtree(root, ignore_errors=True)
    summary = _summary(
        tally,
        rows_total,
        info,
        len(layer_map),
        rollout,
        requests,
        train_s,
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=top_k,
        rollout_batch_size=rollout_batch_size,
        train_batch_size=train_batch_size,
        logit_gain=logit_gain,
        device=device,
    )
    summary["seconds"] = round(time.perf_counter() - started, 3)
    ok = (
        tally["replay"].decisions_differ == 0
        and tally["replay"].tokens_any == 0
        and summary["kl_k3_replay"] < summary["kl_k3_no_replay"]
    )
    summary["ok"] = ok
    return VerifyResult(summary=summary, ok=ok)


def _models(geo: dict, *, vocab_size: int, max_len: int, seed: int, logit_gain: float):
    """``(rollout model, its MegatronReplay, training model, its MegatronReplay)``: the rollout
    model has bf16 weights, as Megatron trains in bf16 (``Float16Module`` casts in and out); the
    trainer is a second GPTModel with fp32 params, loading the bf16 model's state dict. The
    rollout's MegatronReplay only lists its routers."""
    from megatron.core.transformer.module import Float16Module

    from r3rdma.integrations.megatron import MegatronReplay

    device = geo["device"]
    cfg16 = _config(bf16=True, **geo)
    gpt16 = _gpt(cfg16, vocab_size=vocab_size, max_len=max_len, device=device, seed=seed)
    fan_in_init(gpt16, num_layers=geo["num_layers"], seed=seed, logit_gain=logit_gain)
    cfg32 = _config(bf16=False, **geo)
    train_model = _gpt(cfg32, vocab_size=vocab_size, max_len=max_len, device=device, seed=seed + 1)
    state = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in gpt16.state_dict().items()}
    train_model.load_state_dict(state, strict=True)
    rollout_model = Float16Module(cfg16, gpt16)
    rollout_model.eval()
    train_model.eval()
    rollout_replay = MegatronReplay(rollout_model, device=device)
    return rollout_model, rollout_replay, train_model, MegatronReplay(train_model, device=device)


def _roll_out(
    model,
    routers,
    requests: list,
    root: str,
    rollout_id: str,
    layer_map: tuple[int, ...],
    *,
    num_experts: int,
    batch_size: int,
    device: str,
    seed: int,
) -> _Rollout:
    """Generate ``requests`` token by token on the Megatron model, its routers on RECORD, and
    store each request's routing through RoutingWriter -> LocalRoutingStore."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from r3rdma.records import RequestRecord
    from r3rdma.store.local_store import LocalRoutingStore
    from r3rdma.write.writer import RoutingWriter

    gen = torch.Generator(device=device).manual_seed(seed + 7)
    rollout = _Rollout()
    t0 = time.perf_counter()
    for r in routers:
        r.module.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    with LocalRoutingStore(root) as store, RoutingWriter(store, flush_bytes=1 << 20) as writer:
        for first in range(0, len(requests), batch_size):
            group = requests[first : first + batch_size]
            seqs, rows = _generate(model, routers, group, rollout, gen, device)
            for b, q in enumerate(group):
                ids = torch.cat(rows[b]).numpy()  # len(seq) - 1 rows: the last token was never an input
                assert ids.shape[0] == len(seqs[b]) - 1
                writer.submit(RequestRecord(rollout_id, q.request_id, ids.astype(np.uint8), layer_map, num_experts))
                rollout.seqs_of[q.request_id] = seqs[b]
        writer.flush()
    for r in routers:
        r.module.router_replay.clear_indices()
        r.module.router_replay.clear_router_replay_action()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    rollout.seconds = time.perf_counter() - t0
    return rollout


def _generate(
    model, routers, group: list, rollout: _Rollout, gen: torch.Generator, device: str
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Sample one group to its lengths (full-sequence forwards of a right-padded batch, no KV
    cache). Returns each sequence and its recorded routing rows, each position's from the
    forward in which it was first an input; logs each sampled token's log-probability into
    ``rollout``."""
    seqs = [list(q.prompt) for q in group]
    left = [q.max_new_tokens for q in group]
    done = [0] * len(group)  # positions whose routing is recorded
    rows: list[list[torch.Tensor]] = [[] for _ in group]
    for q in group:
        rollout.logp[q.request_id] = {}
    b_size = len(group)
    while any(left):
        tokens, position_ids, mask, _ = _padded(seqs, device)
        with torch.no_grad():
            logits = model(tokens, position_ids, mask)  # [b, s, V], fp32 out
        rollout.forwards += 1
        rec = torch.stack([r.module.router_replay.get_recorded_indices() for r in routers], dim=1)
        rec = rec.to("cpu", torch.int64)  # [s * b, L, K], rows s-major
        for b, q in enumerate(group):
            if not left[b]:
                continue
            n = len(seqs[b])
            pos = torch.arange(done[b], n)
            rows[b].append(rec[pos * b_size + b])
            done[b] = n
            lp = torch.log_softmax(logits[b, n - 1].float(), dim=-1)
            tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
            rollout.logp[q.request_id][n] = float(lp[tok])
            seqs[b].append(tok)
            left[b] -= 1
    return seqs, rows


def _train_forwards(
    model,
    replay,
    requests: list,
    rollout: _Rollout,
    root: str,
    rollout_id: str,
    moe_layers: int,
    *,
    top_k: int,
    batch_size: int,
    device: str,
    seed: int,
):
    """The fp32 forwards over another batch composition (requests reordered and regrouped,
    right-padded), routing live and under MegatronReplay. Returns ``(tallies by mode, rows
    read back, the stored rollout's RolloutInfo, seconds)``."""
    from r3rdma.read.reader import RoutingReader

    reader = RoutingReader(root)
    info = reader.info(rollout_id)
    order = list(np.random.default_rng(seed + 1).permutation(len(requests)))
    tally = {mode: RoutingTally(moe_layers) for mode in ("no_replay", "replay")}
    rows_total = 0
    t0 = time.perf_counter()
    tap = _Tap(replay.routers, top_k)
    try:
        for first in range(0, len(order), batch_size):
            group = [requests[i] for i in order[first : first + batch_size]]
            packed = reader.get_packed(rollout_id, [q.request_id for q in group])
            rows_total += packed.cu_seqlens.tolist()[-1]
            _train_batch(model, replay, tap, group, packed, rollout, tally, device)
    finally:
        tap.close()
        reader.close()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return tally, rows_total, info, time.perf_counter() - t0


def _train_batch(
    model, replay, tap: _Tap, group: list, packed, rollout: _Rollout, tally: dict[str, RoutingTally], device: str
) -> None:
    """One micro-batch's forwards, routing live and replayed, counted into ``tally``."""
    from r3rdma.integrations.megatron import MicroBatch

    rids = [q.request_id for q in group]
    seqs = [rollout.seqs_of[r] for r in rids]
    b_size = len(seqs)
    tokens, position_ids, mask, width = _padded(seqs, device)
    cu = packed.cu_seqlens.tolist()
    want = packed.ids_TLK.to(torch.int64)  # [T, L, K]
    recorded_rows = torch.cat([torch.arange(cu[i + 1] - cu[i]) * b_size + i for i in range(b_size)])
    batch = MicroBatch.padded(rids, [len(s) for s in seqs], seq_length=width)
    for mode in ("no_replay", "replay"):
        with torch.no_grad():
            if mode == "replay":
                with replay.step():
                    replay.load(packed, batch)
                    logits = model(tokens, position_ids, mask)
            else:
                logits = model(tokens, position_ids, mask)
        used = tap.take()[recorded_rows]  # [T, L, K] in packed order
        miss = ~(used[..., :, None] == want[..., None, :]).any(-1)  # used expert not recorded
        a = tally[mode]
        a.decisions_differ += int(miss.sum())
        a.tokens_any += int(miss.any(-1).any(-1).sum())
        a.layer += miss.sum(dim=(0, 2)).numpy()
        for b, q in enumerate(group):
            s = seqs[b]
            p0 = len(q.prompt)
            lp = torch.log_softmax(logits[b, p0 - 1 : len(s) - 1].float(), dim=-1)
            tgt = torch.tensor(s[p0:], device=lp.device)
            a.logp_train.extend(lp.gather(1, tgt[:, None]).squeeze(1).cpu().tolist())
            a.logp_rollout.extend(rollout.logp[q.request_id][p] for p in range(p0, len(s)))


def _summary(
    tally: dict[str, RoutingTally],
    rows_total: int,
    info,
    moe_layers: int,
    rollout: _Rollout,
    requests: list,
    train_s: float,
    *,
    num_layers: int,
    num_experts: int,
    top_k: int,
    rollout_batch_size: int,
    train_batch_size: int,
    logit_gain: float,
    device: str,
) -> dict[str, Any]:
    """The run's summary (the JSON line of ``r3rdma verify --trainer megatron``), less its total
    time and verdict."""
    summary: dict[str, Any] = {
        "trainer": "megatron",
        "model_config": f"megatron-gpt-moe-{num_layers}L-{num_experts}x{top_k}",
        "model_type": "megatron-core GPTModel (local spec)",
        "moe_layers": moe_layers,
        "num_experts": info.num_experts,
        "top_k": info.top_k,
        "rollout": f"bfloat16 Megatron GPTModel (Float16Module), token by token, right-padded batch {rollout_batch_size}, routers on RECORD",
        "train": f"float32 Megatron GPTModel (state dict of the bf16 one), full sequence, padded (batch {train_batch_size}, reordered)",
        "device": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device,
        "init": f"fan-in (logit gain {logit_gain})",
        "requests": len(requests),
        "rollout_forwards": rollout.forwards,
        "routing_rows": rows_total,
        "generated_tokens": len(tally["replay"].logp_train),
    }
    decisions = rows_total * moe_layers * top_k
    for mode, suffix in (("no_replay", ""), ("replay", "_replay")):
        a = tally[mode]
        r = np.asarray(a.logp_train, dtype=np.float64) - np.asarray(a.logp_rollout, dtype=np.float64)
        summary[f"router_decisions_differ{suffix}"] = a.decisions_differ / decisions
        summary[f"tokens_any_layer_differ{suffix}"] = a.tokens_any / rows_total
        summary[f"kl_k3_{mode}"] = float(np.mean(np.expm1(r) - r))
        summary[f"extreme_ratio_tokens_{mode}"] = float(np.mean(np.abs(r) > math.log(2)))
        summary[f"mean_abs_logp_diff_{mode}"] = float(np.mean(np.abs(r)))
        summary[f"layer_decisions_differ{suffix}"] = [int(x) / (rows_total * top_k) for x in a.layer]
    summary["decisions_differ_count"] = tally["no_replay"].decisions_differ
    summary["decisions_differ_count_replay"] = tally["replay"].decisions_differ
    summary["rollout_seconds"] = round(rollout.seconds, 3)
    summary["train_seconds"] = round(train_s, 3)
    return summary


def main(args) -> int:
    """Run the Megatron verify and report it; 2 (the reason's code on stderr) when Megatron cannot run here."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        result = run_verify_megatron(
            num_requests=args.requests,
            rollout_batch_size=args.rollout_batch_size,
            train_batch_size=args.train_batch_size,
            seed=args.seed,
            min_prompt=args.min_prompt,
            max_prompt=args.max_prompt,
            min_new=args.min_new,
            max_new=args.max_new,
            logit_gain=args.logit_gain,
            root=args.root,
            device=device,
        )
    except MegatronVerifyUnavailable as e:
        print(f"error: {e.code}", file=sys.stderr)
        return 2
    return report(result, f"r3rdma verify --trainer megatron: {result.summary['model_type']}")
