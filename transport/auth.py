"""Shared-secret loading and the HMAC challenge-response of the hello.

Both sides prove knowledge of the secret over a transcript of two fresh random nonces
(one chosen by each side), under different labels per direction so a proof can never be
reflected back. The secret itself never goes on the wire.

The HTTP service never sees the secret either: it takes bearer tokens derived from it, one
way, so that holding one (e.g. sniffed from a plain-HTTP read) gives neither the secret nor
the other token (docs/PROTOCOL.md, "HTTP tokens")::

    read token  = HMAC-SHA256(key=secret, msg=b"r3rdma read v1").hexdigest()    # GET/HEAD
    admin token = HMAC-SHA256(key=secret, msg=b"r3rdma admin v1").hexdigest()   # DELETE

``secret`` is the HMAC key exactly as the hello uses it (see :func:`load_secret`); the token
is the 64 lowercase hex characters, sent as ``Authorization: Bearer <token>``. Any client
computes it with ``hmac.new(secret, b"r3rdma read v1", hashlib.sha256).hexdigest()``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from r3rdma.errors import ConfigError

__all__ = [
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "MIN_SECRET_BYTES",
    "NONCE_BYTES",
    "READ_TOKEN_LABEL",
    "ADMIN_TOKEN_LABEL",
    "load_secret",
    "coerce_secret",
    "derive_read_token",
    "derive_admin_token",
    "load_token_file",
    "coerce_token",
]

SECRET_ENV = "R3_STORE_TOKEN"
SECRET_FILE_ENV = "R3_STORE_TOKEN_FILE"  # read by R3Config (store_token_file) and the commands, not here
MIN_SECRET_BYTES = 16
NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256

_CLIENT_LABEL = b"r3rdma client proof v1\x00"
_SERVER_LABEL = b"r3rdma server proof v1\x00"
READ_TOKEN_LABEL = b"r3rdma read v1"
ADMIN_TOKEN_LABEL = b"r3rdma admin v1"


def coerce_secret(secret: bytes | str) -> bytes:
    """Return ``secret`` as bytes, refusing short or empty secrets."""
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)):
        raise ConfigError(f"secret must be bytes or str, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)} "
            "(generate one with: python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return bytes(secret)


def load_secret(path: str | os.PathLike[str] | None = None) -> bytes:
    """Load the shared secret: from the file ``path`` if given, else ``$R3_STORE_TOKEN``
    (callers resolve ``$R3_STORE_TOKEN_FILE`` into ``path``).

    A file's trailing newline is stripped. Raises :class:`ConfigError` when neither source
    is set, the file cannot be read, or the secret is shorter than 16 bytes.
    """
    if path is not None:
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read the secret file {str(path)!r}: {e}") from e
        return coerce_secret(raw.rstrip(b"\r\n"))
    value = os.environ.get(SECRET_ENV)
    if value:
        return coerce_secret(value)
    raise ConfigError(
        f"no transport secret (the push secret): set {SECRET_FILE_ENV} to the secret's file (or {SECRET_ENV} to the secret "
        "itself), or pass the file's path (store_token_file=, --token-file); engines and store nodes "
        "share it (scripts/start_store_nodes.sh writes one and names it in DIR/env)"
    )


def derive_read_token(secret: bytes | str) -> str:
    """The HTTP read token of ``secret``: ``HMAC-SHA256(secret, b"r3rdma read v1")`` as hex.

    Store nodes accept it (and only it) for GET/HEAD; it cannot push (the UCX hello needs the
    secret) nor delete (that needs :func:`derive_admin_token`). ``secret`` is the push secret's
    bytes (a ``str`` is UTF-8 encoded), at least 16 bytes, as :func:`load_secret` returns it.
    """
    return hmac.new(coerce_secret(secret), READ_TOKEN_LABEL, hashlib.sha256).hexdigest()


def derive_admin_token(secret: bytes | str) -> str:
    """The HTTP admin token of ``secret``: ``HMAC-SHA256(secret, b"r3rdma admin v1")`` as hex.

    Store nodes accept it (and only it) for DELETE (retention). A reader's token cannot delete.
    """
    return hmac.new(coerce_secret(secret), ADMIN_TOKEN_LABEL, hashlib.sha256).hexdigest()


def load_token_file(path: str | os.PathLike[str]) -> str:
    """A bearer token from a file (e.g. the ``<secret file>.read`` a store node writes).

    Surrounding whitespace is stripped. Raises :class:`ConfigError` if the file cannot be read,
    is empty, or holds anything but printable ASCII (a header value could not carry it).
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the token file {str(path)!r}: {e}") from e
    token = raw.strip()
    if not token or any(b < 0x21 or b > 0x7E for b in token):
        raise ConfigError(f"the token file {str(path)!r} is empty or holds other than printable ASCII")
    return token.decode("ascii")


def coerce_token(token: str | bytes, what: str = "the token") -> str:
    """A bearer token as given (``token=open(path).read()`` included): surrounding whitespace
    (a file's trailing newline) is stripped. Raises :class:`ConfigError` saying what is wrong
    (never echoing the token) if it is empty or holds anything but printable ASCII without
    spaces, which an ``Authorization`` header could not carry.
    """
    if isinstance(token, (bytes, bytearray)):
        try:
            token = bytes(token).decode("ascii")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{what} must be printable ASCII; it holds non-ASCII bytes") from e
    if not isinstance(token, str):
        raise ConfigError(f"{what} must be a str, got {type(token).__name__}")
    stripped = token.strip()
    if not stripped:
        raise ConfigError(f"{what} is empty (after stripping surrounding whitespace)")
    bad = sorted({c for c in stripped if not 0x21 <= ord(c) <= 0x7E})
    if bad:
        names = ", ".join(repr(c) for c in bad[:5])
        raise ConfigError(
            f"{what} holds characters a bearer token cannot carry ({names}) inside it: "
            "give the token alone, e.g. load_token_file(path) or open(path).read().strip()"
        )
    return stripped


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def client_proof(secret: bytes, version: int, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return _mac(secret, _CLIENT_LABEL, version, client_nonce, server_nonce)


def server_proof(secret: bytes, version: int, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return _mac(secret, _SERVER_LABEL, version, client_nonce, server_nonce)


def proofs_match(expected: bytes, got: object) -> bool:
    """Constant-time comparison; a non-bytes ``got`` never matches."""
    return isinstance(got, bytes) and hmac.compare_digest(expected, got)


def _mac(secret: bytes, label: bytes, version: int, cn: bytes, sn: bytes) -> bytes:
    # Fixed-length fields, so the concatenation is unambiguous.
    msg = label + version.to_bytes(2, "little") + cn + sn
    return hmac.new(secret, msg, hashlib.sha256).digest()
