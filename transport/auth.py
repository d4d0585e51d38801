"""Shared-secret loading and the HMAC challenge-response of the hello.

Both sides prove knowledge of the secret over a transcript of two fresh random nonces
(one chosen by each side), under different labels per direction so a proof can never be
reflected back. The secret itself never goes on the wire.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from r3rdma.errors import ConfigError

__all__ = ["SECRET_ENV", "MIN_SECRET_BYTES", "NONCE_BYTES", "load_secret", "coerce_secret"]

SECRET_ENV = "R3_STORE_TOKEN"
MIN_SECRET_BYTES = 16
NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256

_CLIENT_LABEL = b"r3rdma client proof v1\x00"
_SERVER_LABEL = b"r3rdma server proof v1\x00"


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
    """Load the shared secret: from the file ``path`` if given, else ``$R3_STORE_TOKEN``.

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
        f"no transport secret: pass a secret file path or set ${SECRET_ENV} "
        "(both sides must share it)"
    )


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
