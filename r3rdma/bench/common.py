"""What the bench programs share: progress on stderr, worker processes driven over a pipe, store
nodes' /metrics and CPU time, a push client's timed commits and warm-up, and the command line's
presets, options and JSON line.

Store nodes are started with :func:`r3rdma.testing.harness.spawn_nodes`, as the tests start them."""

from __future__ import annotations

import argparse
import http.client
import inspect
import json
import os
import sys
import tempfile
import time
import typing
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = [
    "log",
    "bar",
    "rounds_bar",
    "worker_context",
    "Worker",
    "serve",
    "wait_go",
    "run_phase",
    "span_rate",
    "stop_all",
    "scratch_dir",
    "tree_bytes",
    "node_samples",
    "cpu_seconds",
    "TimedCommits",
    "warm_connections",
    "commit_in_batches",
    "add_options",
    "add_preset_arguments",
    "run_from_args",
    "emit",
]


def log(bench: str, progress: bool, message: str) -> None:
    """Print ``message`` on stderr, tagged with the bench's name, when ``progress``."""
    if progress:
        print(f"[bench {bench}] {message}", file=sys.stderr, flush=True)


def bar(progress: bool, total: int, desc: str, unit: str = "req", iterable=None):
    """A tqdm bar on stderr (over ``iterable`` if given), shown only when stderr is a terminal."""
    from tqdm.auto import tqdm

    disable = not (progress and sys.stderr.isatty())
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, mininterval=0.5, disable=disable)


def rounds_bar(rounds: int, name: str):
    """``range(rounds)`` with a progress bar (stderr, terminal only)."""
    return bar(True, rounds, f"bench {name}", "round", range(rounds))


# -- worker processes -----------------------------------------------------------------------------


def worker_context():
    """Bench processes fork from one forkserver that imported the reader once: separate imports
    of torch and zarr in every process cost seconds each on a small machine, forks of one well
    under a second (BENCHMARKS.md, rlstep). The UCX stack is not preloaded: a pushing process
    imports ucxx after its fork."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["r3rdma.read.reader", "r3rdma.bench.common", "r3rdma.bench.rlstep_workers"])
    return ctx


class Worker:
    """A process running ``target(conn, *args)`` and its pipe: commands one way, answers the other
    (``ready``, then per command ``armed`` / ``done``, or ``error`` with a traceback)."""

    def __init__(self, ctx, rank: int, target, args: tuple, name: str) -> None:
        self.rank = rank
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
        self.proc.start()
        child.close()
        self._stopping = False

    def send(self, message: dict[str, Any]) -> None:
        """Send a command (``{"cmd": name, ...}``) to the process."""
        self.conn.send(message)

    def recv(self, timeout: float) -> dict[str, Any]:
        """The process's next answer. Raises TimeoutError after ``timeout`` seconds without one,
        RuntimeError if the process exited or answered ``error`` (its traceback in the message)."""
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.proc.name}: no answer in {timeout} s")
        try:
            message = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"{self.proc.name} exited with {self.proc.exitcode}") from None
        if message.get("event") == "error":
            raise RuntimeError(f"{self.proc.name} failed:\n{message['error']}")
        return message

    def request_stop(self) -> None:
        """Ask the process to stop (once; without waiting for it)."""
        if self.proc.is_alive() and not self._stopping:
            self._stopping = True
            try:
                self.conn.send({"cmd": "stop"})
            except OSError:
                pass

    def stop(self) -> None:
        """Stop the process (asked, then killed after 30 s) and close the pipe."""
        if self.proc.is_alive():
            self.request_stop()
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(30)
        self.conn.close()


def serve(conn, handlers: dict[str, Any]) -> None:
    """Run the commands arriving on ``conn`` (``handlers[cmd["cmd"]](cmd)``) until ``stop`` or
    the pipe closes; an exception goes back as ``{"event": "error"}`` and serving goes on."""
    import traceback

    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        if cmd["cmd"] == "stop":
            return
        try:
            handler = handlers.get(cmd["cmd"])
            if handler is None:
                raise ValueError(f"unknown command {cmd['cmd']!r}")
            handler(cmd)
        except BaseException:
            conn.send({"event": "error", "error": traceback.format_exc()})


def wait_go(conn) -> None:
    """In a worker: say armed (everything up, nothing timed yet), then wait for the release."""
    conn.send({"event": "armed"})
    if conn.recv()["cmd"] != "go":
        raise RuntimeError("expected go")


def run_phase(
    workers: Sequence[Worker], commands: Sequence[dict[str, Any]], timeout: float, on_armed: Callable[[], object] | None = None
) -> list[dict[str, Any]]:
    """Arm each worker with its command, call ``on_armed`` (a count taken before the clock), then
    release them together; their answers."""
    for worker, cmd in zip(workers, commands):
        worker.send(cmd)
    for worker in workers:
        assert worker.recv(timeout)["event"] == "armed"
    if on_armed is not None:
        on_armed()
    for worker in workers:
        worker.send({"cmd": "go"})
    return [worker.recv(timeout) for worker in workers]


def span_rate(results: list[dict[str, Any]]) -> tuple[float, float, int]:
    """(GB/s, seconds, bytes) of a phase: all bytes over first start to last end."""
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    total = sum(r["bytes"] for r in results)
    return total / max(span, 1e-9) / 1e9, span, total


def _stop_node(node) -> None:
    try:
        node.stop()
    except Exception:
        node.kill()


def stop_all(workers, node_procs, remove: Path | None) -> None:
    """A bench's teardown: its worker processes asked to stop (all at once, then waited for),
    its store nodes stopped in parallel, and ``remove`` (a temporary base directory) deleted."""
    import shutil

    for worker in workers:
        worker.request_stop()
    for worker in workers:
        worker.stop()
    if node_procs:
        with ThreadPoolExecutor(len(node_procs)) as pool:
            list(pool.map(_stop_node, node_procs))
    if remove is not None:
        shutil.rmtree(remove, ignore_errors=True)


def scratch_dir(prefix: str, root: str | None = None) -> Path:
    """A bench's base directory: ``root`` (created if missing, kept), else a new temporary one."""
    base = Path(root) if root else Path(tempfile.mkdtemp(prefix=prefix))
    base.mkdir(parents=True, exist_ok=True)
    return base


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# -- what the nodes did -----------------------------------------------------------------------


def node_samples(node) -> dict[str, float]:
    """Every sample of a node's ``/metrics`` by sample name (labels summed), read with
    prometheus-client's own parser: ``r3rdma_store_bytes_ingested_total``, ``..._seconds_sum``."""
    from prometheus_client.parser import text_string_to_metric_families

    url = urllib.parse.urlsplit(node.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {node.read_token}"})
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its live children (a node and its read workers; Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue  # gone meanwhile, or no /proc here
    return total


# -- the push side --------------------------------------------------------------------------


class TimedCommits:
    """A writer's store: a StoreNodesClient whose every commit (push until acknowledged) is logged
    as ``(started, acknowledged, request ids)`` in wall-clock seconds (other processes compare)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.log: list[tuple[float, float, list[str]]] = []

    def commit(self, records):
        """The inner client's commit, logged; returns what it returned."""
        started = time.time()
        result = self.inner.commit(records)
        self.log.append((started, time.time(), [r.request_id for r in records]))
        return result


def warm_connections(client, rollout, rollout_id: str, prefix: str) -> list[str]:
    """Connections up before the clock: records of ``rollout_id`` (a rollout of their own) pushed
    until every node took one; their request ids."""
    from r3rdma.records import RequestRecord

    covered: set[str] = set()
    warm_ids: list[str] = []
    for j in range(1000):
        if len(covered) == len(client.nodes):
            break
        warm = RequestRecord(rollout_id, f"{prefix}w{j}", rollout.ids(j % len(rollout)), rollout.layer_map, rollout.num_experts)
        if not set(client.replica_set(warm)) <= covered:
            client.commit([warm])
            covered.update(client.replica_set(warm))
            warm_ids.append(warm.request_id)
    return warm_ids


def commit_in_batches(store, rollout, order, batch_bytes: int) -> list[float]:
    """Commit ``rollout``'s requests (a :class:`~r3rdma.bench.synthetic.TiledRollout`) to ``store``
    in ``order`` (a sequence of indices), a batch ending at the request that reaches
    ``batch_bytes``; the milliseconds of each ``store.commit`` (records made outside the clock)."""
    times: list[float] = []
    batch: list[int] = []
    size = 0
    for n, i in enumerate(order):
        batch.append(i)
        size += rollout.nbytes(i)
        if size >= batch_bytes or n == len(order) - 1:
            records = [rollout.record(j) for j in batch]
            t0 = time.perf_counter()
            store.commit(records)
            times.append((time.perf_counter() - t0) * 1e3)
            batch, size = [], 0
    return times


# -- command line -----------------------------------------------------------------------------


def add_options(parser, run: Callable[..., Any], names: str, helps: Mapping[str, str] | None = None) -> None:
    """An option ``--name-with-dashes`` per parameter of ``run`` in ``names`` (space-separated),
    its default and type from ``run``'s signature (a bool: a flag, ``--no-...`` when on by
    default; a tuple: one or more values), its help from ``helps``: a bench's defaults live in
    its run function alone."""
    hints = typing.get_type_hints(run)
    params = inspect.signature(run).parameters
    for name in names.split():
        default, hint = params[name].default, hints.get(name, type(params[name].default))
        kwargs: dict[str, Any] = {"default": default, "help": (helps or {}).get(name)}
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif isinstance(default, tuple):
            kwargs.update(nargs="+", type=typing.get_args(hint)[0])
        else:  # int | None: int
            kwargs["type"] = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        parser.add_argument("--" + name.replace("_", "-"), **kwargs)


def add_preset_arguments(
    parser, run: Callable[..., Any], quick: Mapping[str, Any], full: Mapping[str, Any], quick_help: str, helps: Mapping[str, str]
) -> None:
    """``--quick`` (``quick_help``), an option per preset value (unset: the preset's; ``helps``
    says what it is), the synthetic rollout's shape and seed, the nodes' ``--http-workers`` (the
    parameters of ``run``) and ``--json-out``: the options every multi-process bench takes."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    for key, value in full.items():
        what = f"{helps[key]}, " if key in helps else ""
        option = "--" + key.replace("_", "-")
        parser.add_argument(option, type=type(value), default=None, help=f"{what}default {value:g}, --quick {quick[key]:g}")
    workers = {"http_workers": "each node's --http-workers (auto: a quarter of the cores)"}
    add_options(parser, run, "layers top_k experts seed http_workers", workers)
    parser.add_argument("--json-out", default=None, help="also write the JSON result to this file")


def run_from_args(
    run: Callable[..., dict[str, Any]], args, quick: Mapping[str, Any] | None = None, full: Mapping[str, Any] | None = None
) -> int:
    """``run`` called with every option of ``args`` it names as a parameter (``full``'s, or with
    ``--quick`` ``quick``'s, where the option was not given), its result printed by :func:`emit`:
    a bench's ``main``."""
    wanted = inspect.signature(run).parameters
    kwargs = {k: v for k, v in vars(args).items() if k in wanted}
    if full is not None:  # the preset's values (``--quick`` or full size) where no option was given
        chosen = quick if args.quick and quick is not None else full
        kwargs.update({k: chosen[k] if kwargs[k] is None else kwargs[k] for k in chosen})
    return emit(run(**kwargs), getattr(args, "json_out", None))


def emit(result: dict[str, Any], json_out: str | None = None) -> int:
    """The bench's last line: the result as JSON (also written to ``json_out``); exit status 0."""
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0
