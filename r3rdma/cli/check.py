"""`r3rdma check`: the trainer side of the distributed demo.

Reads every request of a rollout remotely from the store nodes' HTTP services and compares it
bit-exactly with the shadow records the rollout ranks wrote. It sends the HTTP read token
(``--read-token-file``, default ``$R3_STORE_READ_TOKEN_FILE`` as ``scripts/start_store_nodes.sh``
writes it into ``DIR/env``), or one derived from the push secret file (``--token-file``); never
the secret. A node that cannot be reached is named once on stderr; every request is then read
from its replicas on the others, and the summary counts the nodes read from. Last line is JSON
with {"requests", "tokens", "stored_bytes", "roundtrip_exact", "store_nodes" (nodes read from),
"unreachable_nodes"}; exit 1 if not exact, 2 (one line naming the error type on stderr) if the
read fails (a request on no reachable node included).
"""

from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np

__all__ = ["add_arguments", "main"]


def add_arguments(parser) -> None:
    """Add ``check``'s options to ``parser``: store node URLs, read token, rollout id, shadow directory."""
    from r3rdma.cli.credentials import add_read_token_arguments

    parser.add_argument(
        "--http-urls",
        default=os.environ.get("R3_STORE_HTTP_URLS", ""),
        help="store node HTTP URLs, comma separated (default: $R3_STORE_HTTP_URLS)",
    )
    add_read_token_arguments(parser)
    parser.add_argument("--rollout-id", default="rollout-0")
    parser.add_argument("--shadow-dir", required=True)


def main(args) -> int:
    """Read the rollout from the store nodes and compare it with the shadow records; exit status 0, 1 or 2 as above."""
    from r3rdma.cli.credentials import read_token
    from r3rdma.cli.inspect import reader_warnings_quiet, stored_bytes_reachable, unreachable_lines
    from r3rdma.errors import R3Error, TransportError
    from r3rdma.read.reader import RoutingReader

    urls = [u.strip() for u in args.http_urls.split(",") if u.strip()]
    if not urls:
        print(
            "r3rdma check: no store node URLs: pass --http-urls http://host:port,... or set R3_STORE_HTTP_URLS "
            "(scripts/start_store_nodes.sh writes it into DIR/env)",
            file=sys.stderr,
        )
        return 2
    shadow: dict[str, np.ndarray] = {}
    for path in sorted(glob.glob(os.path.join(args.shadow_dir, "dp*.npz"))):
        with np.load(path) as data:
            shadow.update({k: data[k] for k in data.files})
    if not shadow:
        print(
            f"r3rdma check: no shadow records (dp*.npz) in --shadow-dir {args.shadow_dir!r}: "
            "expected the directory r3rdma rollout --shadow-dir wrote",
            file=sys.stderr,
        )
        return 2
    try:
        token = read_token(args.read_token_file, args.token_file)
        with reader_warnings_quiet(), RoutingReader(urls, token=token) as reader:
            info = reader.info(args.rollout_id)
            got = reader.get_numpy(args.rollout_id, sorted(shadow))
            unreachable = dict(reader.last_skipped_nodes)
            names = reader.source_names
            try:
                per_node = stored_bytes_reachable(reader, args.rollout_id, token=token)
            except TransportError as e:  # a node lost since the read: the read itself succeeded
                print(f"r3rdma check: cannot size the nodes' data ({e})", file=sys.stderr)
                per_node = {}
    except R3Error as e:
        print(f"r3rdma check: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    for line in unreachable_lines("check", unreachable, len(names)):
        print(line, file=sys.stderr)
    mismatched = [rid for rid, rows in shadow.items() if not np.array_equal(got[rid].astype(np.int64), rows)]
    extra = sorted(set(info.request_ids) - set(shadow))
    tokens = sum(a.shape[0] for a in shadow.values())
    exact = bool(shadow) and not mismatched and not extra
    read_from = [name for name in names if name not in unreachable]
    of = f" of {len(names)}" if unreachable else ""
    print(
        f"r3rdma check: {len(shadow)} requests, {tokens} rows read over HTTP from {len(read_from)}{of} store nodes"
        + (f" ({', '.join(unreachable)} could not be reached)" if unreachable else "")
    )
    for url, nbytes in per_node.items():
        print(f"  {url}: {nbytes} bytes stored")
    print(f"  round trip: {'bit-exact for every request' if exact else f'MISMATCH {mismatched[:5]} extra {extra[:5]}'}")
    print(
        json.dumps(
            {
                "requests": len(shadow),
                "tokens": tokens,
                "stored_bytes": sum(per_node.values()),
                "roundtrip_exact": exact,
                "store_nodes": len(read_from),
                "unreachable_nodes": list(unreachable),
            }
        )
    )
    return 0 if exact else 1
