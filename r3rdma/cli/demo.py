"""`r3rdma demo`: generate with a tiny Qwen3-MoE, capture, store, read back, check bit-exactly."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from r3rdma.integrations.hf_capture import attach_capturer, capturer_for_model
from r3rdma.integrations.hf_rollout import BlockAllocator, HFRolloutDriver, RolloutRequest
from r3rdma.store.local_store import LocalRoutingStore
from r3rdma.integrations.hf_models import build_model, tiny_qwen3_moe
from r3rdma.write.writer import RoutingWriter
from r3rdma.read.reader import RoutingReader
from r3rdma.cli.shadow import ShadowRecorder

__all__ = ["DemoResult", "run_demo", "make_requests"]


@dataclass(frozen=True, slots=True)
class DemoResult:
    requests: int
    tokens: int
    stored_bytes: int
    raw_int32_bytes: int
    roundtrip_exact: bool
    mismatched: tuple[str, ...]
    root: str
    seconds: float

    def summary(self) -> dict:
        return {
            "requests": self.requests,
            "tokens": self.tokens,
            "stored_bytes": self.stored_bytes,
            "raw_int32_bytes": self.raw_int32_bytes,
            "roundtrip_exact": self.roundtrip_exact,
            "root": self.root,
            "seconds": round(self.seconds, 3),
        }


def make_requests(n: int, *, vocab: int, seed: int, min_prompt: int = 3, max_prompt: int = 48,
                  min_new: int = 2, max_new: int = 24) -> list[RolloutRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(min_prompt, max_prompt + 1))
        prompt = tuple(int(t) for t in rng.integers(1, vocab, size=length))
        out.append(RolloutRequest(f"req-{i:04d}", prompt, int(rng.integers(min_new, max_new + 1))))
    return out


def run_demo(*, root: str | None = None, num_requests: int = 12, batch_size: int = 5, seed: int = 0,
             rollout_id: str = "demo-rollout-0") -> DemoResult:
    started = time.perf_counter()
    root = root or tempfile.mkdtemp(prefix="r3rdma-demo-")
    config = tiny_qwen3_moe()
    model = build_model(config, seed=seed)
    requests = make_requests(num_requests, vocab=config.vocab_size, seed=seed)
    # Few blocks, so later waves reuse slots freed by earlier ones, as in a real KV cache.
    allocator = BlockAllocator(num_blocks=batch_size * 6, block_size=16)
    with LocalRoutingStore(root) as store, RoutingWriter(store, flush_bytes=1 << 16) as writer:
        capturer = capturer_for_model(model, num_slots=allocator.num_slots, sink=writer, rollout_id=rollout_id)
        detach = attach_capturer(model, capturer)
        shadow = ShadowRecorder(model)
        driver = HFRolloutDriver(model, capturer, allocator=allocator, batch_size=batch_size,
                                 eos_token_id=7, seed=seed, step_listeners=[shadow.on_step])
        outputs = driver.run(requests)
        detach()
        writer.flush()
    reader = RoutingReader(root)
    stored = reader.get(rollout_id, [o.request_id for o in outputs])
    mismatched = []
    tokens = 0
    for out in outputs:
        rows = len(out.prompt) + len(out.generated) - 1
        tokens += rows
        got = stored[out.request_id].numpy().astype(np.int64)
        if got.shape[0] != rows or not np.array_equal(got, shadow.rows(out.request_id, rows)):
            mismatched.append(out.request_id)
    shadow.close()
    rollout_dir = os.path.join(root, rollout_id)
    stored_bytes = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(rollout_dir) for f in files
    )
    info = reader.info(rollout_id)
    return DemoResult(
        requests=len(outputs),
        tokens=tokens,
        stored_bytes=stored_bytes,
        raw_int32_bytes=tokens * info.num_layers * info.top_k * 4,
        roundtrip_exact=not mismatched and len(stored) == len(outputs),
        mismatched=tuple(mismatched),
        root=root,
        seconds=time.perf_counter() - started,
    )


def add_arguments(parser) -> None:
    parser.add_argument("--root", default=None, help="store root (default: a new temporary directory)")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)


def main(args) -> int:
    result = run_demo(root=args.root, num_requests=args.requests, batch_size=args.batch_size, seed=args.seed)
    print(f"r3rdma demo: tiny Qwen3-MoE, {result.requests} requests, {result.tokens} routing rows")
    print(f"  store root:   {result.root}")
    print(f"  stored bytes: {result.stored_bytes} on disk (int32 raw would be {result.raw_int32_bytes})")
    print(f"  round trip:   {'bit-exact for every request' if result.roundtrip_exact else 'MISMATCH: ' + ', '.join(result.mismatched)}")
    print(f"  time:         {result.seconds:.2f} s")
    print(json.dumps(result.summary()))
    return 0 if result.roundtrip_exact else 1
