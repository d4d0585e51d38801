"""`r3rdma inspect`: what a rollout holds, and how its tokens spread over experts.

``r3rdma inspect SOURCE ROLLOUT [--read-token-file F | --token-file SECRET] [--png load.png]``:
SOURCE is a local store root or a store node's ``http://host:port`` (several, comma-separated,
for a rollout spread over nodes; a node that cannot be reached is named once on stderr and the
rollout is read from the others, its replicas). Over HTTP it sends the read token (from ``--read-token-file``,
or derived here from the push secret file ``--token-file``; never the secret itself). Prints a summary (requests, tokens, stored bytes against raw uint8 / int32 /
base64, layers, top-k, experts, per-layer expert load balance) and writes a heatmap of expert
load per layer. The last line is JSON. A read that fails (token refused, node unreachable,
damaged data) prints one line naming the error type to stderr and exits 2. ``--png`` needs
matplotlib (``pip install "r3rdma[plot]"``): without it the summary and its JSON line are
printed, then one line saying so, exit 2. Output into a closed pipe (``| head``) ends quietly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from r3rdma.read.reader import RoutingReader

__all__ = ["RolloutSummary", "inspect_rollout", "plot_expert_load", "stored_bytes_reachable", "add_arguments", "main"]


@dataclass(frozen=True, slots=True)
class RolloutSummary:
    """What :func:`inspect_rollout` found: request and token counts, geometry, stored bytes
    against raw encodings, and per-layer expert load balance."""

    rollout_id: str
    sources: tuple[str, ...]
    requests: int
    tokens: int
    rows_min: int
    rows_median: float
    rows_max: int
    num_layers: int
    layer_map: tuple[int, ...]
    top_k: int
    num_experts: int
    dtype: str
    stored_bytes: int
    bytes_per_token: float
    raw_uint8_bytes: int
    raw_int32_bytes: int
    base64_int32_bytes: int
    max_load_over_mean: tuple[float, ...]  # per MoE layer: busiest expert's tokens / the mean
    unused_experts: tuple[int, ...]  # per MoE layer
    # Sources that could not be reached (name -> why); the rollout was read from the others.
    unreachable: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Every field as a JSON-ready dict (tuples become lists when dumped)."""
        return asdict(self)


def inspect_rollout(
    sources: str | Sequence[str],
    rollout_id: str,
    *,
    token: str | None = None,
    batch_requests: int = 256,
    progress: bool | None = None,
) -> tuple[RolloutSummary, np.ndarray]:
    """Summary of ``rollout_id`` and its expert load ``[num_layers, num_experts]`` (token counts)."""
    from tqdm.auto import tqdm

    from r3rdma.read.reader import RoutingReader

    with RoutingReader(sources, token=token) as reader:
        info = reader.info(rollout_id)
        unreachable = dict(reader.last_skipped_nodes)
        stored = sum(stored_bytes_reachable(reader, rollout_id, token=token).values())
        names = reader.source_names
        load = np.zeros((info.num_layers, info.num_experts), dtype=np.int64)
        lengths: list[int] = []
        ids = list(info.request_ids)
        show = sys.stderr.isatty() if progress is None else progress
        with tqdm(
            total=len(ids), desc="requests", unit="req", disable=not show or len(ids) <= batch_requests, file=sys.stderr
        ) as bar:
            for first in range(0, len(ids), batch_requests):
                chunk = reader.get_numpy(rollout_id, ids[first : first + batch_requests])
                for array in chunk.values():
                    lengths.append(array.shape[0])
                    flat = array.astype(np.int64).transpose(1, 0, 2).reshape(info.num_layers, -1)  # [L, T*K]
                    for layer in range(info.num_layers):
                        load[layer] += np.bincount(flat[layer], minlength=info.num_experts)[: info.num_experts]
                bar.update(len(chunk))
    tokens = info.total_rows
    ids_per_token = info.num_layers * info.top_k
    mean = load.sum(axis=1, keepdims=True) / max(1, info.num_experts)
    summary = RolloutSummary(
        rollout_id=rollout_id,
        sources=names,
        requests=len(ids),
        tokens=tokens,
        rows_min=min(lengths, default=0),
        rows_median=float(np.median(lengths)) if lengths else 0.0,
        rows_max=max(lengths, default=0),
        num_layers=info.num_layers,
        layer_map=info.layer_map,
        top_k=info.top_k,
        num_experts=info.num_experts,
        dtype=info.dtype,
        stored_bytes=stored,
        bytes_per_token=round(stored / tokens, 2) if tokens else 0.0,
        raw_uint8_bytes=tokens * ids_per_token,
        raw_int32_bytes=tokens * ids_per_token * 4,
        base64_int32_bytes=4 * math.ceil(tokens * ids_per_token * 4 / 3),
        max_load_over_mean=tuple(round(float(m), 3) for m in (load.max(axis=1) / np.maximum(mean[:, 0], 1e-9))),
        unused_experts=tuple(int(n) for n in (load == 0).sum(axis=1)),
        unreachable=unreachable,
    )
    return summary, load


def stored_bytes_reachable(reader: RoutingReader, rollout_id: str, *, token: str | None) -> dict[str, int]:
    """Bytes each source of ``reader`` that its last index fetch reached stores for the rollout,
    by name. :meth:`RoutingReader.stored_bytes` refuses to size a rollout while a source cannot
    be reached; a rollout read from the replicas on the others is sized on those others (the
    ones in :attr:`~RoutingReader.last_skipped_nodes` are left out)."""
    from r3rdma.read.reader import RoutingReader

    skipped = reader.last_skipped_nodes
    if not skipped:
        return reader.stored_bytes(rollout_id)
    live = [name for name in reader.source_names if name not in skipped]
    with RoutingReader(live, token=token) as alive:
        return alive.stored_bytes(rollout_id)


@contextlib.contextmanager
def reader_warnings_quiet() -> Iterator[None]:
    """The reader's per-fetch warnings (a source skipped, a read failed over) off while a command
    runs: it says what was unreachable itself, once, instead of once per index fetch."""
    logger = logging.getLogger("r3rdma.read.reader")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def unreachable_lines(command: str, unreachable: dict[str, str], total: int) -> list[str]:
    """One stderr line per source that could not be reached, saying the rest were read."""
    live = total - len(unreachable)
    return [
        f"r3rdma {command}: store node {name} could not be reached; read from the other {live} (its replicas there): {why}"
        for name, why in unreachable.items()
    ]


def plot_expert_load(
    load: np.ndarray, path: str | os.PathLike[str], *, title: str = "", layer_map: Sequence[int] | None = None
) -> None:
    """Heatmap of the share of each layer's routed tokens that went to each expert.

    Needs matplotlib, the ``plot`` extra: :class:`ConfigError` naming it when absent.
    """
    _require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    share = load / np.maximum(load.sum(axis=1, keepdims=True), 1)
    layers, experts = load.shape
    fig, ax = plt.subplots(figsize=(min(16, 3 + experts * 0.08), min(12, 2 + layers * 0.25)))
    image = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("decoder layer")
    labels = list(layer_map) if layer_map is not None else list(range(layers))
    step = max(1, layers // 24)
    ax.set_yticks(range(0, layers, step), [str(labels[i]) for i in range(0, layers, step)])
    ax.set_title(title or "expert load per layer")
    fig.colorbar(image, ax=ax, label="share of the layer's routed tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


PLOT_HINT = 'pip install "r3rdma[plot]"'


def _require_matplotlib() -> None:
    """Raise :class:`ConfigError` naming the ``plot`` extra when matplotlib cannot be imported."""
    from r3rdma.errors import ConfigError

    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"--png needs matplotlib, which is not installed: {PLOT_HINT}") from e


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def add_arguments(parser) -> None:
    """Add ``inspect``'s arguments to ``parser``: source, rollout id, read token, ``--png`` and its title."""
    from r3rdma.cli.credentials import add_read_token_arguments

    parser.add_argument("source", help="store root directory or store node URL http://host:port (comma-separated for several)")
    parser.add_argument("rollout", help="rollout id")
    add_read_token_arguments(parser)
    parser.add_argument("--png", default=None, help="write a heatmap of expert load per layer to this PNG file")
    parser.add_argument("--title", default=None, help="heatmap title (default: the rollout id and token count)")


def main(args) -> int:
    """Print the rollout's summary (last line JSON), write the heatmap if asked; 2 when the read fails."""
    try:
        code = _main(args)
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        # `r3rdma inspect ... | head`: the reader left; end quietly, as other CLIs do. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(args) -> int:
    from r3rdma.cli.credentials import read_token
    from r3rdma.errors import R3Error

    try:
        remote = "://" in args.source  # a local root needs no token: the environment's is not read
        token = read_token(args.read_token_file, args.token_file) if remote or args.read_token_file or args.token_file else None
        with reader_warnings_quiet():
            summary, load = inspect_rollout(args.source, args.rollout, token=token)
    except R3Error as e:
        print(f"r3rdma inspect: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    for line in unreachable_lines("inspect", summary.unreachable, len(summary.sources)):
        print(line, file=sys.stderr)
    s = summary
    live = [name for name in s.sources if name not in s.unreachable]
    down = f" ({len(s.unreachable)} of {len(s.sources)} could not be reached)" if s.unreachable else ""
    print(f"rollout {s.rollout_id} on {', '.join(live)}{down}")
    print(f"  requests:  {s.requests}  (rows per request min {s.rows_min}, median {s.rows_median:g}, max {s.rows_max})")
    print(f"  tokens:    {s.tokens}")
    print(f"  geometry:  {s.num_layers} MoE layers {list(s.layer_map)}, top-{s.top_k} of {s.num_experts} experts, {s.dtype}")
    print(
        f"  stored:    {_human(s.stored_bytes)} ({s.bytes_per_token} B/token); raw uint8 {_human(s.raw_uint8_bytes)}, "
        f"int32 {_human(s.raw_int32_bytes)}, base64 int32 {_human(s.base64_int32_bytes)}"
    )
    if s.num_layers:
        worst = int(np.argmax(s.max_load_over_mean))
        print(
            f"  balance:   busiest expert / mean load: median {np.median(s.max_load_over_mean):.2f}, "
            f"worst {s.max_load_over_mean[worst]:.2f} (layer {s.layer_map[worst]}); "
            f"unused experts: {sum(s.unused_experts)} over all layers"
        )
    result = s.to_json()
    if args.png:
        try:
            _require_matplotlib()
        except R3Error as e:  # the summary is worth having without the picture: print it, then fail
            print(json.dumps(result), flush=True)
            print(f"r3rdma inspect: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        title = getattr(args, "title", None) or f"expert load, rollout {s.rollout_id} ({s.tokens} tokens)"
        plot_expert_load(load, args.png, title=title, layer_map=s.layer_map)
        print(f"  heatmap:   {args.png}")
        result["png"] = args.png
    print(json.dumps(result))
    return 0
