"""Errors of HTTP reads from a store node, as :class:`R3Error` types a trainer can act on.

A refused token is :class:`AuthenticationError`; a connection refused, reset or closed mid-body
is :class:`TransportError` and a wait past the timeout :class:`R3TimeoutError` (both worth a
retry); another status (5xx) is :class:`StoreError`. Absent files (404) are the caller's to
handle; only bytes that arrived whole and fail their checksum are :class:`CorruptDataError`.
"""

from __future__ import annotations

import http.client
import re

from r3rdma.errors import AuthenticationError, R3Error, R3TimeoutError, StoreError, TransportError

__all__ = ["HTTPStatusError", "read_error", "status_error"]


class HTTPStatusError(Exception):
    """A store node answered with a status its caller cannot use (not 2xx, not a 404 that
    means absent); :func:`read_error` says what it means."""

    def __init__(self, status: int, text: str = "") -> None:
        super().__init__(f"HTTP {status}{' ' + text if text else ''}")
        self.status = status
        self.text = text


def status_error(node: str, what: str, status: int, text: str = "", *, token_sent: bool = True) -> R3Error:
    """The error for store node ``node`` answering ``what`` (e.g. ``GET /zarr/<key>``) with an
    HTTP ``status`` the caller cannot use (a 404 that means "absent" is the caller's to handle).
    ``token_sent``: whether the request carried a token (a 401 then means the wrong one)."""
    if status in (401, 403) and not token_sent:
        return AuthenticationError(
            f"store node {node} needs a read token and no token was sent ({what}: HTTP {status}); "
            "pass token= to RoutingReader (the nodes' read token, derive_read_token(secret), or the "
            "<secret file>.read a node writes), or --read-token-file / R3_STORE_READ_TOKEN_FILE to r3rdma commands"
        )
    if status in (401, 403):
        # The node's text says no more than this; the token itself is never in a message.
        return AuthenticationError(
            f"store node {node} refused the token ({what}: HTTP {status}); "
            "give the reader the nodes' read token, derive_read_token(secret), not the push secret "
            "(--read-token-file / R3_STORE_READ_TOKEN_FILE)"
        )
    detail = " ".join(text.split())[:200]
    side = "failed" if status >= 500 else "refused"  # 5xx: the node's own failure
    return StoreError(f"store node {node} {side} the read ({what}: HTTP {status}{' ' + detail if detail else ''})")


def read_error(node: str, what: str, error: BaseException, *, token_sent: bool = True) -> R3Error | None:
    """The :class:`R3Error` for ``error``, raised while reading ``what`` from store node
    ``node`` over HTTP (r3rdma's client, obstore, http.client, or aiohttp under zarr's fsspec
    store); None when it is not a failure to talk to the node (the caller decides: absent,
    corrupt, a bug).

    - R3Error: itself;
    - :class:`HTTPStatusError`: 404 None (absent), else see :func:`status_error`;
    - a refused token (401/403): AuthenticationError; 404: None (absent); another HTTP status:
      see :func:`status_error` (``token_sent``: whether the request carried a token);
    - a timeout: R3TimeoutError; a connection refused, reset or closed mid-body, a DNS failure,
      an unparsable HTTP response: TransportError. Both are worth a retry;
    - FileNotFoundError: fsspec raises it for a 404 (None here), and also for a status or
      connection error while it probes a file's size (then its cause says which).
    """
    import aiohttp

    if isinstance(error, R3Error):
        return error
    if isinstance(error, HTTPStatusError):  # r3rdma's own client (r3rdma.read.node_http)
        if error.status == 404:
            return None
        return status_error(node, what, error.status, error.text, token_sent=token_sent)
    obstore_error = _obstore_error(node, what, error, token_sent)
    if obstore_error is not None:
        return obstore_error
    if isinstance(error, FileNotFoundError):
        cause = error.__cause__
        if cause is None or isinstance(cause, FileNotFoundError):
            return None
        return read_error(node, what, cause, token_sent=token_sent)
    if isinstance(error, aiohttp.ClientResponseError):
        if error.status == 404:
            return None
        return status_error(node, what, error.status, error.message, token_sent=token_sent)
    if isinstance(error, TimeoutError):  # socket.timeout, asyncio's and aiohttp's timeouts
        return R3TimeoutError(f"store node {node} did not answer in time ({what}; retryable): {_describe(error)}")
    if isinstance(error, (OSError, http.client.HTTPException, aiohttp.ClientError)):
        # ConnectionError (refused, reset), socket.gaierror (DNS), ssl errors, IncompleteRead,
        # aiohttp's connection and payload errors.
        return TransportError(f"connection to store node {node} failed ({what}; retryable): {_describe(error)}")
    return None


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _obstore_error(node: str, what: str, error: BaseException, token_sent: bool) -> R3Error | None:
    """obstore's errors (zarr's ObjectStore over HTTPStore) carry the HTTP outcome in their
    type (a refused token) or only in their text (status, timeout, connection): read both."""
    try:
        from obstore import exceptions as obs
    except ImportError:
        return None
    if not isinstance(error, obs.BaseError):
        return None
    text = str(error)
    first = text.split("\n", 1)[0][:300]
    os_error = re.search(r"kind: (\w+),\s*message: \"([^\"]*)\"", text)  # the socket's own error, in the debug text
    if os_error:
        first += f" ({os_error.group(1)}: {os_error.group(2)})"
    status = re.search(r"non-2xx status code: (\d{3})", text)
    if status:
        return status_error(node, what, int(status.group(1)), first, token_sent=token_sent)
    if isinstance(error, (obs.UnauthenticatedError, obs.PermissionDeniedError)):
        return status_error(node, what, 401 if isinstance(error, obs.UnauthenticatedError) else 403, first, token_sent=token_sent)
    if re.search(r"\bTimedOut\b|timed out|kind: Timeout", text):
        return R3TimeoutError(f"store node {node} did not answer in time ({what}; retryable): {first}")
    return TransportError(f"connection to store node {node} failed ({what}; retryable): {first}")
