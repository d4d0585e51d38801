"""``r3rdma-store``: run one store node until SIGTERM/SIGINT (then drain and exit 0).

When ready it prints one JSON line: {"event": "ready", "host", "ucx_port", "http_port", "root", "pid",
"read_token_file", "http_workers"}.

At start it writes the HTTP read token (``derive_read_token(secret)``, docs/PROTOCOL.md) to
``--read-token-file`` (default: ``<--token-file>.read``, next to the secret), mode 0600, so
trainers can be handed that file instead of the push secret; ``read_token_file`` in the ready
line names it (null when the secret came from ``$R3_STORE_TOKEN`` and no path was given).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile

from r3rdma.errors import ConfigError, R3Error
from r3rdma.transport import TransportLimits, configure_ucx_env, derive_read_token, load_secret
from r3rdma.transport.ucx_env import STORE_NODE_UCX_ENV, stop_ucxx

from .node import StoreNode
from .node_logging import setup_node_logging
from .read_workers import default_http_workers

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="r3rdma-store", description="r3rdma store node: UCX ingest, Zarr on disk, HTTP reads")
    p.add_argument("--root", required=True, help="directory of this node's Zarr root (created if absent)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve HTTP on and to advertise (default 127.0.0.1)")
    p.add_argument("--ucx-port", type=int, default=0, help="UCX listen port (0: pick a free one)")
    p.add_argument("--http-port", type=int, default=0, help="HTTP port (0: pick a free one)")
    p.add_argument(
        "--token-file",
        default=None,
        help="file holding the shared push secret (else R3_STORE_TOKEN); "
        "HTTP takes only tokens derived from it, never the secret",
    )
    p.add_argument(
        "--read-token-file",
        default=None,
        help="write the HTTP read token (derived from the secret) to this file, mode 0600 "
        "(default: <token-file>.read; not written when the secret comes from R3_STORE_TOKEN)",
    )
    p.add_argument("--public-read", action="store_true", help="serve reads without the token (pushes still need it)")
    p.add_argument("--max-payload-mb", type=int, default=256, help="largest payload of one pushed batch")
    p.add_argument("--max-header-kb", type=int, default=4096, help="largest header of one pushed batch")
    p.add_argument(
        "--max-inflight-mb",
        type=int,
        default=1024,
        help="payload MiB being received or handled at once over all clients (memory budget)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=30.0,
        help="deadline of each network step; also how long a pushed batch's payload may stall, "
        "and how long an HTTP connection may take to send a complete request",
    )
    p.add_argument("--zstd-level", type=int, default=3)
    p.add_argument(
        "--layers-per-chunk",
        type=int,
        default=None,
        help="MoE layers per inner chunk of the stored arrays (default: a power-of-two count of equal groups of >= 64 KiB); set it to the "
        "trainers' pipeline stage size so each stage reads only its own layers",
    )
    p.add_argument(
        "--slice-layout",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="lay out arrays of long requests for trainers that read by slice (context-parallel pieces, pipeline stages): "
        "smaller chunks, layer group major (the default; docs/FORMAT.md, format 4). --no-slice-layout: the whole-request "
        "layout, chunks about one request long, for a store read only by whole requests (read about twice as fast)",
    )
    p.add_argument(
        "--http-workers",
        type=_workers,
        default="auto",
        help="processes serving the HTTP port (reads scale with them; this process then only ingests "
        "and commits); 0: this process serves HTTP itself; auto (default): a quarter of the "
        f"cores, at most 8 (here: {default_http_workers()})",
    )
    p.add_argument("--ready-file", default=None, help="also write the ready JSON line to this file (atomically)")
    return p


def _workers(text: str) -> int:
    if text == "auto":
        return default_http_workers()
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number >= 0, got {text!r}")
    return count


def write_read_token(path: str, token: str) -> str:
    """Write ``token`` to ``path`` atomically, mode 0600 (a fresh file, whatever was there); return its absolute path.

    Several nodes sharing one secret file write the same bytes to the same path; each writes
    its own temporary file and renames it, so a reader never sees a partial token.
    """
    path = os.path.abspath(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path))
    except OSError as e:
        raise ConfigError(f"cannot write the read token file {path!r}: {e}") from e
    try:
        with os.fdopen(fd, "w") as f:  # mkstemp creates it 0600
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ConfigError(f"cannot write the read token file {path!r}: {e}") from e
    return path


async def _serve(args: argparse.Namespace) -> int:
    secret = load_secret(args.token_file)
    read_token_file = args.read_token_file or (args.token_file + ".read" if args.token_file else None)
    if read_token_file:
        read_token_file = write_read_token(read_token_file, derive_read_token(secret))
        logging.getLogger("r3rdma.store").info("HTTP read token written to %s", read_token_file)
    limits = TransportLimits(
        max_payload_bytes=args.max_payload_mb << 20,
        max_header_bytes=args.max_header_kb << 10,
        timeout_s=args.timeout_s,
        max_inflight_bytes=args.max_inflight_mb << 20,
    )
    node = StoreNode(
        args.root,
        secret=secret,
        host=args.host,
        ucx_port=args.ucx_port,
        http_port=args.http_port,
        public_read=args.public_read,
        limits=limits,
        zstd_level=args.zstd_level,
        http_workers=args.http_workers,
        layers_per_chunk=args.layers_per_chunk,
        slice_layout=args.slice_layout,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    address = await node.start()
    ready = json.dumps(
        {
            "event": "ready",
            "host": address.host,
            "ucx_port": address.ucx_port,
            "http_port": address.http_port,
            "root": os.path.abspath(args.root),
            "pid": os.getpid(),
            "read_token_file": read_token_file,
            "http_workers": args.http_workers,
        }
    )
    print(ready, flush=True)
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(ready + "\n")
        os.replace(tmp, args.ready_file)
    await stop.wait()
    logging.getLogger("r3rdma.store").info("draining")
    await node.stop(drain=True)
    print(json.dumps({"event": "stopped", "pid": os.getpid()}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``r3rdma-store`` command: serve a node until SIGTERM/SIGINT, then drain; returns the exit
    status (0, or 2 after an :class:`~r3rdma.errors.R3Error`, printed to stderr)."""
    args = build_parser().parse_args(argv)
    setup_node_logging("r3rdma-store")
    try:
        configure_ucx_env(STORE_NODE_UCX_ENV)  # before anything imports ucxx
        return asyncio.run(_serve(args))
    except R3Error as e:
        print(f"r3rdma-store: {e}", file=sys.stderr)
        return 2
    finally:
        stop_ucxx()  # its notifier thread would keep the process from exiting


if __name__ == "__main__":
    sys.exit(main())
