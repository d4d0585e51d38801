"""Synthetic routing with a realistic shape: skewed expert popularity per layer, distinct top-k."""

from __future__ import annotations

import numpy as np

from r3rdma.records import RequestRecord, routing_dtype

__all__ = ["synthetic_records"]


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
