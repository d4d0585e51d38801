import numpy as np
import pytest

from r3rdma.records import RequestRecord


@pytest.fixture
def make_record():
    """Factory of RequestRecords with seeded random routing."""

    def make(request_id="req-0", rows=10, *, rollout_id="roll-0", layers=3, k=2, num_experts=16, seed=None, start_row=0):
        rng = np.random.default_rng(seed if seed is not None else abs(hash(request_id)) % 2**32)
        dtype = np.uint8 if num_experts <= 256 else (np.uint16 if num_experts <= 65536 else np.int32)
        ids = rng.integers(0, num_experts, size=(rows, layers, k)).astype(dtype)
        return RequestRecord(rollout_id, request_id, ids, tuple(range(layers)), num_experts, start_row=start_row)

    return make
