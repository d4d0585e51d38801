"""Counting what a reader fetches from a local root's batch-array shards (reads by slice)."""

from zarr.storage import LocalStore


def count_shard_fetches(monkeypatch) -> list[int]:
    """Patch ``LocalStore.get`` so every read of a batch array's shard (``.../c/0/0/0``: chunks
    and index ranges alike) appends its byte count to the returned list."""
    fetched: list[int] = []
    real_get = LocalStore.get

    async def counting_get(self, key, prototype=None, byte_range=None):
        buffer = await real_get(self, key, prototype, byte_range)
        if key.endswith("/c/0/0/0") and buffer is not None:
            fetched.append(len(buffer))
        return buffer

    monkeypatch.setattr(LocalStore, "get", counting_get)
    return fetched
