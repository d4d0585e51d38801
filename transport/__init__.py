"""r3rdma.transport: authenticated, batched pushes of routing records to store nodes.

Importing this package imports no ucxx and sets no environment variable; the UCXX
implementation loads ucxx on first use, after :func:`configure_ucx_env`.
See docs/PROTOCOL.md for the wire format.
"""

from .auth import derive_admin_token, derive_read_token, load_secret, load_token_file
from .base import Handler, PushAck, ServerAddress, TransportClient, TransportServer
from .batch import PackedBatch, RecordMeta
from .frames import PROTOCOL_VERSION
from .limits import TransportLimits
from .loopback import LoopbackClient, LoopbackServer
from .ucx_env import configure_ucx_env
from .ucxx_transport import UcxxClient, UcxxServer

__all__ = [
    "PROTOCOL_VERSION",
    "Handler",
    "LoopbackClient",
    "LoopbackServer",
    "PackedBatch",
    "PushAck",
    "RecordMeta",
    "ServerAddress",
    "TransportClient",
    "TransportLimits",
    "TransportServer",
    "UcxxClient",
    "UcxxServer",
    "configure_ucx_env",
    "derive_admin_token",
    "derive_read_token",
    "load_secret",
    "load_token_file",
]
