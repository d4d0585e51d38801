"""`r3rdma demo`: generate with a tiny Qwen3-MoE, capture, store, read back, check bit-exactly.

Without ``--root`` (or a config naming its root) the store lives in a new temporary directory
``$TMPDIR/r3rdma-demo-*``, removed when the command ends unless ``--keep`` (the output says
which, and where).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from r3rdma.config import R3Config
from r3rdma.errors import ConfigError

if TYPE_CHECKING:
    from r3rdma.integrations.hf_rollout import RolloutRequest

__all__ = ["DemoResult", "run_demo", "make_requests", "demo_config"]

# The demo's own writer setting: small batches, so a dozen requests make several commits.
DEMO_FLUSH_BYTES = 1 << 16


@dataclass(frozen=True, slots=True)
class DemoResult:
    """What one demo run did: requests and routing rows captured, bytes stored, whether the read-back was bit-exact."""

    requests: int
    tokens: int
    stored_bytes: int
    raw_int32_bytes: int
    roundtrip_exact: bool
    mismatched: tuple[str, ...]
    root: str
    seconds: float

    def summary(self) -> dict:
        """The result as the JSON-ready dict the command prints last (``mismatched`` left out, seconds rounded to ms)."""
        return {
            "requests": self.requests,
            "tokens": self.tokens,
            "stored_bytes": self.stored_bytes,
            "raw_int32_bytes": self.raw_int32_bytes,
            "roundtrip_exact": self.roundtrip_exact,
            "root": self.root,
            "seconds": round(self.seconds, 3),
        }


def make_requests(
    n: int, *, vocab: int, seed: int, min_prompt: int = 3, max_prompt: int = 48, min_new: int = 2, max_new: int = 24
) -> list[RolloutRequest]:
    """``n`` requests ``req-0000``... with random prompts of token ids in ``[1, vocab)`` and random lengths, from ``seed``."""
    import numpy as np

    from r3rdma.integrations.hf_rollout import RolloutRequest

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(min_prompt, max_prompt + 1))
        prompt = tuple(int(t) for t in rng.integers(1, vocab, size=length))
        out.append(RolloutRequest(f"req-{i:04d}", prompt, int(rng.integers(min_new, max_new + 1))))
    return out


def demo_config(root: str, rollout_id: str = "demo-rollout-0") -> R3Config:
    """The pipeline the demo builds without ``--routing-replay-config``: a local store at
    ``root``, small writer batches, the slot table on the model's device, staged transfers."""
    return R3Config(
        routing_store_type="local",
        local_store_dir=root,
        rollout_id=rollout_id,
        flush_bytes=DEMO_FLUSH_BYTES,
        slot_table_device="auto",
        transfer_mode="staged",
    )


def run_demo(
    *,
    root: str | None = None,
    num_requests: int = 12,
    batch_size: int = 5,
    seed: int = 0,
    rollout_id: str = "demo-rollout-0",
    config: R3Config | None = None,
) -> DemoResult:
    """Generate, capture through ``build_capturer(config, ...)``, store, read back, compare with shadow hooks.

    ``config``: the pipeline to build (a local store: the demo reads its root back); None:
    :func:`demo_config` over ``root`` (a new temporary directory when None) and ``rollout_id``.
    With ``config`` the root and the rollout id are the config's.
    """
    import numpy as np

    from r3rdma.cli.shadow import ShadowRecorder
    from r3rdma.integrations.builders import build_capturer
    from r3rdma.integrations.hf_capture import attach_capturer
    from r3rdma.integrations.hf_models import build_model, tiny_qwen3_moe
    from r3rdma.integrations.hf_rollout import BlockAllocator, HFRolloutDriver
    from r3rdma.read.reader import RoutingReader

    started = time.perf_counter()
    if config is None:
        config = demo_config(root or tempfile.mkdtemp(prefix="r3rdma-demo-"), rollout_id)
    elif root is not None:
        raise ConfigError(
            f"run_demo takes root or config, not both (root={root!r}, config's local_store_dir={config.local_store_dir!r})"
        )
    if config.routing_store_type != "local":
        raise ConfigError(
            "r3rdma demo reads its rollout back from a local root: expected routing_store_type 'local', "
            f"got {config.routing_store_type!r} (r3rdma rollout pushes to store nodes)"
        )
    root, rollout_id = config.local_store_dir, config.rollout_id
    model_config = tiny_qwen3_moe()
    model = build_model(model_config, seed=seed)
    requests = make_requests(num_requests, vocab=model_config.vocab_size, seed=seed)
    # Few blocks, so later waves reuse slots freed by earlier ones, as in a real KV cache.
    allocator = BlockAllocator(num_blocks=batch_size * 6, block_size=16)
    capturer = build_capturer(config, model=model, num_slots=allocator.num_slots)
    if capturer is None:  # build_capturer's answer to enable_routing_replay false
        raise ConfigError("r3rdma demo checks a capture round trip: expected enable_routing_replay true, got false")
    # Leaving the block closes the capturer: every request is durable and the root's lock released.
    with capturer:
        detach = attach_capturer(model, capturer)
        shadow = ShadowRecorder(model)
        try:
            driver = HFRolloutDriver(
                model,
                capturer,
                allocator=allocator,
                batch_size=batch_size,
                eos_token_id=7,
                seed=seed,
                step_listeners=[shadow.on_step],
            )
            outputs = driver.run(requests)
        finally:
            detach()
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
    stored_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(rollout_dir) for f in files)
    info = reader.info(rollout_id)
    return DemoResult(
        requests=len(outputs),
        tokens=tokens,
        stored_bytes=stored_bytes,
        raw_int32_bytes=tokens * info.num_layers * info.top_k * 4,
        roundtrip_exact=not mismatched and len(stored) == len(outputs),
        mismatched=tuple(mismatched),
        root=str(root),
        seconds=time.perf_counter() - started,
    )


def add_arguments(parser) -> None:
    parser.add_argument(
        "--root",
        default=None,
        help="store root (default: a new temporary directory; with --routing-replay-config, "
        "the config's local_store_dir unless given)",
    )
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--routing-replay-config",
        metavar="JSON",
        default=None,
        help="build the capture pipeline from this R3Config JSON (FastDeploy's keys plus r3rdma's; "
        "R3_* variables fill the keys it omits); routing_store_type must be 'local'",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the temporary store root the demo makes without --root (default: removed at the end)",
    )


def _refuse_other_stores(config_json: str) -> None:
    """:class:`ConfigError` when the config names a store other than a local root, before the
    config is built: its own validation would otherwise ask for what that store needs (store
    node URLs), which the demo would refuse anyway."""
    try:
        given = json.loads(config_json)
    except ValueError:
        return  # R3Config.from_json says what is wrong with it
    if not isinstance(given, dict):
        return
    store = given.get("routing_store_type", os.environ.get("R3_ROUTING_STORE_TYPE") or "local")
    if store != "local":
        raise ConfigError(
            "r3rdma demo reads its rollout back from a local root: expected routing_store_type "
            f"'local', got {store!r} (r3rdma rollout, scripts/demo.sh, pushes to store nodes)"
        )


def main(args) -> int:
    config = None
    root = args.root
    if args.routing_replay_config is not None:
        _refuse_other_stores(args.routing_replay_config)
        config = R3Config.from_json(args.routing_replay_config)
        if root is not None:  # the flag is an argument too: it beats the JSON's local_store_dir
            config = dataclasses.replace(config, local_store_dir=root)
            root = None
    made = None  # the temporary root this command made (only that one is ever removed)
    if root is None and config is None:
        made = root = tempfile.mkdtemp(prefix="r3rdma-demo-")
    keep = bool(getattr(args, "keep", False))
    try:
        result = run_demo(root=root, num_requests=args.requests, batch_size=args.batch_size, seed=args.seed, config=config)
    finally:
        if made is not None and not keep:
            shutil.rmtree(made, ignore_errors=True)
    if made is None:
        where = result.root
    elif keep:
        where = f"{result.root} (temporary, kept: --keep; remove it when done)"
    else:
        where = f"{result.root} (temporary, removed; --keep keeps it)"
    print(f"r3rdma demo: tiny Qwen3-MoE, {result.requests} requests, {result.tokens} routing rows")
    print(f"  store root:   {where}")
    print(f"  stored bytes: {result.stored_bytes} on disk (int32 raw would be {result.raw_int32_bytes})")
    print(
        f"  round trip:   {'bit-exact for every request' if result.roundtrip_exact else 'MISMATCH: ' + ', '.join(result.mismatched)}"
    )
    print(f"  time:         {result.seconds:.2f} s")
    print(json.dumps({**result.summary(), "root_kept": made is None or keep}))
    return 0 if result.roundtrip_exact else 1
