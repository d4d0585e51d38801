"""A scheduler simulator that drives :class:`RoutingCapturer` like a real inference engine.

Ground truth: a deterministic fake router whose row for a position is a function of the
request's *content* up to and including that position (a rolling prefix hash), so positions
shared by a prefix give equal rows, and anything else gives distinct rows; ids within a row are
distinct experts. The simulator computes every step's routing from the tokens the step really
feeds (draft tokens included), records it through the capturer exactly as an engine's MoE hooks
would, and at the end compares every stored request, read back through the Zarr store, with the
router applied to the request's final content.

Engine features: continuous batching with random arrivals and a token budget (chunked prefill),
paged KV blocks with a prefix cache (full blocks, LRU eviction, optional ``release_slots``),
speculative decoding with variable acceptance (EOS and length limits inside accepted drafts),
a draft model routed through shared hooks (``suspended``) and into its own capturer,
preemption with recompute, aborts, n > 1 samples (independent, or forked with copy-on-write of
the last block), overlap scheduling (step N+1 launched before step N's finishes are processed,
finished requests riding along one extra step), prefill/decode disaggregation (two engines,
each pushing its own segment), EPLB (physical replica ids), chunked MoE and padded router input,
multi-turn conversations (append or ``only_last_turn``).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from r3rdma import LocalRoutingStore, RoutingCapturer, RoutingReader
from r3rdma.errors import UnknownRequestError

M64 = (1 << 64) - 1
EOS = 0
VOCAB = 50


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def extend_hash(prev: int, token: int) -> int:
    """Prefix hash of a sequence extended by one token."""
    return _mix(prev ^ _mix(int(token) + 1))


def prefix_hashes(tokens, h: int = 0x1234) -> list[int]:
    out = []
    for t in tokens:
        h = extend_hash(h, t)
        out.append(h)
    return out


class FakeRouter:
    """Row of a position = f(prefix hash): top-k distinct experts per layer, deterministic."""

    def __init__(self, num_layers: int, top_k: int, num_experts: int, salt: int = 0) -> None:
        self.L, self.K, self.E = num_layers, top_k, num_experts
        self.units = np.array([u for u in range(1, num_experts) if np.gcd(u, num_experts) == 1], dtype=np.uint64)
        self.layer_salt = np.array([_mix(salt * 1000 + l + 1) for l in range(num_layers)], dtype=np.uint64)

    def rows(self, hashes) -> np.ndarray:
        h = np.asarray(hashes, dtype=np.uint64).reshape(-1, 1)
        with np.errstate(over="ignore"):
            x = h ^ self.layer_salt[None, :]
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            x = x ^ (x >> np.uint64(31))
        start = (x % np.uint64(self.E)).astype(np.int64)
        stride = self.units[((x >> np.uint64(32)) % np.uint64(self.units.size)).astype(np.int64)].astype(np.int64)
        k = np.arange(self.K, dtype=np.int64)
        return (start[..., None] + k * stride[..., None]) % self.E  # [T, L, K]


def sample_token(seed: int, position: int, eos_rate: float) -> int:
    """The model's sampled token at ``position`` for a sample seed: independent of scheduling."""
    x = _mix(seed * 1_000_003 + position)
    if (x & 0xFFFF) / 65536.0 < eos_rate:
        return EOS
    return int(1 + (x >> 16) % (VOCAB - 1))


@dataclass
class SimConfig:
    seed: int = 0
    num_prompts: int = 6
    n_samples: int = 1
    fork: bool = False
    max_turns: int = 1
    only_last_turn: bool = False
    block_size: int = 4
    num_blocks: int = 40
    token_budget: int = 12
    max_running: int = 4
    prefix_caching: bool = True
    release_on_evict: bool = True
    spec_k: int = 0
    spec_accept: float = 0.6
    preempt_prob: float = 0.0
    abort_prob: float = 0.0
    overlap: bool = False
    pd_fraction: float = 0.0
    eplb: bool = False
    chunked_moe: bool = False
    padded_router: bool = False
    draft_capture: bool = False
    eos_rate: float = 0.06
    max_new: int = 10
    num_layers: int = 3
    top_k: int = 2
    num_experts: int = 16
    layer_map: tuple[int, ...] = (1, 3, 4)
    max_steps: int = 3000


@dataclass
class Req:
    rid: str  # engine request id
    store_id: str
    seed: int
    tokens: list[int]
    hashes: list[int]
    prompt_len: int
    max_new: int
    start_row: int  # first row this request's record stores
    arrival: int
    pd: bool = False
    phase: str = "single"  # "single" | "prefill" | "decode"
    fork_parent: str | None = None
    fork_children: list["Req"] = field(default_factory=list)
    conv: "Conv | None" = None
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    local_from: int = 0  # positions below this have KV without rows here (P/D transfer)
    done: bool = False
    aborted: bool = False

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class Conv:
    store_id: str
    seed: int
    prompt: list[int]
    turns_left: int
    pd: bool
    turn: int = 0
    stored_rows: int = 0  # rows stored so far (end of the stored span)
    final_tokens: list[int] | None = None  # content of the last completed turn
    ended: bool = False
    pending_part: bool = False  # an aborted later turn left a prefill part pending


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, capturer: RoutingCapturer, *, prefix_caching: bool,
                 release_on_evict: bool) -> None:
        self.bs = block_size
        self.free = list(range(num_blocks))
        self.ref = [0] * num_blocks
        self.cached: dict[int, int] = {}  # prefix hash -> block
        self.block_hash: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.capturer = capturer
        self.prefix_caching = prefix_caching
        self.release_on_evict = release_on_evict

    def slots_of(self, block: int) -> list[int]:
        return list(range(block * self.bs, (block + 1) * self.bs))

    def allocate(self) -> int | None:
        if self.free:
            block = self.free.pop()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hash.pop(block)]
            if self.release_on_evict:
                self.capturer.release_slots(self.slots_of(block))
        else:
            return None
        self.ref[block] = 1
        return block

    def ensure(self, req: Req, upto: int) -> bool:
        """Blocks for positions < upto."""
        while len(req.blocks) * self.bs < upto:
            block = self.allocate()
            if block is None:
                return False
            req.blocks.append(block)
        return True

    def slot(self, req: Req, pos: int) -> int:
        return req.blocks[pos // self.bs] * self.bs + pos % self.bs

    def unref(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if block in self.block_hash:
                self.evictable[block] = None
            else:
                self.free.append(block)

    def release(self, req: Req) -> None:
        for block in req.blocks:
            self.unref(block)
        req.blocks = []

    def match(self, req: Req) -> int:
        """Prefix hit on full cached blocks, leaving at least one token to compute."""
        if not self.prefix_caching:
            return 0
        hit = 0
        while (hit + 1) * self.bs <= len(req.tokens) - 1:
            block = self.cached.get(req.hashes[(hit + 1) * self.bs - 1])
            if block is None:
                break
            req.blocks.append(block)
            self.ref[block] += 1
            self.evictable.pop(block, None)
            hit += 1
        return hit * self.bs

    def register(self, req: Req) -> None:
        if not self.prefix_caching:
            return
        for i in range(min(req.num_computed // self.bs, len(req.blocks))):
            if i * self.bs < req.local_from:
                continue  # KV arrived from the prefill engine: no routing rows here
            h = req.hashes[(i + 1) * self.bs - 1]
            block = req.blocks[i]
            if h not in self.cached and block not in self.block_hash:
                self.cached[h] = block
                self.block_hash[block] = h


class Engine:
    def __init__(self, name: str, sim: "Simulator") -> None:
        cfg = sim.cfg
        self.name, self.sim, self.cfg = name, sim, cfg
        self.records = sim.records
        emap = None
        if cfg.eplb:
            replicas = 2
            perm = sim.rng.permutation(cfg.num_experts * replicas)
            emap = torch.as_tensor(perm % cfg.num_experts)
            # physical id of (logical e, replica r)
            self.phys = np.zeros((cfg.num_experts, replicas), dtype=np.int64)
            seen = [0] * cfg.num_experts
            for phys, logical in enumerate(emap.tolist()):
                self.phys[logical, seen[logical]] = phys
                seen[logical] += 1
        self.cap = RoutingCapturer(layer_map=cfg.layer_map, top_k=cfg.top_k, num_experts=cfg.num_experts,
                                   num_slots=cfg.num_blocks * cfg.block_size, sink=sim, rollout_id="sim",
                                   expert_map=emap)
        self.draft_cap = None
        self.draft_router = FakeRouter(1, cfg.top_k, cfg.num_experts, salt=7)
        if cfg.spec_k and cfg.draft_capture:
            # The draft model's own MoE layer 0: its own capturer, its own table.
            self.draft_cap = RoutingCapturer(layer_map=(0,), top_k=cfg.top_k, num_experts=cfg.num_experts,
                                             num_slots=cfg.num_blocks * cfg.block_size, rollout_id="sim-draft")
        self.kv = BlockManager(cfg.num_blocks, cfg.block_size, self.cap, prefix_caching=cfg.prefix_caching,
                               release_on_evict=cfg.release_on_evict)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.deferred: list[Req] = []  # overlap: finished at the last step, not yet processed
        self.fork_waiting: dict[str, list[Req]] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def admit(self, req: Req) -> None:
        self.waiting.append(req)

    def _drop_kv(self, req: Req) -> None:
        self.kv.release(req)
        req.num_computed = 0
        req.local_from = 0

    def preempt(self, req: Req) -> None:
        self.cap.preempt_request(req.rid)
        if self.draft_cap:
            self.draft_cap.preempt_request(req.rid)
        self.running.remove(req)
        self._drop_kv(req)
        self._orphan_children(req)
        self.waiting.insert(0, req)
        self.sim.preempted += 1

    def abort(self, req: Req) -> None:
        self.cap.abort_request(req.rid)
        if self.draft_cap:
            self.draft_cap.abort_request(req.rid)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._drop_kv(req)
        self._orphan_children(req)
        req.aborted = True
        self.sim.on_aborted(req)

    def _orphan_children(self, req: Req) -> None:
        for child in self.fork_waiting.pop(req.rid, []):
            child.fork_parent = None
            self.waiting.append(child)

    # -- one engine step ---------------------------------------------------------------------

    def step(self) -> None:
        cfg, rng, sim = self.cfg, self.sim.rng, self.sim
        if self.running and rng.random() < cfg.abort_prob:
            self.abort(self.running[rng.integers(len(self.running))])
        if self.waiting and rng.random() < cfg.abort_prob / 2:
            self.abort(self.waiting[rng.integers(len(self.waiting))])
        if self.running and rng.random() < cfg.preempt_prob:
            self.preempt(self.running[rng.integers(len(self.running))])

        # Admission: prefix hits are announced to the capturer as cached rows.
        while self.waiting and len(self.running) < cfg.max_running:
            req = self.waiting[0]
            if req.fork_parent is not None:
                self.waiting.pop(0)
                parent = sim.live.get(req.fork_parent)
                if parent is not None and parent.generated == 0 and not parent.aborted:
                    self.fork_waiting.setdefault(req.fork_parent, []).append(req)
                else:
                    req.fork_parent = None
                    self.waiting.insert(0, req)
                continue
            hit = self.kv.match(req) if req.local_from == 0 else 0
            if hit:
                self.cap.attach_cached(req.rid, range(hit), [self.kv.slot(req, p) for p in range(hit)])
                sim.prefix_hits += hit
            req.num_computed = max(req.num_computed, hit)
            self.waiting.pop(0)
            self.running.append(req)

        # Schedule: decodes (with drafts) first, then prefill chunks under the token budget.
        budget = cfg.token_budget
        plan: list[tuple[Req, int, list[int]]] = []  # (req, count of real tokens, draft tokens)
        for req in sorted(self.running, key=lambda r: -(r.num_computed == len(r.tokens) - 1)):
            remaining = len(req.tokens) - req.num_computed
            if budget <= 0 or remaining <= 0 or req not in self.running:
                continue
            drafts: list[int] = []
            if remaining == 1 and req.generated >= 1 and cfg.spec_k and budget > 1:
                drafts = self._propose(req, min(cfg.spec_k, budget - 1))
            count = min(remaining, budget)
            if not self.kv.ensure(req, req.num_computed + count + len(drafts)):
                # Out of KV: preempt the newest other request, else this one.
                victims = [r for r in self.running if r is not req and all(r is not p[0] for p in plan)]
                if victims:
                    self.preempt(victims[-1])
                    if self.kv.ensure(req, req.num_computed + count + len(drafts)):
                        plan.append((req, count, drafts))
                        budget -= count + len(drafts)
                        continue
                holders = [r for r in self.waiting if r.blocks]
                if holders:
                    # KV held by a waiting request (a P/D handover): drop it, it will recompute.
                    self.cap.preempt_request(holders[-1].rid)
                    self._drop_kv(holders[-1])
                    if self.kv.ensure(req, req.num_computed + count + len(drafts)):
                        plan.append((req, count, drafts))
                        budget -= count + len(drafts)
                        continue
                self.preempt(req)
                continue
            plan.append((req, count, drafts))
            budget -= count + len(drafts)
        # Overlap: requests that finished at the previous step ride along once more (their
        # last sampled token is fed; its row must never be stored).
        zombies = []
        for req in self.deferred:
            pos = len(req.tokens) - 1
            if not req.aborted and self.kv.ensure(req, pos + 1):
                zombies.append(req)
        if not plan and not zombies:
            self._process_deferred()
            return

        request_ids, starts, counts, slots, hashes, accepted = [], [], [], [], [], []
        outcomes = []
        for req, count, drafts in plan:
            p0 = req.num_computed
            n = count + len(drafts)
            request_ids.append(req.rid)
            starts.append(p0)
            counts.append(n)
            slots += [self.kv.slot(req, p) for p in range(p0, p0 + n)]
            hashes += req.hashes[p0 : p0 + count]
            h = req.hashes[p0 + count - 1]
            for d in drafts:
                h = extend_hash(h, d)
                hashes.append(h)
            accepted += [True] * count
            n_acc = 0
            if drafts:
                # Drafts are accepted while they equal what the target samples.
                pos = len(req.tokens)
                for d in drafts:
                    if d != sample_token(req.seed, pos, cfg.eos_rate):
                        break
                    n_acc += 1
                    pos += 1
                accepted += [True] * n_acc + [False] * (len(drafts) - n_acc)
                sim.drafts_accepted += n_acc
                sim.drafts_rejected += len(drafts) - n_acc
            outcomes.append((req, count, drafts, n_acc))
        for req in zombies:
            pos = len(req.tokens) - 1
            request_ids.append(req.rid)
            starts.append(pos)
            counts.append(1)
            slots.append(self.kv.slot(req, pos))
            hashes.append(req.hashes[pos])
            accepted.append(True)

        logical = sim.router.rows(hashes)
        ids = logical
        if cfg.eplb:
            ids = self.phys[logical, rng.integers(0, self.phys.shape[1], size=logical.shape)]
        padded = cfg.padded_router and rng.random() < 0.5
        router_rows = None
        if padded:
            # Router input has padding rows; router_rows picks each token's row.
            total = len(hashes)
            width = total + int(rng.integers(1, 4))
            rows_at = np.sort(rng.choice(width, size=total, replace=False))
            router_rows = torch.as_tensor(rows_at)
            full = rng.integers(0, ids.max() + 1, size=(width,) + ids.shape[1:])
            full[rows_at] = ids
            ids = full
        self.cap.begin_step(request_ids, starts, counts, slots, router_rows=router_rows)
        ids_t = torch.as_tensor(ids)
        process_between = cfg.overlap and rng.random() < 0.5
        for l, layer in enumerate(cfg.layer_map):
            if cfg.chunked_moe and not padded and len(hashes) > 1:
                cut = sorted(set(rng.integers(1, len(hashes), size=2).tolist()))
                for a, b in zip([0] + cut, cut + [len(hashes)]):
                    self.cap.record(layer, ids_t[a:b, l], token_offset=a)
            else:
                self.cap.record(layer, ids_t[:, l])
            if l == 0 and cfg.spec_k:
                # A draft model whose hooks are shared with the target: must not be captured.
                with self.cap.suspended():
                    self.cap.record(0, ids_t[:, l])
        if process_between:
            self._process_deferred()  # finishes while step N+1 is still open
        self.cap.end_step(np.array(accepted) if cfg.spec_k or rng.random() < 0.5 else None)
        if self.draft_cap is not None and plan:
            # The draft model's forward over the same tokens (not the overlap riders: their
            # finish may already be processed), into its own capturer.
            n_plan = len(plan)
            n_tok = sum(counts[:n_plan])
            self.draft_cap.begin_step(request_ids[:n_plan], starts[:n_plan], counts[:n_plan], slots[:n_tok])
            self.draft_cap.record(0, torch.as_tensor(self.draft_router.rows(hashes[:n_tok])[:, 0]))
            self.draft_cap.end_step(np.array(accepted[:n_tok]))
        if not process_between:
            self._process_deferred()

        # Outputs of this step.
        finished = []
        for req, count, drafts, n_acc in outcomes:
            req.num_computed += count
            if req.num_computed < len(req.tokens):
                self.kv.register(req)
                continue  # a prefill chunk that did not reach the last token
            new = drafts[:n_acc] + [sample_token(req.seed, len(req.tokens) + n_acc, cfg.eos_rate)]
            req.num_computed += n_acc
            for tok in new:
                req.tokens.append(tok)
                req.hashes.append(extend_hash(req.hashes[-1], tok))
                if tok == EOS or req.generated >= req.max_new or req.phase == "prefill":
                    req.done = True
                    break
            req.num_computed = min(req.num_computed, len(req.tokens) - 1)
            self.kv.register(req)
            if req.rid in self.fork_waiting and req.generated >= 1:
                self._fork(req)
            if req.done:
                finished.append(req)
        for req in finished:
            self.running.remove(req)
        if cfg.overlap:
            self.deferred = finished
        else:
            for req in finished:
                self._finish(req)

    def _propose(self, req: Req, k: int) -> list[int]:
        out, pos = [], len(req.tokens)
        for _ in range(k):
            truth = sample_token(req.seed, pos, self.cfg.eos_rate)
            out.append(truth if self.sim.rng.random() < self.cfg.spec_accept else (truth % (VOCAB - 1)) + 1 if truth else 1)
            pos += 1
        return out

    def _fork(self, parent: Req) -> None:
        """n > 1 via fork: children share the prompt's KV (full blocks shared, last block copied)."""
        P = parent.prompt_len
        for child in self.fork_waiting.pop(parent.rid):
            child.fork_parent = None
            full = P // self.kv.bs
            child.blocks = parent.blocks[:full]
            for b in child.blocks:
                self.kv.ref[b] += 1
            if not self.kv.ensure(child, P):
                self.kv.release(child)
                self.waiting.append(child)
                continue
            self.cap.fork_request(parent.rid, child.rid, P, slots=[self.kv.slot(child, p) for p in range(P)])
            child.num_computed = P
            tok = sample_token(child.seed, P, self.cfg.eos_rate)
            child.tokens.append(tok)
            child.hashes.append(extend_hash(child.hashes[-1], tok))
            self.sim.forks += 1
            if tok == EOS or child.generated >= child.max_new:
                child.num_computed = P  # positions 0..P-1 computed: all its rows
                child.done = True
                self._finish(child)
            else:
                self.running.append(child)

    def _process_deferred(self) -> None:
        deferred, self.deferred = self.deferred, []
        for req in deferred:
            if not req.aborted:
                self._finish(req)

    def _finish(self, req: Req) -> None:
        sim = self.sim
        if self.draft_cap:
            self.draft_cap.abort_request(req.rid)  # draft routing is not stored in this simulation
        if req.phase == "prefill" and not (req.tokens[-1] == EOS or req.generated >= req.max_new):
            # Disaggregated prefill: push the prefill part, hand the KV to the decode engine.
            self.cap.finish_request(req.rid, prompt_len=req.prompt_len, generated_len=1, start_row=req.start_row,
                                    store_as=req.store_id, final=False)
            self.kv.release(req)
            sim.handover(req)
            return
        end = len(req.tokens) - 1
        if req.phase == "decode":
            self.cap.finish_request(req.rid, prompt_len=req.prompt_len, generated_len=req.generated,
                                    start_row=req.prompt_len, store_as=req.store_id,
                                    total_rows=end - req.start_row)
        else:
            self.cap.finish_request(req.rid, prompt_len=req.prompt_len, generated_len=req.generated,
                                    start_row=req.start_row, store_as=req.store_id)
        self.kv.release(req)
        sim.on_finished(req)


class Simulator:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.router = FakeRouter(cfg.num_layers, cfg.top_k, cfg.num_experts, salt=cfg.seed)
        self.records = []
        self.prefill = Engine("prefill", self) if cfg.pd_fraction else None
        self.engine = Engine("main", self)
        self.now = 0
        self.pending_arrivals: list[Req] = []
        self.convs: dict[str, Conv] = {}
        self.live: dict[str, Req] = {}
        self.prefix_hits = self.preempted = self.drafts_accepted = self.drafts_rejected = self.forks = 0
        self.aborted = 0

    # RoutingSink
    def submit(self, record) -> None:
        self.records.append(record)

    def _new_req(self, conv: Conv, tokens: list[int], start_row: int, arrival: int) -> Req:
        pd = conv.pd
        req = Req(rid=f"{conv.store_id}.t{conv.turn}", store_id=conv.store_id, seed=conv.seed * 31 + conv.turn,
                  tokens=list(tokens), hashes=prefix_hashes(tokens), prompt_len=len(tokens),
                  max_new=int(self.rng.integers(1, self.cfg.max_new + 1)), start_row=start_row, arrival=arrival,
                  pd=pd, phase="prefill" if pd else "single", conv=conv)
        self.live[req.rid] = req
        return req

    def build(self) -> None:
        cfg, rng = self.cfg, self.rng
        shared = [[int(t) for t in rng.integers(1, VOCAB, size=int(rng.integers(2, 10)))] for _ in range(2)]
        for i in range(cfg.num_prompts):
            prompt = list(shared[int(rng.integers(2))]) if rng.random() < 0.6 else []
            prompt += [int(t) for t in rng.integers(1, VOCAB, size=int(rng.integers(1, 12)))]
            arrival = int(rng.integers(0, 12))
            parent = None
            for j in range(cfg.n_samples):
                pd = rng.random() < cfg.pd_fraction
                conv = Conv(store_id=f"p{i}-s{j}", seed=int(rng.integers(1 << 30)), prompt=prompt,
                            turns_left=int(rng.integers(1, cfg.max_turns + 1)), pd=pd)
                self.convs[conv.store_id] = conv
                req = self._new_req(conv, prompt, 0, arrival)
                if cfg.fork and not pd:
                    if parent is None:
                        parent = req
                    else:
                        req.fork_parent = parent.rid
                self.pending_arrivals.append(req)

    def handover(self, req: Req) -> None:
        """P/D: the decode engine receives the prefill's KV (positions < prompt_len) without rows."""
        dec = Req(rid=req.rid, store_id=req.store_id, seed=req.seed, tokens=req.tokens, hashes=req.hashes,
                  prompt_len=req.prompt_len, max_new=req.max_new, start_row=req.start_row, arrival=self.now,
                  pd=True, phase="decode", conv=req.conv)
        if self.engine.kv.ensure(dec, dec.prompt_len):
            dec.num_computed = dec.prompt_len
            dec.local_from = dec.prompt_len
            # KV written by the transfer, not by a forward here: no routing rows for these slots.
            self.engine.cap.release_slots([self.engine.kv.slot(dec, p) for p in range(dec.prompt_len)])
        else:
            self.engine.kv.release(dec)
        self.engine.admit(dec)

    def on_finished(self, req: Req) -> None:
        conv = req.conv
        conv.final_tokens = list(req.tokens)
        conv.stored_rows = len(req.tokens) - 1
        conv.turns_left -= 1
        if conv.turns_left <= 0:
            conv.ended = True
            return
        conv.turn += 1
        user = [int(t) for t in self.rng.integers(1, VOCAB, size=int(self.rng.integers(1, 6)))]
        start = 0 if self.cfg.only_last_turn else conv.stored_rows
        nxt = self._new_req(conv, req.tokens + user, start, self.now + int(self.rng.integers(0, 4)))
        self.pending_arrivals.append(nxt)

    def on_aborted(self, req: Req) -> None:
        self.aborted += 1
        conv = req.conv
        conv.ended = True
        if req.phase == "decode":
            conv.pending_part = True  # its prefill part was pushed and will never complete

    def run(self) -> None:
        self.build()
        engines = [e for e in (self.prefill, self.engine) if e is not None]
        for self.now in range(self.cfg.max_steps):
            arrived = [r for r in self.pending_arrivals if r.arrival <= self.now]
            self.pending_arrivals = [r for r in self.pending_arrivals if r.arrival > self.now]
            for req in arrived:
                (self.prefill if req.phase == "prefill" else self.engine).admit(req)
            for engine in engines:
                engine.step()
            if not self.pending_arrivals and all(
                not e.waiting and not e.running and not e.deferred and not e.fork_waiting for e in engines
            ):
                break
        else:
            raise AssertionError(f"simulation did not drain in {self.cfg.max_steps} steps")
        for engine in engines:
            engine.step()  # flush deferred finishes
            assert engine.cap.active_requests == 0, f"{engine.name}: {engine.cap.active_requests} requests leaked"
            assert engine.cap.tracked_positions == 0
            assert not engine.cap._steps.is_open
            if engine.draft_cap is not None:
                assert engine.draft_cap.active_requests == 0

    # -- ground truth ------------------------------------------------------------------------

    def commit_and_verify(self, root) -> dict:
        """Commit every record (per-request order kept, P/D parts of a turn in random order,
        requests interleaved, random batches) and check every stored request bit-exactly."""
        cfg = self.cfg
        rng = random.Random(cfg.seed)
        by_id: dict[str, list] = {}
        for rec in self.records:
            by_id.setdefault(rec.request_id, []).append(rec)
        queues = []
        for recs in by_id.values():
            # a prefill part may arrive after its decode's final record
            for i in range(len(recs) - 1):
                if not recs[i].final and recs[i + 1].total_rows is not None and rng.random() < 0.5:
                    recs[i], recs[i + 1] = recs[i + 1], recs[i]
            queues.append(list(recs))
        order = []
        while queues:
            q = rng.choice(queues)
            order.append(q.pop(0))
            if not q:
                queues.remove(q)
        cuts = sorted(rng.sample(range(1, len(order)), min(2, len(order) - 1))) if len(order) > 1 else []
        with LocalRoutingStore(root, only_last_turn=cfg.only_last_turn) as store:
            for a, b in zip([0] + cuts, cuts + [len(order)]):
                store.commit(order[a:b])
            pending = store.pending("sim") if order else {}
        reader = RoutingReader(root)
        checked = rows = 0
        finished = [sid for sid, conv in self.convs.items() if conv.final_tokens is not None]
        # One read for every finished request (a read per request was a fifth of the soak's time).
        stored = reader.get_numpy("sim", finished) if finished else {}
        for sid, conv in self.convs.items():
            if conv.final_tokens is None:
                if order:
                    try:
                        reader.get_numpy("sim", [sid])
                    except UnknownRequestError:
                        pass
                    else:
                        raise AssertionError(f"{sid}: aborted before any turn finished, yet visible")
                continue
            got = stored[sid]
            end = len(conv.final_tokens) - 1
            truth = self.router.rows(prefix_hashes(conv.final_tokens)[:end]).astype(got.dtype)
            assert got.shape == truth.shape, f"{sid}: stored {got.shape[0]} rows, expected {end}"
            bad = np.flatnonzero((got != truth).any(axis=(1, 2)))
            assert bad.size == 0, f"{sid}: rows {bad[:10].tolist()} differ from the ground truth"
            checked += 1
            rows += end
        expected_pending = {sid for sid, c in self.convs.items() if c.pending_part}
        assert set(pending) == expected_pending, f"pending {sorted(pending)} != expected {sorted(expected_pending)}"
        return {"requests_checked": checked, "rows_checked": rows, "records": len(self.records),
                "prefix_hits": self.prefix_hits, "preempted": self.preempted, "aborted": self.aborted,
                "drafts_accepted": self.drafts_accepted, "drafts_rejected": self.drafts_rejected,
                "forks": self.forks, "pending": len(pending)}


def run_sim(cfg: SimConfig, root) -> dict:
    sim = Simulator(cfg)
    sim.run()
    return sim.commit_and_verify(root)
