"""A commit's batch array: rows per inner chunk, where each request's rows go, the rows
encoded and written (one shard, :mod:`r3rdma.store.shard_writer`) and its layout for the index
part."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from r3rdma.errors import ShapeMismatchError
from r3rdma.records import RequestRecord
from r3rdma.store.assembly import Assembly
from r3rdma.store.index_entries import shard_entry
from r3rdma.store.rollout_index import GEOMETRY_KEYS
from r3rdma.store.shard_writer import EncodedArray, encode_batch_array, write_encoded

__all__ = [
    "batch_chunk_rows",
    "spans_row_chunks",
    "CP_CHUNK_FRACTION",
    "aligned",
    "place_records",
    "placed_offsets",
    "record_geometry",
    "layers_per_chunk",
    "MIN_LAYER_CHUNK_BYTES",
    "MIN_GROUP_MAJOR_CHUNK_BYTES",
    "MAX_GROUP_MAJOR_GROUPS",
    "encode_array",
    "write_array",
]


# Rows of a batch's requests that a chunk holds at most when they are long: a sixteenth of the
# median request, see batch_chunk_rows.
CP_CHUNK_FRACTION = 16


def batch_chunk_rows(records: Sequence[RequestRecord], min_chunk_rows: int, chunk_rows: int, slice_layout: bool = False) -> int:
    """Rows per inner chunk of a batch's array, from ``min_chunk_rows`` (64) up to
    ``chunk_rows`` (1024): with the store's ``slice_layout``, for long requests
    (:func:`spans_row_chunks`) the largest power of
    two at or below a sixteenth of the batch's median request length, but not below the rows
    that make a row chunk :data:`MIN_GROUP_MAJOR_CHUNK_BYTES` x 4 (four layer groups of at least
    16 KiB: 256 rows of 48 layers x top-8 uint8); else (short requests) the power of two at or
    above the median.

    Why about one request for short ones: a reader decodes whole chunks, and a data-parallel
    rank's requests sit between other ranks' requests. With 1024-row chunks, short requests
    (~100 rows) shared a chunk with ~8 others, so a rank decoded ~8x the rows it asked for,
    and scattered reads of short requests ran at 0.33-0.49 of a contiguous read. A chunk about
    one request long holds one or two of them (:func:`aligned` starts a request that does not
    fit at the next chunk).

    Why much less than a request for long ones: a context-parallel rank replays pieces of each
    sequence (Megatron cuts it in ``2 * cp`` pieces, ~1,100 rows of a 4,300-row request at
    CP=2), and the chunks at a piece's edges are fetched and decoded by both ranks of a pair.
    With 1024-row chunks a TP-broadcast read fetched 1.44x the stored bytes on the 2x H100 host
    (``bench trainer-layout``, BENCHMARKS.md; a CP rank used ~40% of each chunk it decoded).
    Counted over 2,000 requests of 500-8,000 rows (median ~4,200) placed as the store places
    them, the rows both ranks fetch over the rows stored: 1.41 at 1024-row chunks, 1.23 at 512,
    1.12 at 256, 1.06 at 128 (3,000-8,000 rows: 1.34, 1.18, 1.09, 1.05); 512 rows would leave
    the goal of 1.25x stored too little room. Measured on the CPU VM (``bench trainer-layout
    --quick --requests 16 --min-rows 3000 --max-rows 8000 --micro-batch 4``), 1024 -> 256
    rows: TP broadcast fetched 1.36x -> 1.08x the stored bytes. Why not smaller: each chunk is
    a zstd call (a frame's tables built again), a CRC-32C and an index entry, and small chunks
    compress worse (CPU VM, one core, synthetic top-8 ids in 12-layer groups: 1024 rows 0.78
    of raw, 0.86 GB/s decoded; 256 rows 0.85, 0.74 GB/s; 128 rows 0.86, 0.55 GB/s; 64 rows
    0.87, 0.36 GB/s). At 256 rows the step stored 8.7% more bytes and a whole read (every
    layer, every row) cost ~20% more reader CPU, a stage's CP slice ~12% less (one process,
    one core, interleaved); encoding ran faster (0.11-0.12 -> 0.15-0.18 GB/s on one core).
    Such a batch array lays its chunks out layer group major (:func:`encode_array`): a stage's
    chunks over a request's rows are one byte range, so smaller chunks do not mean more GETs.
    Each batch array states its own chunk shape; readers need nothing new.

    Why with ``slice_layout`` (the store's default) only: the same full-size step read whole
    (every layer, every row: a data-parallel rank without pipeline or context parallelism, the
    verl / slime hand-off) takes about twice as long in it (four GETs per request, one per
    layer group, and four times the zstd frames); a store read only by whole requests turns it
    off (BENCHMARKS.md, "Trainer layout", has both layouts' figures).
    """
    lengths = sorted(r.num_rows for r in records)
    median = lengths[len(lengths) // 2]
    ids = records[0].ids_TLK
    row_bytes = ids.shape[1] * ids.shape[2] * ids.dtype.itemsize
    floor = 1 << max(0, (-(-4 * MIN_GROUP_MAJOR_CHUNK_BYTES // max(1, row_bytes)) - 1).bit_length())
    long_rows = max(1 << max(0, (median // CP_CHUNK_FRACTION).bit_length() - 1), floor)
    if slice_layout and spans_row_chunks(long_rows, median):
        return max(min_chunk_rows, min(chunk_rows, long_rows))
    return max(min_chunk_rows, min(chunk_rows, 1 << max(0, (median - 1).bit_length())))


def spans_row_chunks(chunk_rows: int, median_rows: int) -> bool:
    """Whether a batch's requests (their median ``median_rows``) span four row chunks or more
    of ``chunk_rows`` rows: then its array is laid out layer group major (:func:`encode_array`).

    Why four: below it a request is one or two row chunks, a pipeline stage's read of it is a
    GET or two whichever the order, and a whole read (a data-parallel rank without pipeline
    stages) stays one GET per request only in the index's order (row chunk, then layer group);
    layer group major it would be one GET per layer group.
    """
    return 4 * chunk_rows <= median_rows


def aligned(end: int, rows: int, chunk_rows: int) -> int:
    """Where a request of ``rows`` rows goes in a batch array whose rows so far end at ``end``.

    A request that does not fit in what is left of the current chunk starts at the next
    chunk boundary (the rows skipped hold the fill value, belong to no request, and
    compress to almost nothing). Why: a reader fetches and decodes whole chunks, and a
    data-parallel rank reads requests whose neighbours belong to other ranks. Packed back
    to back, a request of 500-3000 rows straddled chunks it shared with its neighbours and
    a rank's share cost ~1.5x its bytes on the wire and in zstd (measured: 1.51x at 1024-row
    chunks); aligned, it touches ceil(rows / chunk_rows) chunks of its own. Requests that
    fit in a chunk's remainder still share it, so short requests add no padding.
    """
    room = -end % chunk_rows
    return end + room if rows > room > 0 else end


def place_records(
    records: list[RequestRecord], state: Assembly, name: str, chunk: int, geometry: dict[str, Any]
) -> tuple[list[tuple[int, RequestRecord]], int, int]:
    """Apply a rollout's records in order to ``state`` and place each new one in batch array
    ``name`` (:func:`aligned`); return the ``(offset, record)`` placed, the duplicates skipped,
    and the array's rows. Refuses a record of another geometry than ``geometry``."""
    new: list[tuple[int, RequestRecord]] = []
    duplicates = 0
    end = 0
    for record in records:
        if record_geometry(record) != geometry:
            raise ShapeMismatchError(
                f"request {record.request_id!r} has geometry {record_geometry(record)}, "
                f"but {records[0].request_id!r} in the same batch has {geometry}"
            )
        offset = aligned(end, record.num_rows, chunk)
        if state.add(record, name, offset):
            new.append((offset, record))
            end = offset + record.num_rows
        else:
            duplicates += 1
    return new, duplicates, end


def placed_offsets(records: Sequence[RequestRecord], chunk: int) -> tuple[list[int], int]:
    """Where :func:`place_records` puts ``records`` if every one of them is new: each one's
    offset, and the array's rows (what a commit encodes before it knows its duplicates)."""
    offsets, end = [], 0
    for record in records:
        offset = aligned(end, record.num_rows, chunk)
        offsets.append(offset)
        end = offset + record.num_rows
    return offsets, end


def record_geometry(record: RequestRecord) -> dict[str, Any]:
    """What every record of a rollout shares (the entry point's geometry keys)."""
    geometry = {
        "num_layers": len(record.layer_map),
        "top_k": record.top_k,
        "num_experts": record.num_experts,
        "dtype": record.ids_TLK.dtype.name,
        "layer_map": list(record.layer_map),
    }
    assert tuple(geometry) == GEOMETRY_KEYS
    return geometry


# The least raw bytes of an inner chunk split by layers (format 3), see layers_per_chunk: in the
# index's order, and layer group major (format 4, long requests).
MIN_LAYER_CHUNK_BYTES = 1 << 16
MIN_GROUP_MAJOR_CHUNK_BYTES = 1 << 14
# The most layer groups of a layer-group-major array, see layers_per_chunk.
MAX_GROUP_MAJOR_GROUPS = 8


def layers_per_chunk(chunk_rows: int, num_layers: int, top_k: int, itemsize: int, group_major: bool = False) -> int:
    """Layers per inner chunk of a batch array: ``num_layers`` split into a power-of-two count
    of equal groups, the most that keep an inner chunk at :data:`MIN_LAYER_CHUNK_BYTES` (64 KiB)
    raw or more, or, for an array laid out layer group major (``group_major``, long requests),
    at :data:`MIN_GROUP_MAJOR_CHUNK_BYTES` (16 KiB) and at most :data:`MAX_GROUP_MAJOR_GROUPS`
    (8) groups (the count divides ``num_layers``: no padded group).

    Why layer groups: a pipeline stage replays its own layers; with every layer in one chunk
    each stage fetched and decoded all of them (PP x its bytes). Why a power of two: pipeline
    stages are equal splits of the layers, mostly 2, 4 or 8 of them, and a stage reads its
    layers alone only where its boundaries are group boundaries: with 48 layers and PP=4
    (12-layer stages) the earlier rule's 3 groups of 16 made the middle stages fetch 3.1x what
    they replay, 4 groups of 12 1.14x (2x H100 host, ``bench trainer-layout``, BENCHMARKS.md),
    and stored 2% fewer bytes. Why not smaller: every chunk is a zstd call on write and read,
    an entry in the shard index and in the index part's copy of it, and, in the index's order,
    a GET of its own when a stage reads a request of several row chunks (its chunks are not
    next to each other). At 64 KiB a 1024-row chunk of top-8 uint8 ids holds 8 layers or more
    (48 layers: 4 groups of 12). Laid out layer group major a stage's chunks over a request
    are one byte range, so only the per-chunk work bounds them: 16 KiB decodes at ~0.7 of the
    rate of 96 KiB chunks (CPU VM, :func:`batch_chunk_rows`), and a 256-row chunk of 48
    layers x top-8 uint8 is then 4 groups of 12 (24 KiB each); more than 8 groups would only
    cut a stage into more byte ranges (pipelines of more than 8 stages are rare). Why equal
    groups only: on the CPU VM a batch of 94 layers encoded at 0.33 GB/s per core in groups of
    19 or 32 (a padded last group) against 0.64-0.72 whole and 0.61-0.66 in 2 groups of 47.
    Short requests (64-row chunks) keep every layer in one chunk. A trainer whose stages do
    not fall on these groups sets the store's ``layers_per_chunk`` to its stage size (or a
    divisor of it).
    """
    layer_bytes = chunk_rows * top_k * itemsize
    least = MIN_GROUP_MAJOR_CHUNK_BYTES if group_major else MIN_LAYER_CHUNK_BYTES
    most = max(1, min(num_layers, num_layers * layer_bytes // least))
    if group_major:
        most = min(most, MAX_GROUP_MAJOR_GROUPS)
    groups = max(g for g in (1 << i for i in range(most.bit_length())) if g <= most and num_layers % g == 0)
    return num_layers // groups


def encode_array(
    placed: list[tuple[int, RequestRecord]],
    end: int,
    chunk_rows: int,
    zstd_level: int,
    layer_group: int | None = None,
    slice_layout: bool = False,
) -> EncodedArray:
    """Encode a batch array of ``end`` rows holding each ``(offset, record)``'s rows at its offset
    (:func:`~r3rdma.store.shard_writer.encode_batch_array`: chunks compressed in parallel, layers
    grouped by :func:`layers_per_chunk`, or ``layer_group`` layers when set (the store's
    setting: a trainer's pipeline stage size); the rows :func:`aligned` skipped hold the fill
    value 0), laid out layer group major with ``slice_layout`` when its requests span several
    row chunks (:func:`spans_row_chunks`). Needs nothing of the index."""
    ids = placed[0][1].ids_TLK
    chunk = max(1, min(chunk_rows, end))
    lengths = sorted(r.num_rows for _, r in placed)
    group_major = slice_layout and spans_row_chunks(chunk, lengths[len(lengths) // 2])
    if layer_group is None:
        per = layers_per_chunk(chunk, ids.shape[1], ids.shape[2], ids.dtype.itemsize, group_major)
    else:
        per = max(1, min(layer_group, ids.shape[1]))
    return encode_batch_array(
        [(offset, r.ids_TLK) for offset, r in placed],
        end,
        chunk_rows=chunk_rows,
        zstd_level=zstd_level,
        layers_per_chunk=per,
        group_major=group_major,
    )


def write_array(rollout_path: Path, name: str, encoded: EncodedArray, zstd_level: int) -> tuple[dict[str, Any], list[Path]]:
    """Write an encoded batch array as ``name``; return its shard layout for the index part and
    the files and directories written (fsynced with the part)."""
    rollout_path.mkdir(parents=True, exist_ok=True)
    # The array's own directory, not the rollout's group: a bare group zarr.json for the
    # parent, left by a crash before the index rename, would list a rollout without an index.
    # What it wrote is what the part makes durable (listed, not walked: a walk of the new
    # tree cost a commit's writing thread a dozen more system calls, each a GIL hand-off
    # beside the encoding threads; shard_writer's module docstring).
    written = write_encoded(rollout_path / name, encoded)
    # The shard's chunk index, copied into the index part: a reader of a few requests from
    # every array (a data-parallel rank's share) then needs one ranged GET per request,
    # not two more per array (its zarr.json and shard index). zarr.json stays the truth.
    # Every chunk is written (placement, :func:`aligned`, leaves less than a chunk of
    # fill rows between requests, so no chunk is all fill value).
    shards = shard_entry(
        encoded.rows, encoded.chunk_rows, encoded.layers_per_chunk, zstd_level > 0, encoded.sizes, encoded.group_major
    )
    return shards, written
