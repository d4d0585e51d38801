"""How the vLLM plug-in is switched on, and how a vLLM request names its stored routing.

Switched on per engine, never by installing r3rdma alone (vLLM loads the plug-in into every
process of every engine once r3rdma is installed):

- ``additional_config={"routing_replay": {...}}`` (``LLM(...)`` keyword, or
  ``--additional-config '{"routing_replay": {...}}'`` on the server command line): the object
  is :class:`~r3rdma.config.R3Config`'s JSON (FastDeploy's ``--routing-replay-config`` keys plus
  r3rdma's own); ``R3_*`` variables fill the keys it leaves out.
- or the environment: ``R3_ROUTING_REPLAY_CONFIG`` (the same JSON) or
  ``R3_ENABLE_ROUTING_REPLAY=1`` with the other ``R3_*`` variables.

A request names its routing through ``SamplingParams.extra_args`` (``vllm_xargs`` in an
OpenAI-compatible request body): ``r3_rollout_id`` (default: the config's ``rollout_id``) and
``r3_request_id`` (default: vLLM's request id, i.e. ``RequestOutput.request_id``, the HTTP
request's id on the server). With ``n > 1`` sample ``i`` is stored as ``<id>.<i>``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

from r3rdma.config import R3Config
from r3rdma.errors import ConfigError
from r3rdma.ids import validate_id

__all__ = [
    "CONFIG_KEY",
    "LOGGER_NAME",
    "LOCATION_KEY",
    "ROLLOUT_ARG",
    "REQUEST_ARG",
    "routing_config",
    "rollout_of",
    "stored_request_id",
]

CONFIG_KEY = "routing_replay"  # the key in vLLM's additional_config
ROLLOUT_ARG = "r3_rollout_id"  # SamplingParams.extra_args / vllm_xargs keys a client sets
REQUEST_ARG = "r3_request_id"
# Set by the plug-in in the front end (never by clients): the id a request is stored under
# before the n > 1 suffix, and its sample index with n > 1. They travel with the request's
# sampling parameters to the scheduler and the workers, which never see the external id.
KEY_ARG = "r3_key"
LOCATION_KEY = "r3_routing"  # kv_transfer_params key of a finished request's routing location
STORE_ARG = "r3_store"  # set by the front end: which store the request goes to (ids are taken per store)
INDEX_ARG = "r3_sample_index"

_TRUE = {"1", "true", "yes", "on"}

# A child of vLLM's own "vllm" logger: the plug-in's lines go through vLLM's handler and format
# ("INFO 11-26 12:00:00 [worker.py:140] r3rdma: recording ..."), shown by default, silenced
# with vLLM's (VLLM_LOGGING_LEVEL, VLLM_CONFIGURE_LOGGING).
LOGGER_NAME = "vllm.r3rdma"


def route_core_logs() -> None:
    """Send r3rdma's own library loggers (``r3rdma``: the writer, the push client) through
    vLLM's handler too, in an engine process where routing replay is on and nobody configured
    them: without it their errors ("a commit failed") would print as bare ``ERROR:r3rdma:``
    lines through Python's last-resort handler, or not at all."""
    import logging

    core = logging.getLogger("r3rdma")
    vllm_logger = logging.getLogger("vllm")
    if core.handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        core.addHandler(handler)
    core.setLevel(vllm_logger.level or logging.INFO)
    core.propagate = False


def routing_config(vllm_config: Any, env: Mapping[str, str] | None = None) -> R3Config | None:
    """The engine's :class:`R3Config`, or None when routing replay is not asked for.

    Asked for: ``additional_config["routing_replay"]`` present, or ``R3_ROUTING_REPLAY_CONFIG``
    set, or ``R3_ENABLE_ROUTING_REPLAY`` true. ``enable_routing_replay: false`` in either turns
    it off again.
    """
    from r3rdma.integrations.vllm.engine_gate import read

    env = os.environ if env is None else env
    extra = read(vllm_config, "additional_config", "VllmConfig") or {}  # renamed: an error, not "off"
    _refuse_near_miss(extra)
    spec: Any = None
    if isinstance(extra, Mapping) and CONFIG_KEY in extra:
        spec = extra[CONFIG_KEY]
        where = f"additional_config[{CONFIG_KEY!r}]"
    elif env.get("R3_ROUTING_REPLAY_CONFIG"):
        spec = env["R3_ROUTING_REPLAY_CONFIG"]
        where = "R3_ROUTING_REPLAY_CONFIG"
    elif env.get("R3_ENABLE_ROUTING_REPLAY", "").strip().lower() in _TRUE:
        spec = {}
        where = "R3_* variables"
    else:
        return None
    if isinstance(spec, str):
        try:
            spec = json.loads(spec) if spec.strip() else {}
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where} is not valid JSON ({e}): {spec!r}") from e
    if spec is True:
        spec = {}
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where} must be a JSON object of R3Config keys, got {type(spec).__name__}: {spec!r}")
    config = R3Config.from_json(dict(spec), env=env)
    return config if config.enable_routing_replay else None


def _refuse_near_miss(extra: Any) -> None:
    """A key of ``additional_config`` that is almost ``routing_replay`` (``routing-replay``,
    ``routingReplay``, ``routing_repaly``) would leave routing replay off without a word."""
    if not isinstance(extra, Mapping) or CONFIG_KEY in extra:
        return
    import difflib

    for key in extra:
        if not isinstance(key, str):
            continue
        squashed = re.sub(r"[^a-z]", "", key.lower())
        if squashed == "routingreplay" or difflib.SequenceMatcher(None, key.lower(), CONFIG_KEY).ratio() >= 0.8:
            raise ConfigError(
                f"additional_config has the key {key!r}, not {CONFIG_KEY!r}: routing replay would stay off for this "
                f"engine. Did you mean additional_config[{CONFIG_KEY!r}]?"
            )


def stored_request_id(extra_args: Mapping[str, Any] | None, engine_request_id: str) -> str:
    """The id a finished vLLM request is stored under (see the module docstring).

    ``extra_args`` are the request's sampling parameters' ``extra_args`` as the scheduler and
    the workers see them (the front end added the key and, with n > 1, the sample index).
    """
    args = extra_args or {}
    key = args.get(KEY_ARG)
    if key is None:  # a request that did not pass through the plug-in's front end
        key = args.get(REQUEST_ARG, engine_request_id)
    key = str(key)
    index = args.get(INDEX_ARG)
    stored = key if index is None else f"{key}.{int(index)}"
    return validate_id(stored, "request id")


def rollout_of(extra_args: Mapping[str, Any] | None, default: str) -> str:
    """The rollout a request is stored in: its ``r3_rollout_id``, else the config's."""
    rollout = (extra_args or {}).get(ROLLOUT_ARG)
    return validate_id(str(rollout), "rollout_id") if rollout is not None else default
