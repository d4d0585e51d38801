"""r3rdma.store: store nodes that ingest routing over UCX, write Zarr, and serve reads over HTTP."""

from .http_app import make_http_app
from .metrics import NodeMetrics
from .address import NodeAddress
from .node import StoreNode

__all__ = ["NodeAddress", "NodeMetrics", "StoreNode", "make_http_app"]
