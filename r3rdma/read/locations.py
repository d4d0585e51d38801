"""Where a reader's sources are: the caller's argument as a list of sources, each one checked,
and the zarr store a store node's URL is read through.

A source is an ``http(s)://`` URL of a store node, a local store root (an existing
directory), or any zarr store. Whatever cannot be one is a :class:`ConfigError` naming it and
what is wrong (a malformed URL, ``host:port`` without ``http://``, a directory that does not
exist), so a typo is not reported later as an unknown rollout.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

from r3rdma.errors import ConfigError
from r3rdma.read.node_http import NodeHTTPStore

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig

__all__ = ["source_items", "check_url", "check_local_root", "http_store"]

# host:port, which is what the engines' R3_STORE_URLS holds (UCX push addresses), not a URL.
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d+)$")


def source_items(sources: Any) -> list[Any]:
    """The reader's sources as a list: one source, a list or tuple of them, or a string of
    comma-separated store node URLs (the form ``$R3_STORE_HTTP_URLS`` and the commands take).

    A string is split on commas unless it names an existing directory (a path may hold one).
    """
    items = list(sources) if isinstance(sources, (list, tuple)) else [sources]
    out: list[Any] = []
    for item in items:
        if isinstance(item, str) and "," in item and not os.path.isdir(item):
            out.extend(part.strip() for part in item.split(",") if part.strip())
        else:
            out.append(item)
    return out


def check_url(url: str) -> str:
    """``url`` if it is a usable store node URL (``http(s)://host[:port][/path]``), else
    :class:`ConfigError` naming it and what is wrong."""
    from urllib.parse import urlsplit

    if any(c.isspace() for c in url):
        raise ConfigError(f"store node URL {url!r} holds whitespace; expected http://host:port")
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError for a port that is not a number in 0..65535
    except ValueError as e:
        raise ConfigError(
            f"store node URL {url!r} is not a valid URL ({e}); expected http://host:port "
            "(several: a list, or one string with commas between URLs)"
        ) from e
    if not parts.hostname:
        raise ConfigError(f"store node URL {url!r} names no host; expected http://host:port")
    if port == 0:
        raise ConfigError(f"store node URL {url!r} has port 0; expected the node's HTTP port (--http-port)")
    if parts.query or parts.fragment:
        raise ConfigError(f"store node URL {url!r} has a query or fragment; expected http://host:port")
    return url


def check_local_root(path: str) -> None:
    """A local source must be an existing directory; else :class:`ConfigError` saying what it is."""
    if os.path.isdir(path):
        return
    if "://" in path:
        scheme = path.split("://", 1)[0]
        raise ConfigError(
            f"source {path!r}: store nodes are read over HTTP, expected http://host:port (or https://), got the scheme {scheme!r}"
        )
    match = _HOST_PORT.match(path)
    if match and not os.path.exists(path):
        raise ConfigError(
            f"source {path!r} is not a URL (and no such directory exists): did you mean http://{path}? "
            "Readers take the store nodes' HTTP URLs (--http-port; $R3_STORE_HTTP_URLS), "
            "not the UCX push addresses of R3_STORE_URLS"
        )
    if os.path.exists(path):
        raise ConfigError(f"source {path!r} is not a directory: expected a local store root or http://host:port")
    raise ConfigError(f"no such directory: {path!r} (expected a local store root, or a store node's http://host:port)")


def http_store(url: str, token: str | None, timeout_s: float) -> Any:
    """A read-only zarr store of a store node's ``/zarr/`` tree.

    ``http://``: :class:`~r3rdma.read.node_http.NodeHTTPStore`, r3rdma's own client (a ranged
    GET of an inner chunk costs 2-2.5x less CPU than through obstore; its module says why).
    ``https://``: ``ObjectStore`` over obstore's ``HTTPStore`` (Rust HTTP client and TLS; it
    moved whole shards at 2-2.5x the rate of zarr's ``FsspecStore``, BENCHMARKS.md "Read at
    scale"). Both try a failed request at most twice more within ``timeout_s``, so a dead node
    fails over in time (obstore's default retries for minutes).
    """
    from datetime import timedelta

    from r3rdma.transport.auth import coerce_token

    if token:  # e.g. open(path).read(): stripped, its trailing newline is no header value
        token = coerce_token(token, "the read token (token=)")
    if url.startswith("http://"):
        return NodeHTTPStore(url, token, timeout_s)
    try:
        from obstore.store import HTTPStore
    except ImportError:  # a declared dependency; without it (no wheel for the platform): fsspec
        return _fsspec_store(url, token, timeout_s)
    from zarr.storage import ObjectStore

    options: ClientConfig = {
        "allow_http": True,
        "connect_timeout": timedelta(seconds=timeout_s),
        "timeout": timedelta(seconds=timeout_s),
    }
    if token:
        options["default_headers"] = {"Authorization": f"Bearer {token}"}
    retry: RetryConfig = {
        "max_retries": 2,
        "retry_timeout": timedelta(seconds=timeout_s),
        "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=1), "base": 2},
    }
    return ObjectStore(HTTPStore.from_url(url.rstrip("/") + "/zarr", client_options=options, retry_config=retry), read_only=True)


def _fsspec_store(url: str, token: str | None, timeout_s: float) -> Any:
    import aiohttp
    from zarr.storage import FsspecStore

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # Each wait (connect, each read) is bounded, not the whole transfer.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
    options = {"headers": headers, "client_kwargs": {"timeout": timeout}}
    return FsspecStore.from_url(url.rstrip("/") + "/zarr", storage_options=options, read_only=True)
