"""Servers for tests: store nodes as subprocesses (the package's own launcher,
r3rdma.store.process), and a stand-in HTTP server in a thread."""

import asyncio
import contextlib
import threading

from aiohttp import web

from r3rdma.store.process import NodeProcess as RunningNode
from r3rdma.store.process import new_token
from r3rdma.store.process import spawn_node as start_node

__all__ = ["RunningNode", "new_token", "start_node", "serve_in_thread"]


@contextlib.contextmanager
def serve_in_thread(app: web.Application):
    """Serve ``app`` on 127.0.0.1 (port 0) from an event loop in a thread; yields its base URL."""
    loop = asyncio.new_event_loop()
    # Test handlers end when the test releases them; a connection the client left open must
    # not hold the server's graceful stop for aiohttp's default 60 s.
    runner = web.AppRunner(app, shutdown_timeout=2.0)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
