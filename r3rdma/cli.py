"""The ``r3rdma`` command line.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``main(args)``;
modules are imported only when their subcommand runs, so ``r3rdma --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

# (command, subcommand or None, module, help)
_COMMANDS = [
    ("demo", None, "r3rdma.demo", "generate with a tiny MoE, capture, store, read back, verify bit-exactly"),
    ("rollout", None, "r3rdma.rollout", "torchrun worker: generate, capture with TP all-gather, push to store nodes"),
    ("check", None, "r3rdma.check", "trainer side: read a rollout from store nodes over HTTP, compare with shadow records"),
    ("verify", None, "r3rdma.verify", "measure rollout/trainer routing mismatch with and without replay"),
    ("delete", None, "r3rdma.retention", "retention: delete rollouts (by id or by age) on every store node"),
    ("bench", "reliability", "r3rdma.bench.reliability_bench", "crash cycles, fuzzing, auth, disk full and load: reliability figures"),
    ("bench", "store", "r3rdma.bench.store_bench", "local-store ingest vs raw zarr write of the same arrays"),
    ("bench", "transport", "r3rdma.bench.transport_bench", "r3rdma push vs raw ucxx send of the same bytes"),
    ("bench", "read", "r3rdma.bench.read_bench", "reader over HTTP vs raw HTTP GETs of the same files"),
    ("bench", "capture", "r3rdma.bench.capture_bench", "MoE decode loop with routing capture off vs on (GPU; CUDA graphs where possible)"),
    ("bench", "kernels", "r3rdma.bench.kernel_bench", "custom (Triton) capture kernels vs the torch reference ops (GPU)"),
    ("bench", "codecs", "r3rdma.bench.codec_bench", "stored bytes per token under standard codecs vs int32 / uint8 / base64"),
    ("bench", "scaling", "r3rdma.bench.scaling_bench", "N store nodes on one machine ingesting concurrently vs N x one node"),
    ("bench", "all", "r3rdma.bench.all_bench", "every bench; writes BENCHMARKS.md-ready tables and PNG plots"),
    ("inspect", None, "r3rdma.inspect", "summary of a rollout (local root or store node URL) and a PNG of expert load"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="r3rdma", description="Rollout Routing Replay store for MoE RL")
    sub = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for command, subcommand, module, help_text in _COMMANDS:
        if subcommand is None:
            p = sub.add_parser(command, help=help_text)
        else:
            if command not in groups:
                group = sub.add_parser(command, help=f"{command} programs; each prints one JSON line last")
                groups[command] = group.add_subparsers(dest="subcommand", required=True)
            p = groups[command].add_parser(subcommand, help=help_text)
        p.set_defaults(_module=module)
        _lazy_arguments(p, module)
    return parser


def _lazy_arguments(parser: argparse.ArgumentParser, module: str) -> None:
    # Arguments are declared by the module; importing it is cheap (heavy imports happen in main).
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        parser.set_defaults(_missing=module)
        return
    mod.add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", None):
        print(f"r3rdma: {args._missing} is not available in this build", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
