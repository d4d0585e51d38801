"""Size limits and deadlines of one transport endpoint (server or client)."""

from __future__ import annotations

from dataclasses import dataclass

from r3rdma.errors import ConfigError

__all__ = ["TransportLimits"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportLimits:
    """What a peer may send and how long any wait may last.

    A receiver checks every size announced by a preamble against these limits *before* it
    allocates, and answers a violation with a ``ProtocolError`` frame, then closes that
    connection only. Every network wait is bounded; running past a deadline raises
    :class:`~r3rdma.errors.R3TimeoutError`.
    """

    #: Largest msgpack header of a batch message (the per-request table). ~200 B/request.
    max_header_bytes: int = 4 << 20
    #: Largest payload (sum of the batch's ``ids_TLK`` bytes) of one message.
    max_payload_bytes: int = 256 << 20
    #: Most requests in one batch message.
    max_records: int = 65536
    #: Most payload frames one message may be split into.
    max_frames: int = 256
    #: Deadline of each network step: connect, each handshake message, each frame send/recv.
    #: Server: a batch's whole payload must arrive within it once its header did; a sender
    #: that stalls longer gets a fatal R3TimeoutError frame and is disconnected, its budget
    #: reservation and buffer released. Store nodes also close an HTTP connection that has
    #: not sent a complete request within it.
    timeout_s: float = 30.0
    #: Client: deadline of opening a connection (UCX endpoint and peer-info exchange). Apart
    #: from ``timeout_s`` because a dead node is found here: ucxx waits out the exchange even
    #: after UCX reported the endpoint down, so a commit to a SIGKILLed node stalled 30 s before
    #: failing over (measured on loopback); a healthy connect takes milliseconds. ucxx's own
    #: default, 5 s, leaves room for a loaded host.
    connect_timeout_s: float = 5.0
    #: Server: deadline of the handler (validation + durable write) for one batch.
    handler_timeout_s: float = 120.0
    #: Client: deadline from the start of a push to its ack (covers the server's handler).
    ack_timeout_s: float = 180.0
    #: Server: an authenticated connection that sends nothing for this long is closed.
    idle_timeout_s: float = 3600.0
    #: Server: payload bytes being received or handled at once, over all connections. A batch
    #: waits (up to ``timeout_s``) for room before its payload buffer is allocated, so many
    #: clients pushing max-size batches cannot exhaust the node's memory; a batch larger than
    #: the budget runs alone. Peak memory is about 3x this (payload, records, encoder buffers).
    max_inflight_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_payload_bytes", "max_records", "max_frames", "max_inflight_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"TransportLimits.{name} must be an int >= 1, got {value!r}")
        if self.max_header_bytes > 0xFFFFFFFF:
            raise ConfigError(f"TransportLimits.max_header_bytes must fit the u32 preamble field, got {self.max_header_bytes}")
        for name in ("timeout_s", "connect_timeout_s", "handler_timeout_s", "ack_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"TransportLimits.{name} must be a number > 0, got {value!r}")
