"""`r3rdma rollout`: a torchrun worker that generates with a HF MoE model and pushes routing
to store nodes, with tensor-parallel ranks gathering each step's routing in one all-gather.

Launch with ``scripts/launch_rollout.sh`` (a torchrun wrapper). Ranks form TP groups of
``--tp-size`` consecutive ranks (default: all); requests are split across the groups (data
parallel). Inside a group every rank runs the same batch and the MoE tokens of each step are
split across the ranks as sequence-parallel MoE does; the capturer all-gathers the step's rows
once (NCCL on GPU, gloo on CPU), so every rank holds the whole slot table, and the rank that
owns a request (hash of its id mod the TP size) pushes it.

With ``--shadow-dir`` the first rank of each group also writes an independent shadow record
(plain router hooks, no capturer) for ``r3rdma check``.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import torch

__all__ = ["add_arguments", "main"]


def add_arguments(parser) -> None:
    parser.add_argument("--store-urls", default=os.environ.get("R3_STORE_URLS", ""),
                        help="store node push addresses host:port,... (default: $R3_STORE_URLS)")
    parser.add_argument("--token-file", default=os.environ.get("R3_STORE_TOKEN_FILE"),
                        help="shared secret file (default: $R3_STORE_TOKEN_FILE, else $R3_STORE_TOKEN)")
    parser.add_argument("--rollout-id", default="rollout-0")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=0, help="ranks per TP group (default: the world size)")
    parser.add_argument("--shadow-dir", default=None, help="write shadow records here (for r3rdma check)")


def main(args) -> int:
    import torch.distributed as dist

    from r3rdma.errors import ConfigError
    from r3rdma.integrations.hf_capture import attach_capturer, capturer_for_model
    from r3rdma.integrations.hf_rollout import BlockAllocator, HFRolloutDriver
    from r3rdma.cli.demo import make_requests
    from r3rdma.integrations.hf_models import build_model, tiny_qwen3_moe
    from r3rdma.write.writer import RoutingWriter
    from r3rdma.cli.shadow import ShadowRecorder
    from r3rdma.write.push_client import StoreNodesClient
    from r3rdma.transport import load_secret

    if "RANK" not in os.environ:
        raise ConfigError("r3rdma rollout runs under torchrun (scripts/launch_rollout.sh); RANK is not set")
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

    urls = [u for u in args.store_urls.split(",") if u]
    if not urls:
        raise ConfigError("no store nodes: pass --store-urls or set R3_STORE_URLS")
    started = time.perf_counter()
    config = tiny_qwen3_moe()
    model = build_model(config, seed=args.seed).to(device)
    requests = make_requests(args.requests, vocab=config.vocab_size, seed=args.seed)[dp_rank :: world // tp]
    allocator = BlockAllocator(num_blocks=args.batch_size * 8, block_size=16)
    client = StoreNodesClient(urls, secret=load_secret(args.token_file))
    with RoutingWriter(client, flush_bytes=1 << 20) as writer:
        capturer = capturer_for_model(model, num_slots=allocator.num_slots, sink=writer,
                                      rollout_id=args.rollout_id, tp_group=tp_group)
        detach = attach_capturer(model, capturer)
        shadow = ShadowRecorder(model) if args.shadow_dir and dist.get_rank(tp_group) == 0 else None
        listeners = [shadow.on_step] if shadow else []
        outputs = HFRolloutDriver(model, capturer, allocator=allocator, batch_size=args.batch_size,
                                  eos_token_id=7, seed=args.seed + dp_rank, step_listeners=listeners).run(requests)
        detach()
        capturer.close()  # on CUDA, finished requests reach the writer once their D2H copy landed
        writer.flush()
        pushed = writer.requests_committed
    client.close()
    if shadow is not None:
        os.makedirs(args.shadow_dir, exist_ok=True)
        rows = {o.request_id: shadow.rows(o.request_id, len(o.prompt) + len(o.generated) - 1) for o in outputs}
        tmp = os.path.join(args.shadow_dir, f".dp{dp_rank}.npz")
        np.savez(tmp, **rows)
        os.replace(tmp, os.path.join(args.shadow_dir, f"dp{dp_rank}.npz"))
        shadow.close()
    total = torch.tensor([pushed], device=device)
    dist.all_reduce(total)
    summary = {"rank": rank, "world": world, "tp": tp, "dp_rank": dp_rank, "requests": len(outputs),
               "pushed_by_rank": pushed, "pushed_total": int(total.item()), "backend": dist.get_backend(),
               "all_gathers": capturer.collectives, "steps": capturer.steps, "seconds": round(time.perf_counter() - started, 2)}
    os.write(1, (json.dumps(summary) + "\n").encode())  # one write: ranks share stdout
    dist.destroy_process_group()
    return 0 if int(total.item()) == args.requests else 1
