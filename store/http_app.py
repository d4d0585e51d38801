"""The store node's read service (aiohttp).

Routes:
  GET  /healthz                    liveness; no token needed
  GET  /metrics                    Prometheus text format
  GET  /v1/rollouts                committed rollout ids
  GET  /v1/rollouts/{rollout_id}   the rollout index (JSON)
  GET|HEAD /zarr/{path}            the Zarr files, with Range (a-b, a-, and suffix -n), so
                                   zarr-python (FsspecStore) and tensorstore open the root over HTTP
  DELETE /v1/rollouts/{rollout_id} delete a rollout and all its requests (retention)
  DELETE /v1/rollouts?older_than_s=N   delete every rollout whose last commit is older than N s

Everything but /healthz needs ``Authorization: Bearer <token>``, with tokens derived from the
push secret (:func:`~r3rdma.transport.auth.derive_read_token`), never the secret itself:
GET/HEAD take the *read token* only (unless the node runs with ``public_read``, which opens
GET/HEAD to anyone); DELETE (and any other method) takes the *admin token* only. A missing or
unknown token is 401; a valid token for the other kind of request is 403 (a reader cannot
delete; the admin token does not read either). The push secret is refused like any wrong
token, so a client that sends it learns nothing and a sniffed request cannot push. Deletes go through
the node's writer (:class:`~r3rdma.store.local_store.LocalRoutingStore`), never behind its back. Paths are checked component by component before the filesystem is touched:
only Zarr names (ids, array names, ``zarr.json``, ``c``, chunk indices); never hidden or
temporary files, never ``..``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import os
import re
import shutil
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from aiohttp import ClientError, ClientSession, ClientTimeout, UnixConnector, hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from r3rdma.errors import ConfigError, CorruptDataError, InvalidIdError, R3Error, UnknownRolloutError
from r3rdma.store.local_store import LocalRoutingStore, check_rollout_dir_name
from r3rdma.store.rollout_index import load_index, read_file

from .metrics import HttpMetrics, NodeMetrics

__all__ = ["make_http_app"]

_COMPONENT = re.compile(r"[A-Za-z0-9_:-][A-Za-z0-9._:-]{0,199}")  # no leading dot: hides .lock/.tmp
_MAX_DEPTH = 8
_SMALL_FILE = 256 << 10  # whole files up to this size are sent from memory (see _send_file)
_CONTROL_SESSION = web.AppKey("control_session", ClientSession)
_CONDITIONAL = ("If-Range", "If-Match", "If-None-Match", "If-Modified-Since", "If-Unmodified-Since")

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_http_app(
    root: Path,
    *,
    read_token: str | None,
    admin_token: str | None,
    public_read: bool,
    metrics: NodeMetrics | HttpMetrics,
    store: LocalRoutingStore | None = None,
    control: str | None = None,
) -> web.Application:
    """The read service of ``root``; with ``store`` (the node's writer) it also serves DELETEs.

    ``control``: a read worker's app (store/read_workers.py) passes on DELETE and /metrics to
    the node process listening on this Unix socket, which owns the writer and the metrics.

    ``read_token`` is accepted for GET/HEAD, ``admin_token`` for DELETE (derive both from the
    push secret with ``derive_read_token`` / ``derive_admin_token``); ``None`` accepts no token
    for that kind of request (``public_read`` still opens GET/HEAD).
    """
    if read_token is None and not public_read:
        raise ConfigError("the read service needs a read token unless public_read is set, got neither")
    if read_token is not None and read_token == admin_token:
        raise ConfigError("the read and admin tokens must differ (derive them with different labels)")
    service = _ReadService(
        root, read_token=read_token, admin_token=admin_token, public_read=public_read, metrics=metrics, store=store
    )
    app = web.Application(middlewares=[service.guard], client_max_size=1024)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/v1/rollouts", service.rollouts)
    app.router.add_get("/v1/rollouts/{rollout_id}", service.rollout_index)
    if control is None:
        app.router.add_get("/metrics", service.metrics_view)
        app.router.add_delete("/v1/rollouts", service.delete_old)
        app.router.add_delete("/v1/rollouts/{rollout_id}", service.delete_rollout)
    else:
        app.cleanup_ctx.append(_control_session(control))
        app.router.add_get("/metrics", _to_node)
        app.router.add_delete("/v1/rollouts", _to_node)
        app.router.add_delete("/v1/rollouts/{rollout_id}", _to_node)
    app.router.add_get("/zarr/{path:.*}", service.zarr_file)  # add_get also answers HEAD
    return app


class _ReadService:
    """The handlers of one node's read service and what they share: the root, the tokens, the
    metrics and (for DELETE) the node's writer."""

    def __init__(
        self,
        root: Path,
        *,
        read_token: str | None,
        admin_token: str | None,
        public_read: bool,
        metrics: NodeMetrics | HttpMetrics,
        store: LocalRoutingStore | None,
    ) -> None:
        self.root = root.resolve()
        self.root_dir = str(self.root)
        self.root_prefix = os.path.join(self.root_dir, "")
        self.bearer_read = f"Bearer {read_token}".encode() if read_token else None
        self.bearer_admin = f"Bearer {admin_token}".encode() if admin_token else None
        self.public_read = public_read
        self.metrics = metrics
        self.store = store

    # -- authorisation and request counts ------------------------------------------------------

    @web.middleware
    async def guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        try:
            self._authorise(request)
            response = await handler(request)
        except web.HTTPException as e:
            self.metrics.http_requests.labels(route, str(e.status)).inc()
            raise
        self.metrics.http_requests.labels(route, str(response.status)).inc()
        return response

    def _authorise(self, request: web.Request) -> None:
        """401 without a known token, 403 with the token of the other kind of request."""
        reading = request.method in ("GET", "HEAD")
        if request.path == "/healthz" or (self.public_read and reading):
            return
        given = request.headers.get("Authorization", "").encode()
        wanted, other = (self.bearer_read, self.bearer_admin) if reading else (self.bearer_admin, self.bearer_read)
        if _is(given, wanted):
            return
        if _is(given, other):
            kind = "the read token" if reading else "the admin token"
            raise web.HTTPForbidden(text=f"this request needs {kind}\n")
        raise web.HTTPUnauthorized(text="missing or wrong bearer token\n", headers={"WWW-Authenticate": "Bearer"})

    # -- metrics and rollouts ------------------------------------------------------------------

    async def metrics_view(self, _request: web.Request) -> web.Response:
        """The node's metrics in Prometheus text format, disk gauges read now. Served only by an
        app without ``control`` (the node process), whose metrics are :class:`NodeMetrics`."""
        metrics = self.metrics
        if not isinstance(metrics, NodeMetrics):
            raise TypeError("/metrics is served by the node process (NodeMetrics); a read worker passes it on to the node")
        usage = shutil.disk_usage(self.root)
        metrics.disk_used.set(usage.used)
        metrics.disk_free.set(usage.free)
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def rollouts(self, _request: web.Request) -> web.Response:
        names = sorted(
            p.name for p in self.root.iterdir() if p.is_dir() and (p / "zarr.json").exists() and _COMPONENT.fullmatch(p.name)
        )
        return web.json_response({"rollouts": names})

    async def rollout_index(self, request: web.Request) -> web.Response:
        """The rollout's whole index, merged from its parts (readers fetch the parts themselves)."""
        rollout_id = _rollout_id(request)
        try:
            index = await asyncio.to_thread(load_index, rollout_id, read_file(self.root / rollout_id), "this node")
        except CorruptDataError as e:
            raise web.HTTPInternalServerError(text=f"{e}\n") from e
        if index is None:
            raise web.HTTPNotFound(text=f"{UnknownRolloutError(f'rollout {rollout_id!r} not found')}\n")
        return web.json_response(index.as_format_1(), dumps=lambda o: json.dumps(o, separators=(",", ":")))

    # -- deletes (through the node's writer) ---------------------------------------------------

    def _writer(self) -> LocalRoutingStore:
        if self.store is None:
            raise web.HTTPMethodNotAllowed("DELETE", ["GET", "HEAD"], text="this read service cannot delete\n")
        return self.store

    async def delete_rollout(self, request: web.Request) -> web.Response:
        rollout_id = _rollout_id(request)
        writer = self._writer()
        try:
            await asyncio.to_thread(writer.delete_rollout, rollout_id)
        except UnknownRolloutError as e:
            raise web.HTTPNotFound(text=f"{e}\n") from e
        except R3Error as e:
            raise web.HTTPInternalServerError(text=f"{type(e).__name__}: {e}\n") from e
        return web.json_response({"deleted": [rollout_id]})

    async def delete_old(self, request: web.Request) -> web.Response:
        raw = request.query.get("older_than_s")
        try:
            age = float(raw) if raw is not None else math.nan
        except ValueError:
            age = math.nan
        if not (math.isfinite(age) and age >= 0):
            raise web.HTTPBadRequest(text=f"DELETE /v1/rollouts needs ?older_than_s=<seconds >= 0>, got {raw!r}\n")
        writer = self._writer()
        try:
            deleted = await asyncio.to_thread(writer.delete_older_than, age)
        except R3Error as e:
            raise web.HTTPInternalServerError(text=f"{type(e).__name__}: {e}\n") from e
        return web.json_response({"deleted": deleted})

    # -- Zarr files ----------------------------------------------------------------------------

    async def zarr_file(self, request: web.Request) -> web.StreamResponse:
        rel = request.match_info["path"]
        real = self._real_path(rel)
        if any(h in request.headers for h in _CONDITIONAL):
            return await self._send_conditional(request, real, rel)
        return await self._send_file(request, real, rel)

    def _real_path(self, rel: str) -> str:
        """The file a /zarr/ path names, checked component by component (400 for what no store
        path looks like, 404 for hidden names and for anything resolving outside the root)."""
        parts = rel.split("/")
        if not rel or len(parts) > _MAX_DEPTH or any(".." in p or not _COMPONENT.fullmatch(p.lstrip(".") or "-") for p in parts):
            raise web.HTTPBadRequest(text=f"not a store path: {rel[:200]!r}\n")
        if any(p.startswith(".") for p in parts):
            # Hidden names (.r3rdma.lock, index temp files, zarr v2's .zgroup probes) are not served.
            raise web.HTTPNotFound(text=f"no such file: {rel}\n")
        # Belt and braces: the resolved path must stay under the root (symlinks included).
        # Strings, not pathlib: this runs for every chunk GET, and Path.parents built a Path
        # per level.
        try:
            real = os.path.realpath(os.path.join(self.root_dir, *parts), strict=True)
        except OSError:  # missing, a file used as a directory, a symlink loop
            raise web.HTTPNotFound(text=f"no such file: {rel}\n") from None
        if not real.startswith(self.root_prefix):
            raise web.HTTPNotFound(text=f"no such file: {rel}\n")
        return real

    async def _send_conditional(self, request: web.Request, real: str, rel: str) -> web.StreamResponse:
        """Conditional requests (If-Range, If-None-Match, ...): zarr readers send none;
        FileResponse implements their whole semantics."""
        if not os.path.isfile(real):
            raise web.HTTPNotFound(text=f"no such file: {rel}\n")
        response = web.FileResponse(real, chunk_size=1 << 20)
        await response.prepare(request)  # sends it: only now is it known what was sent
        if request.method == "GET" and response.status in (200, 206):
            self.metrics.http_bytes.inc(response.content_length or 0)
        return response

    async def _send_file(self, request: web.Request, real: str, rel: str) -> web.StreamResponse:
        """GET or HEAD of a whole file or one byte range (Range: a-b, a-, -n), no conditions.

        Why not ``FileResponse``: it opens, stats and closes each file in the default thread
        pool (three hops, and a stat of ``.gz``/``.br`` siblings). A data-parallel reader's
        scattered share is many ~0.6 MB ranged GETs; measured on the CPU VM, the node spent
        0.62 ms of CPU on each through FileResponse and 0.38 ms here (BENCHMARKS.md "A whole RL
        step"): one open, one fstat, ``sendfile``. Opening a page-cached file does not hold the
        loop up.
        """
        try:
            file = open(real, "rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise web.HTTPNotFound(text=f"no such file: {rel}\n") from None
        with file:
            st = os.fstat(file.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise web.HTTPNotFound(text=f"no such file: {rel}\n")
            ranged, start, stop = _byte_range(request, st.st_size)
            kind = "application/json" if real.endswith(".json") else "application/octet-stream"
            if st.st_size <= _SMALL_FILE and not ranged and request.method == "GET":
                # Metadata documents (zarr.json) and small shards: one read, one write.
                body = file.read()
                self.metrics.http_bytes.inc(len(body))
                return web.Response(body=body, content_type=kind, headers={hdrs.ACCEPT_RANGES: "bytes"})
            response = web.StreamResponse(status=206 if ranged else 200)
            response.content_type = kind
            response.headers[hdrs.ACCEPT_RANGES] = "bytes"
            if ranged:
                response.headers[hdrs.CONTENT_RANGE] = f"bytes {start}-{stop - 1}/{st.st_size}"
            response.etag = f"{st.st_mtime_ns:x}-{st.st_size:x}"  # as FileResponse makes them
            response.last_modified = st.st_mtime
            response.content_length = stop - start
            await response.prepare(request)
            if request.method == "GET" and stop > start:
                self.metrics.http_bytes.inc(stop - start)
                await _send_bytes(request, response, file, start, stop, rel)
            await response.write_eof()
            return response


def _is(given: bytes, expected: bytes | None) -> bool:
    return expected is not None and hmac.compare_digest(given, expected)


def _rollout_id(request: web.Request) -> str:
    rollout_id = request.match_info["rollout_id"]
    try:
        # Also refuses ids naming the root's own files (".r3rdma.lock", "zarr.json"): opening
        # "<root>/.r3rdma.lock/zarr.json" raised NotADirectoryError, a 500.
        return check_rollout_dir_name(rollout_id)
    except InvalidIdError as e:
        raise web.HTTPBadRequest(text=f"{e}\n") from e


def _byte_range(request: web.Request, size: int) -> tuple[bool, int, int]:
    """``(ranged, start, stop)`` of a request for a file of ``size`` bytes: the whole file
    without a Range header; 416 for a range this service does not serve."""
    try:
        rng = request.http_range  # slice; a suffix range "-n" arrives as slice(-n, None)
    except ValueError:
        rng = None  # not a single byte range we understand
    ranged = hdrs.RANGE in request.headers
    if ranged and rng is not None and rng.start is not None and rng.start < 0:
        start, stop = max(0, size + rng.start), size
    elif ranged and rng is not None and rng.start is not None:
        start, stop = rng.start, size if rng.stop is None else min(rng.stop, size)
    else:
        start, stop = 0, size
    if ranged and (rng is None or start >= size):
        raise web.HTTPRequestRangeNotSatisfiable(headers={hdrs.CONTENT_RANGE: f"bytes */{size}"})
    return ranged, start, stop


async def _send_bytes(request: web.Request, response: web.StreamResponse, file, start: int, stop: int, rel: str) -> None:
    """Bytes ``start:stop`` of ``file`` after the prepared headers: ``sendfile``, or plain writes
    on a transport without it."""
    if request.transport is None:
        raise ConnectionResetError("the client went away")
    try:
        await asyncio.get_running_loop().sendfile(request.transport, file, start, stop - start)
        return
    except NotImplementedError:
        pass  # a transport without sendfile (TLS): plain writes below
    offset = start
    while offset < stop:
        chunk = os.pread(file.fileno(), min(1 << 20, stop - offset), offset)
        if not chunk:
            raise ConnectionResetError(f"{rel} shrank while being sent")
        await response.write(chunk)
        offset += len(chunk)


async def _healthz(_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _to_node(request: web.Request) -> web.Response:
    """Pass the request on to the node process (the bearer header too: it checks it again)."""
    session = request.app[_CONTROL_SESSION]
    headers = {k: v for k, v in request.headers.items() if k in ("Authorization", "Accept")}
    try:
        async with session.request(request.method, f"http://node{request.path_qs}", headers=headers) as answer:
            body = await answer.read()
            kind = answer.headers.get("Content-Type")
            return web.Response(status=answer.status, body=body, headers={"Content-Type": kind} if kind else None)
    except ClientError as e:
        raise web.HTTPServiceUnavailable(text=f"the store node process does not answer: {type(e).__name__}: {e}\n") from e


def _control_session(control: str) -> Callable[[web.Application], AsyncIterator[None]]:
    """The app's client of the node process's Unix socket ``control``, open while the app runs."""

    async def session(app: web.Application) -> AsyncIterator[None]:
        # The node's deletes can take a while on a large rollout: no total timeout here.
        app[_CONTROL_SESSION] = ClientSession(connector=UnixConnector(path=control), timeout=ClientTimeout(total=None))
        yield
        await app[_CONTROL_SESSION].close()

    return session
