"""The r3rdma exception hierarchy.

One root, :class:`R3Error`. Each subclass also inherits the built-in exception a caller
would naturally catch (``KeyError`` for unknown ids, ``ValueError`` for bad input,
``TimeoutError`` for waits), so ``except KeyError`` keeps working for code that does not
know r3rdma. Messages say what was expected and what arrived.
"""

from __future__ import annotations

__all__ = [
    "R3Error",
    "ConfigError",
    "InvalidIdError",
    "ShapeMismatchError",
    "OutOfRangeError",
    "RowCountMismatchError",
    "MissingRowsError",
    "SharedRowsMissingError",
    "StaleSlotError",
    "CaptureStateError",
    "UnknownRolloutError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "SegmentError",
    "SegmentOverlapError",
    "SegmentGapError",
    "CorruptDataError",
    "StoreError",
    "R3TimeoutError",
    "TransportError",
    "ProtocolError",
    "AuthenticationError",
    "ReplayError",
]


class R3Error(Exception):
    """Root of every error r3rdma raises on purpose."""


class ConfigError(R3Error, ValueError):
    """A configuration value is out of range or inconsistent."""


class InvalidIdError(R3Error, ValueError):
    """A rollout or request id does not match ``[A-Za-z0-9._:-]{1,200}`` (ids become paths)."""


class ShapeMismatchError(R3Error, ValueError):
    """A tensor's shape, dtype, layer count or top-k differs from what was declared."""


class OutOfRangeError(ShapeMismatchError):
    """A value lies outside the range that was declared: a router id past ``num_experts`` (or
    the ``expert_map``), a layer not in the ``layer_map``, a KV slot past ``num_slots``, a
    ``start_row`` past a request's rows. A :class:`ShapeMismatchError` subclass, so callers
    that catch that keep catching these."""


class RowCountMismatchError(ShapeMismatchError):
    """A request stores another number of rows than its sample has: the caller expected
    ``expected`` rows (a sample's tokens - 1: every token but the last sampled one is a forward
    input), the store holds ``stored``. The routing is not this sample's: another request's
    routing stored under this id (a reused request id whose later commit the store refused), or
    a commit that failed. Raised by reads given ``expected_rows`` before anything is read. A
    :class:`ShapeMismatchError` subclass (so an ``R3Error`` and a ``ValueError``): callers that
    caught the framework helpers' row-count refusals as that keep catching them.

    ``rollout_id``, ``request_id``, ``expected``, ``stored``: the first request that differs
    (None where the raiser did not say)."""

    def __init__(
        self,
        message: str,
        *,
        rollout_id: str | None = None,
        request_id: str | None = None,
        expected: int | None = None,
        stored: int | None = None,
    ) -> None:
        super().__init__(message)
        self.rollout_id, self.request_id, self.expected, self.stored = rollout_id, request_id, expected, stored


class MissingRowsError(R3Error, ValueError):
    """A finished request has positions whose routing row was never computed."""


class SharedRowsMissingError(MissingRowsError):
    """A record whose ``shared_prefix`` names rows the store does not hold: the source request
    is not a complete request of the rollout on that store (not committed there, or committed
    on other nodes only), or has fewer rows than shared. The record is refused (nothing of it
    stored); a :class:`~r3rdma.write.writer.RoutingWriter` then stores it with the rows inline
    when the record carries a copy of them (``SharedPrefix.ids_TLK``)."""


class StaleSlotError(R3Error, ValueError):
    """A KV slot was rewritten by another token before a request that relies on it gathered it."""


class CaptureStateError(R3Error, RuntimeError):
    """The engine called the capturer out of order (e.g. ``record`` outside a step)."""


class UnknownRolloutError(R3Error, KeyError):
    """No committed request exists for this rollout id."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnknownRequestError(R3Error, KeyError):
    """The rollout exists but holds no committed request with this id."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(R3Error, ValueError):
    """A request id was committed before with different bytes."""


class SegmentError(DuplicateRequestError):
    """Segments of one request conflict: they overlap, leave a gap, or disagree on its extent."""


class SegmentOverlapError(SegmentError):
    """A segment covers rows another segment of the same request already covers, with other bytes."""


class SegmentGapError(SegmentError):
    """A request's segments leave rows uncovered (a request stays invisible until none are)."""


class CorruptDataError(R3Error, ValueError):
    """Stored bytes fail their checksum or do not decode: bytes that arrived whole violate
    the format. (Bytes that did not all arrive are a :class:`TransportError`.)"""


class StoreError(R3Error, OSError):
    """The store could not durably write or read (disk full, permissions, I/O error), or a
    store node failed a request on its side (HTTP 5xx). Not a sign of damaged data."""


class R3TimeoutError(R3Error, TimeoutError):
    """A wait ran past its deadline (a peer that did not answer in time).

    Retryable: nothing is known to be wrong with the data; try again, or another replica.
    """


class TransportError(R3Error, ConnectionError):
    """A connection to a peer failed or was closed: refused, reset, dropped mid-transfer (a
    body that ended short), or the peer's name did not resolve.

    Retryable: the data is not known to be damaged; try again, or another replica.
    """


class ProtocolError(R3Error, ValueError):
    """A peer sent a frame that violates the wire protocol (version, size, order, schema)."""


class AuthenticationError(R3Error, PermissionError):
    """The peer did not prove knowledge of the shared secret, or a store node refused the
    token a reader or a retention call presented (HTTP 401/403)."""


class ReplayError(R3Error, RuntimeError):
    """Routing replay was asked for data it does not have or that does not fit."""
