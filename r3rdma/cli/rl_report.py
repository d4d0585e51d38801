"""The summary, table and figure of ``r3rdma rl-loop`` (:mod:`.rl_loop`).

- :func:`summarize`: per run (``r3``: trained with routing replay; ``none``: without), the
  reward at the first and last step, the means of the per-step mismatch measurements (live and
  under replay), r3rdma's time per step, the checks that failed.
- :func:`markdown_table`: one row per step and run, for BENCHMARKS.md.
- :func:`plot`: reward, routing mismatch, KL and r3rdma's time per step (PNG, matplotlib Agg,
  as :mod:`r3rdma.bench.plots`).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

__all__ = ["summarize", "markdown_table", "plot", "write_outputs"]

_MEANS = (
    "reward",
    "loss_after_step",
    "router_decisions_differ",
    "tokens_any_layer_differ",
    "router_decisions_differ_replay",
    "tokens_any_layer_differ_replay",
    "kl_k3_no_replay",
    "kl_k3_replay",
    "mean_abs_logp_diff_no_replay",
    "mean_abs_logp_diff_replay",
)
_SECONDS = ("generate_s", "flush_s", "wait_s", "read_s", "r3_overhead_s", "train_s", "push_s", "reset_s", "retention_s")


def _mean(values: list[Any]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return sum(present) / len(present) if present else None


def summarize(records: list[dict[str, Any]], options: dict[str, Any], *, seconds: float) -> dict[str, Any]:
    """The run's summary (the last JSON line of ``r3rdma rl-loop``), less its verdict;
    ``options``: the run's options as JSON values."""
    runs: dict[str, Any] = {}
    for mode in dict.fromkeys(r["mode"] for r in records):
        rs = [r for r in records if r["mode"] == mode]
        run: dict[str, Any] = {
            "steps": len(rs),
            "reward_first": rs[0]["reward"],
            "reward_last": rs[-1]["reward"],
            "loss_after_step_first": rs[0].get("loss_after_step"),
            "loss_after_step_last": rs[-1].get("loss_after_step"),
        }
        for key in _MEANS:
            run[f"mean_{key}"] = _mean([r.get(key) for r in rs])
        for key in _SECONDS:
            run[f"mean_{key}"] = _mean([r["seconds"].get(key) for r in rs])
        run["failed_checks"] = [
            {"step": r["step"], "check": name, **check}
            for r in rs
            for name, check in r["checks"].items()
            if not check.get("ok", True)
        ]
        runs["r3" if mode == "r3" else "no_r3"] = run
    return {
        "kind": "r3rdma rl-loop",
        "runs": runs,
        "steps": len(records),
        "kl_estimator": "k3 on sampled tokens: mean(exp(r) - 1 - r), r = logp_trainer - logp_engine (KL(engine || trainer))",
        "options": options,
        "machine": _machine(),
        "versions": _versions(),
        "seconds": round(seconds, 1),
    }


def _machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} ({platform.machine()})"
    import os

    return f"CPU, {os.cpu_count()} cores ({platform.machine()})"


def _versions() -> dict[str, str]:
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    try:
        import vllm

        out["vllm"] = vllm.__version__
    except ImportError:
        pass
    return out


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(records: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """One row per step and run: reward, routing mismatch live / under replay, KL, r3rdma's time."""
    o = summary["options"]
    lines = [
        f"`r3rdma rl-loop` ({summary['machine']}; vLLM {summary['versions'].get('vllm', '?')}, engine "
        f"{o['engine_dtype']}{', eager' if o['enforce_eager'] else ', compiled'}; trainer {o['train_dtype']} on {o['device']}; "
        f"{o['prompts']} prompts x {o['samples']} samples per step, lr {o['lr']}). Decisions: (token, layer, top-k slot) "
        "whose expert differs between the trainer's routing and the engine's stored routing; tokens: any layer differs. "
        "KL: k3 on the sampled tokens, KL(engine || trainer). r3rdma s: flush + wait + read of the step's routing.",
        "",
        "| run | step | reward | decisions differ (live) | tokens differ (live) | decisions differ (replay) | "
        "KL k3 live | KL k3 replay | r3rdma s | generate s | train s | push s | checks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        s = r["seconds"]
        lines.append(
            f"| {'R3' if r['mode'] == 'r3' else 'no R3'} | {r['step']} | {r['reward']:.3f} | "
            f"{_fmt(r.get('router_decisions_differ'), '.4%')} | {_fmt(r.get('tokens_any_layer_differ'), '.2%')} | "
            f"{_fmt(r.get('router_decisions_differ_replay'), '.4%')} | {_fmt(r.get('kl_k3_no_replay'), '.2e')} | "
            f"{_fmt(r.get('kl_k3_replay'), '.2e')} | {s['r3_overhead_s']:.3f} | {s['generate_s']:.2f} | "
            f"{s['train_s']:.2f} | {s['push_s']:.2f} | {'ok' if r['ok'] else 'FAILED'} |"
        )
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], path: Path, machine: str) -> str:
    """Four panels against the step: reward per run; decisions differing, live vs replayed;
    KL live vs replayed; r3rdma's seconds beside generation's."""
    from r3rdma.bench.plots import _plt, _save

    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    modes = list(dict.fromkeys(r["mode"] for r in records))
    label = {"r3": "trained with R3", "none": "trained without R3"}
    for mode in modes:
        rs = [r for r in records if r["mode"] == mode]
        steps = [r["step"] for r in rs]
        axes[0][0].plot(steps, [r["reward"] for r in rs], "o-", label=label[mode])
        for key, style, what in (("router_decisions_differ", "o-", "live"), ("router_decisions_differ_replay", "s--", "replay")):
            axes[0][1].plot(steps, [r.get(key) or 0.0 for r in rs], style, label=f"{label[mode]}: {what}")
        for key, style, what in (("kl_k3_no_replay", "o-", "live"), ("kl_k3_replay", "s--", "replay")):
            axes[1][0].plot(steps, [r.get(key) or 0.0 for r in rs], style, label=f"{label[mode]}: {what}")
        axes[1][1].plot(
            steps, [r["seconds"]["r3_overhead_s"] for r in rs], "o-", label=f"{label[mode]}: r3rdma (flush+wait+read)"
        )
        axes[1][1].plot(steps, [r["seconds"]["generate_s"] for r in rs], "s--", label=f"{label[mode]}: generate")
    titles = (
        ("reward (copy task)", "mean reward"),
        ("router decisions: trainer vs engine", "share differing"),
        ("KL(engine || trainer), k3 on sampled tokens", "KL"),
        (f"seconds per step\n{machine}", "s"),
    )
    for ax, (title, ylabel) in zip([axes[0][0], axes[0][1], axes[1][0], axes[1][1]], titles):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    return _save(fig, path)


def write_outputs(records: list[dict[str, Any]], summary: dict[str, Any], out: Path) -> dict[str, str]:
    """``steps.jsonl``, ``summary.json``, ``rl_loop.md`` and (with matplotlib) ``rl_loop.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    path = out / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    files["steps"] = str(path)
    path = out / "rl_loop.md"
    path.write_text(markdown_table(records, summary))
    files["table"] = str(path)
    try:
        files["plot"] = plot(records, out / "rl_loop.png", summary["machine"])
    except ImportError:  # matplotlib is an extra (r3rdma[plot])
        pass
    path = out / "summary.json"
    path.write_text(json.dumps({**summary, "files": files}, indent=1))
    files["summary"] = str(path)
    return files
