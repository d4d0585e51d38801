"""Configuration of routing capture and storage.

Precedence for every field: explicit argument, then ``R3_<FIELD>`` environment variable, then
the default. The JSON form accepts FastDeploy's ``--routing-replay-config`` keys
(``enable_routing_replay``, ``routing_store_type``, ``local_store_dir``, ``only_last_turn``)
so an existing launch line carries over; unknown keys are refused, not ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from r3rdma.errors import ConfigError

__all__ = ["R3Config"]

_STORE_TYPES = ("local", "store_nodes")
_DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True, slots=True, kw_only=True)
class R3Config:
    """Routing capture and storage settings.

    Attributes:
        enable_routing_replay: capture routing during rollouts (FastDeploy key).
        routing_store_type: ``"local"`` writes Zarr under ``local_store_dir`` in this process;
            ``"store_nodes"`` pushes to the store nodes in ``store_urls`` (FastDeploy key;
            its ``"rdma"`` value is accepted as an alias of ``"store_nodes"``).
        local_store_dir: root directory of the local store (FastDeploy key).
        only_last_turn: in multi-turn rollouts, store only the rows of the last turn
            (FastDeploy key).
        rollout_id: default rollout id of finished requests when the engine gives none.
        store_urls: store node addresses (``host:ucx_port``) for ``store_nodes``.
        slot_table_device: where the slot table lives: ``auto`` (CUDA when available), ``cpu``
            or ``cuda``.
        pin_host_table: on CUDA, keep the slot table in pinned host memory instead of HBM.
        flush_bytes: the writer commits a batch once this many bytes of finished requests
            are queued (MB-sized batches keep per-commit costs small).
        flush_interval_s: ... or once the oldest queued request waited this long.
        max_inflight_bytes: finished requests queued but not yet durable, in bytes; a
            finishing request waits (backpressure) rather than grow memory past this.
        zstd_level: compression level of the Zarr chunks (0 disables compression).
        chunk_rows: token rows per Zarr chunk (the unit of a range read).
    """

    enable_routing_replay: bool = True
    routing_store_type: str = "local"
    local_store_dir: str = "./r3rdma_data"
    only_last_turn: bool = False
    rollout_id: str = "default"
    store_urls: tuple[str, ...] = ()
    slot_table_device: str = "auto"
    pin_host_table: bool = False
    flush_bytes: int = 8 << 20
    flush_interval_s: float = 0.05
    max_inflight_bytes: int = 1 << 30
    zstd_level: int = 3
    chunk_rows: int = 1024

    def __post_init__(self) -> None:
        store_type = "store_nodes" if self.routing_store_type == "rdma" else self.routing_store_type
        object.__setattr__(self, "routing_store_type", store_type)
        if store_type not in _STORE_TYPES:
            raise ConfigError(f"routing_store_type must be one of {_STORE_TYPES} (or 'rdma'), got {self.routing_store_type!r}")
        if self.slot_table_device not in _DEVICES:
            raise ConfigError(f"slot_table_device must be one of {_DEVICES}, got {self.slot_table_device!r}")
        if store_type == "store_nodes" and not self.store_urls:
            raise ConfigError("routing_store_type 'store_nodes' needs store_urls (host:port, ...), got none")
        if isinstance(self.store_urls, str):
            object.__setattr__(self, "store_urls", tuple(u for u in self.store_urls.split(",") if u))
        for name in ("flush_bytes", "max_inflight_bytes", "chunk_rows"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.flush_bytes > self.max_inflight_bytes:
            raise ConfigError(
                f"flush_bytes ({self.flush_bytes}) must not exceed max_inflight_bytes ({self.max_inflight_bytes})"
            )
        if self.flush_interval_s < 0:
            raise ConfigError(f"flush_interval_s must be >= 0, got {self.flush_interval_s}")
        if not 0 <= self.zstd_level <= 22:
            raise ConfigError(f"zstd_level must be in 0..22, got {self.zstd_level}")
        from r3rdma.ids import validate_id

        validate_id(self.rollout_id, "rollout_id")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "R3Config":
        """Build a config: ``overrides`` first, then ``R3_<FIELD>`` variables, then defaults."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in overrides:
                values[f.name] = overrides[f.name]
            elif (raw := env.get("R3_" + f.name.upper())) is not None:
                values[f.name] = _parse(f, raw)
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown R3Config fields: {sorted(unknown)}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> "R3Config":
        """Parse FastDeploy-style JSON (``--routing-replay-config``) plus r3rdma's own keys."""
        data = json.loads(text) if isinstance(text, str) else dict(text)
        if not isinstance(data, dict):
            raise ConfigError(f"routing replay config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown routing replay config keys {sorted(unknown)}; known: {sorted(known)}")
        if "store_urls" in data:
            data["store_urls"] = tuple(data["store_urls"])
        return cls.from_env(**data)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def _parse(f: dataclasses.Field, raw: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind == "bool":
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind.startswith("tuple"):
            return tuple(u.strip() for u in raw.split(",") if u.strip())
        return raw
    except ValueError as e:
        raise ConfigError(f"R3_{f.name.upper()}={raw!r} is not a valid {kind}") from e
