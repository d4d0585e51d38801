"""Wire framing: a fixed 16-byte preamble, a msgpack header, then payload frames.

Every protocol message is sent as separate transport messages, in order::

    preamble (16 B) | header (header_len B, msgpack map) | payload frame 1 | ... | frame n

The preamble announces both sizes, so a receiver checks them against its limits before it
allocates anything. The frame lengths of the payload are listed in the header.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from r3rdma import errors as _errors
from r3rdma.errors import ProtocolError, R3Error, TransportError

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "PREAMBLE_BYTES",
    "INLINE_HEADER_BYTES",
    "HANDSHAKE_MAX_HEADER_BYTES",
    "MAX_ERROR_MESSAGE_CHARS",
    "Kind",
    "Preamble",
    "pack_header",
    "unpack_header",
    "error_header",
    "error_from_header",
]

MAGIC = b"R3"
PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS: tuple[int, ...] = (1,)
_PREAMBLE = struct.Struct("<2sBBIQ")  # magic, version, kind, header_len u32, payload_len u64
PREAMBLE_BYTES = _PREAMBLE.size
assert PREAMBLE_BYTES == 16

#: A header of at most this many bytes travels in the same UCX message as its preamble: the
#: receiver always posts a PREAMBLE_BYTES + INLINE_HEADER_BYTES buffer first, so small
#: messages (handshake, acks, batches of a few requests) cost one receive instead of two.
INLINE_HEADER_BYTES = 4080
#: Before authentication a peer may not make us allocate more than this (no payload at all).
HANDSHAKE_MAX_HEADER_BYTES = 1024
#: Error messages are cut to this length so an error frame stays small.
MAX_ERROR_MESSAGE_CHARS = 4000
#: Largest header of a reply (ack / error) a client accepts.
REPLY_MAX_HEADER_BYTES = 16 << 10


class Kind(enum.IntEnum):
    """Message kinds (preamble byte 3)."""

    HELLO = 1  # client -> server: supported versions, client nonce
    CHALLENGE = 2  # server -> client: chosen version, server nonce
    AUTH = 3  # client -> server: client proof
    AUTH_OK = 4  # server -> client: server proof
    BATCH = 5  # client -> server: request table + payload
    ACK = 6  # server -> client: the batch is durable
    ERROR = 7  # either way: typed error, maybe fatal (connection closes after it)


@dataclass(frozen=True, slots=True)
class Preamble:
    """The fixed-size first message of every protocol message."""

    version: int
    kind: Kind
    header_len: int
    payload_len: int
    #: The header bytes, when they arrived in the preamble's message (``header_len`` <=
    #: ``INLINE_HEADER_BYTES``); empty otherwise.
    inline: bytes = field(default=b"", compare=False, repr=False)

    def pack(self) -> bytes:
        """The preamble's fixed ``PREAMBLE_BYTES`` on the wire (``inline`` is not part of them)."""
        return _PREAMBLE.pack(MAGIC, self.version, int(self.kind), self.header_len, self.payload_len)

    @classmethod
    def unpack(cls, raw: bytes | bytearray | memoryview) -> Preamble:
        """Parse a received preamble (without ``inline``); raises :class:`ProtocolError` on a wrong
        size, magic or kind."""
        if len(raw) != PREAMBLE_BYTES:
            raise ProtocolError(f"preamble must be {PREAMBLE_BYTES} bytes, got {len(raw)}")
        magic, version, kind, header_len, payload_len = _PREAMBLE.unpack(bytes(raw))
        if magic != MAGIC:
            raise ProtocolError(f"preamble magic must be {MAGIC!r}, got {magic!r}: not an r3rdma peer")
        try:
            kind = Kind(kind)
        except ValueError:
            raise ProtocolError(f"preamble kind must be one of {[int(k) for k in Kind]}, got {kind}") from None
        return cls(version, kind, header_len, payload_len)


def pack_header(header: dict[str, Any]) -> bytes:
    """A message header as msgpack (bytes as bin, not str)."""
    return msgpack.packb(header, use_bin_type=True)


def unpack_header(raw: bytes | bytearray | memoryview, what: str) -> dict[str, Any]:
    """Decode a msgpack map; anything else (including trailing bytes) is a ProtocolError."""
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.UnpackException) as e:  # ExtraData, FormatError, StackError ...
        raise ProtocolError(f"{what} header is not valid msgpack ({len(raw)} bytes): {e}") from e
    if not isinstance(header, dict):
        raise ProtocolError(f"{what} header must be a msgpack map, got {type(header).__name__}")
    return header


def error_header(exc: BaseException, *, seq: int | None, fatal: bool) -> dict[str, Any]:
    """The header of an ERROR frame for ``exc`` (class name + message, cut to size)."""
    name = type(exc).__name__ if isinstance(exc, R3Error) else "TransportError"
    message = str(exc)
    if not isinstance(exc, R3Error):
        # A bug on the server: do not leak internals beyond the type name.
        message = f"internal server error ({type(exc).__name__}): {message}"
    if len(message) > MAX_ERROR_MESSAGE_CHARS:
        message = message[: MAX_ERROR_MESSAGE_CHARS - 20] + f"... ({len(message)} chars)"
    return {"seq": seq, "error": name, "message": message, "fatal": fatal}


def error_from_header(header: dict[str, Any]) -> R3Error:
    """Rebuild the R3Error subclass named by an ERROR frame; unknown names -> TransportError."""
    name = header.get("error")
    message = header.get("message")
    if not isinstance(message, str):
        message = repr(message)
    cls = getattr(_errors, name, None) if isinstance(name, str) and name in _errors.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, R3Error)):
        return TransportError(f"peer reported unknown error {name!r}: {message}")
    return cls(f"peer: {message}")
