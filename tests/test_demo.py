"""The main job, as scripts/demo.sh runs it.

``python -m r3rdma demo`` runs as a program once (its entry point, its exit status); the other
cases call the same command in this process (``r3rdma.cli.main``), which spares each one a
Python that imports torch and transformers again.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from r3rdma.cli import main as cli_main


def _demo(capsys, *argv: str) -> tuple[dict, str]:
    """``r3rdma demo ARGV`` in this process: (its JSON line, everything it printed)."""
    assert cli_main(["demo", *argv]) == 0
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1]), out


def test_demo_roundtrip_exact(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "r3rdma", "demo", "--root", str(tmp_path / "store"), "--requests", "10"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["roundtrip_exact"] is True
    assert result["requests"] == 10 and result["tokens"] > 10 and result["stored_bytes"] > 0


def test_demo_builds_its_pipeline_from_routing_replay_config(tmp_path, capsys):
    config = {"enable_routing_replay": True, "routing_store_type": "local", "local_store_dir": str(tmp_path / "r3"),
              "rollout_id": "from-config", "zstd_level": 0, "flush_bytes": 4096}
    result, _ = _demo(capsys, "--requests", "3", "--batch-size", "3", "--routing-replay-config", json.dumps(config))
    assert result["roundtrip_exact"] is True and result["requests"] == 3
    assert result["root"] == str(tmp_path / "r3")
    assert (tmp_path / "r3" / "from-config" / "zarr.json").exists()  # the config's root and rollout id


@pytest.mark.parametrize(
    "config, match",
    [
        ({"routing_store_type": "rdma", "store_urls": ["127.0.0.1:1"]}, "expected routing_store_type 'local'"),
        ({"enable_routing_replay": False}, "expected enable_routing_replay true"),
    ],
)
def test_demo_refuses_a_config_it_cannot_read_back(config, match, tmp_path):
    from r3rdma.cli.demo import run_demo
    from r3rdma.config import R3Config
    from r3rdma.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        run_demo(config=R3Config.from_json(dict(config, local_store_dir=str(tmp_path / "r3"))))
    assert not (tmp_path / "r3").exists()


@pytest.mark.parametrize("keep", [False, True])
def test_demo_removes_its_temporary_root_unless_kept(tmp_path, keep, capsys, monkeypatch):
    """Issue 30: without --root the demo's $TMPDIR/r3rdma-demo-* is removed at the end, and the
    output says so; --keep keeps it and says where."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # $TMPDIR as this process's tempfile read it
    result, stdout = _demo(capsys, "--requests", "3", "--batch-size", "3", *(["--keep"] if keep else []))
    assert result["roundtrip_exact"] is True and result["root_kept"] is keep
    root = Path(result["root"])
    assert root.parent == tmp and root.name.startswith("r3rdma-demo-")
    left = [p.name for p in tmp.iterdir() if p.name.startswith("r3rdma-demo-")]
    if keep:
        assert left == [root.name] and (root / "demo-rollout-0" / "zarr.json").exists()
        assert f"{root} (temporary, kept" in stdout
    else:
        assert left == []
        assert f"{root} (temporary, removed; --keep keeps it)" in stdout
