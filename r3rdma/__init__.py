"""r3rdma: a store for Rollout Routing Replay (R3) of Mixture-of-Experts models.

Rollout engines capture each token's top-k expert ids per MoE layer (:class:`RoutingCapturer`),
commit them as Zarr v3 (:class:`LocalRoutingStore` behind a :class:`RoutingWriter`), and
trainers read them back (:class:`RoutingReader`) to replay them in their forward pass.

Importing r3rdma touches no GPU, starts no thread and sets no environment variable.
"""

from .capture import RoutingCapturer, RoutingSink, num_routing_rows
from .config import R3Config
from .errors import *  # noqa: F403 - the hierarchy is part of the public API
from .errors import __all__ as _errors_all
from .ids import validate_id
from .local_store import CommitResult, LocalRoutingStore
from .pipeline import RoutingWriter
from .reader import PackedRouting, RolloutInfo, RoutingReader
from .records import RequestRecord, routing_dtype

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
