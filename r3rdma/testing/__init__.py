"""Fault injection for r3rdma's own store nodes: the reliability scenarios (crash cycles under
SIGKILL, disk full, load, protocol and HTTP fuzzing, a node lost with its root, refused records,
restarts, stalled senders) and the pieces they share.

Library code, like ``zarr.testing``: ``r3rdma bench reliability`` is a thin driver that runs
them at full size and prints their figures; tests/test_reliability.py and tests/test_fuzz.py
call the same functions at small sizes. Nothing outside this package imports it but the
bench and the tests.
"""
