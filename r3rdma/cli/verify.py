"""`r3rdma verify`: the R3 paper's measurement on our stack.

1. Roll out with one numeric setting (default: bf16 weights, batched generation with a KV cache,
   left padding), capturing routing through r3rdma into a local Zarr store and recording the
   log-probability of every sampled token.
2. Read the routing back with :class:`RoutingReader` and run the training forward in another
   setting (default: fp32, full sequences without a cache, a different batch composition:
   requests reordered and regrouped, right-padded or packed), once without and once with
   :class:`RouterReplay`.
3. Compare: routing actually used by the trainer vs recorded (decisions / tokens that differ),
   and the train-inference mismatch of the sampled tokens' log-probabilities.

KL: the k3 estimator of KL(pi_rollout || pi_train) over the generated tokens (sampled from
pi_rollout): ``mean(exp(r) - 1 - r)`` with ``r = logp_train - logp_rollout``. A token is
"extreme" when the paper's ratio ``tau = pi_train / pi_rollout`` or its inverse exceeds 2, i.e.
``|r| > log 2``; the distribution of ``|r|`` is reported as quantiles and a histogram. Routing:
the share of router decisions (token x layer x top-k slot) whose expert is not in the other
side's top-k set, the share of tokens with at least one differing layer, and the mean number of
differing layers per token.

``--model PATH``: a checkpoint of ``r3rdma train-tiny`` (or any Hugging Face MoE checkpoint with
a byte vocabulary) instead of a random-init preset: its weights are used as trained (no re-init),
prompts are windows of held-out standard-library text, generation is sampled, and the summary
carries the checkpoint's held-out loss.

Exit status 1 unless replay leaves zero routing differences and lowers the KL.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from r3rdma.cli.verify_report import RoutingTally, VerifyResult, report
from r3rdma.integrations.hf_routers import RoutingTap

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from r3rdma.read.reader import RolloutInfo

__all__ = ["PRESETS", "VerifyOptions", "VerifyResult", "report", "resolve_config", "run_verify"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def _qwen3_16x64():
    from r3rdma.integrations.hf_models import tiny_qwen3_moe

    # >= 16 layers, >= 64 experts, top-8 like Qwen3-30B-A3B; small widths so a GPU runs it quickly.
    return tiny_qwen3_moe(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=128,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=64,
        num_experts_per_tok=8,
        mlp_only_layers=[],
        max_position_embeddings=4096,
    )


def _small_qwen3():
    from r3rdma.integrations.hf_models import tiny_qwen3_moe

    # The CPU default: 5 MoE layers of 32 experts, top-4. Enough routing flips under bf16 vs
    # fp32 that the KL drop from replay stands out from bf16 noise on a few hundred tokens.
    return tiny_qwen3_moe(num_hidden_layers=6, num_experts=32, num_experts_per_tok=4)


def _small_qwen3_vllm():
    from r3rdma.integrations.hf_models import tiny_qwen3_moe

    # The default of --engine vllm: vLLM's CPU attention takes head_dim >= 32 (16 fails inside
    # the engine). 64 experts, top-8: bf16 vs fp32 flips enough decisions that the KL drop from
    # replay stands out; with 16 experts, top-4, the KL change sat inside bf16 noise
    # (BENCHMARKS.md, "vLLM rollouts").
    return tiny_qwen3_moe(num_hidden_layers=6, head_dim=32, num_experts=64, num_experts_per_tok=8)


def _qwen3_48x128():
    from r3rdma.integrations.hf_models import tiny_qwen3_moe

    # Qwen3-30B-A3B's routing geometry (48 MoE layers, 128 experts, top-8), narrow widths.
    return tiny_qwen3_moe(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=64,
        num_hidden_layers=48,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=128,
        num_experts_per_tok=8,
        mlp_only_layers=[],
        max_position_embeddings=4096,
    )


def _tiny(name: str):
    from r3rdma.integrations import hf_models as models

    return getattr(models, name)()


#: ``--model-config`` when none is given, per rollout engine.
DEFAULT_PRESET = {"hf": "small-qwen3-moe", "vllm": "small-qwen3-moe-vllm"}

PRESETS = {
    "small-qwen3-moe": _small_qwen3,
    "small-qwen3-moe-vllm": _small_qwen3_vllm,
    "tiny-qwen3-moe": lambda: _tiny("tiny_qwen3_moe"),
    "tiny-deepseek-v3": lambda: _tiny("tiny_deepseek_v3"),
    "tiny-olmoe": lambda: _tiny("tiny_olmoe"),
    "qwen3-moe-16x64": _qwen3_16x64,
    "qwen3-moe-48x128": _qwen3_48x128,
}


def resolve_config(spec: str):
    """A preset name (see ``PRESETS``) or a JSON file of config fields with ``model_type``."""
    if spec in PRESETS:
        return PRESETS[spec]()
    if os.path.isfile(spec):
        from transformers import AutoConfig

        with open(spec) as f:
            fields = json.load(f)
        model_type = fields.pop("model_type", None)
        if not model_type:
            raise SystemExit(f"r3rdma verify: {spec} has no 'model_type' (e.g. \"qwen3_moe\")")
        for key in ("architectures", "transformers_version", "torch_dtype", "dtype"):
            fields.pop(key, None)
        return AutoConfig.for_model(model_type, **fields)
    raise SystemExit(f"r3rdma verify: --model-config {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a JSON file")


def fan_in_init(model: PreTrainedModel, *, seed: int, logit_gain: float) -> None:
    """Redraw a random model's weights so that every sublayer matters (a sketch of a trained
    model's scale): weights N(0, 1/fan_in), embeddings N(0, 1), lm_head N(0, logit_gain^2/hidden);
    routers N(0, 4/hidden) (router logits of std ~2, as trained routers have). HF's default
    init (std 0.02 everywhere) leaves the MoE output so small next to the residual stream that
    routing barely changes the logits, and the next-token distribution nearly uniform: the
    routing mismatch would not show in the KL.

    Projections that write into the residual stream (``o_proj``, ``down_proj``, the experts'
    ``down_proj``) are scaled by ``1/sqrt(2 * num_layers)`` (GPT-2 / Megatron's scaled init):
    without it a deep random network is chaotic, bf16 rounding alone is amplified layer after
    layer until it swamps everything, and replay could not lower the KL of a 16- or 48-layer
    model (BENCHMARKS.md, "Routing mismatch and replay")."""
    gen = torch.Generator(device="cpu").manual_seed(seed + 12345)
    depth_scale = 1.0 / math.sqrt(2 * model.config.num_hidden_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:
                continue
            fan_in = param.shape[-1]
            if "embed_tokens" in name:
                std = 1.0
            elif name.startswith("lm_head"):
                std = logit_gain / math.sqrt(fan_in)
            elif name.endswith("mlp.gate.weight"):
                std = 2.0 / math.sqrt(fan_in)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                std = depth_scale / math.sqrt(fan_in)
            else:
                std = 1.0 / math.sqrt(fan_in)
            param.copy_(torch.randn(param.shape, generator=gen) * std)


def _train_batches(outputs, order, layout: str, train_batch_size: int):
    """Micro-batches of the training forward: (request outputs, input_ids, extra kwargs, row index of
    each request's token p in the routers' flattened input)."""
    for first in range(0, len(order), train_batch_size):
        group = [outputs[i] for i in order[first : first + train_batch_size]]
        seqs = [list(o.prompt) + list(o.generated) for o in group]
        if layout == "packed":
            input_ids = torch.tensor([[t for s in seqs for t in s]])
            position_ids = torch.cat([torch.arange(len(s)) for s in seqs]).unsqueeze(0)
            starts = np.cumsum([0] + [len(s) for s in seqs])[:-1]
            kwargs = {"position_ids": position_ids}  # packed: no attention_mask, no cache
            rows = [int(st) + np.arange(len(s)) for st, s in zip(starts, seqs)]
        else:  # right padding
            width = max(len(s) for s in seqs)
            input_ids = torch.zeros((len(seqs), width), dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for b, s in enumerate(seqs):
                input_ids[b, : len(s)] = torch.tensor(s)
                mask[b, : len(s)] = 1
            kwargs = {"attention_mask": mask}
            rows = [b * width + np.arange(len(s)) for b, s in enumerate(seqs)]
        yield group, seqs, input_ids, kwargs, rows


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyOptions:
    """One ``r3rdma verify`` run (the Hugging Face trainer path); each field is the CLI flag of
    the same name (``--requests`` for ``num_requests``, ``--model`` for ``model_path``)."""

    # The model: a preset or JSON config with random weights (``init``, ``logit_gain``), or a
    # trained checkpoint (``model_path``; then model_config and init are ignored).
    model_config: str | None = None  # default: DEFAULT_PRESET[engine]
    model_path: str | None = None
    init: str = "fan-in"
    logit_gain: float = 4.0
    # The requests: how many, their prompt and generation lengths; ``seed`` seeds everything.
    num_requests: int = 16
    min_prompt: int = 8
    max_prompt: int = 48
    min_new: int = 8
    max_new: int = 32
    seed: int = 0
    # The rollout side.
    engine: str = "hf"
    rollout_dtype: str = "bfloat16"
    rollout_batch_size: int = 8
    # The training side.
    train_dtype: str = "float32"
    layout: str = "packed"
    train_batch_size: int = 3
    device: str = "cpu"
    root: str | None = None  # store root to keep (default: a temporary directory, removed)


@dataclass(frozen=True, slots=True)
class _Rollout:
    """What the rollout side produced: the outputs, each sampled token's log-probability by
    request and position, its wall time and a description for the summary."""

    outputs: list
    logp: dict[str, dict[int, float]]
    seconds: float
    description: str


@dataclass(slots=True)
class _Training:
    """The training forwards' tallies by mode, replay's own live-vs-replayed count, the rows
    read back, the stored rollout's geometry (``RolloutInfo``) and the wall time."""

    tally: dict[str, RoutingTally]
    live_vs_replayed: dict[str, int]
    rows_total: int
    info: RolloutInfo
    seconds: float


def run_verify(options: VerifyOptions | None = None, /, **fields: Any) -> VerifyResult:
    """Roll out, store, read back, train without and with replay, compare (module docstring).

    ``fields`` override ``options`` (default :class:`VerifyOptions`), so
    ``run_verify(engine="vllm", num_requests=12)`` runs ``VerifyOptions(engine="vllm", num_requests=12)``.
    """
    from r3rdma.integrations.hf_routers import find_moe_routers

    o = replace(options or VerifyOptions(), **fields)
    started = time.perf_counter()
    if o.engine not in ("hf", "vllm"):
        raise SystemExit(f"r3rdma verify: --engine must be hf or vllm, got {o.engine!r}")
    if o.layout not in ("packed", "padded"):
        raise SystemExit(f"r3rdma verify: --layout must be packed or padded, got {o.layout!r}")
    train_model, meta = _train_model(o)
    rollout_model = _same_weights_in_both_dtypes(train_model, o)
    routers = find_moe_routers(train_model)
    requests = _requests(o, train_model.config)
    rollout_id = "verify-rollout-0"
    root = o.root or tempfile.mkdtemp(prefix="r3rdma-verify-")
    try:
        rollout = _roll_out(o, rollout_model, requests, root, rollout_id)
        del rollout_model
        training = _train_forwards(o, train_model, routers, rollout, root, rollout_id)
    finally:
        if o.root is None:
            shutil.rmtree(root, ignore_errors=True)
    summary = _summary(o, train_model.config, meta, len(routers), rollout, training)
    summary["seconds"] = round(time.perf_counter() - started, 3)
    ok = (
        training.tally["replay"].decisions_differ == 0
        and training.tally["replay"].tokens_any == 0
        and summary["kl_k3_replay"] < summary["kl_k3_no_replay"]
    )
    summary["ok"] = ok
    return VerifyResult(summary=summary, ok=ok)


def _train_model(o: VerifyOptions) -> tuple[PreTrainedModel, dict | None]:
    """The trainer's fp32 model (a trained checkpoint, or a config's random weights under
    ``o.init``) and the checkpoint's train_tiny.json (None for random weights)."""
    from r3rdma.integrations.hf_models import build_model

    if o.model_path is not None:
        return load_trained(o.model_path)
    model = build_model(resolve_config(o.model_config or DEFAULT_PRESET[o.engine]), seed=o.seed, dtype=torch.float32)
    if o.init == "fan-in":
        fan_in_init(model, seed=o.seed, logit_gain=o.logit_gain)
    elif o.init != "hf":
        raise SystemExit(f"r3rdma verify: --init must be fan-in or hf, got {o.init!r}")
    return model, None


def _same_weights_in_both_dtypes(train_model: PreTrainedModel, o: VerifyOptions) -> PreTrainedModel:
    """Round ``train_model``'s weights to the rollout dtype once, move it to the device in the
    train dtype, and return its copy in the rollout dtype: both sides hold the same weights and
    only the arithmetic differs, as between an inference engine and a trainer loading one
    checkpoint."""
    with torch.no_grad():
        for param in train_model.parameters():
            param.copy_(param.to(_DTYPES[o.rollout_dtype]).to(param.dtype))
    # transformers wraps PreTrainedModel.to in functools.wraps, which mypy does not bind as a method.
    train_model.to(o.device)  # type: ignore[arg-type]
    train_model.to(_DTYPES[o.train_dtype])  # type: ignore[arg-type]
    return copy.deepcopy(train_model).to(_DTYPES[o.rollout_dtype])  # type: ignore[arg-type]


def _requests(o: VerifyOptions, config) -> list:
    """Held-out text prompts for a trained checkpoint, random token ids otherwise."""
    lengths = {"min_prompt": o.min_prompt, "max_prompt": o.max_prompt, "min_new": o.min_new, "max_new": o.max_new}
    if o.model_path is not None:
        from r3rdma.cli.train_tiny import heldout_prompts

        return heldout_prompts(o.num_requests, seed=o.seed, **lengths)
    from r3rdma.cli.demo import make_requests

    return make_requests(o.num_requests, vocab=config.vocab_size, seed=o.seed, **lengths)


def _roll_out(o: VerifyOptions, model: PreTrainedModel, requests: list, root: str, rollout_id: str) -> _Rollout:
    """Generate ``requests`` on the rollout engine, its routing captured into ``root``."""
    if o.engine == "vllm":
        from r3rdma.cli.verify_vllm import rollout_with_vllm

        return _Rollout(
            *rollout_with_vllm(
                model,
                requests,
                root=root,
                rollout_id=rollout_id,
                dtype=o.rollout_dtype,
                seed=o.seed,
                batch_size=o.rollout_batch_size,
            )
        )
    return _roll_out_hf(o, model, requests, root, rollout_id)


def _roll_out_hf(o: VerifyOptions, model: PreTrainedModel, requests: list, root: str, rollout_id: str) -> _Rollout:
    """Batched KV-cache decode (left padding) with the HF driver, through capturer, writer and
    a local store; the log-probability of every sampled token from the driver's listener."""
    from r3rdma.integrations.hf_capture import attach_capturer, capturer_for_model
    from r3rdma.integrations.hf_rollout import BlockAllocator, HFRolloutDriver
    from r3rdma.store.local_store import LocalRoutingStore
    from r3rdma.write.writer import RoutingWriter

    logp: dict[str, dict[int, float]] = {r.request_id: {} for r in requests}

    def on_sample(info) -> None:
        for rid, pos, lp in zip(info.request_ids, info.positions, info.logprobs.tolist()):
            logp[rid][pos] = lp

    block_size = 16
    max_len = o.max_prompt + o.max_new + 1
    allocator = BlockAllocator(num_blocks=o.rollout_batch_size * (-(-max_len // block_size)) + 1, block_size=block_size)
    t0 = time.perf_counter()
    with LocalRoutingStore(root) as store, RoutingWriter(store, flush_bytes=1 << 20) as writer:
        capturer = capturer_for_model(model, num_slots=allocator.num_slots, sink=writer, rollout_id=rollout_id)
        detach = attach_capturer(model, capturer)
        driver = HFRolloutDriver(
            model,
            capturer,
            allocator=allocator,
            batch_size=o.rollout_batch_size,
            eos_token_id=None,
            seed=o.seed,
            sample_listeners=[on_sample],
        )
        outputs = driver.run(requests)
        detach()
        writer.flush()
    seconds = time.perf_counter() - t0
    return _Rollout(
        outputs, logp, seconds, f"{o.rollout_dtype}, batched KV-cache decode (batch {o.rollout_batch_size}, left padding)"
    )


class _TrainForward:
    """The training model's forward, routing live or under :class:`RouterReplay`, with a
    :class:`RoutingTap` that sees what the experts get."""

    def __init__(self, model: torch.nn.Module, routers, device: str) -> None:
        from r3rdma.integrations.hf_router_replay import RouterReplay

        self.model, self.routers, self.device = model, routers, device
        self.replay = RouterReplay(model)
        self.replay.detach()
        self.tap = RoutingTap(routers)  # registered after replay's hooks: sees what the experts get

    def __call__(self, input_ids: torch.Tensor, kwargs: dict, replayed=None):
        """``(logits, ids the experts got [N, L, K], replay's report or None)``; with a
        ``ReplayBatch`` ``replayed``, the routers replay it."""
        if replayed is not None:
            self.replay.attach()
            # Re-register the tap so it runs after the replay hook.
            self.tap.close()
            self.tap = RoutingTap(self.routers)
            self.replay.set_routing(replayed)
        with torch.no_grad():
            logits = self.model(
                input_ids=input_ids.to(self.device), use_cache=False, **{k: v.to(self.device) for k, v in kwargs.items()}
            ).logits
        used_NLK = self.tap.take()
        if replayed is None:
            return logits, used_NLK, None
        replay_report = self.replay.last_report
        self.replay.detach()
        return logits, used_NLK, replay_report

    def close(self) -> None:
        self.tap.close()


def _train_forwards(
    o: VerifyOptions, model: torch.nn.Module, routers, rollout: _Rollout, root: str, rollout_id: str
) -> _Training:
    """Read the routing back and run the training forwards over another batch composition
    (requests reordered and regrouped, ``o.layout``), without and with replay."""
    from r3rdma.read.reader import RoutingReader
    from r3rdma.replay import ReplayBatch

    reader = RoutingReader(root)
    info = reader.info(rollout_id)
    order = list(np.random.default_rng(o.seed + 1).permutation(len(rollout.outputs)))
    tally = {mode: RoutingTally(len(routers)) for mode in ("no_replay", "replay")}
    live_vs_replayed = {"decisions_differ": 0, "tokens_any": 0}
    rows_total = 0
    t0 = time.perf_counter()
    forward = _TrainForward(model, routers, o.device)
    for group, seqs, input_ids, kwargs, rows in _train_batches(rollout.outputs, order, o.layout, o.train_batch_size):
        packed = reader.get_packed(rollout_id, [out.request_id for out in group])
        cu = packed.cu_seqlens.tolist()
        rows_total += cu[-1]
        if o.layout == "packed":
            batch = ReplayBatch.packed(packed, [len(s) for s in seqs])
        else:
            batch = ReplayBatch.padded(packed, kwargs["attention_mask"])
        recorded_rows = torch.from_numpy(np.concatenate([r[: cu[i + 1] - cu[i]] for i, r in enumerate(rows)]))
        for mode in ("no_replay", "replay"):
            logits, used_NLK, replay_report = forward(input_ids, kwargs, batch if mode == "replay" else None)
            if replay_report is not None:
                live_vs_replayed["decisions_differ"] += replay_report.decisions_differ
                live_vs_replayed["tokens_any"] += replay_report.tokens_any_layer_differ
            _count_routing(tally[mode], used_NLK[recorded_rows], packed.ids_TLK)
            _count_logp(tally[mode], logits, input_ids, group, seqs, rows, rollout.logp)
    forward.close()
    return _Training(tally, live_vs_replayed, rows_total, info, time.perf_counter() - t0)


def _count_routing(tally: RoutingTally, used_TLK: torch.Tensor, recorded_TLK: torch.Tensor) -> None:
    """Add the decisions, tokens and layers where the routing used differs from the recorded."""
    from r3rdma.replay import routing_agreement

    d, t, per_layer = routing_agreement(used_TLK, recorded_TLK)
    tally.layers_per_token.append(_layers_differ_per_token(used_TLK, recorded_TLK))
    tally.decisions_differ += d
    tally.tokens_any += t
    tally.layer += np.asarray(per_layer)


def _count_logp(
    tally: RoutingTally,
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    group,
    seqs,
    rows,
    logp_rollout: dict[str, dict[int, float]],
) -> None:
    """Add the trainer's and the rollout's log-probabilities of each generated token."""
    # Logits at the row of position p - 1 predict the token at position p (generated positions
    # only: those have a rollout log-prob).
    pred_rows = np.concatenate([r[len(out.prompt) - 1 : len(s) - 1] for out, s, r in zip(group, seqs, rows)])
    target_rows = pred_rows + 1
    flat_logits = logits.reshape(-1, logits.shape[-1])[torch.from_numpy(pred_rows).to(logits.device)]
    targets = input_ids.reshape(-1)[torch.from_numpy(target_rows)].to(logits.device)
    logp = torch.log_softmax(flat_logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)
    tally.logp_train.extend(logp.cpu().tolist())
    for out, s in zip(group, seqs):
        tally.logp_rollout.extend(logp_rollout[out.request_id][pos] for pos in range(len(out.prompt), len(s)))


def _summary(
    o: VerifyOptions, config, meta: dict | None, moe_layers: int, rollout: _Rollout, training: _Training
) -> dict[str, Any]:
    """The run's summary (the JSON line of ``r3rdma verify``), less its total time and verdict."""
    info, rows_total = training.info, training.rows_total
    summary: dict[str, Any] = {
        "model_config": o.model_path if o.model_path is not None else o.model_config or DEFAULT_PRESET[o.engine],
        "model_type": config.model_type,
        "model": "random init" if o.model_path is None else o.model_path,
        "moe_layers": moe_layers,
        "num_experts": info.num_experts,
        "top_k": info.top_k,
        "rollout": rollout.description,
        "engine": o.engine,
        "train": f"{o.train_dtype}, full sequence, {o.layout} (batch {o.train_batch_size}, reordered)",
        "device": o.device,
        "init": (
            "trained checkpoint"
            if o.model_path is not None
            else o.init
            if o.init == "hf"
            else f"fan-in (logit gain {o.logit_gain})"
        ),
        "prompts": "held-out stdlib text (bytes), sampled generation" if o.model_path is not None else "random token ids",
        "requests": len(rollout.outputs),
        "routing_rows": rows_total,
        "generated_tokens": len(training.tally["replay"].logp_train),
    }
    decisions = rows_total * moe_layers * info.top_k
    for mode, suffix in (("no_replay", ""), ("replay", "_replay")):
        summary.update(_mode_metrics(training.tally[mode], mode, suffix, decisions, rows_total, info.top_k))
    summary["replay_live_vs_replayed_decisions_differ"] = training.live_vs_replayed["decisions_differ"] / decisions
    summary["replay_live_vs_replayed_tokens_any_layer_differ"] = training.live_vs_replayed["tokens_any"] / rows_total
    if meta is not None:
        summary["heldout_loss_before_training"] = meta.get("heldout_loss_before")
        summary["heldout_loss_after_training"] = meta.get("heldout_loss_after")
        summary["train_tiny"] = {k: meta.get(k) for k in ("seed", "settings", "device", "tokens_seen", "versions")}
    summary["rollout_seconds"] = round(rollout.seconds, 3)
    summary["train_seconds"] = round(training.seconds, 3)
    return summary


def _mode_metrics(a: RoutingTally, mode: str, suffix: str, decisions: int, rows_total: int, top_k: int) -> dict[str, Any]:
    """One mode's routing differences and log-ratio statistics (KL k3, extreme tokens, ...)."""
    r = np.asarray(a.logp_train, dtype=np.float64) - np.asarray(a.logp_rollout, dtype=np.float64)
    lpt = np.concatenate(a.layers_per_token) if a.layers_per_token else np.zeros(0, np.int64)
    return {
        f"router_decisions_differ{suffix}": a.decisions_differ / decisions,
        f"tokens_any_layer_differ{suffix}": a.tokens_any / rows_total,
        f"kl_k3_{mode}": float(np.mean(np.expm1(r) - r)),
        f"extreme_ratio_tokens_{mode}": float(np.mean(np.abs(r) > math.log(2))),
        f"extreme_tokens_{mode}": int(np.sum(np.abs(r) > math.log(2))),
        f"mean_abs_logp_diff_{mode}": float(np.mean(np.abs(r))),
        f"abs_log_ratio_quantiles_{mode}": _quantiles(np.abs(r)),
        f"abs_log_ratio_hist_{mode}": _histogram(np.abs(r)),
        f"mean_layers_differ_per_token{suffix}": float(lpt.mean()) if lpt.size else 0.0,
        f"mean_layers_differ_per_differing_token{suffix}": float(lpt[lpt > 0].mean()) if (lpt > 0).any() else 0.0,
        f"layer_decisions_differ{suffix}": [int(x) / (rows_total * top_k) for x in a.layer],
    }


_HIST_EDGES = (0.0, 0.01, 0.05, 0.1, 0.25, math.log(2), 1.0, 2.0, math.inf)


def _quantiles(x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {}
    qs = {"p50": 50, "p90": 90, "p99": 99, "p99.9": 99.9}
    out = {k: float(np.percentile(x, q)) for k, q in qs.items()}
    out["max"] = float(x.max())
    return out


def _histogram(x: np.ndarray) -> dict[str, int]:
    """Counts of |log ratio| in the bins of ``_HIST_EDGES`` (log 2 is the paper's extreme-token line)."""
    counts, _ = np.histogram(x, bins=np.asarray(_HIST_EDGES))
    names = []
    for lo, hi in itertools.pairwise(_HIST_EDGES):
        names.append(f"[{lo:.3g},{'log2' if hi == math.log(2) else f'{hi:.3g}'})".replace("[0.693", "[log2"))
    return dict(zip(names, (int(c) for c in counts)))


def _layers_differ_per_token(a_TLK: torch.Tensor, b_TLK: torch.Tensor) -> np.ndarray:
    """Per token: how many layers' top-k sets differ between two routings."""
    a = a_TLK.to(torch.int64)
    b = b_TLK.to(torch.int64).to(a.device)
    differ_TLK = ~(a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1)
    return differ_TLK.any(-1).sum(-1).cpu().numpy()


def load_trained(path: str) -> tuple[PreTrainedModel, dict | None]:
    """``(fp32 model in eval mode, train_tiny.json dict or None)`` from a checkpoint directory."""
    from transformers import AutoModelForCausalLM

    from r3rdma.cli.train_tiny import read_meta
    from r3rdma.integrations.hf_models import progress_bars_on_terminal_only

    progress_bars_on_terminal_only()  # transformers' "Loading weights" bar only on a terminal
    if not os.path.isdir(path):
        raise SystemExit(f"r3rdma verify: --model {path!r} is not a checkpoint directory (see r3rdma train-tiny)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.config.output_router_logits = False
    _require_moe(model, path)
    return model.eval(), read_meta(path)


def _require_moe(model: torch.nn.Module, path: str) -> None:
    """:class:`ConfigError` when the checkpoint has no MoE router at all (a dense model): there is
    no routing to record or replay, which is not a shape error of a MoE model."""
    from r3rdma.errors import ConfigError, ShapeMismatchError
    from r3rdma.integrations.hf_routers import find_moe_routers

    try:
        find_moe_routers(model)
    except ShapeMismatchError as e:
        if any(type(m).__name__.endswith(("TopKRouter", "TopkRouter")) for m in model.modules()):
            raise  # a MoE model whose routers do not fit: the shape error is the right one
        model_type = getattr(model.config, "model_type", type(model).__name__)
        raise ConfigError(
            f"--model {path!r} is not a Mixture-of-Experts model: its {model_type} ({type(model).__name__}) has no "
            "MoE router, so there is no routing to record or replay. Expected a transformers MoE checkpoint "
            "(Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, ...), e.g. one from r3rdma train-tiny --out DIR"
        ) from e


def add_arguments(parser) -> None:
    parser.add_argument(
        "--trainer",
        choices=("hf", "megatron"),
        default="hf",
        help="hf: transformers model (CPU or GPU); megatron: a megatron-core GPTModel rolls out in bf16 "
        "and trains in fp32 (GPU only; r3rdma.cli.verify_megatron; uses --requests, batch sizes, "
        "lengths, --seed, --logit-gain, --root, --device)",
    )
    parser.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="rollout engine: hf (transformers, batched KV-cache decode) or vllm (a real vLLM engine "
        "with r3rdma's plug-in recording the routing; needs vLLM, Qwen3-MoE-family models)",
    )
    parser.add_argument(
        "--model-config",
        default=None,
        help=f"preset ({', '.join(PRESETS)}) or a JSON file of config fields with model_type "
        f"(default: {DEFAULT_PRESET['hf']}; {DEFAULT_PRESET['vllm']} under --engine vllm)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="trained checkpoint (r3rdma train-tiny --out PATH): its weights as trained, prompts from "
        "held-out stdlib text; --model-config and --init are ignored",
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rollout-batch-size", type=int, default=8)
    parser.add_argument("--train-batch-size", type=int, default=3)
    parser.add_argument("--layout", choices=("packed", "padded"), default="packed", help="training batch layout")
    parser.add_argument("--rollout-dtype", choices=sorted(_DTYPES), default="bfloat16")
    parser.add_argument("--train-dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-prompt", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=48)
    parser.add_argument("--min-new", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument(
        "--init",
        choices=("fan-in", "hf"),
        default="fan-in",
        help="random weights: fan-in scaled (default; routing matters) or transformers' default",
    )
    parser.add_argument("--logit-gain", type=float, default=4.0, help="lm_head scale under --init fan-in")
    parser.add_argument("--root", default=None, help="store root to keep (default: a temporary directory, removed)")


def main(args) -> int:
    if getattr(args, "trainer", "hf") == "megatron":
        from r3rdma.cli.verify_megatron import main as megatron_main

        return megatron_main(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = run_verify(
        VerifyOptions(
            model_config=args.model_config,
            model_path=args.model,
            init=args.init,
            logit_gain=args.logit_gain,
            num_requests=args.requests,
            min_prompt=args.min_prompt,
            max_prompt=args.max_prompt,
            min_new=args.min_new,
            max_new=args.max_new,
            seed=args.seed,
            engine=args.engine,
            rollout_dtype=args.rollout_dtype,
            rollout_batch_size=args.rollout_batch_size,
            train_dtype=args.train_dtype,
            layout=args.layout,
            train_batch_size=args.train_batch_size,
            device=device,
            root=args.root,
        )
    )
    s = result.summary
    return report(result, f"r3rdma verify: {s['model_type']} ({s['model_config']})")
