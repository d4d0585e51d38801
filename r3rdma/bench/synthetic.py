"""Synthetic routing with a realistic shape: skewed expert popularity per layer, distinct top-k."""

from __future__ import annotations

import numpy as np

from r3rdma.records import RequestRecord, routing_dtype

__all__ = ["synthetic_records", "routing_pool", "TiledRollout"]


def synthetic_records(
    num_requests: int,
    *,
    num_layers: int = 48,
    top_k: int = 8,
    num_experts: int = 128,
    min_rows: int = 256,
    max_rows: int = 4096,
    rollout_id: str = "bench",
    seed: int = 0,
) -> list[RequestRecord]:
    """Requests whose rows draw top-k distinct experts from a per-layer Zipf-like popularity."""
    rng = np.random.default_rng(seed)
    dtype = routing_dtype(num_experts)
    popularity = rng.dirichlet(np.full(num_experts, 0.5), size=num_layers)  # [L, E]
    records = []
    for i in range(num_requests):
        rows = int(rng.integers(min_rows, max_rows + 1))
        # Gumbel top-k = sampling k distinct experts without replacement by popularity.
        gumbel = rng.gumbel(size=(rows, num_layers, num_experts)).astype(np.float32)
        scores = np.log(popularity)[None].astype(np.float32) + gumbel
        ids = np.argpartition(-scores, top_k, axis=-1)[..., :top_k].astype(dtype)
        records.append(RequestRecord(rollout_id, f"req-{i:06d}", ids, tuple(range(num_layers)), num_experts))
    return records


def routing_pool(
    rows: int,
    *,
    num_layers: int = 48,
    top_k: int = 8,
    num_experts: int = 128,
    base_rows: int = 2048,
    seed: int = 0,
) -> np.ndarray:
    """``[rows, L, K]`` routing rows of the same per-layer distribution as :func:`synthetic_records`
    (skewed per-layer expert popularity, K distinct experts per row), made cheaply: ``base_rows``
    rows are sampled exactly (Gumbel top-k), then each layer of each pool row takes that layer of
    an independently drawn base row. Every layer's marginal is exact and ids stay distinct within a
    row; only the joint across layers is the base's mixed, which no reader or codec here looks at.
    The cost is ``base_rows x L x E`` samples plus a gather, whatever ``rows`` is."""
    rng = np.random.default_rng(seed)
    dtype = routing_dtype(num_experts)
    popularity = rng.dirichlet(np.full(num_experts, 0.5), size=num_layers)  # [L, E]
    log_pop = np.log(popularity).astype(np.float32)[None]
    base = np.empty((base_rows, num_layers, top_k), dtype=dtype)
    for lo in range(0, base_rows, 512):  # bounded float32 temporaries
        hi = min(base_rows, lo + 512)
        scores = log_pop + rng.gumbel(size=(hi - lo, num_layers, num_experts)).astype(np.float32)
        base[lo:hi] = np.argpartition(-scores, top_k - 1, axis=-1)[..., :top_k]
    pick_RL = rng.integers(0, base_rows, size=(rows, num_layers))
    return base[pick_RL, np.arange(num_layers)[None, :]]  # [rows, L, K]


class TiledRollout:
    """A rollout of many requests whose rows are slices of one :func:`routing_pool`.

    Request ``i`` is ``pool[offsets[i] : offsets[i] + lengths[i]]`` (a view, no copy): generating
    10 GB of routing costs a pool of a few MB. Offsets are distinct (a random permutation of the
    pool's start rows), so every request has its own bytes and CRC, and requests committed next
    to each other come from far-apart pool rows (a codec sees no copies within a chunk).

    ``lengths``: rows of each request, given instead of drawn uniformly from
    ``min_rows..max_rows`` (a bench's own length mix); each must lie in that range.
    """

    def __init__(
        self,
        num_requests: int,
        *,
        min_rows: int,
        max_rows: int,
        num_layers: int = 48,
        top_k: int = 8,
        num_experts: int = 128,
        rollout_id: str = "scale",
        seed: int = 0,
        lengths: np.ndarray | None = None,
    ) -> None:
        if not 1 <= min_rows <= max_rows:
            raise ValueError(f"need 1 <= min_rows <= max_rows, got {min_rows}, {max_rows}")
        rng = np.random.default_rng(seed + 1)
        starts = max(num_requests, 1 << 16)
        self.pool = routing_pool(starts + max_rows, num_layers=num_layers, top_k=top_k, num_experts=num_experts, seed=seed)
        if lengths is None:
            self.lengths = rng.integers(min_rows, max_rows + 1, size=num_requests)
        else:
            self.lengths = np.asarray(lengths, dtype=np.int64)
            if (
                self.lengths.shape != (num_requests,)
                or not (min_rows <= self.lengths).all()
                or not (self.lengths <= max_rows).all()
            ):
                raise ValueError(f"lengths must be {num_requests} row counts in {min_rows}..{max_rows}")
        self.offsets = rng.permutation(starts)[:num_requests]
        self.rollout_id = rollout_id
        self.num_experts = num_experts
        self.layer_map = tuple(range(num_layers))
        self.row_bytes = num_layers * top_k * self.pool.itemsize

    def __len__(self) -> int:
        return len(self.lengths)

    @staticmethod
    def request_id(i: int) -> str:
        """The id of request ``i`` (``r000042``): zero-padded, so ids sort in request order."""
        return f"r{i:06d}"

    def ids(self, i: int) -> np.ndarray:
        """``[rows, L, K]`` of request ``i`` (a view of the pool)."""
        return self.pool[self.offsets[i] : self.offsets[i] + self.lengths[i]]

    def nbytes(self, i: int) -> int:
        """Bytes of request ``i``'s routing (uint8 ids)."""
        return int(self.lengths[i]) * self.row_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole rollout's routing."""
        return int(self.lengths.sum()) * self.row_bytes

    def record(self, i: int) -> RequestRecord:
        """Request ``i`` as a :class:`RequestRecord` (its ids a view of the pool; the CRC is computed here)."""
        return RequestRecord(self.rollout_id, self.request_id(i), self.ids(i), self.layer_map, self.num_experts)
