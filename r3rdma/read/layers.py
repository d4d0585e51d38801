"""A read's layer selection: decoder layer ids, as a trainer names them, to stored positions.

A rollout stores its MoE layers only (``layer_map[l]``: the decoder layer of stored layer
``l``). A pipeline stage names the decoder layers it replays; a read of them fetches only the
inner chunks holding them (format 3 stores hold a group of layers per chunk).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from r3rdma.errors import ConfigError, ShapeMismatchError

__all__ = ["layer_list", "layer_selection"]


def layer_list(layers: Iterable[int] | None) -> list[int] | None:
    """``layers`` (a sequence or a range) as a list of ints, checked for type and repeats;
    None: every layer."""
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise ConfigError(f"layers must be decoder layer ids (a sequence or a range of ints), got {layers!r}")
    out = list(layers)
    bad = [x for x in out if isinstance(x, bool) or not isinstance(x, (int, np.integer))]
    if bad:
        raise ConfigError(f"layers must be decoder layer ids (ints), got {bad[:5]!r}")
    out = [int(x) for x in out]
    if not out:
        raise ConfigError("layers selects no layer; pass None for every layer")
    if len(set(out)) != len(out):
        raise ConfigError(f"layers repeat: {sorted(x for x in set(out) if out.count(x) > 1)[:5]}")
    return out


def layer_selection(
    rollout_id: str, geometry: dict[str, Any], layers: Iterable[int] | None
) -> tuple[np.ndarray | None, dict[str, Any]]:
    """The stored (MoE) layer positions of ``layers`` (decoder layer ids) and the geometry of
    what a read of them returns; ``(None, geometry)`` for every layer in stored order."""
    chosen = layer_list(layers)
    layer_map = list(geometry["layer_map"])
    if chosen is None or chosen == layer_map:
        return None, geometry
    position = {layer: i for i, layer in enumerate(layer_map)}
    missing = [layer for layer in chosen if layer not in position]
    if missing:
        raise ShapeMismatchError(
            f"rollout {rollout_id!r} has no MoE layer {', '.join(map(str, missing[:8]))}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            + f" (asked for decoder layers {_span(chosen)}; the rollout stores {_span(layer_map)})"
        )
    positions = np.fromiter((position[layer] for layer in chosen), dtype=np.intp, count=len(chosen))
    return positions, {**geometry, "num_layers": len(chosen), "layer_map": chosen}


def _span(layers: list[int]) -> str:
    """Layer ids, short: ``0..47`` when consecutive, else the list (the first 16)."""
    if layers and layers == list(range(layers[0], layers[0] + len(layers))):
        return f"{layers[0]}..{layers[-1]}" if len(layers) > 1 else str(layers[0])
    return str(layers[:16])[:-1] + (f", ... ({len(layers)} layers)]" if len(layers) > 16 else "]")
