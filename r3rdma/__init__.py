"""r3rdma: a store for Rollout Routing Replay (R3) of Mixture-of-Experts models.

What an engine and a trainer call. An engine builds its capture pipeline from one
:class:`R3Config` (``build_capturer(R3Config.from_json(...), ...)``, from
:mod:`r3rdma.integrations.builders`) or by hand from
:class:`RoutingCapturer`, :class:`RoutingWriter` and a store (:class:`LocalRoutingStore` or
:class:`StoreNodesClient`). A trainer reads with :class:`RoutingReader` (:class:`PackedRouting`
micro-batches) and replays with :class:`RouterReplay` / :class:`ReplayBatch`.

Errors: every error r3rdma raises on purpose is an :class:`R3Error`. The ones exported here are
those a caller branches on: retry (:class:`TransportError`, :class:`R3TimeoutError`), fix the
credentials (:class:`AuthenticationError`), the data is not there (:class:`UnknownRolloutError`,
:class:`UnknownRequestError`), the data is damaged (:class:`CorruptDataError`). The whole
hierarchy is in :mod:`r3rdma.errors`; engine and trainer integrations in
:mod:`r3rdma.integrations`.

Importing r3rdma touches no GPU, starts no thread and sets no environment variable; names load
on first use, so a store node or a transport-only process does not import torch.
"""

import importlib as _importlib

from r3rdma.errors import (
    AuthenticationError,
    CorruptDataError,
    R3Error,
    R3TimeoutError,
    TransportError,
    UnknownRequestError,
    UnknownRolloutError,
)

_LAZY = {
    "R3Config": "r3rdma.config",
    "RoutingCapturer": "r3rdma.capture",
    "RoutingWriter": "r3rdma.write",
    "StoreNodesClient": "r3rdma.write",
    "LocalRoutingStore": "r3rdma.store.local_store",
    "RoutingReader": "r3rdma.read",
    "PackedRouting": "r3rdma.read",
    "RouterReplay": "r3rdma.integrations.hf_router_replay",
    "ReplayBatch": "r3rdma.replay",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'r3rdma' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # The public API and the module's dunders; not helpers or submodules bound as a side effect.
    return sorted(set(__all__) | {"__version__"} | {n for n in globals() if n.startswith("__") and n.endswith("__")})


__version__ = "0.1.0"

__all__ = [
    "R3Config",
    "RoutingCapturer",
    "RoutingWriter",
    "LocalRoutingStore",
    "StoreNodesClient",
    "RoutingReader",
    "PackedRouting",
    "RouterReplay",
    "ReplayBatch",
    "R3Error",
    "AuthenticationError",
    "CorruptDataError",
    "R3TimeoutError",
    "TransportError",
    "UnknownRequestError",
    "UnknownRolloutError",
]
