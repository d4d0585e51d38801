"""The ``r3rdma`` command line."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="r3rdma", description="Rollout Routing Replay store for MoE RL")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="generate with a tiny MoE, capture, store, read back, verify bit-exactly")
    demo.add_argument("--root", default=None, help="store root (default: a new temporary directory)")
    demo.add_argument("--requests", type=int, default=12)
    demo.add_argument("--batch-size", type=int, default=5)
    demo.add_argument("--seed", type=int, default=0)

    bench = sub.add_parser("bench", help="benchmarks; each prints one JSON line last")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    store = bench_sub.add_parser("store", help="local-store ingest vs raw zarr write of the same arrays")
    store.add_argument("--requests", type=int, default=96)
    store.add_argument("--rounds", type=int, default=3)
    store.add_argument("--root", default=None, help="scratch directory (default: temporary)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(args)
    if args.command == "bench" and args.bench == "store":
        from .bench.store_bench import main as store_main

        return store_main(args)
    raise AssertionError(f"unhandled command {args}")


if __name__ == "__main__":
    sys.exit(main())
