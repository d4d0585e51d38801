"""Capture kernels: the torch reference against plain-numpy semantics (CPU), and every custom
kernel against the reference, bit for bit, on the GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3rdma import kernels
from r3rdma.errors import ConfigError
from r3rdma.kernels import reference

DTYPES = [(16, torch.uint8), (256, torch.uint8), (300, torch.int16), (70000, torch.int32)]
SHAPES = [(1, 1, 1), (5, 3, 2), (64, 24, 8), (257, 48, 8), (33, 7, 3)]  # T, L, K (odd sizes too)


def _ids(T, K, num_experts, gen, device):
    return torch.randint(0, num_experts, (T, K), generator=gen, dtype=torch.int64).to(device)


def _poisoned_table(S, L, K, dtype, gen, device):
    # Random contents, never zeros: an unwritten or mis-indexed row must show.
    hi = 256 if dtype == torch.uint8 else 1 << 15
    return torch.randint(0, hi, (S, L, K), generator=gen, dtype=torch.int64).to(dtype).to(device)


# -- reference semantics on the CPU ---------------------------------------------------------


@pytest.mark.parametrize("num_experts,dtype", DTYPES)
def test_table_dtype(num_experts, dtype):
    assert reference.table_dtype(num_experts) == dtype


@pytest.mark.parametrize("T,L,K", SHAPES)
@pytest.mark.parametrize("with_rows", [False, True])
@pytest.mark.parametrize("with_map", [False, True])
def test_reference_record_layer(T, L, K, with_rows, with_map):
    gen = torch.Generator().manual_seed(T * 1000 + L)
    E = 64
    buf = torch.full((T + 3, L, K), 251, dtype=torch.uint8)
    pad = T + 5
    ids = _ids(pad if with_rows else T, K, 2 * E if with_map else E, gen, "cpu")
    rows = torch.randperm(pad, generator=gen)[:T] if with_rows else None
    emap = torch.randint(0, E, (2 * E,), generator=gen) if with_map else None
    layer = L - 1
    reference.record_layer(buf, layer, ids, rows, emap)
    src = ids.numpy()[rows.numpy()] if with_rows else ids.numpy()
    if with_map:
        src = emap.numpy()[src]
    np.testing.assert_array_equal(buf[:T, layer].numpy(), src.astype(np.uint8))
    assert (buf[T:] == 251).all() and (L == 1 or (buf[:, : L - 1] == 251).all())


@pytest.mark.parametrize("num_experts,dtype", DTYPES)
@pytest.mark.parametrize("with_idx", [False, True])
def test_reference_write_and_gather(num_experts, dtype, with_idx):
    gen = torch.Generator().manual_seed(num_experts)
    S, T, L, K = 97, 20, 5, 3
    table = _poisoned_table(S, L, K, dtype, gen, "cpu")
    before = table.clone()
    rows = torch.randint(0, num_experts, (T, L, K), generator=gen, dtype=torch.int64)
    idx = torch.tensor([0, 3, 4, 9, 19]) if with_idx else None
    n = T if idx is None else idx.numel()
    slots = torch.randperm(S, generator=gen)[:n]
    reference.write_step_rows(table, slots, rows, idx)
    src = rows if idx is None else rows[idx]
    expected = before.clone()
    expected[slots] = src.to(dtype)
    assert torch.equal(table, expected)
    got = reference.gather_rows(table, slots)
    assert torch.equal(got, src.to(dtype))
    out = torch.empty_like(got)
    assert reference.gather_rows(table, slots, out) is out and torch.equal(out, got)


def test_dispatch_uses_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("R3_KERNELS", "triton")
    kernels.set_kernel_backend(None)
    assert kernels.kernel_backend() == "triton"
    table = torch.zeros((8, 2, 2), dtype=torch.uint8)
    kernels.write_step_rows(table, torch.tensor([3]), torch.tensor([[[1, 2], [3, 4]]]))  # CPU: reference
    assert kernels.gather_rows(table, torch.tensor([3])).tolist() == [[[1, 2], [3, 4]]]
    monkeypatch.setenv("R3_KERNELS", "bogus")
    with pytest.raises(ConfigError):
        kernels.kernel_backend()
    with pytest.raises(ConfigError):
        kernels.set_kernel_backend("cuda")


def test_importing_kernels_does_not_import_triton():
    import subprocess
    import sys

    code = "import sys, r3rdma.kernels, r3rdma.capture.capturer; assert 'triton' not in sys.modules and 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- custom kernels against the reference on the GPU -----------------------------------------

gpu = pytest.mark.gpu


def _triton():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return pytest.importorskip("r3rdma.kernels.triton_kernels")


@gpu
@pytest.mark.parametrize("T,L,K", SHAPES)
@pytest.mark.parametrize("with_rows", [False, True])
@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("num_experts,dtype", DTYPES)
def test_gpu_record_layer_parity(T, L, K, with_rows, with_map, num_experts, dtype):
    tk = _triton()
    gen = torch.Generator().manual_seed(T + L + K + num_experts)
    pad = T + 7
    phys = num_experts + 13 if with_map else num_experts
    ids = _ids(pad if with_rows else T, K, phys, gen, "cuda")
    rows = torch.randperm(pad, generator=gen)[:T].cuda() if with_rows else None
    emap = torch.randint(0, num_experts, (phys,), generator=gen).cuda() if with_map else None
    bufs = [_poisoned_table(T + 2, L, K, dtype, torch.Generator().manual_seed(1), "cuda") for _ in range(2)]
    for layer in sorted({0, L // 2, L - 1}):
        reference.record_layer(bufs[0], layer, ids, rows, emap)
        tk.record_layer(bufs[1], layer, ids, rows, emap)
    torch.cuda.synchronize()
    assert torch.equal(bufs[0], bufs[1])
    # int32 ids (some routers emit them) and a non-contiguous [T, K] view.
    wide = torch.randint(0, num_experts, (T, 2 * K), generator=gen, dtype=torch.int64).cuda()
    for src in (ids[:T].to(torch.int32), wide[:, ::2]):
        reference.record_layer(bufs[0], 0, src)
        tk.record_layer(bufs[1], 0, src)
        assert torch.equal(bufs[0], bufs[1])


@gpu
@pytest.mark.parametrize("T,L,K", SHAPES)
@pytest.mark.parametrize("num_experts,dtype", DTYPES)
@pytest.mark.parametrize("with_idx", [False, True])
@pytest.mark.parametrize("narrow", [False, True])
def test_gpu_write_gather_parity(T, L, K, num_experts, dtype, with_idx, narrow):
    tk = _triton()
    gen = torch.Generator().manual_seed(T * 7 + L + num_experts)
    S = 3 * T + 11
    rows = torch.randint(0, num_experts, (T, L, K), generator=gen, dtype=torch.int64)
    rows = (rows if narrow else rows.to(dtype)).cuda()
    idx = torch.randperm(T, generator=gen)[: max(1, T // 2)].sort().values.cuda() if with_idx else None
    n = T if idx is None else idx.numel()
    slots = torch.randperm(S, generator=gen)[:n].cuda()
    tables = [_poisoned_table(S, L, K, dtype, torch.Generator().manual_seed(2), "cuda") for _ in range(2)]
    reference.write_step_rows(tables[0], slots, rows, idx)
    tk.write_step_rows(tables[1], slots, rows, idx)
    assert torch.equal(tables[0], tables[1])
    order = torch.randperm(S, generator=gen)[: 2 * T].cuda()  # gather any slots, repeats allowed
    order = torch.cat([order, order[:3]])
    ref = reference.gather_rows(tables[0], order)
    got = tk.gather_rows(tables[1], order)
    assert torch.equal(ref, got)
    out = torch.full_like(got, 7)
    assert tk.gather_rows(tables[1], order, out) is out and torch.equal(out, ref)
    assert tk.gather_rows(tables[1], order[:0]).shape == (0, L, K)


@gpu
def test_gpu_dispatch_picks_per_backend():
    _triton()
    table = torch.zeros((64, 4, 8), dtype=torch.uint8, device="cuda")
    rows = torch.randint(0, 64, (10, 4, 8), device="cuda")
    slots = torch.arange(10, device="cuda") * 3
    try:
        for backend in ("torch", "triton", "auto"):
            kernels.set_kernel_backend(backend)
            table.zero_()
            kernels.write_step_rows(table, slots, rows)
            assert torch.equal(kernels.gather_rows(table, slots), rows.to(torch.uint8))
    finally:
        kernels.set_kernel_backend(None)


@gpu
def test_gpu_kernels_have_no_host_sync_and_replay_in_a_graph():
    tk = _triton()
    L, K, S, T = 24, 8, 512, 64
    table = torch.zeros((S, L, K), dtype=torch.uint8, device="cuda")
    buf = torch.zeros((T, L, K), dtype=torch.uint8, device="cuda")
    ids = torch.zeros((T, K), dtype=torch.int64, device="cuda")
    slots = torch.zeros(T, dtype=torch.int64, device="cuda")
    out = torch.empty((T, L, K), dtype=torch.uint8, device="cuda")

    def step():
        for layer in range(L):
            tk.record_layer(buf, layer, ids)
        tk.write_step_rows(table, slots, buf)
        tk.gather_rows(table, slots, out)

    step()  # compile outside the graph
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for trial in range(3):
        ids.copy_(torch.randint(0, 128, (T, K), device="cuda"))
        slots.copy_(torch.randperm(S, device="cuda")[:T])
        graph.replay()
        torch.cuda.synchronize()
        expected = ids.to(torch.uint8)[:, None, :].expand(T, L, K)
        assert torch.equal(out, expected)
        assert torch.equal(table[slots], expected)
