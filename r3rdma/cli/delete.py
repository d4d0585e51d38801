"""`r3rdma delete`: retention, delete rollouts (by id or by age) on every store node.

Deleting is an operator action: nodes take DELETE only with the admin token,
``derive_admin_token(secret)`` (docs/PROTOCOL.md, "HTTP tokens"), which this command derives
from the push secret file the operator holds (``--token-file``); the secret is never sent, and
a trainer's read token is refused (HTTP 403).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from r3rdma.errors import R3Error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", required=True, help="comma-separated store node HTTP URLs (http://host:port)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--rollout", action="append", help="rollout id to delete on every node (repeatable)")
    what.add_argument("--older-than-s", type=float, help="delete every rollout whose last commit is older than this")
    parser.add_argument("--token-file", default=None,
                        help="the push secret file (else $R3_STORE_TOKEN_FILE, then $R3_STORE_TOKEN): the admin token "
                             "is derived from it here and only that is sent; the read token cannot delete")
    parser.add_argument("--timeout-s", type=float, default=30.0)


def main(args: argparse.Namespace) -> int:
    from r3rdma.cli.credentials import admin_token
    from r3rdma.store.retention import delete_older_than, delete_rollout

    try:
        token = admin_token(args.token_file)
        nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
        if args.rollout:
            out: dict[str, Any] = {"deleted": {rid: delete_rollout(nodes, rid, token=token, timeout_s=args.timeout_s)
                                               for rid in args.rollout}}
        else:
            out = {"deleted_older_than": delete_older_than(nodes, args.older_than_s, token=token, timeout_s=args.timeout_s)}
    except R3Error as e:
        print(f"r3rdma delete: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0
