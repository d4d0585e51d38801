"""r3rdma: a store for Rollout Routing Replay (R3) of Mixture-of-Experts models.

Rollout engines capture each token's top-k expert ids per MoE layer (:class:`RoutingCapturer`),
commit them as Zarr v3 (:class:`LocalRoutingStore` behind a :class:`RoutingWriter`), and
trainers read them back (:class:`RoutingReader`) to replay them in their forward pass.

Importing r3rdma touches no GPU, starts no thread and sets no environment variable.
"""

from .errors import *  # noqa: F403 - the hierarchy is part of the public API
from .errors import __all__ as _errors_all

# Public names resolve lazily (PEP 562): a store node or a transport-only process imports
# r3rdma.errors without pulling in torch; ``from r3rdma import RoutingCapturer`` still works.
_LAZY = {
    "RoutingCapturer": "capture", "RoutingSink": "capture", "num_routing_rows": "capture",
    "R3Config": "config",
    "validate_id": "ids",
    "CommitResult": "local_store", "LocalRoutingStore": "local_store",
    "RoutingWriter": "pipeline",
    "PackedRouting": "reader", "RolloutInfo": "reader", "RoutingReader": "reader",
    "RequestRecord": "records", "routing_dtype": "records",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'r3rdma' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "CommitResult",
    "LocalRoutingStore",
    "PackedRouting",
    "R3Config",
    "RequestRecord",
    "RolloutInfo",
    "RoutingCapturer",
    "RoutingReader",
    "RoutingSink",
    "RoutingWriter",
    "num_routing_rows",
    "routing_dtype",
    "validate_id",
    *_errors_all,
]
