"""The main job, as scripts/demo.sh runs it."""

import json
import subprocess
import sys


def test_demo_roundtrip_exact(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "r3rdma", "demo", "--root", str(tmp_path / "store"), "--requests", "10"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["roundtrip_exact"] is True
    assert result["requests"] == 10 and result["tokens"] > 10 and result["stored_bytes"] > 0
