"""The vLLM plug-in's record path on a GPU, without vLLM (its wheel does not reach the GPU
machines): :mod:`r3rdma.kernels.record_op` inside CUDA graphs captured at several padded sizes,
eager and torch.compile'd, replayed over steps with changing requests, positions, KV slots and
real-token counts, with the host driving the capturer exactly as the plug-in does: inline
(``begin_step(..., graphed=True)``, replay, ``end_step()``), and handed over to a
:class:`~r3rdma.capture.capture_thread.CaptureThread` after the replay (the rows copied from the
model's buffer on the stream, the capturer's calls on the thread), as the plug-in does now for
a model on the GPU, and to an :class:`~r3rdma.capture.capture_thread.InlineCapture` (the same
calls at once, ``capture_thread="off"``).

What it covers: the op is captured into each graph against the fixed step buffer and repeats on
every replay; rows a graph wrote for its padded size are never stored; stored rows equal an
eager, hook-free reference computed on the real tokens only; and the step path does no host
synchronisation (``torch.cuda.set_sync_debug_mode("error")`` around begin, replay and end, or
replay and hand-over; the mode is process-wide, so the thread's work in that window is held to
it too).
What it does not cover: vLLM's own graph dispatch and padding rules (the CPU tests run the real
engine, compiled, for those).

The toy MoE computes exactly (integer-valued float32, tie-free logits), so the padded graph,
the compiled graph and the eager reference must agree bit for bit, whatever kernels run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3rdma import RoutingCapturer
from r3rdma.capture.capture_thread import _MAX_STAGING, CaptureThread, InlineCapture
from r3rdma.kernels.record_op import new_step_buffer, record_hook

pytestmark = pytest.mark.gpu

H, E, K, L = 16, 32, 4, 3
SIZES = (4, 8, 16)  # graph capture sizes; a step of T tokens replays the smallest size >= T


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


class ToyMoE(torch.nn.Module):
    """L MoE layers: integer router weights, logits made distinct per expert (``* E + e``), and
    a residual update from the chosen experts' integer embeddings; every op is exact in fp32."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.router = torch.nn.Parameter(torch.randint(-3, 4, (L, H, E), generator=gen).float(), requires_grad=False)
        self.emb = torch.nn.Parameter(torch.randint(-2, 3, (L, E, H), generator=gen).float(), requires_grad=False)
        self.register_buffer("tiebreak", torch.arange(E, dtype=torch.float32))
        self.hooks: list = [None] * L

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        for layer in range(L):
            logits = (x_TH @ self.router[layer]) * E + self.tiebreak
            ids_TK = logits.topk(K, dim=-1).indices
            self.hooks[layer](ids_TK)
            x_TH = torch.clamp(x_TH + self.emb[layer][ids_TK].sum(1), -50, 50)
        return x_TH


def _reference_rows(model: ToyMoE, x_TH: torch.Tensor) -> np.ndarray:
    """Eager, no graph, no capturer: the real tokens' routing ``[T, L, K]``."""
    rows: list[torch.Tensor] = []
    saved = model.hooks
    model.hooks = [rows.append] * L
    try:
        with torch.no_grad():
            model(x_TH)
    finally:
        model.hooks = saved
    return torch.stack(rows, dim=1).to(torch.uint8).cpu().numpy()


def _capture_graphs(forward, x_static: torch.Tensor, capturer) -> dict[int, torch.cuda.CUDAGraph]:
    graphs = {}
    for size in SIZES:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(3):  # warm-up (and compile) outside the graph, as torch.cuda.graph asks
                with capturer.graph_capture(size):
                    forward(x_static[:size])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), capturer.graph_capture(size), torch.cuda.graph(graph):
            forward(x_static[:size])
        graphs[size] = graph
    return graphs


@pytest.mark.parametrize("handoff", ["inline", "thread", "thread-host", "inline-capture"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager-graphs", "compiled-graphs"])
def test_record_op_in_cuda_graphs_stores_real_rows_only_with_no_host_sync(compiled, handoff):
    device = torch.device("cuda")
    model = ToyMoE().to(device)
    step_buf = new_step_buffer(max_tokens=max(SIZES), num_layers=L, top_k=K, num_experts=E, device=device)
    model.hooks = [record_hook(step_buf, layer) for layer in range(L)]
    # Handed over, the capturer works on its own copy: the model's buffer belongs to the next
    # forward. "thread-host": the capturer on the host, as the vLLM plug-in builds it (each
    # step's rows leave the device in one copy; the thread makes no other CUDA call).
    # "inline-capture": InlineCapture over the GPU table (the plug-in with capture_thread="off").
    table = torch.device("cpu") if handoff == "thread-host" else device
    own = torch.zeros(step_buf.shape, dtype=step_buf.dtype, device=table)
    capturer = RoutingCapturer(
        layer_map=list(range(L)),
        top_k=K,
        num_experts=E,
        num_slots=1024,
        device=table,
        step_buffer=step_buf if handoff == "inline" else own,
    )
    thread: CaptureThread | InlineCapture | None = None
    if handoff == "inline-capture":
        thread = InlineCapture(capturer)
    elif handoff != "inline":
        thread = CaptureThread(capturer)
    forward = torch.compile(model, dynamic=False) if compiled else model
    x_static = torch.zeros(max(SIZES), H, device=device)
    graphs = _capture_graphs(forward, x_static, capturer)

    rng = np.random.default_rng(1)
    features: dict[tuple[str, int], np.ndarray] = {}  # (request, position) -> its token's input
    expected: dict[str, list[np.ndarray]] = {}
    computed: dict[str, int] = {}
    free_bases = list(range(0, 1024, 64))  # each live request owns 64 KV slots
    bases: dict[str, int] = {}
    next_id, replays_by_size, padded_rows = 0, dict.fromkeys(SIZES, 0), 0
    for step in range(60):
        # Start requests, pick who runs: decodes (1 token) and prefill chunks (2-6 tokens).
        while len(computed) < 4:
            computed[f"r{next_id}"] = 0
            expected[f"r{next_id}"] = []
            bases[f"r{next_id}"] = free_bases.pop()
            next_id += 1
        running = [r for r in computed if rng.random() < 0.8] or list(computed)[:1]
        counts = [int(rng.integers(1, 7)) if computed[r] < 8 else 1 for r in running]
        while sum(counts) > max(SIZES):
            counts[counts.index(max(counts))] -= 1
        total = sum(counts)
        size = min(s for s in SIZES if s >= total)
        starts = [computed[r] for r in running]
        x_host = rng.integers(-3, 4, size=(size, H)).astype(np.float32)  # rows past `total`: padding garbage
        slots, row = [], 0
        for r, start, n in zip(running, starts, counts):
            for p in range(start, start + n):
                features[(r, p)] = x_host[row]
                slots.append(bases[r] + p)
                row += 1
        x_real = torch.from_numpy(x_host[:total]).to(device)
        reference = _reference_rows(model, x_real)
        x_static[:size].copy_(torch.from_numpy(x_host).to(device))

        torch.cuda.set_sync_debug_mode("error")
        try:
            if thread is None:
                capturer.begin_step(running, starts, counts, np.asarray(slots), graphed=True)
                graphs[size].replay()
                capturer.end_step()
            else:
                graphs[size].replay()
                thread.step(running, np.asarray(starts), np.asarray(counts), np.asarray(slots), step_buf[:total])
        finally:
            torch.cuda.set_sync_debug_mode(0)
        replays_by_size[size] += 1
        padded_rows += size - total

        row = 0
        for r, n in zip(running, counts):
            expected[r].extend(reference[row : row + n])
            computed[r] += n
            row += n
        # Finish requests past 12 positions: gather and compare.
        for r in [r for r, n in computed.items() if n >= 12]:
            if thread is None:
                record = capturer.finish_request(r, prompt_len=computed[r], generated_len=1)
            else:
                record = thread.call(lambda r=r: capturer.finish_request(r, prompt_len=computed[r], generated_len=1))
            np.testing.assert_array_equal(record.ids_TLK, np.stack(expected.pop(r)), err_msg=r)
            del computed[r]
            free_bases.append(bases.pop(r))
    if thread is not None:
        thread.close()
        assert thread.calls > 60 and thread.error is None
    if handoff == "thread-host":
        # 60 steps' rows left the device through a few pinned buffers the thread reused
        # (the engine thread allocated no pinned memory per step).
        assert 1 <= thread._staging_made <= _MAX_STAGING and len(thread._staging) == thread._staging_made, thread._staging_made
    assert all(replays_by_size.values()), replays_by_size  # every captured size replayed, padded
    assert padded_rows > 0
    assert capturer.rows_captured == sum(1 for _ in features)  # real rows only, never padding
