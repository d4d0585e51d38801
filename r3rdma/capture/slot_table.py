"""The device slot table: routing rows indexed by KV slot, and the buffers the routers write.

It owns every device tensor of capture and what the host knows about each slot:

- ``table_SLK``: one ``[L, K]`` row per KV slot, in device memory, or in pinned host memory
  mapped into the device (UVA) so the same kernels write it over PCIe;
- the step buffer the routers write during a forward (:meth:`SlotTable.record`, one kernel per
  layer), and the fixed router-rows buffer a CUDA graph reads, with the addresses each graph
  was captured against (:meth:`SlotTable.graph_key`);
- per slot, host-side: its write generation, the number of the table operation (a step's
  write, a fork's copy, a release) that last touched it, negative once released (0: never
  written); a slot rewritten after a request relied on it is then detected, and a released
  slot is refused to a prefix hit. Why operation numbers rather than a count of writes per
  slot: a step writes its slots once each, so its number names every write of it, and the
  step's update is one scatter of a scalar, not a gather, an add and two scatters (each numpy
  call on the engine's step path costs microseconds with the caches cold from the forward);
- the scatter of a step's rows into the table (:meth:`SlotTable.write_step`), the gather of a
  request's rows (:meth:`SlotTable.gather`), copy-on-write of forked slots
  (:meth:`SlotTable.copy_rows`), release, and the one slot-range check every call that takes
  slots goes through (:meth:`SlotTable.check_slots`).

It knows nothing of requests or steps: callers pass slot arrays and get generations back. On a
CUDA device nothing here synchronises the host: indices travel through pinned staging memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from r3rdma.errors import ConfigError, OutOfRangeError, ShapeMismatchError, StaleSlotError
from r3rdma.kernels import gather_rows, record_layer, table_dtype, write_step_rows

__all__ = ["SlotTable", "host_int64"]


class SlotTable:
    """KV-slot-indexed routing rows on ``device``, the step buffer, and per-slot generations.

    Args:
        num_slots: KV slots of the engine's cache (table rows).
        num_layers, top_k: the ``[L, K]`` shape of one row.
        num_experts: picks the table dtype (:func:`r3rdma.kernels.table_dtype`).
        device: where the table and the step buffer live (validated by the caller).
        pin_memory: keep the table in pinned host memory (on CUDA mapped into the device).
    """

    def __init__(
        self, *, num_slots: int, num_layers: int, top_k: int, num_experts: int, device: torch.device, pin_memory: bool
    ) -> None:
        self.num_slots = num_slots
        self.device = device
        self.cuda = device.type == "cuda"
        dtype = table_dtype(num_experts)
        shape = (num_slots, num_layers, top_k)
        self.host_table: torch.Tensor | None = None
        if pin_memory and device.type == "cpu":
            self.table_SLK = torch.zeros(shape, dtype=dtype).pin_memory()
        elif pin_memory:
            # Pinned memory from cudaHostAlloc is mapped, and with unified addressing its host
            # pointer is valid on the device: a CUDA tensor over the same bytes lets the usual
            # kernels (torch and Triton) write it. host_table keeps the allocation alive.
            self.host_table = torch.zeros(shape, dtype=dtype).pin_memory()
            self.table_SLK = _device_view_of_pinned(self.host_table, device)
        else:
            self.table_SLK = torch.zeros(shape, dtype=dtype, device=device)
        # A CPU table is scattered into and gathered from through numpy views of it and of the
        # step buffer in which a whole [L, K] row is one item (a void dtype of its bytes): the
        # same bytes as write_step_rows (torch's index_copy_), over 20x faster at decode sizes
        # (64-512 rows of 48x8 bytes, one thread: 2-9 us against 48-175 us), and one memcpy per
        # row instead of numpy's strided copy of an [L, K] subarray per index (64 rows of 64
        # bytes after the caches were flushed: 5 us against 16 us on the CPU VM).
        self._row_item = np.dtype((np.void, num_layers * top_k * dtype.itemsize))
        self._table_np = _rows_as_items(self.table_SLK, self._row_item) if device.type == "cpu" else None
        self.step_buf = torch.zeros((0, num_layers, top_k), dtype=dtype, device=device)
        self.rows_buf = torch.zeros(0, dtype=torch.int64, device=device)  # graphed router_rows
        self._graph_tokens: dict[int, tuple[int, int, bool]] = {}  # T -> (step buf ptr, rows buf ptr, router_rows)
        self.fixed_step_rows = 0  # > 0: the model writes a fixed step buffer of this many rows itself
        # Per slot: the operation that last wrote it (> 0), or released it (< 0); 0: never written.
        self.gen = np.zeros(num_slots, dtype=np.int64)
        self._op = 0  # operations so far (write_step, copy_rows, release)
        self._seen = np.zeros(num_slots, dtype=np.int32)  # scratch of check_distinct
        self._stamps = np.arange(256, dtype=np.int32)  # check_distinct's stamps, sliced (one numpy call less per step)

    # -- indices ------------------------------------------------------------------------------

    @property
    def step_buf(self) -> torch.Tensor:
        """The step buffer ``[rows, L, K]`` the routers write (grown by :meth:`reserve_step`)."""
        return self._step_buf

    @step_buf.setter
    def step_buf(self, buf: torch.Tensor) -> None:
        self._step_buf = buf
        self._step_np = _rows_as_items(buf, self._row_item) if self._table_np is not None else None

    def check_slots(self, slots: np.ndarray) -> None:
        """Raise :class:`OutOfRangeError` unless every slot is in ``0 .. num_slots - 1``."""
        # One reduction: as unsigned, a negative slot is larger than any valid one.
        if slots.size and slots.view(np.uint64).max() >= self.num_slots:
            raise OutOfRangeError(f"slots must be in 0..{self.num_slots - 1}, got {slots.min()}..{slots.max()}")

    def check_distinct(self, slots: np.ndarray) -> None:
        """Raise :class:`ShapeMismatchError` if a slot appears twice (``slots`` already checked
        in range). Without a sort: token ``t`` stamps its index on its slot, and a repeated slot
        keeps one stamp only, so another token of that slot reads a stamp not its own."""
        n = slots.size
        if n < 2:
            return
        if self._stamps.size < n:
            self._stamps = np.arange(max(n, 2 * self._stamps.size), dtype=np.int32)
        stamp = self._stamps[:n]
        self._seen[slots] = stamp
        if (self._seen[slots] != stamp).any():
            raise ShapeMismatchError("a slot appears twice in one step: each token writes its own KV slot")

    def to_device(self, values: np.ndarray) -> torch.Tensor:
        """Host int64 indices on the table's device without a host sync.

        Through pinned memory from torch's caching host allocator: it reuses a staging block
        only once the copy recorded on it has completed, so the next step cannot overwrite
        indices still in flight (the race of a shared pinned buffer, vLLM #39568).
        """
        host = torch.from_numpy(values)
        if not self.cuda:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    # -- the step buffer and graphs -------------------------------------------------------------

    def fix_step_buffer(self, buf_TLK: torch.Tensor) -> None:
        """Use ``buf_TLK`` as the step buffer from now on, at its address, never reallocated:
        the model's routers write it themselves (:mod:`r3rdma.kernels.record_op`), in compiled
        code or a replayed CUDA graph, so every step of up to ``len(buf_TLK)`` tokens counts as
        graphed."""
        _, num_layers, top_k = self.step_buf.shape
        if buf_TLK.dim() != 3 or tuple(buf_TLK.shape[1:]) != (num_layers, top_k) or buf_TLK.shape[0] < 1:
            raise ShapeMismatchError(
                f"step_buffer must have shape [max_tokens, {num_layers}, {top_k}], got {tuple(buf_TLK.shape)}"
            )
        if buf_TLK.dtype != self.table_SLK.dtype or buf_TLK.device != self.table_SLK.device:
            raise ShapeMismatchError(
                f"step_buffer must be {self.table_SLK.dtype} on {self.table_SLK.device} (the slot "
                f"table's), got {buf_TLK.dtype} on {buf_TLK.device}"
            )
        if not buf_TLK.is_contiguous():
            raise ShapeMismatchError("step_buffer must be contiguous")
        self.step_buf = buf_TLK
        self.fixed_step_rows = int(buf_TLK.shape[0])

    def reserve_step(self, rows: int) -> None:
        """Grow the step buffer to hold at least ``rows`` rows (a graph keeps its old address)."""
        if self.fixed_step_rows:
            if rows > self.fixed_step_rows:
                raise ShapeMismatchError(
                    f"a step of {rows} tokens does not fit the fixed step buffer of "
                    f"{self.fixed_step_rows} rows (size it from the engine's token budget)"
                )
            return
        if self.step_buf.shape[0] < rows:
            _, num_layers, top_k = self.step_buf.shape
            self.step_buf = torch.zeros(
                (max(rows, 2 * self.step_buf.shape[0]), num_layers, top_k),
                dtype=self.step_buf.dtype,
                device=self.device,
            )

    def router_rows_view(self, n: int) -> torch.Tensor:
        """The first ``n`` entries of the fixed router-rows buffer a graph reads (grown if needed)."""
        if self.rows_buf.shape[0] < n:
            self.rows_buf = torch.zeros(max(n, 2 * self.rows_buf.shape[0]), dtype=torch.int64, device=self.device)
        return self.rows_buf[:n]

    def graph_key(self, with_rows: bool) -> tuple[int, int, bool]:
        """The buffer addresses a graph captured now would read and write."""
        return (self.step_buf.data_ptr(), self.rows_buf.data_ptr() if with_rows else 0, with_rows)

    def remember_graph(self, num_tokens: int, with_rows: bool) -> None:
        """Note that a graph of ``num_tokens`` tokens was captured over the buffers as they are now."""
        self._graph_tokens[num_tokens] = self.graph_key(with_rows)

    def graph_for(self, num_tokens: int) -> tuple[int, int, bool] | None:
        """The key a graph of ``num_tokens`` tokens was captured with, or None."""
        if self.fixed_step_rows and num_tokens <= self.fixed_step_rows:
            return self.graph_key(False)
        return self._graph_tokens.get(num_tokens)

    def graph_token_counts(self) -> list[int]:
        """The token counts graphs were captured for, ascending."""
        return sorted(self._graph_tokens)

    def record(
        self,
        begin: int,
        n: int,
        moe: int,
        topk_ids_TK: torch.Tensor,
        router_rows: torch.Tensor | None,
        expert_map: torch.Tensor | None,
    ) -> None:
        """One kernel: select the router rows, map EPLB replicas to logical ids, narrow, and store
        them as rows ``begin .. begin + n - 1`` of the step buffer, MoE layer ``moe``."""
        record_layer(self.step_buf[begin : begin + n], moe, topk_ids_TK, router_rows, expert_map)

    # -- the table ------------------------------------------------------------------------------

    @property
    def valid(self) -> np.ndarray:
        """Per slot: whether it holds a row, written and not released since (a new array)."""
        return self.gen > 0

    def write_step(self, slots: np.ndarray, total: int, token_idx: np.ndarray | None = None) -> int:
        """Scatter step-buffer rows into ``slots`` and return their new generation (one for
        all: this write's operation number).

        Rows ``0 .. total - 1`` of the step buffer, or with ``token_idx`` only those tokens
        (speculative decoding: accepted tokens), one slot each.
        """
        table_np, step_np = self._table_np, self._step_np  # both set on a CPU table, both None on CUDA
        if table_np is not None and step_np is not None:  # CPU: numpy scatter, the bytes write_step_rows writes
            rows = step_np[:total]
            table_np[slots] = rows if token_idx is None else rows[token_idx]
        elif token_idx is None:
            write_step_rows(self.table_SLK, self.to_device(slots), self.step_buf[:total])
        else:  # one transfer for both index arrays
            both = self.to_device(np.concatenate([slots, token_idx]))
            write_step_rows(self.table_SLK, both[: slots.size], self.step_buf[:total], both[slots.size :])
        # Slots of one step are distinct (begin_step checks): each is written once, by this operation.
        self._op += 1
        self.gen[slots] = self._op
        return self._op

    def gather(self, slots: np.ndarray) -> torch.Tensor:
        """The rows of ``slots``, packed ``[len(slots), L, K]`` on the device (one kernel).

        On a CPU table, numpy's fancy indexing (one contiguous copy per row of L*K bytes, the
        same bytes ``gather_rows`` returns): torch's ``index_select`` on small uint8 rows took
        ~10x longer, on the finishing request's path."""
        if self._table_np is not None:
            return torch.from_numpy(self.gather_host(slots))
        return gather_rows(self.table_SLK, self.to_device(slots))

    def gather_host(self, slots: np.ndarray) -> np.ndarray:
        """The rows of ``slots`` as a host numpy array ``[len(slots), L, K]`` (a copy; from a
        device table, a synchronous copy). A CPU table's come without a round trip through
        torch (~30 us of ``from_numpy`` / ``cpu`` / ``numpy`` per finishing request, with the
        engine's caches cold)."""
        if self._table_np is None:
            return self.gather(slots).cpu().numpy()
        _, num_layers, top_k = self.table_SLK.shape
        rows = self._table_np[slots].view(_NUMPY_OF[self.table_SLK.dtype])
        return rows.reshape(slots.size, num_layers, top_k)

    def stale(self, slots: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """Indices ``i`` where ``slots[i]`` was written again since generation ``gens[i]``."""
        return np.flatnonzero(self.gen[slots] != gens)

    def any_stale(self, slots: np.ndarray, gens: np.ndarray) -> bool:
        """Whether any ``slots[i]`` was written again since generation ``gens[i]`` (:meth:`stale`
        without the indices)."""
        return bool((self.gen[slots] != gens).any())

    def copy_rows(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Copy-on-write: rows of ``src`` into ``dst`` on the device; the new generations of ``dst``."""
        if np.unique(dst).size != dst.size:
            raise ShapeMismatchError("fork_request: a copy-on-write slot appears twice")
        rows = self.gather(src)
        write_step_rows(self.table_SLK, self.to_device(dst), rows)
        self._op += 1
        self.gen[dst] = self._op
        return self.gen[dst]

    def release(self, slots: np.ndarray) -> None:
        """The slots' rows stop being valid (evicted or reassigned KV blocks)."""
        self.check_slots(slots)
        self._op += 1
        self.gen[slots] = -self._op

    def check_attachable(self, request_id: str, slots: np.ndarray) -> None:
        """Raise :class:`StaleSlotError` unless every slot holds a valid row (a prefix-cache hit)."""
        never = slots[self.gen[slots] == 0]
        if never.size:
            raise StaleSlotError(f"request {request_id!r} attaches to slots never written: {never[:8].tolist()}")
        released = slots[self.gen[slots] < 0]
        if released.size:
            raise StaleSlotError(
                f"request {request_id!r} attaches to slots released (evicted) and not rewritten since: "
                f"{released[:8].tolist()} (a prefix-cache hit on a block that no longer holds its prefix?)"
            )


class _PinnedOnDevice:
    """``__cuda_array_interface__`` of pinned host memory, for torch.as_tensor(device="cuda")."""

    def __init__(self, host: torch.Tensor) -> None:
        typestr = {torch.uint8: "|u1", torch.int16: "<i2", torch.int32: "<i4"}[host.dtype]
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": typestr,
            "data": (host.data_ptr(), False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def _device_view_of_pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    view = torch.as_tensor(_PinnedOnDevice(host), device=device)
    if view.data_ptr() != host.data_ptr() or view.device.type != "cuda":
        raise ConfigError("pinned host slot table: this CUDA setup does not map pinned memory into the device (no UVA)")
    return view


_NUMPY_OF = {torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32}


def _rows_as_items(rows_SLK: torch.Tensor, item: np.dtype) -> np.ndarray:
    """A host ``[S, L, K]`` tensor as a numpy array of ``S`` items, one per row (same bytes)."""
    rows, num_layers, top_k = rows_SLK.shape
    flat = rows_SLK.numpy().reshape(rows, num_layers * top_k)  # contiguous: a view
    return flat.view(item).reshape(rows)


def host_int64(values: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """Slots or positions the engine passes, as a flat host int64 array (never a device read)."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ShapeMismatchError(
                "slot and position arrays must be host values (the engine's own mapping), got a device tensor"
            )
        values = values.numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)
