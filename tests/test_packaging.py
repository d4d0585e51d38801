"""A wheel built from the tree installs non-editable into a clean venv and imports all four packages."""

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_into_clean_venv(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(ROOT)],
        check=True, capture_output=True, text=True,
    )
    (wheel,) = wheels.glob("r3rdma-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.startswith("r3rdma-")}
    assert top == {"r3rdma"}, f"the wheel must add exactly one top-level name, got {top}"
    for sub in ("transport", "kernels", "store"):
        assert f"r3rdma/{sub}/__init__.py" in names
    # Every package of the source tree is in the wheel (a subpackage missing from
    # pyproject's list would only show up in a non-editable install).
    for folder, prefix in (("r3rdma", "r3rdma"), ("transport", "r3rdma/transport"), ("kernels", "r3rdma/kernels"), ("store", "r3rdma/store")):
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.relative_to(ROOT / folder).as_posix()
            assert f"{prefix}/{rel}" in names, f"{folder}/{rel} is missing from the wheel"

    venv = tmp_path / "clean"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # Dependencies (torch, zarr, ...) come from this environment through a plain path entry,
    # which does not activate the editable-install finder of the development checkout.
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    check = (
        "import r3rdma, r3rdma.transport, r3rdma.kernels, r3rdma.store, importlib.util, sys\n"
        "import r3rdma.cli, r3rdma.integrations.hf_routers, r3rdma.bench.store_bench, r3rdma.store.cli\n"
        f"assert r3rdma.__file__.startswith({str(venv)!r}), r3rdma.__file__\n"
        "assert importlib.util.find_spec('kernels') is None or 'r3rdma' not in (importlib.util.find_spec('kernels').origin or '')\n"
        "from importlib.metadata import entry_points\n"
        "assert any(e.name == 'r3rdma' for e in entry_points(group='console_scripts'))\n"
        "print('ok')\n"
    )
    out = subprocess.run([str(py), "-c", check], cwd=tmp_path, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "ok"
    assert (venv / "bin" / "r3rdma").exists()
