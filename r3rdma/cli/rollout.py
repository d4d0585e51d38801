"""`r3rdma rollout`: a torchrun worker that generates with a HF MoE model and pushes routing
to store nodes, with tensor-parallel ranks gathering each step's routing in one all-gather.

Launch with ``scripts/launch_rollout.sh`` (a torchrun wrapper). Ranks form TP groups of
``--tp-size`` consecutive ranks (default: all); requests are split across the groups (data
parallel). Inside a group every rank runs the same batch and the MoE tokens of each step are
split across the ranks as sequence-parallel MoE does; the capturer all-gathers the step's rows
once (NCCL on GPU, gloo on CPU), so every rank holds the whole slot table, and the rank that
owns a request (hash of its id mod the TP size) pushes it.

The capture pipeline (capturer, writer, store client) is built by
:func:`~r3rdma.integrations.builders.build_capturer`, from
``--routing-replay-config`` when given, else from the flags (:func:`rollout_config`).

With ``--shadow-dir`` the first rank of each group also writes an independent shadow record
(plain router hooks, no capturer) for ``r3rdma check``.
"""

from __future__ import annotations

import json
import os
import time

__all__ = ["add_arguments", "main", "rollout_config"]

# Writer batches of the rollout worker when no --routing-replay-config is given.
ROLLOUT_FLUSH_BYTES = 1 << 20


def add_arguments(parser) -> None:
    """Add ``rollout``'s options to ``parser``: store nodes, secret, rollout id, config JSON, workload, TP size, shadow dir."""
    parser.add_argument(
        "--store-urls",
        default=None,
        help="store node push addresses host:port,... (default: $R3_STORE_URLS; beats the config's store_urls)",
    )
    parser.add_argument(
        "--token-file",
        default=None,
        help="shared secret file (default: $R3_STORE_TOKEN_FILE, else $R3_STORE_TOKEN; beats the config's store_token_file)",
    )
    parser.add_argument("--rollout-id", default=None, help="rollout id (default: rollout-0, or the config's rollout_id)")
    parser.add_argument(
        "--routing-replay-config",
        metavar="JSON",
        default=None,
        help="build the capture pipeline from this R3Config JSON (FastDeploy's keys plus r3rdma's; "
        "R3_* variables fill the keys it omits; the flags above beat it)",
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=0, help="ranks per TP group (default: the world size)")
    parser.add_argument("--shadow-dir", default=None, help="write shadow records here (for r3rdma check)")


def rollout_config(args, env=None):
    """The :class:`~r3rdma.config.R3Config` the worker builds its capturer from.

    With ``--routing-replay-config``: that JSON (``R3_*`` variables fill what it omits), then
    ``--store-urls`` / ``--token-file`` / ``--rollout-id`` where given. Without it: store nodes
    at ``--store-urls`` (else ``$R3_STORE_URLS``), the secret from ``--token-file`` (else
    ``$R3_STORE_TOKEN_FILE``, else ``$R3_STORE_TOKEN``), 1 MiB writer batches, staged transfers.
    """
    import dataclasses

    from r3rdma.config import R3Config
    from r3rdma.errors import ConfigError

    env = os.environ if env is None else env
    flags = {}
    if args.store_urls is not None:
        flags["store_urls"] = args.store_urls
    if args.token_file is not None:
        flags["store_token_file"] = args.token_file
    if args.rollout_id is not None:
        flags["rollout_id"] = args.rollout_id
    if args.routing_replay_config is not None:
        config = R3Config.from_json(args.routing_replay_config, env=env)
        return dataclasses.replace(config, **flags) if flags else config
    urls = flags.get("store_urls", env.get("R3_STORE_URLS", ""))
    if not urls:
        raise ConfigError("no store nodes: pass --store-urls, set R3_STORE_URLS, or pass --routing-replay-config")
    # The worker's own defaults; other R3_* variables (R3_STORE_REPLICAS, ...) fill the rest.
    return R3Config.from_env(
        env,
        routing_store_type="store_nodes",
        store_urls=urls,
        store_token_file=flags.get("store_token_file", env.get("R3_STORE_TOKEN_FILE")),
        rollout_id=flags.get("rollout_id", "rollout-0"),
        flush_bytes=ROLLOUT_FLUSH_BYTES,
        slot_table_device="auto",
        transfer_mode="staged",
    )


def main(args) -> int:
    """Run this rank's share of the rollout and print its summary as one JSON line.

    Exit 0 when every request was pushed (or capture is disabled), 1 otherwise; :class:`ConfigError` outside torchrun.
    """
    import numpy as np
    import torch
    import torch.distributed as dist

    from r3rdma.cli.demo import make_requests
    from r3rdma.cli.shadow import ShadowRecorder
    from r3rdma.errors import ConfigError
    from r3rdma.integrations.builders import build_capturer
    from r3rdma.integrations.hf_capture import attach_capturer
    from r3rdma.integrations.hf_models import build_model, tiny_qwen3_moe
    from r3rdma.integrations.hf_rollout import BlockAllocator, HFRolloutDriver
    from r3rdma.write.writer import RoutingWriter

    if "RANK" not in os.environ:
        raise ConfigError(
            "r3rdma rollout is a torchrun worker and RANK is not set: launch it with "
            "scripts/launch_rollout.sh --nproc-per-node N -- [rollout flags] (a torchrun wrapper; "
            "scripts/demo.sh runs it with 2 store nodes)"
        )
    r3_config = rollout_config(args)  # before any process group: a bad config fails fast on every rank
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = args.tp_size or world
    if world % tp:
        raise ConfigError(f"--tp-size {tp} must divide the world size {world}")
    groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(world // tp)]
    dp_rank, tp_group = rank // tp, groups[rank // tp]
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    started = time.perf_counter()
    config = tiny_qwen3_moe()
    # transformers wraps PreTrainedModel.to in functools.wraps, which mypy does not bind as a method.
    model = build_model(config, seed=args.seed).to(device)  # type: ignore[arg-type]
    requests = make_requests(args.requests, vocab=config.vocab_size, seed=args.seed)[dp_rank :: world // tp]
    allocator = BlockAllocator(num_blocks=args.batch_size * 8, block_size=16)
    # None when the config disables capture: the generation below runs the same way.
    capturer = build_capturer(r3_config, model=model, num_slots=allocator.num_slots, tp_group=tp_group)
    shadow = ShadowRecorder(model) if args.shadow_dir and dist.get_rank(tp_group) == 0 else None
    listeners = [shadow.on_step] if shadow else []
    detach = attach_capturer(model, capturer) if capturer is not None else (lambda: None)
    try:
        outputs = HFRolloutDriver(
            model,
            capturer,
            allocator=allocator,
            batch_size=args.batch_size,
            eos_token_id=7,
            seed=args.seed + dp_rank,
            step_listeners=listeners,
        ).run(requests)
    finally:
        detach()
        if capturer is not None:
            # Hands every finished request to the writer (on CUDA once its D2H copy landed),
            # commits it to the store nodes, and closes the writer and its client.
            capturer.close()
    pushed = 0
    if capturer is not None:
        writer = capturer.sink
        if not isinstance(writer, RoutingWriter):  # build_capturer's sink is always the writer it built
            raise TypeError(f"build_capturer's capturer should write through a RoutingWriter, got {type(writer).__name__}")
        pushed = writer.requests_committed
    if shadow is not None:
        os.makedirs(args.shadow_dir, exist_ok=True)
        rows = {o.request_id: shadow.rows(o.request_id, len(o.prompt) + len(o.generated) - 1) for o in outputs}
        tmp = os.path.join(args.shadow_dir, f".dp{dp_rank}.npz")
        np.savez(tmp, **rows)  # type: ignore[arg-type]  # numpy's stub types **kwds as if they could fill allow_pickle
        os.replace(tmp, os.path.join(args.shadow_dir, f"dp{dp_rank}.npz"))
        shadow.close()
    total = torch.tensor([pushed], device=device)
    dist.all_reduce(total)
    summary = {
        "rank": rank,
        "world": world,
        "tp": tp,
        "dp_rank": dp_rank,
        "requests": len(outputs),
        "capture": capturer is not None,
        "pushed_by_rank": pushed,
        "pushed_total": int(total.item()),
        "backend": dist.get_backend(),
        "all_gathers": capturer.collectives if capturer is not None else 0,
        "steps": capturer.steps if capturer is not None else 0,
        "seconds": round(time.perf_counter() - started, 2),
    }
    os.write(1, (json.dumps(summary) + "\n").encode())  # one write: ranks share stdout
    dist.destroy_process_group()
    if capturer is None:
        return 0  # capture disabled by the config: nothing to push
    return 0 if int(total.item()) == args.requests else 1
