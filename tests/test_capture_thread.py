"""The capture thread: a capturer's calls handed over from the engine's thread store exactly
what the same calls made inline store, errors reach the engine, nothing queued is lost; and
InlineCapture, the same hand-over calls run at once."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from r3rdma.capture.capture_thread import CaptureThread, InlineCapture
from r3rdma.capture.capturer import RoutingCapturer
from r3rdma.errors import CaptureStateError, ConfigError, OutOfRangeError
from r3rdma.kernels.record_op import new_step_buffer

L, K, E, SLOTS = 3, 2, 16, 64


class _Sink(list):
    def submit(self, record):
        self.append(record)


def _capturer(sink=None) -> RoutingCapturer:
    buf = new_step_buffer(max_tokens=16, num_layers=L, top_k=K, num_experts=E, device="cpu")
    return RoutingCapturer(layer_map=[1, 3, 4], top_k=K, num_experts=E, num_slots=SLOTS, step_buffer=buf, sink=sink)


def _script(seed: int = 0):
    """Steps of a small engine: two requests prefill in chunks and decode, a third hits the
    first one's prefix (attached before its first step), one finishes mid-run, one aborts."""
    rng = np.random.default_rng(seed)
    steps = []

    def rows(n):
        return torch.from_numpy(rng.integers(0, E, size=(n, L, K)).astype(np.int16))

    # a: positions 0..3 (prefill), b: 0..2
    steps.append(("step", ["a", "b"], [0, 0], [4, 3], np.array([0, 1, 2, 3, 8, 9, 10]), rows(7), [], []))
    steps.append(("step", ["a", "b"], [4, 3], 1, np.array([4, 11]), rows(2), [], []))
    # c reuses a's first 4 rows (slots 0..3), then computes position 4 in its own slot
    steps.append(("step", ["a", "b", "c"], [5, 4, 4], 1, np.array([5, 12, 16]), rows(3), [("c", np.arange(4), np.arange(4))], []))
    steps.append(("finish", "b", dict(prompt_len=3, generated_len=3)))  # rows 0..4
    steps.append(("step", ["a", "c"], [6, 5], 1, np.array([6, 17]), rows(2), [], []))
    steps.append(("abort", "a"))
    steps.append(("finish", "c", dict(prompt_len=4, generated_len=3)))  # rows 0..5
    return steps


def _run_inline(cap: RoutingCapturer, script):
    for item in script:
        if item[0] == "step":
            _, ids, starts, counts, slots, rows, before, after = item
            for rid, pos, sl in before:
                cap.attach_cached(rid, pos, sl)
            cap.step_buffer[: rows.shape[0]].copy_(rows)
            cap.begin_step(
                ids, np.asarray(starts), counts if isinstance(counts, int) else np.asarray(counts), slots, graphed=True
            )
            cap.end_step()
        elif item[0] == "finish":
            cap.finish_request(item[1], **item[2])
        else:
            cap.abort_request(item[1])


def _run_threaded(thread: CaptureThread, script, model_buf: torch.Tensor):
    for item in script:
        if item[0] == "step":
            _, ids, starts, counts, slots, rows, before, after = item
            model_buf[: rows.shape[0]] = rows.numpy() if isinstance(model_buf, np.ndarray) else rows  # what the routers wrote
            counts = counts if isinstance(counts, int) else np.asarray(counts)
            thread.step(ids, np.asarray(starts), counts, slots, model_buf[: rows.shape[0]], before=before, after=after)
            model_buf[:] = 7  # the next forward rewrites the model's buffer at once
        elif item[0] == "finish":
            thread.submit(thread.capturer.finish_request, item[1], **item[2])
        else:
            thread.submit(thread.capturer.abort_request, item[1])


def _records(sink: list) -> dict:
    return {r.request_id: r.ids_TLK for r in sink}


@pytest.mark.parametrize("runner", ["thread", "inline", "inline-numpy", "inline-shared", "inline-shared-numpy"])
def test_handed_over_calls_store_what_inline_calls_store(runner):
    """``inline-shared``: the model writes the capturer's own step buffer (the vLLM plug-in
    inline), so a step's rows are already in place and nothing is copied."""
    script = _script()
    a, b = _Sink(), _Sink()
    _run_inline(_capturer(a), script)
    threaded = _capturer(b)
    if runner.startswith("inline-shared"):
        model_buf = threaded.step_buffer
    else:
        model_buf = new_step_buffer(max_tokens=16, num_layers=L, top_k=K, num_experts=E, device="cpu")
    if runner == "thread":
        thread = CaptureThread(threaded, max_pending=2)  # backpressure on the engine's side, nothing lost
    else:
        thread = InlineCapture(threaded)
    _run_threaded(thread, script, model_buf.numpy() if runner.endswith("numpy") else model_buf)
    thread.call(threaded.flush)
    assert thread.calls == len(script) + 1
    assert thread.threaded == (runner == "thread") and (thread.busy_seconds > 0) == thread.threaded
    thread.close()
    with pytest.raises(CaptureStateError, match="closed"):
        thread.submit(threaded.abort_request, "a")
    assert sorted(_records(a)) == sorted(_records(b)) == ["b", "c"]
    for rid, routing in _records(a).items():
        np.testing.assert_array_equal(routing, _records(b)[rid])
    assert _records(b)["c"].shape == (6, L, K) and threaded.active_requests == 0


def test_an_error_on_the_thread_is_raised_to_the_engine_and_stops_the_work():
    cap = _capturer()
    thread = CaptureThread(cap)
    rows = torch.zeros((2, L, K), dtype=torch.int16)
    thread.step(["a", "b"], np.array([0, 0]), 1, np.array([0, SLOTS + 5]), rows)  # a slot past the table
    with pytest.raises(OutOfRangeError, match=f"slots must be in 0..{SLOTS - 1}"):
        thread.call(lambda: None)  # the call behind it answers with the error that stopped the thread
    with pytest.raises(OutOfRangeError):
        thread.submit(cap.abort_request, "a")  # the next hand-off raises it too
    with pytest.raises(OutOfRangeError):
        thread.close()
    thread.close()  # once closed, closing again does nothing
    with pytest.raises(CaptureStateError, match="closed"):
        thread.submit(cap.abort_request, "a")
    assert cap.steps == 0  # the bad step never reached the table


def test_call_returns_the_result_or_raises_its_error_in_order():
    cap = _capturer()
    thread = CaptureThread(cap)
    seen: list[str] = []
    thread.submit(seen.append, "first")
    assert thread.call(lambda: list(seen)) == ["first"]
    assert thread.call(threading.current_thread) is not threading.current_thread()

    def boom():
        raise ValueError("only this call")

    with pytest.raises(ValueError, match="only this call"):
        thread.call(boom)
    assert thread.error is None  # a call's own error goes to its caller, the thread goes on
    assert thread.call(len, seen) == 1
    thread.close()


def test_close_runs_everything_handed_over():
    cap = _capturer()
    thread = CaptureThread(cap, max_pending=1)
    done: list[int] = []
    gate = threading.Event()
    thread.submit(gate.wait)  # the thread is busy: the next hand-off waits for room
    opener = threading.Timer(0.2, gate.set)
    opener.start()
    for i in range(5):
        thread.submit(done.append, i)
    thread.close()
    opener.join()
    assert done == [0, 1, 2, 3, 4]


def test_inline_errors_are_raised_by_the_call_that_made_them():
    cap = _capturer()
    inline = InlineCapture(cap)
    rows = torch.zeros((2, L, K), dtype=torch.int16)
    with pytest.raises(OutOfRangeError, match=f"slots must be in 0..{SLOTS - 1}"):
        inline.step(["a", "b"], np.array([0, 0]), 1, np.array([0, SLOTS + 5]), rows)
    assert cap.steps == 0 and inline.error is None
    inline.step(["a", "b"], np.array([0, 0]), 1, np.array([0, 1]), rows)  # the capturer goes on
    assert cap.steps == 1


@pytest.mark.parametrize("runner", [CaptureThread, InlineCapture])
def test_a_capturer_without_a_fixed_step_buffer_is_refused(runner):
    cap = RoutingCapturer(layer_map=[0], top_k=K, num_experts=E, num_slots=SLOTS)
    with pytest.raises(ConfigError, match="fixed step_buffer"):
        runner(cap)


class _SlowCopy:
    """A device-to-host copy's event that completes ``delay`` seconds after it was recorded,
    counting how often it is asked and waited on."""

    def __init__(self, delay: float) -> None:
        import time

        self.done_at = time.perf_counter() + delay
        self.queries = 0
        self.waits = 0

    def query(self) -> bool:
        import time

        self.queries += 1
        return time.perf_counter() >= self.done_at

    def synchronize(self) -> None:
        import time

        self.waits += 1
        time.sleep(max(0.0, self.done_at - time.perf_counter()))  # as a CUDA event's: without the GIL


def test_rows_still_on_the_device_are_waited_for_without_polling_and_not_counted_as_work():
    """A step handed over before the GPU ran it (asynchronous scheduling: about one forward
    ahead): the thread waits on its rows' copy event once, instead of asking it again and again
    (each ask took the GIL, and a CUDA call, from the engine's thread: at every 50 us, ~400 times
    a step, measured on an H200, the step was ~0.8 ms longer). The wait is ``wait_seconds``, not
    ``busy_seconds`` (the thread's own work, which the vLLM bench reports)."""
    from r3rdma.capture.transfer import StagedRows

    sink = _Sink()
    thread = CaptureThread(_capturer(sink))
    rows = torch.from_numpy(np.random.default_rng(0).integers(0, E, size=(2, L, K)).astype(np.int16))
    copy = _SlowCopy(0.1)
    thread.submit(thread._step, ["a", "b"], np.array([0, 0]), 1, np.array([0, 8]), StagedRows(rows, copy), None, (), ())
    thread.submit(thread.capturer.finish_request, "a", prompt_len=1, generated_len=1)
    thread.close()
    assert copy.queries <= 2 and copy.waits == 1, (copy.queries, copy.waits)  # polled at 50 us: over a thousand asks
    assert thread.wait_seconds >= 0.1 and thread.busy_seconds < thread.wait_seconds / 2, (
        thread.wait_seconds,
        thread.busy_seconds,
    )
    (record,) = sink
    np.testing.assert_array_equal(record.ids_TLK, rows[:1].numpy())
