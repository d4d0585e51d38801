"""The distributed main job on CPU: 2 store nodes, a 2-rank gloo torchrun rollout with TP
all-gather, then a trainer reading remotely over HTTP, bit-exact against shadow records."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, env, timeout=300):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_torchrun_tp2_rollout_to_two_store_nodes_then_remote_check(tmp_path):
    env = dict(os.environ, R3_STORE_BIN=str(Path(sys.executable).parent / "r3rdma-store"))
    nodes = tmp_path / "nodes"
    run(["bash", "scripts/start_store_nodes.sh", "2", "--dir", str(nodes)], env)
    try:
        for line in (nodes / "env").read_text().splitlines():
            key, value = line.removeprefix("export ").split("=", 1)
            env[key] = value
        out = run(["bash", "scripts/launch_rollout.sh", "--nproc-per-node", "2", "--",
                   "--rollout-id", "dist", "--requests", "10", "--batch-size", "4", "--shadow-dir", str(tmp_path / "shadow")], env)
        ranks = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
        assert len(ranks) == 2 and {r["backend"] for r in ranks} == {"gloo"}
        assert all(r["pushed_total"] == 10 for r in ranks)
        assert sum(r["pushed_by_rank"] for r in ranks) == 10 and all(r["pushed_by_rank"] > 0 for r in ranks)
        # one all-gather per step, not one per layer
        assert all(r["all_gathers"] == r["steps"] > 0 for r in ranks)
        # The trainer holds only the read token file (DIR/env names it), never the push secret.
        trainer_env = {k: v for k, v in env.items() if k not in ("R3_STORE_TOKEN_FILE", "R3_STORE_TOKEN")}
        assert Path(trainer_env["R3_STORE_READ_TOKEN_FILE"]).is_file()
        out = run([sys.executable, "-m", "r3rdma", "check", "--rollout-id", "dist", "--shadow-dir", str(tmp_path / "shadow")],
                  trainer_env)
        result = json.loads(out.strip().splitlines()[-1])
        assert result["roundtrip_exact"] is True and result["requests"] == 10 and result["store_nodes"] == 2
        stored = [sum(1 for _ in (nodes / f"node{i}" / "dist").glob("b*")) for i in range(2)]
        assert all(n > 0 for n in stored), f"requests did not spread over both nodes: {stored}"
    finally:
        subprocess.run(["bash", "scripts/stop_store_nodes.sh", str(nodes)], cwd=ROOT, capture_output=True, timeout=120)
