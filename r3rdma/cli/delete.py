"""`r3rdma delete`: retention, delete rollouts (by id or by age) on every store node.

Deleting is an operator action: nodes take DELETE only with the admin token,
``derive_admin_token(secret)`` (docs/PROTOCOL.md, "HTTP tokens"), which this command derives
from the push secret file the operator holds (``--token-file``); the secret is never sent, and
a trainer's read token is refused (HTTP 403): given the read token file (``F.read``, or the
file ``$R3_STORE_READ_TOKEN_FILE`` names) the command sends nothing, says that deleting needs
the push secret file and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from r3rdma.errors import R3Error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``delete``'s options to ``parser``: nodes, what to delete (ids or an age), the push secret file."""
    parser.add_argument("--nodes", required=True, help="comma-separated store node HTTP URLs (http://host:port)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--rollout", action="append", help="rollout id to delete on every node (repeatable)")
    what.add_argument("--older-than-s", type=float, help="delete every rollout whose last commit is older than this")
    parser.add_argument(
        "--token-file",
        default=None,
        help="the push secret file (else $R3_STORE_TOKEN_FILE, then $R3_STORE_TOKEN): the admin token "
        "is derived from it here and only that is sent; the read token cannot delete",
    )
    parser.add_argument("--timeout-s", type=float, default=30.0)


SECRET_HINT = (
    "deleting needs the admin token, which r3rdma delete derives from the push secret file the store "
    "nodes were started with: pass that file as --token-file (r3rdma-store --token-file F; with "
    "scripts/start_store_nodes.sh it is DIR/token, R3_STORE_TOKEN_FILE in DIR/env), not the read token "
    "file F.read that trainers hold"
)


def _is_read_token_file(path: str) -> bool:
    """``path`` is the read token file: named ``<secret file>.read`` as nodes write it, or the
    file ``$R3_STORE_READ_TOKEN_FILE`` names. Both hold 64 hex digits, so the name tells them apart."""
    from r3rdma.cli.credentials import READ_TOKEN_FILE_ENV

    if path.endswith(".read"):
        return True
    read_file = os.environ.get(READ_TOKEN_FILE_ENV)
    if not read_file:
        return False
    try:
        return os.path.samefile(path, read_file)
    except OSError:
        return False


def main(args: argparse.Namespace) -> int:
    """Delete on every node and print what was deleted as one JSON line; 2 on a refused token or a store error."""
    from r3rdma.cli.credentials import SECRET_FILE_ENV, admin_token
    from r3rdma.errors import AuthenticationError
    from r3rdma.store.retention import delete_older_than, delete_rollout

    secret_file = args.token_file or os.environ.get(SECRET_FILE_ENV) or None
    if secret_file and _is_read_token_file(secret_file):
        # A read token cannot delete (nodes answer it with HTTP 403), and an admin token
        # "derived" from it is no token at all (401): say so before sending anything.
        print(
            f"r3rdma delete: AuthenticationError: {secret_file} is a read token file; a read token cannot "
            f"delete (store nodes refuse it with HTTP 403), so nothing was sent. {SECRET_HINT}",
            file=sys.stderr,
        )
        return 2
    try:
        token = admin_token(args.token_file)
        nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
        if args.rollout:
            out: dict[str, Any] = {
                "deleted": {rid: delete_rollout(nodes, rid, token=token, timeout_s=args.timeout_s) for rid in args.rollout}
            }
        else:
            out = {"deleted_older_than": delete_older_than(nodes, args.older_than_s, token=token, timeout_s=args.timeout_s)}
    except AuthenticationError as e:
        source = secret_file or "$R3_STORE_TOKEN"
        print(
            f"r3rdma delete: AuthenticationError: {e}. The admin token derived from {source} was refused: {SECRET_HINT}",
            file=sys.stderr,
        )
        return 2
    except R3Error as e:
        print(f"r3rdma delete: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0
