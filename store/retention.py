"""Retention: delete rollouts on every store node (the library behind ``r3rdma delete``).

Deletion goes through each node's authenticated HTTP service (``DELETE /v1/rollouts/{id}``,
``DELETE /v1/rollouts?older_than_s=N``), never around it: the node owns its root (it holds the
writer lock) and removes a rollout's index first, so readers stop seeing it at once, then its
arrays. A trainer that reads a deleted rollout gets :class:`~r3rdma.errors.UnknownRolloutError`.

Every node is asked, in parallel; a node that cannot be reached makes the call raise after
the others were done, so a retention run is either complete or says which nodes still hold data
(the message names them; the error's ``failed_nodes`` lists them). With replicas a rollout's
requests live on several nodes: pass every node, and run the delete again once a node that was
down is back (its copy reappears to readers when it restarts).
Errors say what happened: :class:`AuthenticationError` (the node refused the token),
:class:`TransportError` (connection refused, reset or closed) and :class:`R3TimeoutError`
(both worth a retry: deletes are idempotent), :class:`StoreError` (the node failed: HTTP 5xx),
:class:`CorruptDataError` (an answer that is not the JSON the node sends).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from r3rdma.errors import (
    AuthenticationError,
    ConfigError,
    CorruptDataError,
    InvalidIdError,
    R3Error,
    R3TimeoutError,
    StoreError,
    TransportError,
    UnknownRolloutError,
)
from r3rdma.ids import validate_id
from r3rdma.transport.auth import coerce_token

__all__ = ["delete_rollout", "delete_older_than"]


def delete_rollout(nodes: Sequence[str], rollout_id: str, *, token: str, timeout_s: float = 30.0) -> dict[str, bool]:
    """Delete ``rollout_id`` (all its requests) on every node (``http://host:port``).

    Returns, per node, whether it held the rollout. Raises :class:`UnknownRolloutError` if no
    node held it, :class:`TransportError` / :class:`R3TimeoutError` if a node could not be
    reached or did not answer in ``timeout_s`` (after asking all).
    """
    validate_id(rollout_id, "rollout_id")
    results = _run(nodes, "DELETE", f"/v1/rollouts/{rollout_id}", token, timeout_s, missing_ok=True)
    held = {node: body is not None for node, body in results.items()}
    if not any(held.values()):
        raise UnknownRolloutError(f"rollout {rollout_id!r} not found on any of {len(nodes)} store nodes")
    return held


def delete_older_than(nodes: Sequence[str], age_s: float, *, token: str, timeout_s: float = 30.0) -> dict[str, list[str]]:
    """Delete, on every node, each rollout whose last commit is more than ``age_s`` s old.

    Returns the deleted rollout ids per node.
    """
    if isinstance(age_s, bool) or not isinstance(age_s, (int, float)) or not age_s >= 0:
        raise ConfigError(f"age_s must be a number >= 0, got {age_s!r}")
    results = _run(nodes, "DELETE", f"/v1/rollouts?older_than_s={float(age_s)!r}", token, timeout_s, missing_ok=False)
    out = {}
    for node, body in results.items():
        deleted = body.get("deleted") if isinstance(body, dict) else None
        if not isinstance(deleted, list):
            raise CorruptDataError(
                f"store node {node} answered DELETE /v1/rollouts with {str(body)[:200]!r}, not {{'deleted': [...]}}"
            )
        out[node] = deleted
    return out


def _run(nodes: Sequence[str], method: str, path: str, token: str, timeout_s: float, *, missing_ok: bool) -> dict[str, Any]:
    if not nodes:
        raise ConfigError("retention needs at least one store node URL (http://host:port)")
    for node in nodes:
        if not node.startswith(("http://", "https://")):
            raise ConfigError(f"store node URL must be http(s)://host:port, got {node!r}")
    token = coerce_token(token, "the admin token (token=)")  # stripped; refused if malformed
    return asyncio.run(_all(list(nodes), method, path, token, timeout_s, missing_ok))


async def _all(nodes: list[str], method: str, path: str, token: str, timeout_s: float, missing_ok: bool) -> dict[str, Any]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(node: str) -> Any:
            url = node.rstrip("/") + path
            what = f"{method} {path.split('?')[0]}"  # never the headers: they hold the token
            try:
                async with session.request(method, url, headers=headers) as response:
                    text = await response.text()
                    status = response.status
            except TimeoutError as e:  # asyncio's and aiohttp's timeouts (before OSError: a subclass)
                raise R3TimeoutError(f"store node {node} did not answer {what} within {timeout_s} s (retryable)") from e
            except (aiohttp.ClientError, OSError) as e:
                raise TransportError(f"store node {node}: {what} failed (retryable): {type(e).__name__}: {e}") from e
            if status == 200:
                try:
                    return json.loads(text)
                except ValueError as e:
                    raise CorruptDataError(f"store node {node} answered {what} with {text[:200]!r}, not JSON") from e
            if status == 404 and missing_ok:
                return None
            message = f"store node {node} answered {what} with HTTP {status}: {text.strip()[:500]}"
            if status in (401, 403):
                raise AuthenticationError(f"{message} (the token was refused: check the store token)")
            if status == 400:
                raise InvalidIdError(message)
            raise StoreError(message)

        results = await asyncio.gather(*(one(n) for n in nodes), return_exceptions=True)
    failed = [(n, r) for n, r in zip(nodes, results) if isinstance(r, BaseException)]
    if failed:
        first = failed[0][1]
        done = [n for n, r in zip(nodes, results) if not isinstance(r, BaseException)]
        summary = "; ".join(f"{n}: {r}" for n, r in failed)
        cls = type(first) if isinstance(first, R3Error) else StoreError
        error = cls(f"retention incomplete on {len(failed)} of {len(nodes)} nodes (done on {done}): {summary}")
        # Still hold data: delete there again later. Set on the instance (it keeps the first
        # failure's type, whose class does not declare the attribute), as RoutingWriter does.
        setattr(error, "failed_nodes", [n for n, _ in failed])  # noqa: B010
        raise error from first
    return dict(zip(nodes, results))
