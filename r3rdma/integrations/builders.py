"""The capture pipeline an :class:`~r3rdma.config.R3Config` names, built: a writer over its store,
and a capturer over the writer.

The settings live in :mod:`r3rdma.config`, which builds nothing; this module sits above what it
builds (capture, write, store, the transport's secret) and, for a Hugging Face model, reads the
geometry from the model's routers (:func:`~r3rdma.integrations.hf_capture.model_geometry`)::

    cfg = R3Config.from_json(routing_replay_config)        # or R3Config.from_env(...)
    with build_capturer(cfg, model=model, num_slots=kv_slots) as capturer:   # None when disabled
        ...

Engines that shape the capturer themselves (the vLLM plug-in) take only :func:`build_writer`.
Each function imports what it builds, so building a writer for store nodes loads no zarr.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from r3rdma.config import DEFAULT_ROLLOUT_ID, R3Config
from r3rdma.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from r3rdma.capture.capturer import RoutingCapturer
    from r3rdma.write.writer import RoutingWriter

__all__ = ["build_capturer", "build_writer"]

logger = logging.getLogger("r3rdma")

_default_rollout_noted = False  # warned once per process (below), not per capturer
_default_rollout_lock = threading.Lock()


def build_writer(config: R3Config, *, connect: bool = True) -> RoutingWriter:
    """The writer and the store ``config`` names, the writer owning the store.

    A :class:`~r3rdma.write.writer.RoutingWriter` (``flush_bytes``, ``flush_interval_s``,
    ``max_inflight_bytes``) over a :class:`~r3rdma.store.local_store.LocalRoutingStore`
    (``local_store_dir``, ``zstd_level``, ``chunk_rows``, ``only_last_turn``) or a
    :class:`~r3rdma.write.push_client.StoreNodesClient` (``store_urls``, secret from
    ``store_token_file`` / ``$R3_STORE_TOKEN``). ``writer.close()`` commits what it holds,
    then closes the store (releasing the local root's lock, or the client's connections).
    Built whatever ``enable_routing_replay`` says: callers that honour it use
    :func:`build_capturer`. Store nodes are connected to and authenticated with here
    (``StoreNodesClient.check``; ``connect=False`` leaves it to the first push): a node that
    cannot be reached, or refuses the secret, fails the build, naming it, not the first commit
    at the end of a rollout.
    """
    from r3rdma.write.writer import RoutingWriter

    store = _open_store(config)
    try:
        check = getattr(store, "check", None)
        if connect and callable(check):
            check()
        return RoutingWriter(
            store,
            flush_bytes=config.flush_bytes,
            flush_interval_s=config.flush_interval_s,
            max_inflight_bytes=config.max_inflight_bytes,
            owns_store=True,
        )
    except BaseException:
        store.close()
        raise


def build_capturer(
    config: R3Config,
    *,
    num_slots: int,
    model: torch.nn.Module | None = None,
    layer_map: Sequence[int] | None = None,
    top_k: int | None = None,
    num_experts: int | None = None,
    device: str | torch.device | None = None,
    tp_group: torch.distributed.ProcessGroup | None = None,
    expert_map: torch.Tensor | Sequence[int] | None = None,
) -> RoutingCapturer | None:
    """The capture pipeline ``config`` names, or None when ``enable_routing_replay`` is false.

    Returns a :class:`~r3rdma.capture.capturer.RoutingCapturer` whose sink is
    :func:`build_writer`'s writer (``capturer.sink``), and which owns it:
    ``capturer.close()`` (or leaving ``with build_capturer(cfg, ...) as capturer:``) hands
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
        device: where the slot table lives; None: ``config.slot_table_device``. With ``model``
            it must be on the model's device type (routers' ids are recorded in place).
        tp_group: the tensor-parallel group whose ranks split each step's MoE tokens
            (a runtime object, so an argument and not a field). With a local store each
            rank opens ``local_store_dir``: give ranks their own roots or use store nodes.
        expert_map: EPLB physical -> logical expert map (see ``RoutingCapturer``).

    Raises :class:`~r3rdma.errors.ConfigError` for missing or disagreeing geometry, a
    device that does not fit, or a store that cannot be opened (nothing stays open then).
    """
    if not config.enable_routing_replay:
        return None
    if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 1:
        raise ConfigError(f"num_slots must be an int >= 1, got {num_slots!r}")
    layer_map, top_k, num_experts = _geometry(model, layer_map, top_k, num_experts)
    device = _resolve_device(config, device, model)
    from r3rdma.capture.capturer import RoutingCapturer

    writer = build_writer(config)
    try:
        capturer = RoutingCapturer(
            layer_map=layer_map,
            top_k=top_k,
            num_experts=num_experts,
            num_slots=num_slots,
            sink=writer,
            rollout_id=config.rollout_id,
            device=device,
            pin_memory=config.pin_host_table,
            expert_map=expert_map,
            tp_group=tp_group,
            transfer_mode=config.transfer_mode,
            owns_sink=True,
        )
    except BaseException:
        writer.close()
        raise
    if config.rollout_id == DEFAULT_ROLLOUT_ID:
        where = config.local_store_dir if config.routing_store_type == "local" else "the store nodes"
        _note_default_rollout(str(where))
    return capturer


def _open_store(config: R3Config):
    if config.routing_store_type == "local":
        from r3rdma.store.local_store import LocalRoutingStore

        return LocalRoutingStore(
            config.local_store_dir,
            zstd_level=config.zstd_level,
            chunk_rows=config.chunk_rows,
            only_last_turn=config.only_last_turn,
            layers_per_chunk=config.layers_per_chunk,
            slice_layout=config.slice_layout,
        )
    from r3rdma.transport.auth import load_secret
    from r3rdma.write.push_client import StoreNodesClient

    return StoreNodesClient(
        config.store_urls, secret=load_secret(config.store_token_file), replicas=config.store_replicas or None
    )


_GEOMETRY_NAMES = ("layer_map", "top_k", "num_experts")


def _geometry(model, layer_map, top_k, num_experts) -> tuple[tuple[int, ...], int, int]:
    given_map = None if layer_map is None else tuple(int(x) for x in layer_map)
    given = (given_map, top_k, num_experts)
    if model is None:
        if given_map is None or top_k is None or num_experts is None:
            missing = [name for name, value in zip(_GEOMETRY_NAMES, given) if value is None]
            raise ConfigError(
                f"build_capturer needs layer_map, top_k and num_experts, or model= to read them from; missing {missing}"
            )
        return given_map, top_k, num_experts
    from r3rdma.integrations.hf_capture import model_geometry

    found = model_geometry(model)
    wrong = [
        f"{name}: the model has {model_value!r}, the argument says {value!r}"
        for name, model_value, value in zip(_GEOMETRY_NAMES, found, given)
        if value is not None and value != model_value
    ]
    if wrong:
        raise ConfigError("build_capturer(model=...) geometry disagrees with the model's routers: " + "; ".join(wrong))
    return found


def _resolve_device(config: R3Config, device, model) -> torch.device:
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
    elif config.slot_table_device != "auto":
        resolved = torch.device(config.slot_table_device)
    elif model_device is not None:
        resolved = model_device
    else:
        resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if resolved.type == "cuda" and resolved.index is None and torch.cuda.is_available():
        resolved = torch.device("cuda", torch.cuda.current_device())
    if model_device is not None and resolved.type != model_device.type:
        raise ConfigError(
            f"the slot table must be on the model's device type: the model is on {model_device}, "
            f"the slot table would be on {resolved} (slot_table_device={config.slot_table_device!r}, device={device!r})"
        )
    if config.pin_host_table and resolved.type != "cuda":
        raise ConfigError(f"pin_host_table keeps a CUDA slot table in pinned host memory; the slot table is on {resolved}")
    return resolved


def _note_default_rollout(store: str) -> None:
    """Say once per process that finished requests land in rollout "default": a trainer that
    reads its own step id (e.g. "step-0042") would find nothing there."""
    global _default_rollout_noted
    with _default_rollout_lock:
        if _default_rollout_noted:
            return
        _default_rollout_noted = True
    logger.warning(
        "r3rdma: the capturer stores finished requests under rollout id %r in %s (no rollout_id set): "
        "readers must ask for %r; set R3Config(rollout_id=...) or R3_ROLLOUT_ID to one id per RL step",
        DEFAULT_ROLLOUT_ID,
        store,
        DEFAULT_ROLLOUT_ID,
    )
