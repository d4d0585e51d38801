"""The shape of the house: a small public API, a CLI that starts without the heavy stack, and
import arrows that point one way (kernels and transport are leaves; store sits below the rest)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import r3rdma

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "zarr", "transformers", "numpy", "ucxx", "aiohttp")


def test_public_api_is_small_and_every_name_resolves():
    assert len(r3rdma.__all__) <= 16, r3rdma.__all__
    assert len(set(r3rdma.__all__)) == len(r3rdma.__all__)
    for name in r3rdma.__all__:
        assert getattr(r3rdma, name).__name__ == name
    for name in ("R3Config", "RoutingCapturer", "RoutingWriter", "LocalRoutingStore", "StoreNodesClient",
                 "RoutingReader", "PackedRouting", "RouterReplay", "ReplayBatch", "R3Error"):
        assert name in r3rdma.__all__
    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        r3rdma.NotAThing  # noqa: B018


def test_every_exported_error_is_an_r3error():
    for name in r3rdma.__all__:
        value = getattr(r3rdma, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert issubclass(value, r3rdma.R3Error), name


def _fresh_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60).stdout


def test_importing_r3rdma_and_cli_help_load_no_heavy_module():
    code = (
        "import contextlib, io, json, sys\n"
        "import r3rdma, r3rdma.errors\n"
        "from r3rdma.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit as e:\n"
        "        code = e.code\n"
        f"print(json.dumps({{'code': code, 'help': out.getvalue(), 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))\n"
    )
    result = json.loads(_fresh_python(code).splitlines()[-1])
    assert result["code"] == 0
    assert result["heavy"] == [], f"r3rdma --help imported {result['heavy']}"
    for command in ("demo", "rollout", "check", "verify", "inspect", "delete", "bench"):
        assert command in result["help"]


def test_reading_a_store_without_tensors_loads_no_torch(tmp_path, make_record):
    """``r3rdma inspect`` and ``RoutingReader.get_numpy`` stay in numpy: torch (2.5 s of a 3.9 s
    start) is imported where a tensor is made (r3rdma.read.packed)."""
    from r3rdma.store.local_store import LocalRoutingStore

    with LocalRoutingStore(str(tmp_path / "store")) as store:
        store.commit([make_record("q0", rows=5)])
    code = (
        "import contextlib, io, json, sys\n"
        "from r3rdma.cli import main\n"
        "from r3rdma import RoutingReader\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    code = main(['inspect', {str(tmp_path / 'store')!r}, 'roll-0'])\n"
        f"rows = RoutingReader({str(tmp_path / 'store')!r}).get_numpy('roll-0', ['q0'])['q0'].shape[0]\n"
        "print(json.dumps({'code': code, 'rows': rows, 'torch': 'torch' in sys.modules}))\n"
    )
    assert json.loads(_fresh_python(code).splitlines()[-1]) == {"code": 0, "rows": 5, "torch": False}


def test_subcommand_help_lists_its_own_arguments():
    out = subprocess.run([sys.executable, "-m", "r3rdma", "delete", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--older-than-s" in out.stdout
    out = subprocess.run([sys.executable, "-m", "r3rdma", "bench", "nope"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "invalid choice" in out.stderr


def _r3rdma_imports(path: Path) -> set[str]:
    """Absolute r3rdma modules a file imports (relative imports stay inside its own package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("r3rdma"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("r3rdma"))
    return found


# Small value types every layer may use.
VALUE_TYPES = ("r3rdma.errors", "r3rdma.ids", "r3rdma.records")


@pytest.mark.parametrize(
    "folder, allowed",
    [
        ("kernels", VALUE_TYPES + ("r3rdma.kernels",)),
        ("transport", VALUE_TYPES + ("r3rdma.transport",)),
        ("store", VALUE_TYPES + ("r3rdma.store", "r3rdma.transport")),
    ],
)
def test_import_arrows_point_down(folder, allowed):
    wrong = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        # A bare "r3rdma" comes with `from r3rdma import errors`, which also names r3rdma.errors
        # (checked against `allowed` like any other module).
        bad = sorted(m for m in _r3rdma_imports(path)
                     if m != "r3rdma" and not any(m == a or m.startswith(a + ".") for a in allowed))
        if bad:
            wrong[str(path.relative_to(ROOT))] = bad
    assert not wrong, f"{folder}/ may import only {allowed}; found {wrong}"


def _module_graph() -> dict[str, set[str]]:
    """Every r3rdma module (installed names) -> the r3rdma modules it imports, anywhere in the
    file (function-level imports too), relative imports resolved."""
    roots = {"r3rdma": "r3rdma", "store": "r3rdma.store", "transport": "r3rdma.transport", "kernels": "r3rdma.kernels"}
    mods: dict[str, tuple[Path, bool]] = {}
    for folder, pkg in roots.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [x for x in path.relative_to(ROOT / folder).with_suffix("").parts if x != "__init__"]
            mods[".".join([pkg, *parts])] = (path, path.name == "__init__.py")
    graph = {}
    for name, (path, is_pkg) in mods.items():
        pkg = name if is_pkg else name.rsplit(".", 1)[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        graph[name] = {m for m in out if m in mods and m != name}
    return graph


def test_no_import_circles():
    graph = _module_graph()
    circles = []
    for start in graph:  # a circle through `start`: a path from one of its imports back to it
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m == start:
                circles.append(start)
                break
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
    assert not circles, f"modules on an import circle: {sorted(circles)}"


def test_fault_injection_is_imported_only_by_the_bench_driver():
    # r3rdma.testing is harness for `bench reliability` and the tests, not part of the data path.
    graph = _module_graph()
    users = sorted(m for m, deps in graph.items()
                   if any(d == "r3rdma.testing" or d.startswith("r3rdma.testing.") for d in deps)
                   and not m.startswith("r3rdma.testing") and not m.startswith("r3rdma.bench"))
    assert users == [], users
