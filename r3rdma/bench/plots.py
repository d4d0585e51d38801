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
    ax2.plot(mb, [r["ratio"] for r in rows], "o-")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_xscale("log")
    ax2.set_ylim(0, max(1.1, max(r["ratio"] for r in rows) * 1.1))
    ax2.set_xlabel("message size (MB)")
    ax2.set_ylabel("push / raw")
    ax2.set_title(machine, fontsize=8)
    return _save(fig, path)


def plot_batch_overhead(store_rows: list[dict[str, Any]], capture_rows: list[dict[str, Any]], path: Path, machine: str) -> str:
    """Overhead vs batch size: store ingest vs raw zarr per writer batch size, and (GPU) the
    decode step with capture on vs off per decode batch size."""
    plt = _plt()
    panels = 2 if capture_rows else 1
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels + 1, 4), squeeze=False)
    ax = axes[0][0]
    mb = [r["flush_bytes"] / (1 << 20) for r in store_rows]
    ax.plot(mb, [r["ratio"] for r in store_rows], "o-", label="ingest / raw zarr write")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_ylim(0, max(1.1, max(r["ratio"] for r in store_rows) * 1.1))
    ax.set_xlabel("writer batch (flush_bytes, MB)")
    ax.set_ylabel("throughput ratio")
    ax.set_title(f"store ingest overhead vs batch size\n{machine}", fontsize=9)
    ax.legend()
    if capture_rows:
        ax = axes[0][1]
        batch = [r["batch"] for r in capture_rows]
        ax.plot(batch, [r["step_ms_off"] / r["step_ms_on"] for r in capture_rows], "o-", label="step time off / on")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.1)
        ax.set_xlabel("decode batch (sequences)")
        ax.set_ylabel("speed ratio (capture on)")
        ax.set_title(f"capture overhead vs batch size\n{capture_rows[0].get('device', '')}", fontsize=9)
        ax.legend()
    return _save(fig, path)
