"""Which HTTP token a command sends, from which file (shared by inspect, check and delete).

Store nodes never take the push secret over HTTP (docs/PROTOCOL.md, "HTTP tokens"): reads
take ``derive_read_token(secret)``, deletes ``derive_admin_token(secret)``. A command given
the push secret file derives the token it needs here, on the client, and sends only that.
"""

from __future__ import annotations

import os

from r3rdma.transport.auth import (
    SECRET_ENV,
    derive_admin_token,
    derive_read_token,
    load_secret,
    load_token_file,
)

__all__ = ["READ_TOKEN_FILE_ENV", "SECRET_FILE_ENV", "add_read_token_arguments", "admin_token", "read_token"]

READ_TOKEN_FILE_ENV = "R3_STORE_READ_TOKEN_FILE"  # written by scripts/start_store_nodes.sh into DIR/env
SECRET_FILE_ENV = "R3_STORE_TOKEN_FILE"


def add_read_token_arguments(parser) -> None:
    """``--read-token-file`` or ``--token-file`` (the push secret, derived here): see :func:`read_token`."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--read-token-file",
        default=None,
        help="file holding the store nodes' HTTP read token (default: $R3_STORE_READ_TOKEN_FILE)",
    )
    which.add_argument(
        "--token-file",
        default=None,
        help="or the push secret file: the read token is derived from it here and only that is sent "
        "(default when no read token file is set: $R3_STORE_TOKEN_FILE, then $R3_STORE_TOKEN)",
    )


def read_token(read_token_file: str | None, secret_file: str | None) -> str | None:
    """The read token to send, first found of: ``read_token_file`` (the token itself, e.g. the
    ``<secret file>.read`` a node writes); ``secret_file`` (the push secret: the read token is
    derived from it); ``$R3_STORE_READ_TOKEN_FILE``; ``$R3_STORE_TOKEN_FILE`` (derived);
    ``$R3_STORE_TOKEN`` (derived). ``None`` when none is set (a local root needs no token).
    """
    if read_token_file:
        return load_token_file(read_token_file)
    if secret_file:
        return derive_read_token(load_secret(secret_file))
    if os.environ.get(READ_TOKEN_FILE_ENV):
        return load_token_file(os.environ[READ_TOKEN_FILE_ENV])
    if os.environ.get(SECRET_FILE_ENV):
        return derive_read_token(load_secret(os.environ[SECRET_FILE_ENV]))
    if os.environ.get(SECRET_ENV):
        return derive_read_token(load_secret())
    return None


def admin_token(secret_file: str | None) -> str:
    """The admin token (DELETE), derived from the push secret: ``secret_file``, else
    ``$R3_STORE_TOKEN_FILE``, else ``$R3_STORE_TOKEN``; :class:`ConfigError` if none is set."""
    return derive_admin_token(load_secret(secret_file or os.environ.get(SECRET_FILE_ENV) or None))
