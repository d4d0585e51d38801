"""A reader's HTTP client of one store node: its Zarr files, with shards decoded as they stream.

A trainer that wants most of a batch array needs the array's ``zarr.json`` and its one shard
file. Through zarr's fsspec store that is a chain: metadata GET, then shard GET, then decode
of the whole shard once its last byte has arrived. Here the three overlap:

- the metadata and the shard (``c/0/0/0``: r3rdma writes one shard per batch array) are
  requested together;
- once the metadata names the shard's index size, the index alone is fetched with a suffix
  Range GET, so it is known long before the body's end (where it lies) arrives;
- while the body streams into one buffer, each inner chunk whose bytes have all arrived is
  CRC-checked and decompressed in the chunk pool (threads; crc32c and zstd release the GIL).

So decoding hides behind the transfer and only the last chunk's decode follows it. Anything
that is not that layout (other codecs, several shards) comes back as None and the caller
reads through zarr. One event loop thread and one aiohttp session per client; every wait has
a timeout (``timeout_s`` between bytes).
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import aiohttp
import numpy as np

from .errors import CorruptDataError
from .shard_codec import ShardDecoder, chunk_pool

__all__ = ["NodeHttpClient", "HttpStatusError"]

_SHARD_KEY = "c/0/0/0"  # the one shard of a batch array (default key encoding, "/" separator)
_READ_BUFSIZE = 4 << 20  # aiohttp's 64 KiB default pauses the socket reader too often at GB/s


class HttpStatusError(Exception):
    """A store node answered a read with an unexpected HTTP status."""

    def __init__(self, url: str, status: int, text: str) -> None:
        super().__init__(f"GET {url}: HTTP {status} {text.strip()[:200]}")
        self.status = status


class NodeHttpClient:
    """GETs of ``<base_url>/zarr/<key>`` with a bearer ``token``; thread-safe, blocking API."""

    def __init__(self, base_url: str, token: str | None, *, timeout_s: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._thread: threading.Thread | None = None

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return

        async def shutdown() -> None:
            if self._session is not None:
                await self._session.close()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        assert self._thread is not None
        self._thread.join(timeout=10)
        loop.close()

    def get_json(self, key: str) -> dict[str, Any] | None:
        """The JSON document at ``key``, or None if the node has no such file (404)."""
        return self._run(self._get_json(key))

    def read_array(self, key: str, where: str) -> np.ndarray | None:
        """The whole batch array at ``key`` (its directory), or None when its layout is not the
        one :class:`ShardDecoder` knows. Raises CorruptDataError naming ``where`` on damage."""
        return self._run(self._read_array(key.rstrip("/") + "/", where))

    # -- internals --------------------------------------------------------------------------

    def _run(self, coro: Any) -> Any:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=loop.run_forever, name="r3rdma-http", daemon=True)
                self._thread.start()
                self._loop = loop
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # created on the loop thread, used only there
            self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout, read_bufsize=_READ_BUFSIZE)
        return self._session

    def _url(self, key: str) -> str:
        return f"{self.base_url}/zarr/{key}"

    async def _get_json(self, key: str) -> dict[str, Any] | None:
        session = await self._client()
        async with session.get(self._url(key)) as response:
            if response.status == 404:
                return None
            body = await response.read()
            if response.status != 200:
                raise HttpStatusError(self._url(key), response.status, body.decode(errors="replace"))
        try:
            document = json.loads(body)
        except ValueError as e:
            raise CorruptDataError(f"{self._url(key)} is not JSON: {e}") from e
        if not isinstance(document, dict):
            raise CorruptDataError(f"{self._url(key)} is not a JSON object")
        return document

    async def _get_range(self, key: str, suffix: int) -> bytes:
        session = await self._client()
        async with session.get(self._url(key), headers={"Range": f"bytes=-{suffix}"}) as response:
            body = await response.read()
            if response.status not in (200, 206):
                raise HttpStatusError(self._url(key), response.status, body.decode(errors="replace"))
        return body[-suffix:]

    async def _read_array(self, prefix: str, where: str) -> np.ndarray | None:
        session = await self._client()
        metadata = asyncio.ensure_future(self._get_json(prefix + "zarr.json"))
        try:
            async with session.get(self._url(prefix + _SHARD_KEY)) as response:
                meta = await metadata
                if meta is None:
                    raise CorruptDataError(f"{where}: {self._url(prefix + 'zarr.json')} not found")
                decoder = ShardDecoder.of(meta)
                if decoder is None or decoder.num_shards != 1:
                    return None  # not our layout: the body is dropped unread with the connection
                out = np.empty(decoder.shape, dtype=decoder.dtype)
                if response.status == 404:  # no shard file: every chunk is the fill value
                    decoder.decode_into(out, 0, None, where)
                    return out
                if response.status != 200:
                    text = (await response.read()).decode(errors="replace")
                    raise HttpStatusError(self._url(prefix + _SHARD_KEY), response.status, text)
                await self._stream_decode(response, prefix + _SHARD_KEY, decoder, out, where)
                return out
        finally:
            if not metadata.done():
                metadata.cancel()

    async def _stream_decode(
        self, response: aiohttp.ClientResponse, key: str, decoder: ShardDecoder, out: np.ndarray, where: str
    ) -> None:
        size = response.content_length
        if size is None:  # no length to stream into: take the body whole, then decode
            decoder.decode_into(out, 0, await response.read(), where)
            return
        if size < decoder.index_bytes:
            raise CorruptDataError(f"{where}: shard has {size} bytes, less than its {decoder.index_bytes}-byte index")
        loop = asyncio.get_running_loop()
        index = asyncio.ensure_future(self._get_range(key, decoder.index_bytes))
        body = np.empty(size, dtype=np.uint8)
        view = memoryview(body)
        received = 0
        plan: list | None = None
        next_job = 0
        decodes: list[asyncio.Future] = []
        piece_task: asyncio.Future | None = None
        try:
            while True:
                piece_task = asyncio.ensure_future(response.content.readany())
                if plan is None and not index.done():
                    # Whichever comes first: more body, or the index (then the chunks already
                    # received can start decoding while the sender is between writes).
                    await asyncio.wait([piece_task, index], return_when=asyncio.FIRST_COMPLETED)
                if plan is None and index.done():
                    plan = decoder.plan(out, 0, index.result(), size, where)
                while plan is not None and next_job < len(plan) and plan[next_job].end <= received:
                    job = plan[next_job]
                    decodes.append(loop.run_in_executor(chunk_pool(), decoder.decode_chunk, view[job.offset : job.end], job.target, job.where))
                    next_job += 1
                piece = await piece_task
                if not piece:
                    break
                if received + len(piece) > size:
                    raise CorruptDataError(f"{where}: shard body exceeds its Content-Length {size}")
                view[received : received + len(piece)] = piece
                received += len(piece)
            if received != size:
                raise CorruptDataError(f"{where}: shard body ended after {received} of {size} bytes")
            tail = await index
            if bytes(view[size - decoder.index_bytes :]) != tail:
                # The file changed between the two GETs (deleted and rewritten under the same name).
                raise CorruptDataError(f"{where}: shard changed while it was being read")
            if plan is None:
                plan = decoder.plan(out, 0, tail, size, where)
            for job in plan[next_job:]:
                decodes.append(loop.run_in_executor(chunk_pool(), decoder.decode_chunk, view[job.offset : job.end], job.target, job.where))
            await asyncio.gather(*decodes)
        except BaseException:
            index.cancel()
            if piece_task is not None:
                piece_task.cancel()
            # Chunk decodes write into ``out``; let the started ones finish before it is dropped.
            await asyncio.gather(*decodes, return_exceptions=True)
            raise
