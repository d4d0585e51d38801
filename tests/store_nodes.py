"""Store nodes as subprocesses for tests: the package's own launcher (r3rdma.store.process)."""

from r3rdma.store.process import NodeProcess as RunningNode
from r3rdma.store.process import new_token
from r3rdma.store.process import spawn_node as start_node

__all__ = ["RunningNode", "new_token", "start_node"]
