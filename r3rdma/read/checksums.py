"""CRC-32C of a concatenation from its parts' CRC-32Cs (the parts' bytes not at hand).

A reader compares the copies of a request on several store nodes by their segments' CRC-32Cs
(docs/FORMAT.md: each is the CRC-32C of the segment's rows in C order, in the stored dtype).
Copies of the same rows may be cut into different segments (a shared prefix stored by
reference on one node and inline on another, issue #35); their segment CRCs combined into
one CRC of the rows both copies hold compare equal (:mod:`r3rdma.read.replicas`).
"""

from __future__ import annotations

from collections.abc import Iterable

import crc32c

__all__ = ["crc32c_concat"]

# Zeros hashed in pieces of this size: a segment's bytes may run to megabytes, the buffer
# stays small (and is allocated once).
_ZEROS = memoryview(bytes(1 << 18))


def _crc_of_zeros(length: int, value: int) -> int:
    """``crc32c(bytes(length), value)``, hashing the shared zero buffer piece by piece."""
    piece = len(_ZEROS)
    while length > piece:
        value = crc32c.crc32c(_ZEROS, value)
        length -= piece
    return int(crc32c.crc32c(_ZEROS[:length], value))


def crc32c_concat(parts: Iterable[tuple[int, int]]) -> int:
    """The CRC-32C of the concatenation of byte strings given as ``(crc32c, length)`` each, in
    order (0, the CRC-32C of no bytes, when there are none).

    Written here because the ``crc32c`` package (2.x) has no combine function. It relies on
    CRC-32C (with its initial and final XOR) being affine in the data and the initial value
    together, so that with ``z(n, v) = crc32c(bytes(n), v)``::

        crc(A || B) = crc32c(B, crc(A)) = z(len B, crc(A)) ^ crc(B) ^ z(len B, 0)

    which costs hashing ``2 * len(B)`` zero bytes (a reader does it only for copies cut into
    different segments, rare). tests/test_replica_segments.py checks the identity and this
    function against the CRC-32C of the concatenation for random splits, empty parts included.
    """
    value = 0
    for crc, length in parts:
        if length:
            value = _crc_of_zeros(length, value) ^ crc ^ _crc_of_zeros(length, 0)
    return value
