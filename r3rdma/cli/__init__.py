"""The ``r3rdma`` command line: one module per command.

Each command module exposes ``add_arguments(parser)`` and ``main(args)``. Only the module of
the command being run is imported (its heavy imports: torch, zarr, transformers), so
``r3rdma --help`` imports none of them.

An :class:`~r3rdma.errors.R3Error` a command lets through (a bad ``--routing-replay-config``,
a model that is not a MoE model, ``rollout`` outside torchrun) ends it as ``inspect`` and
``check`` end theirs: one stderr line ``r3rdma <command>: <ErrorType>: <message>``, exit 2, no
traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from r3rdma.errors import R3Error

__all__ = ["main", "build_parser"]

# (command, subcommand or None, module, help)
COMMANDS = [
    ("demo", None, "r3rdma.cli.demo", "generate with a tiny MoE, capture, store, read back, verify bit-exactly"),
    ("rollout", None, "r3rdma.cli.rollout", "torchrun worker: generate, capture with TP all-gather, push to store nodes"),
    ("check", None, "r3rdma.cli.check", "trainer side: read a rollout from store nodes over HTTP, compare with shadow records"),
    ("verify", None, "r3rdma.cli.verify", "measure rollout/trainer routing mismatch with and without replay"),
    ("inspect", None, "r3rdma.cli.inspect", "summary of a rollout (local root or store node URL) and a PNG of expert load"),
    (
        "train-tiny",
        None,
        "r3rdma.cli.train_tiny",
        "train a small Qwen3-MoE on the standard library's sources, for verify --model",
    ),
    ("delete", None, "r3rdma.cli.delete", "retention: delete rollouts (by id or by age) on every store node"),
    (
        "rl-loop",
        None,
        "r3rdma.cli.rl_loop",
        "GRPO on one long-lived vLLM engine: weights pushed every step, routing replayed, checked and measured",
    ),
    (
        "bench",
        "reliability",
        "r3rdma.bench.reliability_bench",
        "crash cycles, fuzzing, auth, disk full and load: reliability figures",
    ),
    ("bench", "store", "r3rdma.bench.store_bench", "local-store ingest vs raw zarr write of the same arrays"),
    ("bench", "transport", "r3rdma.bench.transport_bench", "r3rdma push vs raw ucxx send of the same bytes"),
    (
        "bench",
        "capture",
        "r3rdma.bench.capture_bench",
        "MoE decode loop with routing capture off vs on (GPU; CUDA graphs where possible)",
    ),
    ("bench", "kernels", "r3rdma.bench.kernel_bench", "custom (Triton) capture kernels vs the torch reference ops (GPU)"),
    (
        "bench",
        "vllm",
        "r3rdma.bench.vllm_bench",
        "the same vLLM workload with r3rdma's plug-in off and on: tokens/s ratio, host time per step",
    ),
    (
        "bench",
        "rlstep",
        "r3rdma.bench.rlstep_bench",
        "one RL step as deployed: engines push as requests finish, trainer ranks collect their shares; the stall",
    ),
    (
        "bench",
        "trainer-layout",
        "r3rdma.bench.trainer_layout_bench",
        "a stored step read by the ranks of a DP x TP x PP x CP trainer: bytes fetched vs replayed per rank",
    ),
    (
        "bench",
        "groups",
        "r3rdma.bench.group_bench",
        "GRPO groups through store nodes: prompt rows stored once (shared prefixes) vs with every sample",
    ),
    ("bench", "all", "r3rdma.bench.all_bench", "every bench; writes BENCHMARKS.md-ready tables and PNG plots"),
]


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the command named in ``argv`` (if any) gets its module's arguments."""
    argv = sys.argv[1:] if argv is None else argv
    words = [a for a in argv if not a.startswith("-")]
    parser = argparse.ArgumentParser(prog="r3rdma", description="Rollout Routing Replay store for MoE RL")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for command, subcommand, module, help_text in COMMANDS:
        if subcommand is None:
            p = sub.add_parser(command, help=help_text, description=help_text)
            chosen = words[:1] == [command]
        else:
            if command not in groups:
                group = sub.add_parser(command, help=f"{command} programs; each prints one JSON line last")
                groups[command] = group.add_subparsers(dest="subcommand", required=True, metavar="PROGRAM")
            p = groups[command].add_parser(subcommand, help=help_text, description=help_text)
            chosen = words[:2] == [command, subcommand]
        p.set_defaults(_module=module)
        if chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command named in ``argv`` (default ``sys.argv[1:]``) and return its exit status.

    An :class:`~r3rdma.errors.R3Error` becomes one stderr line and status 2; a closed stdout pipe, status 0.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(importlib.import_module(args._module).main(args) or 0)
    except R3Error as e:
        command = " ".join(w for w in (args.command, getattr(args, "subcommand", None)) if w)
        message = " ".join(str(e).splitlines())  # one line, whatever the message holds
        print(f"r3rdma {command}: {type(e).__name__}: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `r3rdma ... | head`: the reader went away; exit quietly like other CLIs (and keep
        # Python's exit-time flush of stdout from raising again).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
