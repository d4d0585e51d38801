"""Configuration of routing capture and storage, and the pipeline it builds.

Precedence for every field: explicit argument, then ``R3_<FIELD>`` environment variable, then
the default. The JSON form accepts FastDeploy's ``--routing-replay-config`` keys
(``enable_routing_replay``, ``routing_store_type``, ``local_store_dir``, ``only_last_turn``)
so an existing launch line carries over; unknown keys are refused, not ignored.

An engine builds its whole capture pipeline from one config::

    cfg = R3Config.from_json(routing_replay_config)        # or R3Config.from_env(...)
    with cfg.build_capturer(model=model, num_slots=kv_slots) as capturer:   # None when disabled
        ...

This module imports neither torch nor zarr: ``build_*`` import what they build.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from r3rdma.errors import ConfigError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("r3rdma")

DEFAULT_ROLLOUT_ID = "default"
_default_rollout_noted = False  # warned once per process (below), not per capturer
_default_rollout_lock = threading.Lock()


def _note_default_rollout(store: str) -> None:
    """Say once per process that finished requests land in rollout "default": a trainer that
    reads its own step id (e.g. "step-0042") would find nothing there."""
    global _default_rollout_noted
    with _default_rollout_lock:
        if _default_rollout_noted:
            return
        _default_rollout_noted = True
    logger.warning("r3rdma: the capturer stores finished requests under rollout id %r in %s (no rollout_id set): "
                   "readers must ask for %r; set R3Config(rollout_id=...) or R3_ROLLOUT_ID to one id per RL step",
                   DEFAULT_ROLLOUT_ID, store, DEFAULT_ROLLOUT_ID)

    from r3rdma.capture.capturer import RoutingCapturer
    from r3rdma.write.writer import RoutingWriter

__all__ = ["R3Config"]

_STORE_TYPES = ("local", "store_nodes")
_TRANSFER_MODES = ("auto", "staged", "gpu_direct")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True, slots=True, kw_only=True)
class R3Config:
    """Routing capture and storage settings; :meth:`build_capturer` turns them into a pipeline.

    What a built pipeline is: a :class:`~r3rdma.capture.capturer.RoutingCapturer` (slot table,
    step path) whose sink is a :class:`~r3rdma.write.writer.RoutingWriter` (batches finished
    requests on a background thread) over a store: a
    :class:`~r3rdma.store.local_store.LocalRoutingStore` (``local``) or a
    :class:`~r3rdma.write.push_client.StoreNodesClient` (``store_nodes``). Each field below
    names the part it configures. Settings that change what is stored but cannot be honoured by
    the chosen store type are refused (``only_last_turn``, ``zstd_level``, ``chunk_rows`` with
    ``store_nodes``: those are the store node's settings); addresses of the other store type
    (``local_store_dir`` with ``store_nodes``, ``store_urls`` / ``store_token_file`` with
    ``local``) are not consulted, so an environment that sets both kinds keeps working.

    Attributes:
        enable_routing_replay: capture routing at all (FastDeploy key). False:
            :meth:`build_capturer` returns None, so an engine keeps one code path.
        routing_store_type: the store the writer commits to. ``"local"``: a
            :class:`~r3rdma.store.local_store.LocalRoutingStore` writing Zarr under
            ``local_store_dir`` in this process; ``"store_nodes"``: a
            :class:`~r3rdma.write.push_client.StoreNodesClient` pushing over UCX to
            ``store_urls`` (FastDeploy key; its ``"rdma"`` value is an alias of
            ``"store_nodes"``).
        local_store_dir: ``local`` only: root directory of the local store (FastDeploy key).
            One writer process owns a root (a lock refuses a second).
        only_last_turn: ``local`` only (FastDeploy key): the local store keeps each
            conversation's latest full view. Every turn finishes with ``start_row=0`` and its
            record *replaces* the stored conversation it extends
            (``LocalRoutingStore(only_last_turn=True)``; docs/ENGINE_SEMANTICS.md, Multi-turn).
            False: a later turn finishes with ``start_row`` = rows stored so far and is appended
            as a segment. Store nodes append only, so True with ``store_nodes`` is refused.
        rollout_id: the capturer's rollout id for finished requests whose
            ``finish_request`` names none. Left at ``"default"``, :meth:`build_capturer`
            logs a warning (logger ``r3rdma``, once per process) naming it: readers must ask
            for that id; set one id per RL step (``R3_ROLLOUT_ID``).
        store_urls: ``store_nodes`` only: push addresses ``host:ucx_port`` of the store nodes
            (the client places requests on them by rendezvous hashing). A comma-separated
            string is accepted (``R3_STORE_URLS``).
        store_token_file: ``store_nodes`` only: file holding the shared push secret
            (``R3_STORE_TOKEN_FILE``, as the cluster set-up exports it); None: the secret comes
            from ``$R3_STORE_TOKEN`` (:func:`r3rdma.transport.load_secret`).
        store_replicas: ``store_nodes`` only: copies of each request, on the first R nodes of
            its rendezvous order; a batch is durable once all R acknowledged
            (``StoreNodesClient(replicas=)``, docs/DISTRIBUTED.md). 0: the client's default, 2
            with two or more nodes, else 1.
        slot_table_device: where the capturer's slot table and step buffers live, when
            :meth:`build_capturer` is given no ``device``: ``auto`` (the model's device when
            built with ``model=``; else CUDA when available, else CPU), ``cpu``, ``cuda`` or
            ``cuda:<n>``.
        pin_host_table: the capturer keeps its (CUDA) slot table in pinned host memory mapped
            into the device instead of HBM (``RoutingCapturer(pin_memory=True)``): no HBM for
            the table, slower scatters and gathers. Needs a CUDA slot table.
        transfer_mode: how the capturer moves finished rows off the GPU
            (``RoutingCapturer(transfer_mode=)``, :mod:`r3rdma.capture.transfer`): ``auto``
            (measure both paths against the first store node at build time and keep the
            faster; ``staged`` with a local store or off CUDA), ``staged`` (async copy into
            pinned host memory, then a host push) or ``gpu_direct`` (UCX reads the device rows;
            needs ``store_nodes``).
        flush_bytes: the writer commits a batch once this many bytes of finished requests
            are queued (MB-sized batches keep per-commit costs small).
        flush_interval_s: ... or once the oldest queued request waited this long (writer).
        max_inflight_bytes: writer: finished requests queued but not yet durable, in bytes; a
            finishing request waits (backpressure) rather than grow memory past this.
        zstd_level: ``local`` only: zstd level of the local store's Zarr chunks (0: no
            compression). Store nodes compress with their own ``--zstd-level``; a non-default
            value with ``store_nodes`` is refused.
        chunk_rows: ``local`` only: token rows per Zarr chunk of the local store (the unit of a
            range read). A non-default value with ``store_nodes`` is refused.
    """

    enable_routing_replay: bool = True
    routing_store_type: str = "local"
    local_store_dir: str = "./r3rdma_data"
    only_last_turn: bool = False
    rollout_id: str = DEFAULT_ROLLOUT_ID
    store_urls: tuple[str, ...] = ()
    store_token_file: str | None = None
    store_replicas: int = 0
    slot_table_device: str = "auto"
    pin_host_table: bool = False
    transfer_mode: str = "auto"
    flush_bytes: int = 8 << 20
    flush_interval_s: float = 0.05
    max_inflight_bytes: int = 1 << 30
    zstd_level: int = 3
    chunk_rows: int = 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _checked_type(f, getattr(self, f.name)))
        store_type = "store_nodes" if self.routing_store_type == "rdma" else self.routing_store_type
        object.__setattr__(self, "routing_store_type", store_type)
        if store_type not in _STORE_TYPES:
            raise ConfigError(f"routing_store_type must be one of {_STORE_TYPES} (or 'rdma'), got {self.routing_store_type!r}")
        if not _DEVICE.fullmatch(self.slot_table_device):
            raise ConfigError(f"slot_table_device must be auto, cpu, cuda or cuda:<n>, got {self.slot_table_device!r}")
        if self.transfer_mode not in _TRANSFER_MODES:
            raise ConfigError(f"transfer_mode must be one of {_TRANSFER_MODES}, got {self.transfer_mode!r}")
        if self.store_token_file == "":
            object.__setattr__(self, "store_token_file", None)
        if store_type == "store_nodes":
            if not self.store_urls:
                raise ConfigError("routing_store_type 'store_nodes' needs store_urls (host:port, ...), got none")
            from r3rdma.write.push_client import parse_node_url

            for url in self.store_urls:
                parse_node_url(url)
            if not 0 <= self.store_replicas <= len(self.store_urls):
                raise ConfigError(f"store_replicas must be in 0..{len(self.store_urls)} (0: the default) for "
                                  f"{len(self.store_urls)} store nodes, got {self.store_replicas}")
            if self.only_last_turn:
                raise ConfigError(
                    "only_last_turn needs routing_store_type 'local': store nodes append a later turn as a "
                    "segment (finish it with start_row = rows stored so far) and cannot replace a stored "
                    "conversation; got only_last_turn=True with 'store_nodes'"
                )
            for name, where in (("zstd_level", "r3rdma-store --zstd-level"), ("chunk_rows", "the node's default")):
                default = _DEFAULTS[name]
                if getattr(self, name) != default:
                    raise ConfigError(
                        f"{name} is a setting of the store nodes ({where}), not of a pusher: with "
                        f"'store_nodes' expected the default {default}, got {getattr(self, name)}"
                    )
        if self.transfer_mode == "gpu_direct" and store_type != "store_nodes":
            raise ConfigError("transfer_mode 'gpu_direct' pushes device memory to store nodes; it needs "
                              f"routing_store_type 'store_nodes', got {store_type!r}")
        if self.pin_host_table and self.slot_table_device == "cpu":
            raise ConfigError("pin_host_table keeps a CUDA slot table in pinned host memory; "
                              "slot_table_device is 'cpu' (use 'auto' or 'cuda')")
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

    # -- parsing ----------------------------------------------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "R3Config":
        """Build a config: ``overrides`` first, then ``R3_<FIELD>`` variables, then defaults."""
        env = os.environ if env is None else env
        unknown = set(overrides) - set(_DEFAULTS)
        if unknown:
            raise ConfigError(f"unknown R3Config fields {sorted(unknown)}; known: {sorted(_DEFAULTS)}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in overrides:
                values[f.name] = overrides[f.name]
            elif (raw := env.get("R3_" + f.name.upper())) is not None:
                values[f.name] = _parse(f, raw)
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any], env: Mapping[str, str] | None = None) -> "R3Config":
        """Parse FastDeploy-style JSON (``--routing-replay-config``) plus r3rdma's own keys.

        The JSON's keys are arguments: they beat ``R3_*`` variables (of ``env``, default
        ``os.environ``), which fill the keys it does not set.
        """
        try:
            data = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"routing replay config is not valid JSON ({e}): {text!r}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"routing replay config must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - set(_DEFAULTS)
        if unknown:
            raise ConfigError(f"unknown routing replay config keys {sorted(unknown)}; known: {sorted(_DEFAULTS)}")
        return cls.from_env(env, **data)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    # -- what it builds ---------------------------------------------------------------------

    def build_writer(self) -> "RoutingWriter":
        """The writer and the store this config names, the writer owning the store.

        A :class:`~r3rdma.write.writer.RoutingWriter` (``flush_bytes``, ``flush_interval_s``,
        ``max_inflight_bytes``) over a :class:`~r3rdma.store.local_store.LocalRoutingStore`
        (``local_store_dir``, ``zstd_level``, ``chunk_rows``, ``only_last_turn``) or a
        :class:`~r3rdma.write.push_client.StoreNodesClient` (``store_urls``, secret from
        ``store_token_file`` / ``$R3_STORE_TOKEN``). ``writer.close()`` commits what it holds,
        then closes the store (releasing the local root's lock, or the client's connections).
        Built whatever ``enable_routing_replay`` says: callers that honour it use
        :meth:`build_capturer`.
        """
        from r3rdma.write.writer import RoutingWriter

        store = self._open_store()
        try:
            return RoutingWriter(store, flush_bytes=self.flush_bytes, flush_interval_s=self.flush_interval_s,
                                 max_inflight_bytes=self.max_inflight_bytes, owns_store=True)
        except BaseException:
            store.close()
            raise

    def build_capturer(
        self,
        *,
        num_slots: int,
        model: "torch.nn.Module | None" = None,
        layer_map: Sequence[int] | None = None,
        top_k: int | None = None,
        num_experts: int | None = None,
        device: "str | torch.device | None" = None,
        tp_group: "torch.distributed.ProcessGroup | None" = None,
        expert_map: "torch.Tensor | Sequence[int] | None" = None,
    ) -> "RoutingCapturer | None":
        """The capture pipeline this config names, or None when ``enable_routing_replay`` is false.

        Returns a :class:`~r3rdma.capture.capturer.RoutingCapturer` whose sink is
        :meth:`build_writer`'s writer (``capturer.sink``), and which owns it:
        ``capturer.close()`` (or leaving ``with cfg.build_capturer(...) as capturer:``) hands
        every finished request over, commits it durably, and closes the writer and its store.
        ``capturer.sink.flush()`` waits for durability without closing.

        Args:
            num_slots: KV slots of the engine's cache (rows of the slot table).
            model: a Hugging Face transformers MoE model: ``layer_map``, ``top_k`` and
                ``num_experts`` are read from its routers
                (:func:`r3rdma.integrations.hf_capture.model_geometry`); hook it with
                :func:`~r3rdma.integrations.hf_capture.attach_capturer`.
            layer_map, top_k, num_experts: the geometry (see ``RoutingCapturer``); required
                without ``model``; with it, optional and checked against the model.
            device: where the slot table lives; None: ``slot_table_device``. With ``model`` it
                must be on the model's device type (routers' ids are recorded in place).
            tp_group: the tensor-parallel group whose ranks split each step's MoE tokens
                (a runtime object, so an argument and not a field). With a local store each
                rank opens ``local_store_dir``: give ranks their own roots or use store nodes.
            expert_map: EPLB physical -> logical expert map (see ``RoutingCapturer``).

        Raises :class:`~r3rdma.errors.ConfigError` for missing or disagreeing geometry, a
        device that does not fit, or a store that cannot be opened (nothing stays open then).
        """
        if not self.enable_routing_replay:
            return None
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 1:
            raise ConfigError(f"num_slots must be an int >= 1, got {num_slots!r}")
        layer_map, top_k, num_experts = _geometry(model, layer_map, top_k, num_experts)
        device = self._resolve_device(device, model)
        from r3rdma.capture.capturer import RoutingCapturer

        writer = self.build_writer()
        try:
            capturer = RoutingCapturer(
                layer_map=layer_map,
                top_k=top_k,
                num_experts=num_experts,
                num_slots=num_slots,
                sink=writer,
                rollout_id=self.rollout_id,
                device=device,
                pin_memory=self.pin_host_table,
                expert_map=expert_map,
                tp_group=tp_group,
                transfer_mode=self.transfer_mode,
                owns_sink=True,
            )
        except BaseException:
            writer.close()
            raise
        if self.rollout_id == DEFAULT_ROLLOUT_ID:
            where = self.local_store_dir if self.routing_store_type == "local" else "the store nodes"
            _note_default_rollout(str(where))
        return capturer

    def _open_store(self):
        if self.routing_store_type == "local":
            from r3rdma.store.local_store import LocalRoutingStore

            return LocalRoutingStore(self.local_store_dir, zstd_level=self.zstd_level, chunk_rows=self.chunk_rows,
                                     only_last_turn=self.only_last_turn)
        from r3rdma.transport.auth import load_secret
        from r3rdma.write.push_client import StoreNodesClient

        return StoreNodesClient(self.store_urls, secret=load_secret(self.store_token_file),
                                replicas=self.store_replicas or None)

    def _resolve_device(self, device, model) -> "torch.device":
        import torch

        model_device = None
        if model is not None:
            param = next(iter(model.parameters()), None)
            model_device = param.device if param is not None else torch.device("cpu")
        if device is not None:
            try:
                resolved = torch.device(device)
            except (RuntimeError, TypeError) as e:
                raise ConfigError(f"device must name a torch device such as 'cpu', 'cuda' or 'cuda:0', got {device!r}") from e
        elif self.slot_table_device != "auto":
            resolved = torch.device(self.slot_table_device)
        elif model_device is not None:
            resolved = model_device
        else:
            resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if resolved.type == "cuda" and resolved.index is None and torch.cuda.is_available():
            resolved = torch.device("cuda", torch.cuda.current_device())
        if model_device is not None and resolved.type != model_device.type:
            raise ConfigError(
                f"the slot table must be on the model's device type: the model is on {model_device}, "
                f"the slot table would be on {resolved} (slot_table_device={self.slot_table_device!r}, device={device!r})"
            )
        if self.pin_host_table and resolved.type != "cuda":
            raise ConfigError(f"pin_host_table keeps a CUDA slot table in pinned host memory; the slot table is on {resolved}")
        return resolved


_DEFAULTS = {f.name: f.default for f in fields(R3Config)}


def _geometry(model, layer_map, top_k, num_experts) -> tuple[tuple[int, ...], int, int]:
    given = {
        "layer_map": None if layer_map is None else tuple(int(x) for x in layer_map),
        "top_k": top_k,
        "num_experts": num_experts,
    }
    if model is None:
        missing = [name for name, value in given.items() if value is None]
        if missing:
            raise ConfigError(f"build_capturer needs layer_map, top_k and num_experts, or model= to read them from; missing {missing}")
        return given["layer_map"], given["top_k"], given["num_experts"]
    from r3rdma.integrations.hf_capture import model_geometry

    found = dict(zip(("layer_map", "top_k", "num_experts"), model_geometry(model)))
    wrong = [f"{name}: the model has {found[name]!r}, the argument says {value!r}"
             for name, value in given.items() if value is not None and value != found[name]]
    if wrong:
        raise ConfigError("build_capturer(model=...) geometry disagrees with the model's routers: " + "; ".join(wrong))
    return found["layer_map"], found["top_k"], found["num_experts"]


def _checked_type(f: dataclasses.Field, value: Any) -> Any:
    """``value`` as field ``f``'s type, or a ConfigError saying what was expected and what arrived."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    ok = True
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind == "str":
        ok = isinstance(value, str)
    elif kind == "str | None":
        ok = value is None or isinstance(value, str)
    elif kind.startswith("tuple"):
        if isinstance(value, str):
            value = tuple(u.strip() for u in value.split(",") if u.strip())
        elif isinstance(value, (list, tuple)) and all(isinstance(u, str) for u in value):
            value = tuple(value)
        else:
            ok = False
    if not ok:
        raise ConfigError(f"{f.name}: expected {kind}, got {type(value).__name__} {value!r}")
    return value


def _parse(f: dataclasses.Field, raw: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind == "bool":
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)  # internal: reported below as a ConfigError naming the variable
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind.startswith("tuple"):
            return tuple(u.strip() for u in raw.split(",") if u.strip())
        return raw
    except ValueError as e:
        raise ConfigError(f"R3_{f.name.upper()}={raw!r} is not a valid {kind}") from e
