"""PNG figures of `r3rdma bench all` (matplotlib, Agg backend: no display needed).

Every figure shows r3rdma's number next to its yardstick from the same run, and the ratio.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_transport", "plot_batch_overhead"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return str(path)


def _ratio_panel(
    ax, x: list[float], ratios: list[float], label: str | None, xlabel: str, ylabel: str, title: str, base: int = 10
):
    """A panel of r3rdma's figure over its yardstick's (1.0: as fast as the yardstick) against a
    log-scaled ``x``."""
    ax.plot(x, ratios, "o-", label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=base)
    ax.set_ylim(0, max(1.1, max(ratios) * 1.1))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if label:
        ax.legend()


def plot_transport(result: dict[str, Any], path: Path, machine: str) -> str:
    """Push throughput vs message size, against raw ucxx sends of the same bytes."""
    plt = _plt()
    rows = result["by_size"]
    mb = [r["bytes"] / (1 << 20) for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax.plot(mb, [r["push_gbps"] for r in rows], "o-", label="r3rdma push (validate, CRC, ack)")
    ax.plot(mb, [r["raw_ucxx_gbps"] for r in rows], "s--", label="raw ucxx send (yardstick)")
    ax.set_xscale("log")
    ax.set_xlabel("message size (MB)")
    ax.set_ylabel("GB/s")
    ax.legend()
    ax.set_title("transport throughput vs message size")
    _ratio_panel(ax2, mb, [r["ratio"] for r in rows], None, "message size (MB)", "push / raw", machine)
    return _save(fig, path)


def plot_batch_overhead(store_rows: list[dict[str, Any]], capture_rows: list[dict[str, Any]], path: Path, machine: str) -> str:
    """Overhead vs batch size: store ingest vs raw zarr per writer batch size, and (GPU) the
    decode step with capture on vs off per decode batch size."""
    plt = _plt()
    panels = 2 if capture_rows else 1
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels + 1, 4), squeeze=False)
    mb = [r["flush_bytes"] / (1 << 20) for r in store_rows]
    ratios = [r["ratio"] for r in store_rows]
    title = f"store ingest overhead vs batch size\n{machine}"
    _ratio_panel(axes[0][0], mb, ratios, "ingest / raw zarr write", "writer batch (flush_bytes, MB)", "throughput ratio", title)
    if capture_rows:
        batch = [r["batch"] for r in capture_rows]
        speed = [r["step_ms_off"] / r["step_ms_on"] for r in capture_rows]
        title = f"capture overhead vs batch size\n{capture_rows[0].get('device', '')}"
        _ratio_panel(
            axes[0][1], batch, speed, "step time off / on", "decode batch (sequences)", "speed ratio (capture on)", title, 2
        )
    return _save(fig, path)
