"""Benchmark programs (`r3rdma bench ...`). Each prints one JSON line last."""
