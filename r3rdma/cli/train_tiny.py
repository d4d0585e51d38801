"""`r3rdma train-tiny`: train a small Qwen3-MoE on the Python standard library's sources.

The data ships with every Python installation: the ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` (``site-packages`` / ``dist-packages`` excluded), read in
sorted order of their relative paths. A file is held out when ``zlib.crc32(relative path) % 20
== 0`` (about 5%); the rest is the training stream. The tokenizer is byte-level: ids 0-255 are
bytes, 256 / 257 / 258 are BOS / EOS (between files) / PAD, so nothing is downloaded. It is
saved with the model (``tokenizer.json``, :func:`r3rdma.integrations.vllm.checkpoint.write_byte_tokenizer`):
a text's UTF-8 bytes are its ids, as the training text's were, so ``AutoTokenizer`` and vLLM
take text prompts.

The model is a ``Qwen3MoeForCausalLM`` (every layer MoE) trained with the router
load-balancing loss on (``output_router_logits=True``, ``router_aux_loss_coef``), AdamW, a fixed
warm-up then cosine decay, on random windows of the training stream drawn from a seeded
generator. Before and after training it measures the held-out loss (mean next-byte cross
entropy, nats, on fixed evenly spaced windows of the held-out stream) and the expert load per
layer on those windows (top-k counts; ``chi2_over_df``: chi-square against a uniform load
divided by its degrees of freedom, ~1 or below for routing that ignores its input).

Output: ``model.save_pretrained(OUT)`` (config + safetensors, bfloat16), the byte tokenizer
(``tokenizer.json``, ``tokenizer_config.json``) and ``OUT/train_tiny.json`` (tokenizer, data
split, seed, hyper-parameters, losses, load statistics, versions). ``r3rdma verify --model OUT``
loads it with ``AutoModelForCausalLM.from_pretrained``; ``vllm.LLM(model=OUT)`` serves it (on
the CPU with ``--head-dim 32``: vLLM's CPU attention needs head size >= 32).

Defaults are for one GPU (8 layers x 64 experts, top-8, ~10 min at most; ``--time-budget``
caps the training loop: if the first steps project past it, the step count is lowered once,
after step 20, and the JSON records the steps run, so ``--steps N --time-budget 0`` repeats
it). ``--quick``: 4 layers x 16 experts, top-4, a slice of the data, on the CPU in well under
3 minutes (CI). Runs are seeded: on the CPU the same command gives the same weights; on a GPU
the data order and initialisation are the same, floating-point reductions may differ in the
last bits.

The last line printed is JSON (the contents of ``train_tiny.json``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "BOS",
    "DEFAULT",
    "EOS",
    "PAD",
    "QUICK",
    "VOCAB_SIZE",
    "TrainSettings",
    "add_arguments",
    "expert_load",
    "heldout_loss",
    "heldout_prompts",
    "is_heldout",
    "load_corpus",
    "load_stats",
    "main",
    "model_config",
    "read_meta",
    "stdlib_files",
    "train",
]

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 259
HOLDOUT_MOD = 20
META_FILE = "train_tiny.json"


@dataclass(frozen=True, slots=True)
class TrainSettings:
    """Model and training hyper-parameters of one ``train-tiny`` run."""

    layers: int = 8
    experts: int = 64
    top_k: int = 8
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    moe_intermediate: int = 128
    seq_len: int = 512
    batch_size: int = 32
    steps: int = 2500
    warmup_steps: int = 100
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    router_aux_loss_coef: float = 0.01
    eval_windows: int = 64
    train_bytes: int | None = None  # cap on the training stream (None: all of it)
    heldout_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.top_k > self.experts:
            raise ValueError(f"top_k must be <= experts, got top_k={self.top_k}, experts={self.experts}")
        if min(self.layers, self.experts, self.top_k, self.hidden, self.seq_len, self.batch_size, self.steps) < 1:
            raise ValueError("layers, experts, top_k, hidden, seq_len, batch_size and steps must be >= 1")


DEFAULT = TrainSettings()
QUICK = TrainSettings(
    layers=4,
    experts=16,
    top_k=4,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    moe_intermediate=64,
    seq_len=128,
    batch_size=16,
    steps=150,
    warmup_steps=15,
    lr=3e-3,
    eval_windows=32,
    train_bytes=2_000_000,
    heldout_bytes=200_000,
)


# -- data --------------------------------------------------------------------------------------


def stdlib_files() -> tuple[str, list[tuple[str, str]]]:
    """``(stdlib root, [(relative path, absolute path)])`` of the standard library's .py files, sorted."""
    import sysconfig

    root = os.path.realpath(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in filenames:
            if name.endswith(".py"):
                full = os.path.join(dirpath, name)
                out.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    out.sort()
    return root, out


def is_heldout(relpath: str) -> bool:
    """Whether the stdlib file at ``relpath`` (relative, ``/``-separated) is held out: ``crc32 % HOLDOUT_MOD == 0``."""
    return zlib.crc32(relpath.encode()) % HOLDOUT_MOD == 0


def load_corpus(*, train_bytes: int | None = None, heldout_bytes: int | None = None):
    """``(train_ids, heldout_ids, info)``: int16 numpy streams (files' bytes, EOS after each file)
    and a description of the split (root, Python version, file counts, bytes, a digest)."""
    import hashlib

    import numpy as np

    root, files = stdlib_files()
    if not files:
        raise SystemExit(f"r3rdma train-tiny: no .py files under {root}")
    parts: dict[bool, list[np.ndarray]] = {True: [], False: []}
    used = {True: 0, False: 0}
    counts = {True: 0, False: 0}
    cap = {True: heldout_bytes, False: train_bytes}
    digest = hashlib.sha256()
    for rel, full in files:
        held = is_heldout(rel)
        limit = cap[held]
        if limit is not None and used[held] >= limit:
            continue
        with open(full, "rb") as f:
            data = f.read()
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        arr = np.empty(len(data) + 1, dtype=np.int16)
        arr[:-1] = np.frombuffer(data, dtype=np.uint8)
        arr[-1] = EOS
        parts[held].append(arr)
        used[held] += arr.size
        counts[held] += 1
    train = np.concatenate(parts[False]) if parts[False] else np.zeros(0, np.int16)
    heldout = np.concatenate(parts[True]) if parts[True] else np.zeros(0, np.int16)
    if cap[False] is not None:
        train = train[: cap[False]]
    if cap[True] is not None:
        heldout = heldout[: cap[True]]
    info = {
        "source": "stdlib .py files (sysconfig.get_paths()['stdlib'], site-/dist-packages excluded), sorted by path",
        "stdlib": root,
        "python": sys.version.split()[0],
        "holdout_rule": f"zlib.crc32(relative path) % {HOLDOUT_MOD} == 0",
        "train_files": counts[False],
        "heldout_files": counts[True],
        "train_tokens": int(train.size),
        "heldout_tokens": int(heldout.size),
        "files_sha256": digest.hexdigest(),
    }
    return train, heldout, info


def heldout_prompts(
    n: int, *, seed: int, min_prompt: int, max_prompt: int, min_new: int, max_new: int, heldout_bytes: int | None = None
):
    """``n`` rollout requests whose prompts are windows of held-out standard-library text
    (byte ids), each starting at the beginning of a line; seeded."""
    import numpy as np

    from r3rdma.integrations.hf_rollout import RolloutRequest

    _, heldout, _ = load_corpus(train_bytes=0, heldout_bytes=heldout_bytes)
    rng = np.random.default_rng(seed)
    starts = np.flatnonzero(heldout[:-1] == ord("\n")) + 1
    starts = starts[starts + max_prompt < heldout.size]
    out = []
    for i in range(n):
        length = int(rng.integers(min_prompt, max_prompt + 1))
        s = int(starts[rng.integers(0, starts.size)])
        prompt = tuple(int(t) for t in heldout[s : s + length])
        out.append(RolloutRequest(f"req-{i:04d}", prompt, int(rng.integers(min_new, max_new + 1))))
    return out


# -- model -------------------------------------------------------------------------------------


def model_config(settings: TrainSettings):
    """The ``Qwen3MoeConfig`` of ``settings`` (every layer MoE, byte vocabulary)."""
    from r3rdma.integrations.hf_models import tiny_qwen3_moe

    return tiny_qwen3_moe(
        vocab_size=VOCAB_SIZE,
        hidden_size=settings.hidden,
        intermediate_size=4 * settings.hidden,
        moe_intermediate_size=settings.moe_intermediate,
        num_hidden_layers=settings.layers,
        num_attention_heads=settings.heads,
        num_key_value_heads=settings.kv_heads,
        head_dim=settings.head_dim,
        num_experts=settings.experts,
        num_experts_per_tok=settings.top_k,
        mlp_only_layers=[],
        decoder_sparse_step=1,
        max_position_embeddings=max(2048, 2 * settings.seq_len),
        norm_topk_prob=True,
        router_aux_loss_coef=settings.router_aux_loss_coef,
        output_router_logits=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
    )


def _eval_batches(heldout, settings: TrainSettings, device):
    import numpy as np
    import torch

    span = heldout.size - settings.seq_len - 1
    if span <= 0:
        raise SystemExit(f"r3rdma train-tiny: held-out stream too short ({heldout.size} tokens)")
    starts = np.linspace(0, span, settings.eval_windows).astype(np.int64)
    windows = np.stack([heldout[s : s + settings.seq_len] for s in starts]).astype(np.int64)
    x = torch.from_numpy(windows).to(device)
    step = max(1, settings.batch_size)
    return [x[i : i + step] for i in range(0, x.shape[0], step)]


def expert_load(router_logits, top_k: int, num_experts: int):
    """``[layers, experts]`` int64 counts of top-k choices from per-layer router logits."""
    import torch

    rows = []
    for logits in router_logits:
        ids = torch.topk(logits.float(), top_k, dim=-1).indices.reshape(-1)
        rows.append(torch.bincount(ids, minlength=num_experts).cpu())
    return torch.stack(rows).numpy()


def load_stats(load) -> dict[str, Any]:
    """Balance statistics of a ``[layers, experts]`` load: chi-square against uniform per degree
    of freedom (per layer; ~1 or below when routing ignores the input), busiest / mean, normalised
    entropy, unused experts."""
    import numpy as np

    load = np.asarray(load, dtype=np.float64)
    experts = load.shape[1]
    expected = load.sum(axis=1, keepdims=True) / experts
    chi2_df = (((load - expected) ** 2) / np.maximum(expected, 1e-12)).sum(axis=1) / max(1, experts - 1)
    share = load / np.maximum(load.sum(axis=1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(share > 0, share * np.log(share), 0.0).sum(axis=1) / math.log(experts)
    return {
        "chi2_over_df": [round(float(v), 2) for v in chi2_df],
        "chi2_over_df_median": round(float(np.median(chi2_df)), 2),
        "max_over_mean": [round(float(v), 3) for v in load.max(axis=1) / np.maximum(expected[:, 0], 1e-12)],
        "normalized_entropy": [round(float(v), 4) for v in entropy],
        "unused_experts": [int(v) for v in (load == 0).sum(axis=1)],
    }


def _tv_distance(a, b) -> list[float]:
    """Per layer: total variation distance between the load shares of ``a`` and ``b``."""
    import numpy as np

    sa = np.asarray(a, np.float64) / np.maximum(np.asarray(a).sum(axis=1, keepdims=True), 1)
    sb = np.asarray(b, np.float64) / np.maximum(np.asarray(b).sum(axis=1, keepdims=True), 1)
    return [round(float(v), 4) for v in 0.5 * np.abs(sa - sb).sum(axis=1)]


def heldout_loss(model, batches, *, top_k: int, num_experts: int):
    """``(mean next-token cross entropy in nats, expert load [layers, experts])`` on ``batches``."""
    import torch

    was_training = model.training
    model.eval()
    total, count, load = 0.0, 0, None
    with torch.no_grad():
        for x in batches:
            out = model(input_ids=x, use_cache=False, output_router_logits=True)
            logits = out.logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
            total += float(loss)
            count += x[:, 1:].numel()
            part = expert_load(out.router_logits, top_k, num_experts)
            load = part if load is None else load + part
    model.train(was_training)
    return total / count, load


def _usable_experts_implementation(model, settings: TrainSettings, device: str, log) -> str:
    """transformers' default experts implementation (grouped_mm where it can dispatch) if a
    forward + backward of the training kind runs here, else ``eager`` (the per-expert loop)."""
    import torch

    impl = getattr(model.config, "_experts_implementation", None) or "eager"
    if impl == "eager":
        return impl
    x = torch.randint(0, 256, (2, min(16, settings.seq_len)), device=device)
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            out = model(input_ids=x, labels=x, use_cache=False, output_router_logits=True)
        out.loss.backward()
    except (RuntimeError, NotImplementedError, ValueError) as e:
        log(f"experts implementation {impl!r} failed here ({type(e).__name__}: {str(e)[:200]}); using 'eager'")
        model.set_experts_implementation("eager")
        impl = "eager"
    model.zero_grad(set_to_none=True)
    return impl


def _lr_at(step: int, steps: int, s: TrainSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, steps - s.warmup_steps))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    settings: TrainSettings,
    out_dir: str,
    *,
    seed: int = 0,
    device: str = "cpu",
    time_budget: float = 0.0,
    log_every: int = 50,
    threads: int | None = None,
    log=print,
) -> dict[str, Any]:
    """Train, save the checkpoint and ``train_tiny.json`` under ``out_dir``; returns the JSON dict.

    On the CPU, torch's deterministic algorithms are on for the run (restored after): the same
    settings and seed give bit-identical weights (CPU backward reductions otherwise differ in
    the last bits from run to run)."""
    import torch

    deterministic = not device.startswith("cuda")
    previous = torch.are_deterministic_algorithms_enabled()
    if deterministic:
        torch.use_deterministic_algorithms(True)
    try:
        meta = _train(
            settings, out_dir, seed=seed, device=device, time_budget=time_budget, log_every=log_every, threads=threads, log=log
        )
    finally:
        torch.use_deterministic_algorithms(previous)
    meta["deterministic_algorithms"] = deterministic
    with open(os.path.join(out_dir, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def _train(
    settings: TrainSettings, out_dir: str, *, seed: int, device: str, time_budget: float, log_every: int, threads: int | None, log
) -> dict[str, Any]:
    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    train_ids, heldout, data_info = load_corpus(train_bytes=settings.train_bytes, heldout_bytes=settings.heldout_bytes)
    if train_ids.size <= settings.seq_len + 1:
        raise SystemExit(f"r3rdma train-tiny: training stream too short ({train_ids.size} tokens)")
    log(
        f"data: {data_info['train_files']} train files ({data_info['train_tokens'] / 1e6:.2f} M bytes), "
        f"{data_info['heldout_files']} held-out files ({data_info['heldout_tokens'] / 1e6:.2f} M bytes), "
        f"Python {data_info['python']} stdlib"
    )

    torch.manual_seed(seed)
    config = model_config(settings)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    experts_impl = _usable_experts_implementation(model, settings, device, log)
    n_params = sum(p.numel() for p in model.parameters())
    eval_batches = _eval_batches(heldout, settings, device)
    loss_before, load_before = heldout_loss(model, eval_batches, top_k=settings.top_k, num_experts=settings.experts)
    log(
        f"model: {settings.layers} MoE layers x {settings.experts} experts, top-{settings.top_k}, hidden {settings.hidden}, "
        f"{n_params / 1e6:.1f} M parameters; held-out loss before training {loss_before:.4f} nats/byte"
    )

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )
    data = torch.from_numpy(train_ids.astype(np.int64)).to(device)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    offsets_T = torch.arange(settings.seq_len, device=device)
    autocast = device.startswith("cuda")
    steps = settings.steps
    history: list[dict[str, float]] = []
    model.train()
    t_loop = time.perf_counter()
    step = 0
    t20 = None
    while step < steps:
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, settings)
        starts = torch.randint(0, data.numel() - settings.seq_len, (settings.batch_size,), generator=gen).to(device)
        x = data[starts[:, None] + offsets_T[None, :]]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=x, labels=x, use_cache=False, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % log_every == 0 or step == steps or step == 1:
            aux = float(out.aux_loss.detach())
            lm = float(out.loss.detach()) - settings.router_aux_loss_coef * aux
            history.append({"step": step, "loss": round(lm, 4), "aux_loss": round(aux, 4)})
            log(f"step {step}/{steps}: loss {lm:.4f}, aux {aux:.4f}, {time.perf_counter() - t_loop:.0f} s")
        if step == 20 and time_budget > 0 and steps > 40:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t20 = time.perf_counter()
        if step == 40 and t20 is not None:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - t20) / 20
            projected = (time.perf_counter() - t_loop) + per_step * (steps - step)
            if projected > time_budget:
                new_steps = max(step + 1, int(step + (time_budget - (time.perf_counter() - t_loop)) / per_step))
                log(
                    f"time budget {time_budget:.0f} s: {per_step * 1e3:.0f} ms/step projects {projected:.0f} s; "
                    f"steps {steps} -> {new_steps}"
                )
                steps = new_steps
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t_loop
    loss_after, load_after = heldout_loss(model, eval_batches, top_k=settings.top_k, num_experts=settings.experts)
    log(f"held-out loss after {steps} steps: {loss_after:.4f} nats/byte (before {loss_before:.4f}); {train_s:.0f} s")

    os.makedirs(out_dir, exist_ok=True)
    model.config.output_router_logits = False
    from r3rdma.integrations.hf_models import progress_bars_on_terminal_only

    progress_bars_on_terminal_only()  # "Writing model shards" only on a terminal
    # Saved in bfloat16, the dtype vLLM serves it in: fp32 weights made every vLLM start print a
    # "loading float32 into bfloat16" line per weight. Trainers load it in fp32 (upcast, exact).
    model.to(torch.bfloat16).save_pretrained(out_dir)
    from r3rdma.integrations.vllm.checkpoint import write_byte_tokenizer

    write_byte_tokenizer(out_dir, bos=BOS, eos=EOS, pad=PAD, vocab_size=VOCAB_SIZE)
    s = asdict(settings)
    s.pop("extra")
    meta = {
        "kind": "r3rdma train-tiny",
        "tokenizer": {
            "kind": "bytes",
            "vocab_size": VOCAB_SIZE,
            "bos": BOS,
            "eos": EOS,
            "pad": PAD,
            "note": "ids 0-255 are bytes; EOS between files",
            "files": "tokenizer.json: text -> its UTF-8 bytes (AutoTokenizer.from_pretrained(path))",
        },
        "data": data_info,
        "seed": seed,
        "settings": {**s, "steps": steps, "steps_requested": settings.steps},
        "device": device if not device.startswith("cuda") else f"{device} ({torch.cuda.get_device_name()})",
        "parameters": n_params,
        "experts_implementation": experts_impl,
        "active_parameters_per_token": n_params
        - settings.layers * (settings.experts - settings.top_k) * 3 * settings.moe_intermediate * settings.hidden,
        "tokens_seen": steps * settings.batch_size * settings.seq_len,
        "heldout_loss_before": round(loss_before, 4),
        "heldout_loss_after": round(loss_after, 4),
        "heldout_bits_per_byte_after": round(loss_after / math.log(2), 4),
        "heldout_eval_tokens": sum(int(b[:, 1:].numel()) for b in eval_batches),
        "expert_load_before": load_stats(load_before),
        "expert_load_after": load_stats(load_after),
        # How far training moved each layer's load from the untrained routers' on the same windows.
        "load_tv_distance_vs_untrained": _tv_distance(load_before, load_after),
        "history": history,
        "train_seconds": round(train_s, 1),
        "seconds": round(time.perf_counter() - started, 1),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__},
        "path": os.path.abspath(out_dir),
    }
    with open(os.path.join(out_dir, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    np.save(os.path.join(out_dir, "expert_load_heldout.npy"), load_after)
    np.save(os.path.join(out_dir, "expert_load_heldout_untrained.npy"), load_before)
    return meta


def read_meta(path: str) -> dict[str, Any] | None:
    """The ``train_tiny.json`` of a checkpoint directory, or None."""
    meta = os.path.join(path, META_FILE)
    if not os.path.isfile(meta):
        return None
    with open(meta) as f:
        return json.load(f)


def add_arguments(parser) -> None:
    """Add ``train-tiny``'s options to ``parser``: output directory, ``--quick``, device, seed, model and training sizes."""
    parser.add_argument(
        "--out",
        default="train-tiny-out",
        help="checkpoint directory, created (default: train-tiny-out, in the current directory)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny model (4 layers x 16 experts, top-4) on a 2 MB slice, CPU, ~1 minute"
    )
    parser.add_argument("--device", default=None, help="default: cuda if available (cpu with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 2500; --quick 150)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument(
        "--head-dim",
        type=int,
        default=None,
        help="attention head size (default 64; --quick 16, which vLLM's CPU attention cannot run: "
        "use 32 for a checkpoint for r3rdma verify --engine vllm)",
    )
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--router-aux-loss-coef", type=float, default=None)
    parser.add_argument(
        "--time-budget",
        type=float,
        default=480.0,
        help="seconds for the training loop: fewer steps if the first 40 project past it (0: off)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def main(args) -> int:
    """Train, save the checkpoint and print its metadata as JSON; exit 1 if the held-out loss did not go down."""
    import dataclasses

    import torch

    base = QUICK if args.quick else DEFAULT
    overrides = {
        k: getattr(args, a)
        for k, a in (
            ("steps", "steps"),
            ("layers", "layers"),
            ("experts", "experts"),
            ("top_k", "top_k"),
            ("hidden", "hidden"),
            ("head_dim", "head_dim"),
            ("seq_len", "seq_len"),
            ("batch_size", "batch_size"),
            ("lr", "lr"),
            ("router_aux_loss_coef", "router_aux_loss_coef"),
        )
        if getattr(args, a) is not None
    }
    settings = dataclasses.replace(base, **overrides)
    device = args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    meta = train(
        settings,
        args.out,
        seed=args.seed,
        device=device,
        time_budget=args.time_budget,
        threads=args.threads,
        log_every=25 if args.quick else 100,
        log=lambda m: print(m, flush=True),
    )
    print(f"saved {args.out} (model, byte tokenizer, {META_FILE}); try: r3rdma verify --model {args.out}")
    print(json.dumps(meta))
    return 0 if meta["heldout_loss_after"] < meta["heldout_loss_before"] else 1
