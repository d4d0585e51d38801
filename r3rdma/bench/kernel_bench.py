"""`r3rdma bench kernels`: the custom (Triton) capture kernels against the torch reference.

For each operation and size, two times per implementation, same inputs, same run:

- ``gpu_us``: device time per call, from a CUDA graph of ``--calls`` back-to-back calls,
  replayed and timed with CUDA events (launch overhead removed: what a graphed decode step pays);
- ``eager_us``: wall time per call launched eagerly from Python, ending with one synchronise
  (what an eager engine pays; small sizes are bound by the launch cost on the CPU).

A custom kernel "wins" an operation when it is faster in the regime that operation runs in:
``record_layer`` runs inside the forward (graphed in real engines: ``gpu_us``),
``write_step_rows`` once per step, eagerly (``eager_us``), ``gather_rows`` on the finish path
(bandwidth: ``gpu_us`` at the large sizes). The last line is JSON.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

from r3rdma.bench.common import run_from_args

__all__ = ["run_kernel_bench", "add_arguments", "main"]


def _time_graph(fn, calls: int, repeats: int) -> float:
    import torch

    fn()  # compile / warm up
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def _time_eager(fn, calls: int, repeats: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(samples)


def _cases(layers: int, top_k: int, num_slots: int):
    """(op, label, size, make) where make() returns {impl_name: fn} over shared inputs."""
    import torch

    from r3rdma.kernels import reference, triton_kernels

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    table = torch.randint(0, 128, (num_slots, layers, top_k), device=dev, generator=gen).to(torch.uint8)
    cases: list[tuple[str, str, int, Callable[[], dict[str, Callable[[], object]]]]] = []

    def both(op: str, *args) -> dict[str, Callable[[], object]]:
        """The reference's and the Triton kernel's ``op``, each a call over the same ``args``."""
        return {
            name: functools.partial(getattr(impl, op), *args) for name, impl in (("torch", reference), ("triton", triton_kernels))
        }

    for T in (64, 256, 4096):
        for rows_mode in ("dense", "router_rows", "router_rows+expert_map"):

            def make_record_layer(T=T, rows_mode=rows_mode):
                pad = T + T // 4
                ids = torch.randint(0, 128, (pad, top_k), device=dev, generator=gen)
                rows = torch.randperm(pad, device=dev, generator=gen)[:T] if rows_mode != "dense" else None
                src = ids if rows is not None else ids[:T]
                emap = torch.randperm(128, device=dev, generator=gen) if "expert_map" in rows_mode else None
                buf = torch.zeros((T, layers, top_k), dtype=torch.uint8, device=dev)
                return both("record_layer", buf, 3, src, rows, emap)

            cases.append(("record_layer", f"T={T} {rows_mode}", T, make_record_layer))
    for T in (64, 1024, 8192):
        for mode in ("all", "accepted"):

            def make_write_step_rows(T=T, mode=mode):
                rows = torch.randint(0, 128, (T, layers, top_k), device=dev, generator=gen).to(torch.uint8)
                idx = torch.randperm(T, device=dev, generator=gen)[: T // 2].sort().values if mode == "accepted" else None
                n = T if idx is None else idx.numel()
                slots = torch.randperm(num_slots, device=dev, generator=gen)[:n]
                return both("write_step_rows", table, slots, rows, idx)

            cases.append(("write_step_rows", f"T={T} {mode}", T, make_write_step_rows))
    for T in (1024, 8192, 32768):

        def make_gather_rows(T=T):
            slots = torch.randperm(num_slots, device=dev, generator=gen)[:T]
            out = torch.empty((T, layers, top_k), dtype=torch.uint8, device=dev)
            return both("gather_rows", table, slots, out)

        cases.append(("gather_rows", f"T={T}", T, make_gather_rows))
    return cases


def run_kernel_bench(
    *, layers: int = 48, top_k: int = 8, num_slots: int = 1 << 18, calls: int = 50, repeats: int = 20, verbose: bool = True
) -> dict:
    """Time each capture kernel, torch reference vs Triton, on the GPU (graphed) and eagerly; return
    per-case microseconds and, per operation, the geometric-mean speedup in its regime.
    Raises SystemExit without a CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("r3rdma bench kernels needs a CUDA GPU")
    rows = []
    for op, label, size, make in _cases(layers, top_k, num_slots):
        fns = make()
        row = {"op": op, "case": label, "tokens": size}
        for name, fn in fns.items():
            row[f"{name}_gpu_us"] = round(_time_graph(fn, calls, repeats), 2)
            row[f"{name}_eager_us"] = round(_time_eager(fn, calls, repeats), 2)
        row["gpu_speedup"] = round(row["torch_gpu_us"] / row["triton_gpu_us"], 2)
        row["eager_speedup"] = round(row["torch_eager_us"] / row["triton_eager_us"], 2)
        rows.append(row)
        if verbose:
            print(
                f"{op:16s} {label:34s} torch gpu {row['torch_gpu_us']:8.2f} us eager {row['torch_eager_us']:8.2f} us | "
                f"triton gpu {row['triton_gpu_us']:8.2f} us eager {row['triton_eager_us']:8.2f} us | "
                f"x{row['gpu_speedup']:.2f} gpu x{row['eager_speedup']:.2f} eager",
                flush=True,
            )
    # The regime each op runs in decides (see the module docstring).
    regime = {"record_layer": "gpu", "write_step_rows": "eager", "gather_rows": "gpu"}
    summary = {}
    for op, key in regime.items():
        ratios = [r[f"{key}_speedup"] for r in rows if r["op"] == op]
        geo = statistics.geometric_mean(ratios)
        summary[op] = {
            "regime": key,
            "geomean_speedup": round(geo, 3),
            "min": min(ratios),
            "max": max(ratios),
            "custom_wins": geo > 1.05 and min(ratios) > 0.95,
        }
    return {
        "bench": "kernels",
        "device": torch.cuda.get_device_name(),
        "layers": layers,
        "top_k": top_k,
        "num_slots": num_slots,
        "summary": summary,
        "rows": rows,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``r3rdma bench kernels``: the slot table's shape, calls per timing, repeats."""
    parser.add_argument("--layers", type=int, default=48, help="MoE layers L (Qwen3-30B-A3B: 48)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--num-slots", type=int, default=1 << 18, help="slot-table rows")
    parser.add_argument("--calls", type=int, default=50, help="calls per timed graph / eager loop")
    parser.add_argument("--repeats", type=int, default=20)


def main(args: argparse.Namespace) -> int:
    """``r3rdma bench kernels``: run, print the result as the last JSON line."""
    return run_from_args(run_kernel_bench, args)
