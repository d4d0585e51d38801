"""Megatron-core RouterReplay driven from stored routing (CPU: real TopKRouter.routing and
topk_routing_with_score_function; only TopKRouter.gating needs CUDA)."""

import itertools
import os
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
pytest.importorskip("megatron.core")

from megatron.core.tensor_parallel.mappings import _split_along_first_dim  # noqa: E402
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402

from r3rdma import LocalRoutingStore, RoutingReader, RoutingWriter  # noqa: E402
from r3rdma.errors import ConfigError, ReplayError, ShapeMismatchError  # noqa: E402
from r3rdma.integrations.megatron import MegatronReplay, MicroBatch, ParallelLayout, prefetch_routing  # noqa: E402
from r3rdma.records import RequestRecord  # noqa: E402

E, K, NUM_LAYERS = 8, 2, 4
LAYER_MAP = (0, 2, 3)  # decoder layer 1 is dense
PG = types.SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)


def config(**kw):
    args = dict(
        num_layers=NUM_LAYERS, hidden_size=16, num_attention_heads=2, num_moe_experts=E, moe_router_topk=K,
        moe_enable_routing_replay=True, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        use_cpu_initialization=True, add_bias_linear=False,
    )
    args.update(kw)
    return TransformerConfig(**args)


class Layer(torch.nn.Module):
    def __init__(self, cfg, decoder_layer):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.router = TopKRouter(cfg, PG)
        self.mlp.router.set_layer_number(decoder_layer + 1)  # Megatron's layer_number is 1-based


class Stage(torch.nn.Module):
    """The routers of one pipeline stage (or virtual chunk), in Megatron's module nesting."""

    def __init__(self, cfg, decoder_layers):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(Layer(cfg, d) for d in decoder_layers)


def run_routers(replay, n_rows, b=1, seed=0, grad=False):
    """One forward of every local router on [s, b, E] logits; returns per-router chosen ids
    (sorted per row) and the logits (for gradient checks)."""
    g = torch.Generator().manual_seed(seed)
    chosen, all_logits, all_probs = [], [], []
    for r in replay.routers:
        logits = torch.randn(n_rows // b, b, E, generator=g, requires_grad=grad)
        probs, routing_map = r.module.routing(logits)
        chosen.append(torch.stack([row.nonzero().flatten() for row in routing_map]))
        all_logits.append(logits)
        all_probs.append(probs)
    return chosen, all_logits, all_probs


@pytest.fixture
def stored(tmp_path):
    """Five requests written through RoutingWriter into a LocalRoutingStore; stored rows = n - 1."""
    rng = np.random.default_rng(7)
    lens = {"r0": 7, "r1": 12, "r2": 5, "r3": 9, "r4": 16}
    rows = {}
    store = LocalRoutingStore(tmp_path / "root")
    writer = RoutingWriter(store)
    for rid, n in lens.items():
        ids = np.stack([np.stack([rng.permutation(E)[:K] for _ in LAYER_MAP]) for _ in range(n - 1)]).astype(np.uint8)
        rows[rid] = ids
        writer.submit(RequestRecord("roll", rid, ids, LAYER_MAP, E))
    writer.flush()
    writer.close()
    store.close()
    reader = RoutingReader(tmp_path / "root")
    yield reader, lens, rows
    reader.close()


def expected_full(rows, lens, ids, fmt, length, cu_pad=None):
    """Full (unsplit) per-decoder-layer targets [N, K] as sorted id rows and a recorded mask."""
    b = len(ids)
    out = {d: [] for d in LAYER_MAP}
    rec = []
    if fmt == "padded":
        coords = [(s, i, s * b + i) for s in range(length) for i in range(b)]
    else:
        coords = [(p, i, cu_pad[i] + p) for i in range(b) for p in range(cu_pad[i + 1] - cu_pad[i])]
    for pos, i, row in coords:
        r = rows[ids[i]]
        ok = pos < lens[ids[i]] - 1
        rec.append(ok)
        for li, d in enumerate(LAYER_MAP):
            v = r[pos, li] if ok else np.array([(row * K + j) % E for j in range(K)])
            out[d].append(np.sort(v.astype(np.int64)))
    return {d: torch.tensor(np.stack(v)) for d, v in out.items()}, torch.tensor(rec)


def test_padded_forced_ids_and_spread_pads(stored):
    reader, lens, rows = stored
    ids = ["r1", "r0", "r2"]
    replay = MegatronReplay(Stage(config(), [0, 1, 2, 3][:1] + [2, 3]))
    batch = MicroBatch.padded(ids, [lens[i] for i in ids], seq_length=14)
    want, rec = expected_full(rows, lens, ids, "padded", 14)
    with replay.step():
        replay.load(reader.get_packed("roll", ids), batch)
        chosen, _, _ = run_routers(replay, 14 * 3, b=3)
    for r, got in zip(replay.routers, chosen):
        assert torch.equal(got, want[r.decoder_layer])
        pads = got[~rec]
        assert (pads[:, 0] != pads[:, 1]).all()  # no duplicate within a row
        counts = torch.bincount(pads.flatten(), minlength=E)
        assert counts.max() < pads.numel() and (counts > 0).sum() == E  # spread over every expert


def test_thd_forced_ids(stored):
    reader, lens, rows = stored
    ids = ["r4", "r2", "r3"]
    batch = MicroBatch.thd(ids, [lens[i] for i in ids], pad_to_multiple_of=4)
    assert batch.cu_seqlens_padded == (0, 16, 24, 36)
    replay = MegatronReplay([Stage(config(), [0]), Stage(config(), [2, 3])])  # two virtual chunks
    want, _ = expected_full(rows, lens, ids, "thd", 36, batch.cu_seqlens_padded)
    with replay.step():
        for chunk in (0, 1):  # each chunk's forward_step loads its own routers
            replay.load(reader.get_packed("roll", ids), batch, chunk=chunk)
        chosen, _, _ = run_routers(replay, 36)
    assert [r.decoder_layer for r in replay.routers] == [0, 2, 3]
    for r, got in zip(replay.routers, chosen):
        assert torch.equal(got, want[r.decoder_layer])


class FakeGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.fixture
def gloo(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def rank_targets(stored_, ids, batch, layout, cfg_kw):
    reader, _, _ = stored_
    replay = MegatronReplay(Stage(config(**cfg_kw), [0, 2, 3]), layout=layout)
    with replay.step():
        return replay.targets(reader.get_packed("roll", ids), batch).to(torch.int64).sort(dim=-1).values


def test_padded_cp2_sp2_match_megatron_split(stored, gloo):
    """CP=2 zigzag then SP=2: each rank's targets equal Megatron's own split of the full rows
    (utils.get_batch_on_this_cp_rank, then mappings._split_along_first_dim on [s, b])."""
    _, lens, rows = stored
    ids = ["r1", "r0"]
    batch = MicroBatch.padded(ids, [lens[i] for i in ids], seq_length=16)
    want, _ = expected_full(rows, lens, ids, "padded", 16)
    full = torch.stack([want[d] for d in LAYER_MAP])  # [L, S*B, K], rows s-major
    by_bs = full.view(3, 16, 2, K).permute(0, 2, 1, 3)  # [L, B, S, K]: Megatron's batch layout
    seen = []
    for cp_rank in range(2):
        local = get_batch_on_this_cp_rank({"tokens": by_bs.reshape(6, 16, K)}, cp_group=FakeGroup(2, cp_rank))["tokens"]
        s_b = local.view(3, 2, 8, K).permute(0, 2, 1, 3)  # [L, s_cp, B, K]
        for tp_rank in range(2):
            mine = torch.stack([_split_along_first_dim(x, FakeGroup(2, tp_rank)) for x in s_b]).reshape(3, -1, K)
            layout = ParallelLayout(tp_size=2, tp_rank=tp_rank, sequence_parallel=True, cp_size=2, cp_rank=cp_rank)
            got = rank_targets(stored, ids, batch, layout, dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2))
            assert torch.equal(got, mine)
            seen.append(got)
    assert sum(g.shape[1] for g in seen) == 32  # every row on exactly one rank


def test_thd_cp2_zigzag_per_sequence(stored):
    """THD: each sequence cut into 2*cp chunks (TE thd_get_partitioned_indices); ranks' rows
    permute back to the full packed sequence."""
    _, lens, rows = stored
    ids = ["r4", "r2", "r3"]
    batch = MicroBatch.thd(ids, [lens[i] for i in ids], pad_to_multiple_of=4)
    want, _ = expected_full(rows, lens, ids, "thd", 36, batch.cu_seqlens_padded)
    full = torch.stack([want[d] for d in LAYER_MAP])
    order = []
    for r in range(2):
        for i in range(3):
            a, b = batch.cu_seqlens_padded[i], batch.cu_seqlens_padded[i + 1]
            c = (b - a) // 4
            order += list(range(a + r * c, a + (r + 1) * c)) + list(range(a + (3 - r) * c, a + (4 - r) * c))
    got = torch.cat([rank_targets(stored, ids, batch, ParallelLayout(cp_size=2, cp_rank=r), dict(context_parallel_size=2)) for r in range(2)], dim=1)
    assert sorted(order) == list(range(36))
    assert torch.equal(got, full[:, order])
    with pytest.raises(ShapeMismatchError, match="divisible by 4"):
        rank_targets(stored, ids, MicroBatch.thd(ids, [lens[i] for i in ids], pad_to_multiple_of=2), ParallelLayout(cp_size=2), dict(context_parallel_size=2))


def test_cp_ranks_read_only_their_rows(stored):
    """prefetch_routing(layout=) reads each CP rank's rows alone (cp_rows: fewer rows read);
    its targets equal those of whole reads, padded and thd, every rank."""
    from r3rdma.integrations.megatron import cp_rows

    reader, lens, _ = stored
    ids = ["r4", "r2", "r3"]
    cases = [
        MicroBatch.thd(ids, [lens[i] for i in ids], pad_to_multiple_of=4),
        MicroBatch.padded(ids, [lens[i] for i in ids], seq_length=16),
    ]
    for batch in cases:
        for rank in range(2):
            layout = ParallelLayout(cp_size=2, cp_rank=rank)
            replay = MegatronReplay(Stage(config(context_parallel_size=2), [0, 2, 3]), layout=layout)
            (got_batch, sliced), = prefetch_routing(reader, "roll", [batch], layout=layout)
            read = sliced.cu_seqlens.diff().tolist()
            assert read == [sum(b - a for a, b in cp_rows([batch], layout)[rid]) for rid in ids]
            assert sum(read) < sum(lens[i] - 1 for i in ids)  # the other rank's rows stayed on the node
            with replay.step():
                whole = replay.targets(reader.get_packed("roll", ids), batch)
                assert torch.equal(replay.targets(sliced, got_batch), whole)
            other = ParallelLayout(cp_size=2, cp_rank=1 - rank)
            (_, wrong), = prefetch_routing(reader, "roll", [batch], layout=other)
            if wrong.cu_seqlens.diff().tolist() != read:  # another rank's rows do not pass as this one's
                with replay.step(), pytest.raises(ShapeMismatchError, match="context-parallel"):
                    replay.targets(wrong, batch)


@pytest.mark.parametrize("cp", [1, 2])
def test_sp_ranks_read_only_their_rows(stored, gloo, cp):
    """Sequence parallel (TP=2, with and without CP=2): prefetch_routing(layout=) reads each
    rank's own rows (rank_rows: one span, two or none per request), together every row once;
    each rank's targets equal those of whole reads, padded and thd."""
    from r3rdma.integrations.megatron import rank_rows

    reader, lens, _ = stored
    ids = ["r4", "r2", "r3"]
    cases = [
        MicroBatch.thd(ids, [lens[i] for i in ids], pad_to_multiple_of=2 * cp * 2),
        MicroBatch.padded(ids, [lens[i] for i in ids], seq_length=16),
    ]
    cfg = dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=cp)
    for batch in cases:
        total = 0
        for tp_rank, cp_rank in itertools.product(range(2), range(cp)):
            layout = ParallelLayout(tp_size=2, tp_rank=tp_rank, sequence_parallel=True, cp_size=cp, cp_rank=cp_rank)
            spans = rank_rows([batch], layout)
            replay = MegatronReplay(Stage(config(**cfg), [0, 2, 3]), layout=layout)
            (got_batch, sliced), = prefetch_routing(reader, "roll", [batch], layout=layout)
            read = sliced.cu_seqlens.diff().tolist()
            assert read == [sum(b - a for a, b in spans[rid]) for rid in ids]
            total += sum(read)
            with replay.step():
                whole = replay.targets(reader.get_packed("roll", ids), batch)
                assert torch.equal(replay.targets(sliced, got_batch), whole)
            other = ParallelLayout(tp_size=2, tp_rank=1 - tp_rank, sequence_parallel=True, cp_size=cp, cp_rank=cp_rank)
            (_, wrong), = prefetch_routing(reader, "roll", [batch], layout=other)
            if wrong.cu_seqlens.diff().tolist() != read:  # another rank's rows do not pass as this one's
                with replay.step(), pytest.raises(ShapeMismatchError, match="sequence-parallel"):
                    replay.targets(wrong, batch)
        assert total == sum(lens[i] - 1 for i in ids)  # every stored row read by exactly one rank
    with pytest.raises(ConfigError, match="each tensor-parallel rank reads its own rows"):
        list(prefetch_routing(reader, "roll", cases[:1], layout=layout, tp_group=torch.distributed.group.WORLD))


def _tp_broadcast_worker(rank, root, out):
    """One of two TP ranks (gloo): the group's first rank reads and broadcasts, the other gets
    the same routing without a reader; a bad id fails on both."""
    import json

    from r3rdma.errors import UnknownRequestError

    torch.distributed.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=2)
    try:
        reader = RoutingReader(root) if rank == 0 else None
        batches = [MicroBatch.thd(["r4", "r2"], [16, 5]), MicroBatch.thd(["r0"], [7])]
        got = [r.ids_TLK.numpy() for _, r in prefetch_routing(reader, "roll", batches, tp_group=torch.distributed.group.WORLD)]
        np.save(f"{out}/rank{rank}.npy", np.concatenate([g.reshape(-1) for g in got]))
        try:
            list(prefetch_routing(reader, "roll", [MicroBatch.thd(["nope"], [3])], tp_group=torch.distributed.group.WORLD))
            error = None
        except UnknownRequestError as e:
            error = type(e).__name__
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump({"error": error}, f)
    finally:
        torch.distributed.destroy_process_group()
    # The interpreter's teardown after gloo sometimes aborts the process ("terminate called
    # without an active exception", torch 2.13 CPU: 2 runs in 6 on the 2-core VM), after this
    # rank wrote everything the test checks: it leaves without the teardown. An error above
    # still propagates (and fails the test) before this line.
    os._exit(0)


def test_tp_group_reads_once_and_broadcasts(stored, tmp_path):
    """prefetch_routing(tp_group=): the first rank of the group reads, the others receive the
    same routing (no reader there); a failed read is raised on every rank, none hangs."""
    import json

    import torch.multiprocessing as mp

    _, _, rows = stored  # the fixture's store is tmp_path / "root"
    out = tmp_path / "tp"
    out.mkdir()
    mp.start_processes(_tp_broadcast_worker, args=(str(tmp_path / "root"), str(out)), nprocs=2, start_method="spawn")
    want = np.concatenate([rows[r].reshape(-1) for r in ("r4", "r2", "r0")])
    for rank in range(2):
        np.testing.assert_array_equal(np.load(out / f"rank{rank}.npy"), want)
        assert json.loads((out / f"rank{rank}.json").read_text()) == {"error": "UnknownRequestError"}


def test_sp2_thd_slices_concatenate(stored):
    _, lens, rows = stored
    ids = ["r0", "r3"]
    batch = MicroBatch.thd(ids, [lens[i] for i in ids], pad_to_multiple_of=2)
    want, _ = expected_full(rows, lens, ids, "thd", batch.seq_length, batch.cu_seqlens_padded)
    parts = [rank_targets(stored, ids, batch, ParallelLayout(tp_size=2, tp_rank=r, sequence_parallel=True), dict(tensor_model_parallel_size=2, sequence_parallel=True)) for r in range(2)]
    assert parts[0].shape[1] == parts[1].shape[1] == batch.seq_length // 2
    assert torch.equal(torch.cat(parts, dim=1), torch.stack([want[d] for d in LAYER_MAP]))


def test_pipeline_stages_take_their_layers(stored):
    reader, lens, rows = stored
    ids = ["r0", "r2"]
    batch = MicroBatch.thd(ids, [lens[i] for i in ids])
    want, _ = expected_full(rows, lens, ids, "thd", batch.seq_length, batch.cu_seqlens_padded)
    for stage_layers in ([0], [2, 3]):
        replay = MegatronReplay(Stage(config(), stage_layers))
        with replay.step():
            replay.load(reader.get_packed("roll", ids), batch)
            chosen, _, _ = run_routers(replay, batch.seq_length)
        assert [r.decoder_layer for r in replay.routers] == stage_layers
        for d, got in zip(stage_layers, chosen):
            assert torch.equal(got, want[d])


@pytest.fixture
def stored_by_layer(tmp_path, monkeypatch):
    """The same five requests in a store whose inner chunks hold one layer each, so a read of
    some layers fetches fewer chunks (the writer's own rule groups these tiny layers into one)."""
    from r3rdma.store import batch_array

    from .shard_fetches import count_shard_fetches

    monkeypatch.setattr(batch_array, "layers_per_chunk", lambda *_: 1)
    rng = np.random.default_rng(7)
    lens = {"r0": 7, "r1": 12, "r2": 5, "r3": 9, "r4": 16}
    rows = {rid: np.stack([np.stack([rng.permutation(E)[:K] for _ in LAYER_MAP]) for _ in range(n - 1)]).astype(np.uint8) for rid, n in lens.items()}
    with LocalRoutingStore(tmp_path / "root", chunk_rows=8, min_chunk_rows=8) as store:
        store.commit([RequestRecord("roll", rid, ids, LAYER_MAP, E) for rid, ids in rows.items()])
    fetched = count_shard_fetches(monkeypatch)  # bytes of every shard read
    reader = RoutingReader(tmp_path / "root")
    yield reader, lens, rows, fetched
    reader.close()


@pytest.mark.parametrize("stage_layers", [[[2, 3]], [[0], [3]]], ids=["pp_stage", "vpp_chunks"])
def test_stage_reads_only_its_layers(stored_by_layer, stage_layers):
    """A pipeline stage (with virtual stages: every chunk's layers) reads its routers' layers
    alone through prefetch_routing(layers=replay.layers), fetches fewer bytes than a read of
    every layer, and replays exactly what the whole read replays."""
    reader, lens, rows, fetched = stored_by_layer
    micro_batches = [MicroBatch.thd(["r4", "r0"], [lens["r4"], lens["r0"]], pad_to_multiple_of=2), MicroBatch.padded(["r1", "r3"], [12, 9], seq_length=12)]
    replay = MegatronReplay([Stage(config(), layers) for layers in stage_layers])
    assert replay.layers == tuple(d for layers in stage_layers for d in layers)
    asked = []
    real_prefetch = reader.prefetch

    def spy(*args, **kw):
        asked.append(kw.get("layers"))
        return real_prefetch(*args, **kw)

    reader.prefetch = spy
    by_stage = list(prefetch_routing(reader, "roll", micro_batches, layers=replay.layers))
    stage_bytes = sum(fetched)
    fetched.clear()
    whole = list(prefetch_routing(reader, "roll", micro_batches))
    whole_bytes = sum(fetched)
    assert asked == [replay.layers, None]
    assert 0 < stage_bytes < whole_bytes
    for (batch, part), (_, every) in zip(by_stage, whole):
        assert part.layer_map == replay.layers and every.layer_map == LAYER_MAP
        assert part.ids_TLK.shape[1] == len(replay.layers)
        for chunk in range(len(stage_layers)):
            with replay.step():
                sliced = replay.targets(part, batch, chunk=chunk)
                assert torch.equal(sliced, replay.targets(every, batch, chunk=chunk))
    # the routers' decisions, loaded from the stage's read, are the rollout's
    batch, part = by_stage[1]
    want, _ = expected_full(rows, lens, list(batch.request_ids), "padded", batch.seq_length)
    n = batch.seq_length * len(batch.request_ids)
    with replay.step():
        for chunk in range(len(stage_layers)):
            replay.load(part, batch, chunk=chunk)
        chosen, _, _ = run_routers(replay, n, b=len(batch.request_ids))
    for r, got in zip(replay.routers, chosen):
        assert torch.equal(got, want[r.decoder_layer])


def test_routing_read_without_a_stage_layer_refused(stored):
    """A read of other layers than the stage's (a layer-sliced PackedRouting missing one of its
    routers' layers) is refused, naming the layer and what the rank replays."""
    reader, lens, _ = stored
    batch = MicroBatch.thd(["r2"], [lens["r2"]])
    replay = MegatronReplay(Stage(config(), [2, 3]))
    partial = reader.get_packed("roll", ["r2"], layers=[2])
    assert partial.layer_map == (2,)
    with replay.step(), pytest.raises(ShapeMismatchError, match=r"layers \[3\] of this stage .*layer_map \[2\].*replay decoder layers \[2, 3\]"):
        replay.load(partial, batch)
    with pytest.raises(ShapeMismatchError, match="no MoE layer 1"):  # before the step, before any read
        prefetch_routing(reader, "roll", [batch], layers=[1, 2]).__next__()


@pytest.mark.parametrize("reentrant", [True, False])
def test_recompute_replays_the_same_ids_fifo(stored, reentrant):
    """Two micro-batches forward, then their backwards (pipeline order): the recomputed forward
    of each pops its own routing, not the last loaded."""
    reader, lens, rows = stored
    replay = MegatronReplay(Stage(config(), [0]))
    router = replay.routers[0].module
    mbs = [["r1"], ["r3", "r0"]]
    seen = []

    def fn(logits):
        probs, routing_map = router.routing(logits)
        seen.append(torch.stack([row.nonzero().flatten() for row in routing_map]))
        return probs

    with replay.step():
        outs = []
        for k, ids in enumerate(mbs):
            batch = MicroBatch.thd(ids, [lens[i] for i in ids])
            replay.load(reader.get_packed("roll", ids), batch)
            logits = torch.randn(batch.seq_length, 1, E, requires_grad=True)
            with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recompute all of fn
                outs.append((torch.utils.checkpoint.checkpoint(fn, logits, use_reentrant=reentrant), logits))
        for probs, logits in outs:
            (probs * torch.arange(E)).sum().backward()
            assert logits.grad is not None
        assert router.router_replay.replay_backward_list == []
    assert len(seen) == 4
    assert torch.equal(seen[0], seen[2]) and torch.equal(seen[1], seen[3])
    assert not torch.equal(seen[0][: len(seen[1])], seen[1][: len(seen[0])])


def test_virtual_pipeline_chunks_take_only_their_micro_batches(stored):
    """Interleaved virtual pipeline (two chunks on this rank) with recompute: Megatron's schedule
    runs chunk 0 on micro-batches 0, 1, then chunk 1 on 0, 1, and recomputes in its own
    backward order. Each load names its chunk, so each router's recompute FIFO holds only its
    own micro-batches; loading every router per forward would queue micro-batch 0 twice on
    chunk 1's routers and replay it for micro-batch 2's recompute (same shape, wrong ids)."""
    reader, lens, rows = stored
    chunks = [Stage(config(), [0]), Stage(config(), [2, 3])]
    replay = MegatronReplay(chunks)
    assert [(r.decoder_layer, r.chunk) for r in replay.routers] == [(0, 0), (2, 1), (3, 1)]
    mbs = [["r1", "r0"], ["r3", "r4"], ["r2", "r0"]]
    batches = [MicroBatch.thd(ids, [lens[i] for i in ids], cu_seqlens_padded=[0, 16, 32]) for ids in mbs]
    routing = [reader.get_packed("roll", ids) for ids in mbs]
    want = [expected_full(rows, lens, ids, "thd", 32, [0, 16, 32])[0] for ids in mbs]
    seen: dict = {}

    def run(chunk, m):
        routers = [r for r in replay.routers if r.chunk == chunk]

        def fn(logits):
            outs = []
            for r in routers:
                probs, routing_map = r.module.routing(logits)
                phase = "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
                seen.setdefault((r.decoder_layer, m, phase), []).append(
                    torch.stack([row.nonzero().flatten() for row in routing_map]))
                outs.append(probs)
            return sum(outs)

        logits = torch.randn(32, 1, E, requires_grad=True)
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            return torch.utils.checkpoint.checkpoint(fn, logits, use_reentrant=False)

    with replay.step():
        with pytest.raises(ConfigError, match="2 chunks"):
            replay.load(routing[0], batches[0])
        with pytest.raises(ConfigError, match="not one of the 2 model chunks"):
            replay.load(routing[0], batches[0], chunk=Stage(config(), [0]))
        with pytest.raises(ConfigError, match="out of range"):
            replay.load(routing[0], batches[0], chunk=2)
        wrapper = torch.nn.Module()  # as DDP / Float16Module hold the chunk the schedule is given
        wrapper.module = chunks[1]
        replay.load(routing[0], batches[0], chunk=wrapper)
        replay.load(routing[0], batches[0], chunk=1)  # loaded again: the FIFO now holds it twice
        for r in replay.routers:
            r.module.router_replay.replay_backward_list.clear()
        pending = {}
        order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 2)]  # forward order of the interleaved schedule
        for chunk, m in order:
            replay.load(routing[m], batches[m], chunk=chunks[chunk] if m % 2 else chunk)
            pending[(chunk, m)] = run(chunk, m)
        with pytest.raises(ReplayError, match="no routing loaded"):  # chunk 1 has taken its micro-batch 2
            run(1, 2)
        for key in [(1, 0), (0, 0), (1, 1), (0, 1), (1, 2), (0, 2)]:  # backward order
            (pending.pop(key) * torch.arange(E)).sum().backward()
        assert all(r.module.router_replay.replay_backward_list == [] for r in replay.routers)
    for r in replay.routers:
        for m in range(len(mbs)):
            assert torch.equal(seen[(r.decoder_layer, m, "forward")][0], want[m][r.decoder_layer])
            assert torch.equal(seen[(r.decoder_layer, m, "recompute")][0], want[m][r.decoder_layer]), (r.decoder_layer, m)


def test_gradients_reach_router_scores(stored):
    reader, lens, _ = stored
    ids = ["r2"]
    batch = MicroBatch.thd(ids, [lens["r2"]])
    replay = MegatronReplay(Stage(config(moe_router_score_function="sigmoid"), [0]))
    with replay.step():
        replay.load(reader.get_packed("roll", ids), batch)
        target = replay.routers[0].module.router_replay.target_topk_idx
        logits = torch.randn(batch.seq_length, E, requires_grad=True)
        probs, routing_map = topk_routing_with_score_function(
            logits, K, score_function="sigmoid", router_replay=replay.routers[0].module.router_replay
        )
        (probs * torch.randn(E)).sum().backward()
    mask = torch.zeros(batch.seq_length, E, dtype=torch.bool).scatter(1, target, True)
    assert torch.equal(routing_map.bool(), mask)
    assert (logits.grad[mask] != 0).all() and (logits.grad[~mask] == 0).all()


def test_off_by_one_and_missing_routing(stored):
    reader, lens, _ = stored
    replay = MegatronReplay(Stage(config(), [0]))
    with replay.step():
        with pytest.raises(ShapeMismatchError, match="seq_len - unrecorded_tail"):  # engine's n - 1 rows, trainer says 0 tail
            replay.load(reader.get_packed("roll", ["r0"]), MicroBatch.thd(["r0"], [lens["r0"]], unrecorded_tail=0))
        replay.load(reader.get_packed("roll", ["r0"]), MicroBatch.thd(["r0"], [lens["r0"] - 1], unrecorded_tail=0))
        with pytest.raises(ReplayError, match="missing"):
            replay.load(reader.get_packed("roll", ["r0"]), MicroBatch.thd(["r0", "r1"], [7, 12]))


def test_forward_without_load_and_reuse_refused(stored):
    reader, lens, _ = stored
    replay = MegatronReplay(Stage(config(), [0]))
    router = replay.routers[0].module
    with replay.step():
        with pytest.raises(ReplayError, match="no routing loaded"):
            router.routing(torch.randn(4, 1, E))
        replay.load(reader.get_packed("roll", ["r2"]), MicroBatch.thd(["r2"], [5]))
        with pytest.raises(ShapeMismatchError, match="sees 4 tokens"):
            router.routing(torch.randn(4, 1, E))
        router.routing(torch.randn(5, 1, E))
        with pytest.raises(ReplayError, match="no routing loaded"):  # a second forward needs a new load
            router.routing(torch.randn(5, 1, E))
    with pytest.raises(ReplayError, match="outside"):
        replay.load(reader.get_packed("roll", ["r2"]), MicroBatch.thd(["r2"], [5]))


def test_step_clears_on_exception(stored):
    reader, _, _ = stored
    replay = MegatronReplay(Stage(config(), [0]))
    rr = replay.routers[0].module.router_replay
    with pytest.raises(RuntimeError, match="boom"):
        with replay.step():
            replay.load(reader.get_packed("roll", ["r2"]), MicroBatch.thd(["r2"], [5]))
            raise RuntimeError("boom")
    assert rr.router_replay_action is None and rr.target_topk_idx is None and rr.replay_backward_list == []
    assert "get_replay_topk" not in rr.__dict__


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(moe_enable_routing_replay=False), "moe_enable_routing_replay"),
        (dict(moe_expert_capacity_factor=1.0), "drops replayed tokens"),
        (dict(tensor_model_parallel_size=2), "layout has tp=1"),
    ],
)
def test_config_refusals(kw, match):
    with pytest.raises(ConfigError, match=match):
        MegatronReplay(Stage(config(**kw), [0]))


def test_fusion_sinkhorn_mtp_refused():
    fused = Stage(config(), [0])
    fused.decoder.layers[0].mlp.router.config.moe_router_fusion = True  # TE-only in __post_init__; flip after build
    with pytest.raises(ConfigError, match="moe_router_fusion"):
        MegatronReplay(fused)
    sink = Stage(config(), [0])
    sink.decoder.layers[0].mlp.router.routing_type = "sinkhorn"
    with pytest.raises(ConfigError, match="sinkhorn"):
        MegatronReplay(sink)

    class MTP(MultiTokenPredictionLayer):
        def __init__(self, cfg):
            torch.nn.Module.__init__(self)
            self.transformer_layer = Layer(cfg, 0)  # MTP restarts layer numbering

    model = torch.nn.ModuleList([Stage(config(), [0, 2]), MTP(config())])
    with pytest.raises(ConfigError, match="MTP"):
        MegatronReplay(model)
    replay = MegatronReplay(model, mtp="live")
    assert [r.decoder_layer for r in replay.routers] == [0, 2]


def test_layer_topk_expert_mismatch_refused(stored):
    reader, _, _ = stored
    batch = MicroBatch.thd(["r2"], [5])
    for stage, match in [
        (Stage(config(), [1]), r"layers \[1\]"),
        (Stage(config(moe_router_topk=3), [0]), "top-3"),
        (Stage(config(num_moe_experts=16), [0]), "16 experts"),
    ]:
        replay = MegatronReplay(stage)
        with replay.step(), pytest.raises(ShapeMismatchError, match=match):
            replay.load(reader.get_packed("roll", ["r2"]), batch)


def test_prefetch_in_order(stored):
    reader, lens, rows = stored
    batches = [MicroBatch.thd([i], [lens[i]]) for i in ("r3", "r0", "r4")]
    got = list(prefetch_routing(reader, "roll", batches))
    assert [b.request_ids for b, _ in got] == [("r3",), ("r0",), ("r4",)]
    for b, routing in got:
        assert np.array_equal(routing.ids_TLK.numpy(), rows[b.request_ids[0]])


def test_import_r3rdma_does_not_import_megatron():
    code = "import sys, r3rdma; r3rdma.RoutingReader; r3rdma.RouterReplay; assert 'megatron' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_replay_md_example(stored):
    """The training loop of docs/REPLAY.md ("Megatron-core"), with the routers run on CPU."""
    reader, lens, rows = stored
    model = [Stage(config(), [0]), Stage(config(), [2, 3])]
    micro_batches = [MicroBatch.thd(["r0", "r1"], [lens["r0"], lens["r1"]], pad_to_multiple_of=2), MicroBatch.padded(["r4"], [16], seq_length=16)]
    replay = MegatronReplay(model, layout=ParallelLayout())
    n_forwards = 0
    with replay.step():
        routed = prefetch_routing(reader, "roll", micro_batches, layers=replay.layers)
        data_iterators = list(itertools.tee(routed, len(model)))
        for chunk, m in [(0, 0), (0, 1), (1, 0), (1, 1)]:  # the interleaved schedule's forward order
            batch, routing = next(data_iterators[chunk])
            assert batch is micro_batches[m]
            replay.load(routing, batch, chunk=model[chunk])
            n = batch.seq_length * len(batch.request_ids) if batch.fmt == "padded" else batch.seq_length
            g = torch.Generator().manual_seed(m)
            first = rows[batch.request_ids[0]][0]
            for r in replay.routers:
                if r.chunk == chunk:
                    _, routing_map = r.module.routing(torch.randn(n, 1, E, generator=g))
                    assert routing_map[0].nonzero().flatten().tolist() == sorted(first[LAYER_MAP.index(r.decoder_layer)].tolist())
            n_forwards += 1
    assert n_forwards == 4
