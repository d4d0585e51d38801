"""Configuration of routing capture and storage: what to capture, where it is stored, how it is batched.

Precedence for every field: explicit argument, then ``R3_<FIELD>`` environment variable, then
the default. The JSON form accepts FastDeploy's ``--routing-replay-config`` keys
(``enable_routing_replay``, ``routing_store_type``, ``local_store_dir``, ``only_last_turn``)
so an existing launch line carries over; unknown keys are refused, not ignored.

:class:`R3Config` is a pydantic dataclass (as vLLM's own configs are): pydantic checks each
field's type strictly (a ``"false"`` string is no bool) and its range, ``Literal`` fields name
their few values, and every refusal is a :class:`~r3rdma.errors.ConfigError` naming the field,
what it expected and what arrived. The settings build nothing: the capture pipeline they name
is built by :mod:`r3rdma.integrations.builders`::

    cfg = R3Config.from_json(routing_replay_config)        # or R3Config.from_env(...)
    with build_capturer(cfg, model=model, num_slots=kv_slots) as capturer:   # None when disabled
        ...

This module imports neither torch nor zarr, and nothing above the layers it configures.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass

from r3rdma.errors import ConfigError, R3Error
from r3rdma.ids import validate_id

__all__ = ["DEFAULT_ROLLOUT_ID", "R3Config"]

DEFAULT_ROLLOUT_ID = "default"

# FastDeploy's name of the store-nodes store type; R3Config keeps the canonical name.
_STORE_TYPE_ALIASES = {"rdma": "store_nodes"}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _raising_config_errors(cls):
    """Make ``cls(...)`` (and ``dataclasses.replace``, which calls it) raise
    :class:`~r3rdma.errors.ConfigError` where pydantic raises its ``ValidationError``: r3rdma's
    callers catch one error type, and its message names the field as r3rdma's always did."""
    validate = cls.__init__

    @functools.wraps(validate)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            validate(self, *args, **kwargs)
        except ValidationError as e:
            raise _config_error(e, args, kwargs) from None

    cls.__init__ = __init__
    return cls


@_raising_config_errors
@dataclass(frozen=True, slots=True, kw_only=True, config=ConfigDict(strict=True, extra="forbid"))
class R3Config:
    """Routing capture and storage settings; :func:`r3rdma.integrations.builders.build_capturer`
    turns them into a pipeline.

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
            :func:`~r3rdma.integrations.builders.build_capturer`
            returns None, so an engine keeps one code path.
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
            ``finish_request`` names none. Left at ``"default"``,
            :func:`~r3rdma.integrations.builders.build_capturer`
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
            :func:`~r3rdma.integrations.builders.build_capturer` is given no ``device``:
            ``auto`` (the model's device when built with ``model=``; else CUDA when available,
            else CPU), ``cpu``, ``cuda`` or ``cuda:<n>``. The vLLM plug-in keeps it on the host
            for a model on the GPU too when its capturer runs on a thread (``capture_thread``;
            the thread then makes no CUDA call, :mod:`r3rdma.capture.capture_thread`) unless
            this says ``cuda``.
        capture_thread: where an engine plug-in (vLLM) runs the capturer's work:
            ``on`` (a thread of its own, beside the engine's step path:
            :class:`~r3rdma.capture.capture_thread.CaptureThread`), ``off`` (inline, on the
            engine's thread: :class:`~r3rdma.capture.capture_thread.InlineCapture`) or
            ``auto`` (on for a model on the GPU, whose engine thread waits on the device while
            cores are free; off for a model on the CPU, whose forward keeps every core busy).
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
        layers_per_chunk: ``local`` only: MoE layers per Zarr chunk of the local store (None:
            the store's rule; set the trainers' pipeline stage size so a stage reads only its
            layers). Store nodes take ``r3rdma-store --layers-per-chunk``; a value with
            ``store_nodes`` is refused.
        slice_layout: ``local`` only: lay out the local store's arrays of long requests for
            trainers that read by slice (context-parallel pieces, pipeline stages; format 4;
            the default). False: the whole-request layout, for a store read only by whole
            requests (read about twice as fast). Store nodes take ``r3rdma-store
            --[no-]slice-layout``; False with ``store_nodes`` is refused.
    """

    enable_routing_replay: bool = True
    routing_store_type: Literal["local", "store_nodes"] = "local"
    local_store_dir: str = "./r3rdma_data"
    only_last_turn: bool = False
    rollout_id: str = DEFAULT_ROLLOUT_ID
    store_urls: tuple[str, ...] = ()
    store_token_file: str | None = None
    store_replicas: Annotated[int, Field(ge=0)] = 0
    slot_table_device: str = "auto"
    capture_thread: Literal["auto", "on", "off"] = "auto"
    pin_host_table: bool = False
    transfer_mode: Literal["auto", "staged", "gpu_direct"] = "auto"
    flush_bytes: Annotated[int, Field(gt=0)] = 8 << 20
    flush_interval_s: Annotated[float, Field(ge=0)] = 0.05
    max_inflight_bytes: Annotated[int, Field(gt=0)] = 1 << 30
    zstd_level: Annotated[int, Field(ge=0, le=22)] = 3
    chunk_rows: Annotated[int, Field(gt=0)] = 1024
    layers_per_chunk: Annotated[int, Field(gt=0)] | None = None
    slice_layout: bool = True

    # -- one field at a time (before: the spellings accepted; after: values a type cannot say) --

    @field_validator("routing_store_type", mode="before")
    @classmethod
    def _canonical_store_type(cls, value: Any) -> Any:
        return _STORE_TYPE_ALIASES.get(value, value) if isinstance(value, str) else value

    @field_validator("store_urls", mode="before")
    @classmethod
    def _urls_as_tuple(cls, value: Any) -> Any:
        # "host:port, host:port" is how R3_STORE_URLS and the commands' flags hold them.
        if isinstance(value, str):
            value = tuple(u.strip() for u in value.split(",") if u.strip())
        elif isinstance(value, list):
            value = tuple(value)
        for url in value if isinstance(value, tuple) else ():
            if isinstance(url, str) and url.lower().startswith(("http://", "https://")):
                # An easy mix-up with R3_STORE_HTTP_URLS; as a push address it failed only when
                # the engine had loaded and compiled the model.
                raise ConfigError(f"store_urls takes UCX host:port; HTTP URLs are for readers (R3_STORE_HTTP_URLS): got {url!r}")
        return value

    @field_validator("store_token_file", mode="before")
    @classmethod
    def _empty_token_file_is_none(cls, value: Any) -> Any:
        return None if value == "" else value  # an exported but empty R3_STORE_TOKEN_FILE

    @field_validator("slot_table_device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        if not _DEVICE.fullmatch(value):
            raise ConfigError(f"slot_table_device must be auto, cpu, cuda or cuda:<n>, got {value!r}")
        return value

    @field_validator("rollout_id")
    @classmethod
    def _rollout_id(cls, value: str) -> str:
        return validate_id(value, "rollout_id")

    # -- fields together ----------------------------------------------------------------------

    @model_validator(mode="after")
    def _consistent(self) -> R3Config:
        if self.routing_store_type == "store_nodes":
            self._check_store_nodes()
        if self.transfer_mode == "gpu_direct" and self.routing_store_type != "store_nodes":
            raise ConfigError(
                "transfer_mode 'gpu_direct' pushes device memory to store nodes; it needs "
                f"routing_store_type 'store_nodes', got {self.routing_store_type!r}"
            )
        if self.pin_host_table and self.slot_table_device == "cpu":
            raise ConfigError(
                "pin_host_table keeps a CUDA slot table in pinned host memory; slot_table_device is 'cpu' (use 'auto' or 'cuda')"
            )
        if self.flush_bytes > self.max_inflight_bytes:
            raise ConfigError(f"flush_bytes ({self.flush_bytes}) must not exceed max_inflight_bytes ({self.max_inflight_bytes})")
        return self

    def _check_store_nodes(self) -> None:
        if not self.store_urls:
            raise ConfigError("routing_store_type 'store_nodes' needs store_urls (host:port, ...), got none")
        from r3rdma.write.push_client import parse_node_url

        for url in self.store_urls:
            parse_node_url(url)
        if self.store_replicas > len(self.store_urls):
            raise ConfigError(
                f"store_replicas must be in 0..{len(self.store_urls)} (0: the default) for "
                f"{len(self.store_urls)} store nodes, got {self.store_replicas}"
            )
        if self.only_last_turn:
            raise ConfigError(
                "only_last_turn needs routing_store_type 'local': store nodes append a later turn as a "
                "segment (finish it with start_row = rows stored so far) and cannot replace a stored "
                "conversation; got only_last_turn=True with 'store_nodes'"
            )
        for name, where in (
            ("zstd_level", "r3rdma-store --zstd-level"),
            ("chunk_rows", "the node's default"),
            ("layers_per_chunk", "r3rdma-store --layers-per-chunk"),
            ("slice_layout", "r3rdma-store --no-slice-layout"),
        ):
            default = _DEFAULTS[name]
            if getattr(self, name) != default:
                raise ConfigError(
                    f"{name} is a setting of the store nodes ({where}), not of a pusher: with "
                    f"'store_nodes' expected the default {default}, got {getattr(self, name)}"
                )

    # -- parsing ----------------------------------------------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> R3Config:
        """Build a config: ``overrides`` first, then ``R3_<FIELD>`` variables, then defaults."""
        env = os.environ if env is None else env
        warn_unknown_variables(env)
        unknown = set(overrides) - set(_DEFAULTS)
        if unknown:
            raise ConfigError(f"unknown R3Config fields {sorted(unknown)}; known: {sorted(_DEFAULTS)}")
        values: dict[str, Any] = {}
        from_env: list[str] = []
        for name in _DEFAULTS:
            if name in overrides:
                values[name] = overrides[name]
            elif (raw := env.get("R3_" + name.upper())) is not None:
                values[name] = _parse_env(name, raw)
                from_env.append(name)
        try:
            return cls(**values)
        except ConfigError as e:
            # A value refused by a field's check: say where it came from when a variable set it.
            source = next((name for name in from_env if str(e).startswith(name)), None)
            if source is None:
                raise
            raise ConfigError(f"{e} (from the environment: R3_{source.upper()})") from e

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any], env: Mapping[str, str] | None = None) -> R3Config:
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
        """Every field as one JSON object (sorted keys); :meth:`from_json` reads it back."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(R3Config)}

# Every R3_* variable r3rdma reads: one per field, and those read elsewhere (switches, secrets,
# readers' addresses, the kernels' backend, the scripts' paths).
KNOWN_VARIABLES = frozenset(
    {"R3_" + name.upper() for name in _DEFAULTS}
    | {
        "R3_ENABLE_ROUTING_REPLAY",
        "R3_ROUTING_REPLAY_CONFIG",
        "R3_STORE_TOKEN",
        "R3_STORE_HTTP_URLS",
        "R3_STORE_READ_TOKEN_FILE",
        "R3_KERNELS",
        "R3_STORE_BIN",
        "R3_DEMO_DIR",
        "R3_ROOT",
    }
)
_warned: set[str] = set()


def unknown_variables(env: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``R3_*`` names in ``env`` that r3rdma does not read, each with the known name it is
    closest to (None when none is close): a mistyped variable is otherwise silently ignored."""
    import difflib

    found = []
    for name in sorted(env):
        if name.startswith("R3_") and name not in KNOWN_VARIABLES:
            close = difflib.get_close_matches(name, KNOWN_VARIABLES, n=1, cutoff=0.75)
            found.append((name, close[0] if close else None))
    return found


def warn_unknown_variables(env: Mapping[str, str]) -> None:
    """Log a warning (logger ``r3rdma``) once per process for each unknown ``R3_*`` variable."""
    import logging

    for name, close in unknown_variables(env):
        if name in _warned:
            continue
        _warned.add(name)
        hint = f"; did you mean {close}?" if close else ""
        logging.getLogger("r3rdma").warning("r3rdma: %s is not a variable r3rdma reads, so it is ignored%s", name, hint)


# Each field's type as pydantic checks it, its constraints (Annotated) set aside: what a
# refusal says was expected, and how an R3_* string is read.
_TYPES = typing.get_type_hints(R3Config)


def _base_type(name: str) -> tuple[Any, bool]:
    """Field ``name``'s type without ``None``, and whether it takes ``None`` (``int | None``)."""
    hint = _TYPES[name]
    args = typing.get_args(hint)
    if type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def _type_text(name: str) -> str:
    hint, optional = _base_type(name)
    text = hint.__name__ if isinstance(hint, type) else str(hint)
    return f"{text} or None" if optional else text


def _config_error(error: ValidationError, args: tuple, kwargs: Mapping[str, Any]) -> R3Error:
    """The ConfigError for pydantic's ``error``: one line per refused field, each naming the field,
    what it expects and what arrived. A check of r3rdma's own (a validator raising an R3Error,
    such as ``validate_id``'s InvalidIdError) comes back as itself."""
    problems = error.errors()
    unknown = sorted(str(p["loc"][0]) for p in problems if p["type"] == "unexpected_keyword_argument")
    lines = [f"unknown R3Config fields {unknown}; known: {sorted(_DEFAULTS)}"] if unknown else []
    for p in problems:
        if p["type"] == "unexpected_keyword_argument":
            continue
        own = p.get("ctx", {}).get("error")
        if isinstance(own, R3Error):
            if len(problems) == 1:
                return own
            lines.append(str(own))
            continue
        if p["type"] == "unexpected_positional_argument":
            lines.append(f"R3Config takes keyword arguments only, got {len(args)} positional")
            break
        name = str(p["loc"][0])
        given = kwargs.get(name, p["input"])  # the value as passed: the element pydantic names is inside it
        lines.append(_refusal(p, name, given))
    return ConfigError("; ".join(lines))


def _refusal(problem: Mapping[str, Any], name: str, given: Any) -> str:
    kind, ctx = problem["type"], problem.get("ctx", {})
    if kind == "literal_error":
        choices = typing.get_args(_TYPES[name])
        aliases = [alias for alias, to in _STORE_TYPE_ALIASES.items() if to in choices]
        also = f" (or {', '.join(map(repr, aliases))})" if aliases else ""
        return f"{name} must be one of {choices}{also}, got {given!r}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"{name} must be {bounds[kind]} {limit}, got {given!r}"
    if kind.endswith("_type") or len(problem["loc"]) > 1:
        return f"{name}: expected {_type_text(name)}, got {type(given).__name__} {given!r}"
    return f"{name}: {problem['msg']}, got {given!r}"


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _parse_env(name: str, raw: str) -> Any:
    """The value of variable ``R3_<NAME>`` as field ``name`` takes it (a string otherwise)."""
    hint, optional = _base_type(name)
    if optional and raw.strip().lower() in ("", "none"):
        return None  # an exported but empty variable: the default
    try:
        if hint is bool:
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise ValueError(raw)  # internal: reported below as a ConfigError naming the variable
        if hint is int:
            return int(raw)
        if hint is float:
            return float(raw)
        return raw  # str, a Literal, tuple[str, ...] (comma-separated): R3Config reads those itself
    except ValueError as e:
        raise ConfigError(f"R3_{name.upper()}={raw!r} is not a valid {_type_text(name)}") from e
