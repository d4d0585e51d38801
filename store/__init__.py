"""r3rdma.store: the storage format and where it lives: Zarr v3 layout and codecs, the rollout
index, the local store (embedded default), and the store node (UCX ingest, HTTP reads, metrics).

Submodules load on first use, so reading the format (``layout``, ``local_store``) does not pull
in the node's aiohttp or UCX stack.
"""

import importlib

_LAZY = {
    "LocalRoutingStore": "local_store",
    "CommitResult": "local_store",
    "NodeAddress": "address",
    "NodeMetrics": "metrics",
    "StoreNode": "node",
    "make_http_app": "http_app",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'r3rdma.store' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
