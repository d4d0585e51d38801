"""`r3rdma bench all`: every bench in one run, BENCHMARKS.md-ready tables and PNG plots.

Runs store ingest (and its overhead vs writer batch size), transport (throughput vs message
size) and, where a GPU is present, capture (overhead vs decode batch size). Each number is a
ratio to its yardstick measured in the same run by the same program; the machine is named in
every table and figure. A bench that fails is reported with its error and the others still
run. Writes ``OUT/results.json``, ``OUT/tables.md`` and ``OUT/*.png``; the last line is JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_all", "machine_info", "add_arguments", "main"]


def machine_info() -> dict[str, Any]:
    """Which machine the numbers come from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gb = None
    try:
        mem_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (ValueError, OSError, AttributeError):
        pass
    info: dict[str, Any] = {
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": mem_gb,
        "os": platform.platform(),
        "python": platform.python_version(),
        "gpu": None,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except Exception:  # noqa: BLE001 - no torch / broken driver: a CPU machine
        pass
    return info


def machine_label(info: dict[str, Any]) -> str:
    gpu = info.get("gpu") or "no GPU"
    return f"{info['host']}: {info['cores']} x {info['cpu']}, {info.get('memory_gb')} GB, {gpu}"


def _capture_runs(batches: list[int], quick: bool) -> list[dict[str, Any]]:
    """`r3rdma bench capture` per decode batch size, in subprocesses (its own CUDA context)."""
    rows = []
    for batch in batches:
        cmd = [sys.executable, "-m", "r3rdma", "bench", "capture", "--batch", str(batch), "--quiet"]
        if quick:
            cmd += ["--layers", "2", "--hidden", "256", "--steps", "4", "--rounds", "2"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"bench capture --batch {batch} exited {proc.returncode}: {proc.stderr[-2000:]}")
        rows.append(json.loads(lines[-1]))
    return rows


def run_all(
    *,
    out: str | os.PathLike[str] = "bench_results",
    quick: bool = False,
    skip: tuple[str, ...] = (),
    capture: bool | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every bench not in ``skip`` (capture: ``None`` = when a GPU is present), write ``out``'s
    results.json, tables.md and PNGs; return the summary (ratios, errors per bench, seconds per bench)."""
    from r3rdma.bench import plots
    from r3rdma.bench.store_bench import run_store_bench
    from r3rdma.bench.transport_bench import run_transport_bench

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    label = machine_label(machine)
    if capture is None:
        capture = machine["gpu"] is not None
    results: dict[str, Any] = {"machine": machine, "date": datetime.date.today().isoformat(), "quick": quick}
    errors: dict[str, str] = {}
    pngs: dict[str, str] = {}
    timings: dict[str, float] = {}

    def step(name: str, fn: Callable[[], Any]) -> None:
        if name in skip:
            return
        if progress:
            print(f"bench all: {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - report it and run the rest
            errors[name] = f"{type(e).__name__}: {e}"
            if progress:
                traceback.print_exc(file=sys.stderr)
        timings[name] = round(time.perf_counter() - t0, 1)

    step("store", lambda: run_store_bench(requests=4 if quick else 96, rounds=1 if quick else 3, progress=False))
    flushes = [1 << 18, 1 << 20] if quick else [1 << 19, 2 << 20, 8 << 20, 32 << 20]
    step(
        "store_batch",
        lambda: [
            run_store_bench(requests=3 if quick else 48, rounds=1 if quick else 2, flush_bytes=f, progress=False) for f in flushes
        ],
    )
    step(
        "transport",
        lambda: run_transport_bench(
            sizes_mb=(0.0625, 0.25) if quick else (0.0625, 0.25, 1, 4, 16, 64),
            rounds=1 if quick else 3,
            iterations=1 if quick else 4,
            mb_per_round=1 if quick else 64,
            progress=False,
        ),
    )
    if capture:
        step("capture", lambda: _capture_runs([8] if quick else [16, 64, 256], quick))

    if "transport" in results:
        pngs["transport"] = plots.plot_transport(results["transport"], out_dir / "transport_vs_message_size.png", label)
    if "store_batch" in results:
        pngs["batch_overhead"] = plots.plot_batch_overhead(
            results["store_batch"], results.get("capture", []), out_dir / "overhead_vs_batch_size.png", label
        )
    results["errors"] = errors
    results["pngs"] = pngs
    results["seconds"] = timings
    tables = markdown_tables(results)
    (out_dir / "tables.md").write_text(tables)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    summary = {"bench": "all", "out": str(out_dir), "machine": label, "errors": errors, "pngs": pngs, "seconds": timings}
    for name in ("store", "transport"):
        if name in results:
            summary[f"{name}_ratio"] = results[name]["ratio"]
    if "capture" in results:
        summary["capture_overhead_pct"] = {r["batch"]: r["overhead_pct"] for r in results["capture"]}
    return summary


def _section(title: str, header: list[str], rows: list[list[Any]], note: str = "") -> list[str]:
    """A markdown section: ``title``, ``note`` (if any), then ``rows`` as a table under ``header``."""
    lines = [f"## {title}", ""] + ([note, ""] if note else []) + ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows] + [""]


def markdown_tables(results: dict[str, Any]) -> str:
    """BENCHMARKS.md-ready sections from one `bench all` run."""
    m = results["machine"]
    when = results["date"]
    out = [f"# r3rdma bench all, {when}", "", f"Machine: {machine_label(m)}.", ""]
    if "store" in results:
        s = results["store"]
        row = [f"{m['host']}, {when}", s["requests"], f"{s['bytes'] / 1e6:.0f}", s["ingest_gbps"], s["raw_zarr_gbps"], s["ratio"]]
        out += _section("Store ingest", ["machine", "requests", "MB", "ingest GB/s", "raw zarr GB/s", "ratio"], [row])
    if "store_batch" in results:
        rows = [
            [f"{r['flush_bytes'] / (1 << 20):g}", r["ingest_gbps"], r["raw_zarr_gbps"], r["ratio"]]
            for r in results["store_batch"]
        ]
        header = ["flush_bytes (MB)", "ingest GB/s", "raw zarr GB/s", "ratio"]
        out += _section("Store ingest overhead vs writer batch size", header, rows)
    if "transport" in results:
        t = results["transport"]
        rows = [
            [f"{r['bytes'] / (1 << 20):.3g}", r["requests"], r["push_gbps"], r["raw_ucxx_gbps"], r["ratio"]] for r in t["by_size"]
        ]
        header = ["message MB", "requests", "push GB/s", "raw ucxx GB/s", "ratio"]
        out += _section("Transport: push vs raw ucxx send, by message size", header, rows, f"Path: {t['path']}.")
    if "capture" in results:
        keys = ["device", "batch", "step_ms_off", "step_ms_on", "overhead_pct", "cuda_graphs"]
        header = ["device", "batch", "step ms off", "step ms on", "overhead %", "CUDA graphs"]
        out += _section(
            "Capture overhead vs decode batch size (GPU)", header, [[r.get(k) for k in keys] for r in results["capture"]]
        )
    if results.get("errors"):
        out += ["## Benches that failed", ""] + [f"- {k}: {v}" for k, v in results["errors"].items()] + [""]
    if results.get("pngs"):
        out += ["## Figures", ""] + [f"- {k}: `{v}`" for k, v in results["pngs"].items()] + [""]
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``r3rdma bench all``."""
    parser.add_argument("--out", default="bench_results", help="directory for results.json, tables.md and PNGs")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that everything runs, numbers mean nothing")
    parser.add_argument("--skip", nargs="+", default=[], choices=["store", "store_batch", "transport", "capture"])
    parser.add_argument(
        "--capture", choices=["auto", "on", "off"], default="auto", help="capture bench (default: when CUDA is available)"
    )


def main(args: argparse.Namespace) -> int:
    """``r3rdma bench all``: run, print the summary as JSON; exit status 1 if a bench failed."""
    capture = {"auto": None, "on": True, "off": False}[args.capture]
    summary = run_all(out=args.out, quick=args.quick, skip=tuple(args.skip), capture=capture)
    print(json.dumps(summary))
    return 0 if not summary["errors"] else 1
