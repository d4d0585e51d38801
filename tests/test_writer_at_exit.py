"""A writer closed while the interpreter exits still commits what it holds.

vLLM closes its engine from an exit-time finalizer (``weakref.finalize``), and with it the
plug-in's writer. By then Python has shut every thread pool, so the writer's thread died on
its encoder's ``submit`` and ``close()`` waited for it forever, the last batch lost (an
in-process engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, whose script simply returned). The
same at exit, without vLLM: a script that submits and returns, its writer closed by a finalizer.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np

from r3rdma import RoutingReader

_SCRIPT = textwrap.dedent(
    """
    import sys, weakref
    import numpy as np
    from r3rdma import LocalRoutingStore, RoutingWriter
    from r3rdma.records import RequestRecord

    writer = RoutingWriter(LocalRoutingStore(sys.argv[1]), flush_interval_s=3600, owns_store=True)

    class Engine:  # stands for vLLM's engine, closed by weakref.finalize at exit
        pass

    engine = Engine()
    weakref.finalize(engine, writer.close)
    for i in range(int(sys.argv[2])):
        ids = np.full((5 + i, 3, 2), i, dtype=np.uint8)
        writer.submit(RequestRecord("roll", f"q{i}", ids, (0, 1, 2), 16))
    print("submitted", flush=True)
    """
)


def test_a_writer_closed_at_interpreter_exit_commits_what_it_holds(tmp_path):
    root = tmp_path / "store"
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(root), "8"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "submitted" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    got = RoutingReader(root).get_numpy("roll", [f"q{i}" for i in range(8)])
    for i in range(8):
        np.testing.assert_array_equal(got[f"q{i}"], np.full((5 + i, 3, 2), i, dtype=np.uint8))


def test_a_writer_whose_thread_stopped_raises_instead_of_waiting(tmp_path, monkeypatch, make_record):
    """Whatever stops the writer's thread (a bug), flush() and close() say so instead of hanging."""
    import pytest

    from r3rdma import LocalRoutingStore, RoutingWriter
    from r3rdma.errors import StoreError

    def broken(self, batch, size):
        raise RuntimeError("a bug in the writer")

    monkeypatch.setattr(RoutingWriter, "_stage", broken)
    writer = RoutingWriter(LocalRoutingStore(tmp_path), owns_store=True)
    writer.submit(make_record("a"))
    with pytest.raises(StoreError, match="writer's thread stopped"):
        writer.close(timeout=30)
    with pytest.raises(StoreError, match="closed|stopped"):
        writer.submit(make_record("b"))
