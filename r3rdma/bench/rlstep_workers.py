"""The processes of ``r3rdma bench rlstep`` (:mod:`r3rdma.bench.rlstep_bench` says what each does
in the step): :func:`engine_main`, one TP-owner rank submitting its requests on a schedule, and
:func:`trainer_main`, one data-parallel rank (the step's collect, the timed reads of
:func:`worker_read`, a fresh reader's index open). Both run as
:class:`r3rdma.bench.common.Worker` processes and speak its pipe protocol.
"""

from __future__ import annotations

import os
import time
from typing import Any

from r3rdma.bench.common import serve, wait_go

__all__ = ["engine_main", "trainer_main", "worker_read", "WARM_ROLLOUT"]

#: Where engines push their warm-up records (connections up before the clock), apart from the step.
WARM_ROLLOUT = "rlstep-warm"


def engine_main(
    conn,
    rank: int,
    push_urls: list[str],
    token: str,
    replicas: int,
    rollout_kw: dict[str, Any],
    schedule: list[tuple[int, float]],
    batch_mb: float,
) -> None:
    """One engine rank: connect (warm-up pushes until every node took one), say ready, then on
    ``go`` submit request ``i`` at ``t0 + finish_s`` for each ``(i, finish_s)`` of ``schedule``
    (sorted), flush, and report first submit, ack times and how late submits ran."""
    os.dup2(2, 1)  # the parent's stdout ends with its JSON line: anything printed here goes to stderr
    import traceback

    from r3rdma.bench.common import TimedCommits, warm_connections
    from r3rdma.bench.synthetic import TiledRollout
    from r3rdma.write import RoutingWriter, StoreNodesClient

    client = None
    try:
        rollout = TiledRollout(**rollout_kw)
        client = StoreNodesClient(push_urls, secret=token, replicas=replicas)
        warm_ids = warm_connections(client, rollout, WARM_ROLLOUT, f"e{rank}-")
    except BaseException:
        conn.send({"event": "error", "error": traceback.format_exc()})
        if client is not None:
            client.close()
        return
    conn.send({"event": "ready", "warm": warm_ids})
    try:

        def go(cmd: dict[str, Any]) -> None:
            t0 = cmd["t0"]
            clock = TimedCommits(client)
            batch_bytes = max(1, int(batch_mb * (1 << 20)))
            writer = RoutingWriter(clock, flush_bytes=batch_bytes, max_inflight_bytes=max(8 * batch_bytes, 512 << 20))
            late = 0.0
            first = None
            cpu0 = time.process_time()
            try:
                for i, finish_s in schedule:
                    wait = t0 + finish_s - time.time()
                    if wait > 0:
                        time.sleep(wait)
                    now = time.time()
                    late = max(late, now - (t0 + finish_s))  # the engine fell behind its schedule (CPU, backpressure)
                    first = now if first is None else first
                    writer.submit(rollout.record(i))  # the record's CRC-32C is hashed here, as a capturer does
                writer.flush()
            finally:
                writer.close()
            conn.send(
                {
                    "event": "done",
                    "first_submit": first,
                    "acks": [(acked, ids) for _, acked, ids in clock.log],
                    "late_s": late,
                    "requests": len(schedule),
                    "bytes": sum(rollout.nbytes(i) for i, _ in schedule),
                    "cpu_s": time.process_time() - cpu0,
                }
            )

        serve(conn, {"go": go})
    finally:
        client.close()


def trainer_main(conn, rank: int, urls: list[str], read_token: str) -> None:
    """One trainer rank. Commands: ``warm`` (read a few records of the warm-up rollout:
    connections and buffers up), ``collect`` (the step: collect the share, pack it, report the
    moment it was whole), ``read`` (:func:`worker_read`), ``open`` (a new reader's ``info()`` of
    the rollout, ``repeat`` times: milliseconds each)."""
    os.dup2(2, 1)  # the parent's stdout ends with its JSON line: anything printed here goes to stderr
    from r3rdma.read.reader import RoutingReader
    from r3rdma.records import checksum

    reader = RoutingReader(urls, token=read_token, progress=False)
    conn.send({"event": "ready"})

    def warm(cmd: dict[str, Any]) -> None:
        reader.get_packed(cmd["rollout"], cmd["ids"])
        conn.send({"event": "done"})

    def collect(cmd: dict[str, Any]) -> None:
        cpu0, started = time.process_time(), time.time()
        # Named before the rollout exists (it is created by its first commit): the collector
        # keeps polling until it does, as a trainer rank does when the step begins.
        with reader.collect(cmd["rollout"], cmd["ids"], poll_s=cmd["poll_s"]) as collector:
            packed = collector.packed(cmd["timeout"])  # the share is whole; its replay batch assembled
            done = time.time()
            crcs: dict[str, int] = {}
            if cmd["verify"]:  # outside the clock: what arrived, hashed, for the parent to compare
                crcs = {rid: checksum(array) for rid, array in collector.result(0).items()}
            ids_TLK = packed.ids_TLK
            answer = {
                "event": "done",
                "started": started,
                "done": done,
                "requests": len(packed.request_ids),
                "rows": int(ids_TLK.shape[0]),
                "bytes": ids_TLK.numel() * ids_TLK.element_size(),
                "order_ok": list(packed.request_ids) == list(cmd["ids"]),
                "polls": collector.polls,
                "reads": collector.reads,
                "cpu_s": time.process_time() - cpu0,
                "crcs": crcs,
            }
        del packed, ids_TLK  # the share's memory back before the after-step reads
        conn.send(answer)

    def open_fresh(cmd: dict[str, Any]) -> None:
        times = []
        for _ in range(cmd["repeat"]):
            with RoutingReader(urls, token=read_token, progress=False) as fresh:
                t0 = time.perf_counter()
                info = fresh.info(cmd["rollout"])
                times.append((time.perf_counter() - t0) * 1e3)
        conn.send({"event": "done", "ms": times, "requests": len(info.request_ids)})

    handlers = {"warm": warm, "collect": collect, "read": lambda cmd: worker_read(reader, cmd, conn), "open": open_fresh}
    try:
        serve(conn, handlers)
    finally:
        reader.close()


def worker_read(reader, cmd: dict[str, Any], conn) -> None:
    """Arm (index read, one untimed micro-batch), wait for go, read every micro-batch in order
    through ``prefetch``; report bytes, rows, CPU seconds and the clock's start and end."""
    rollout, batches = cmd["rollout"], cmd["batches"]
    reader.info(rollout)  # the index, as a trainer holds it before its step's reads
    if batches:
        reader.get_packed(rollout, batches[-1])  # connections and buffers warm
    wait_go(conn)
    requests = rows = nbytes = 0
    cpu0 = time.process_time()  # every thread of this reader: decode pool and HTTP client included
    start = time.time()
    with reader.prefetch(rollout, batches, depth=2) as stream:
        for packed in stream:
            requests += len(packed.request_ids)
            rows += int(packed.ids_TLK.shape[0])
            nbytes += packed.ids_TLK.numel() * packed.ids_TLK.element_size()
    conn.send(
        {
            "event": "done",
            "start": start,
            "end": time.time(),
            "requests": requests,
            "rows": rows,
            "bytes": nbytes,
            "cpu_s": time.process_time() - cpu0,
        }
    )
