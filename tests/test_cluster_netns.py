"""The documented cluster recipe across "machines": Linux network namespaces joined by a bridge.

Four hosts, each its own network namespace with one veth interface (``eth0``) on a bridge that
lives in a fifth ("switch") namespace, subnet 10.77.0.0/24; loopback reaches no other host:

- ``ro0`` 10.77.0.1, ``ro1`` 10.77.0.2: ``scripts/launch_rollout.sh --nnodes 2 --node-rank R
  --master-addr 10.77.0.1 --nproc-per-node 1``, so one TP group of 2 ranks across the two hosts
  (gloo on CPU), pushing over UCX (TCP) to the store host;
- ``st`` 10.77.0.3: ``scripts/start_store_nodes.sh N --host 0.0.0.0 --advertise-host 10.77.0.3``;
- ``tr`` 10.77.0.4: the trainer, ``r3rdma check`` over HTTP with the read token only,
  bit-exact against the shadow records (the shadow dir stands for a shared filesystem).

The second test kills a store node (SIGKILL) mid-rollout under the default replicas=2 with 3
nodes: when the first batch is committed on some node (its rollout index on disk lists a
request: an event, polled with a deadline), every rollout worker is frozen (SIGSTOP), that
node is killed, and the workers resume (SIGCONT). Everything pushed after that point fails
over; every request must still read bit-exactly, and the killed node must hold only part of the
rollout (so the kill really fell inside it).

Processes in the namespaces get ``UCX_TLS=tcp``: the namespaces share one kernel, so UCX would
otherwise reach the store over shared memory, which real separate machines cannot. Needs root
and ``ip netns``; the namespaces and every process in them are removed at the end, also on
failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
SUBNET = "10.77.0"
HOSTS = {"ro0": 1, "ro1": 2, "st": 3, "tr": 4}  # host -> last octet
MASTER_PORT = 29517

pytestmark = pytest.mark.slow


def _sh(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
    return proc


def _netns_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root for ip netns"
    probe = f"r3probe{os.getpid()}"
    try:
        proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        return "iproute2 (ip) is not installed"
    if proc.returncode != 0:
        return f"ip netns add failed: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


class Cluster:
    """Namespaces ``<host><tag>`` on a bridge in ``sw<tag>``; ``addr(host)`` is the host's IP."""

    def __init__(self) -> None:
        self.tag = f"r3{os.getpid() % 100000}"
        self.switch = f"sw{self.tag}"
        self.ns = {h: f"{h}{self.tag}" for h in HOSTS}

    def addr(self, host: str) -> str:
        return f"{SUBNET}.{HOSTS[host]}"

    def __enter__(self) -> "Cluster":
        try:
            _sh("ip", "netns", "add", self.switch)
            _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i, (host, ns) in enumerate(self.ns.items()):
                host_end, switch_end = f"h{i}{self.tag}", f"s{i}{self.tag}"  # <= 15 characters
                _sh("ip", "netns", "add", ns)
                _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", switch_end)
                _sh("ip", "link", "set", host_end, "netns", ns)
                _sh("ip", "link", "set", switch_end, "netns", self.switch)
                _sh("ip", "-n", self.switch, "link", "set", switch_end, "master", "br0")
                _sh("ip", "-n", self.switch, "link", "set", switch_end, "up")
                _sh("ip", "-n", ns, "link", "set", host_end, "name", "eth0")
                _sh("ip", "-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
                _sh("ip", "-n", ns, "link", "set", "eth0", "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for ns in [*self.ns.values(), self.switch]:
            pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _sh("ip", "netns", "del", ns, check=False)  # veth pairs go with their namespace

    def cmd(self, host: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host], *argv]


def _host_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("R3_", "UCX_", "GLOO_", "MASTER_"))}
    env.update(R3_STORE_BIN=str(VENV_BIN / "r3rdma-store"), UCX_TLS="tcp", PATH=f"{VENV_BIN}:{env.get('PATH', '')}")
    env.update(extra)
    return env


def _read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        key, value = line.removeprefix("export ").split("=", 1)
        out[key] = value
    return out


def _start_store(cluster: Cluster, nodes: Path, n: int) -> dict[str, str]:
    proc = subprocess.run(
        cluster.cmd("st", "bash", "scripts/start_store_nodes.sh", str(n), "--dir", str(nodes), "--host", "0.0.0.0",
                    "--advertise-host", cluster.addr("st")),
        env=_host_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"start_store_nodes.sh failed:\n{proc.stdout}\n{proc.stderr}"
    env = _read_env_file(nodes / "env")
    st = cluster.addr("st")
    assert all(u.split(":")[0] == st for u in env["R3_STORE_URLS"].split(",")), env
    assert all(u.startswith(f"http://{st}:") for u in env["R3_STORE_HTTP_URLS"].split(",")), env
    return env


def _stop_store(nodes: Path) -> None:
    subprocess.run(["bash", "scripts/stop_store_nodes.sh", str(nodes)], cwd=ROOT, capture_output=True, timeout=120)


def _launch_rollout(cluster: Cluster, store_env: dict[str, str], rollout_id: str, requests: int, shadow: Path,
                    logs: Path) -> list[tuple[subprocess.Popen, Path]]:
    """Both rollout hosts' launchers, as the docs give them; the engine side gets the push secret only."""
    env = _host_env(R3_STORE_URLS=store_env["R3_STORE_URLS"], R3_STORE_TOKEN_FILE=store_env["R3_STORE_TOKEN_FILE"])
    procs = []
    for rank in range(2):
        out = logs / f"rollout{rank}.log"
        with open(out, "w") as f:
            procs.append((subprocess.Popen(
                cluster.cmd(f"ro{rank}", "bash", "scripts/launch_rollout.sh", "--nnodes", "2", "--node-rank", str(rank),
                            "--master-addr", cluster.addr("ro0"), "--master-port", str(MASTER_PORT),
                            "--nproc-per-node", "1", "--",
                            "--rollout-id", rollout_id, "--requests", str(requests), "--batch-size", "4",
                            "--shadow-dir", str(shadow)),
                env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True), out))
    return procs


def _wait_rollout(procs, timeout: float = 270) -> list[dict]:
    deadline = time.monotonic() + timeout
    summaries = []
    for proc, out in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        log = out.read_text()
        assert proc.returncode == 0, f"rollout on {out.name} failed ({proc.returncode}):\n{log[-6000:]}"
        summaries += [json.loads(line) for line in log.splitlines() if line.startswith('{"rank"')]
    return summaries


def _kill_tree(procs) -> None:
    for proc, _ in procs:
        if proc.poll() is None:
            for pid in [*_descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=30)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _check(cluster: Cluster, store_env: dict[str, str], rollout_id: str, shadow: Path) -> dict:
    """The trainer host: HTTP URLs and the read token file only, never the push secret."""
    env = _host_env(R3_STORE_HTTP_URLS=store_env["R3_STORE_HTTP_URLS"],
                    R3_STORE_READ_TOKEN_FILE=store_env["R3_STORE_READ_TOKEN_FILE"])
    proc = subprocess.run(cluster.cmd("tr", sys.executable, "-m", "r3rdma", "check", "--rollout-id", rollout_id,
                                      "--shadow-dir", str(shadow)),
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"r3rdma check failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


_READ_ALL = """
import glob, json, os, sys
import numpy as np
from r3rdma import RoutingReader
rid, shadow_dir = sys.argv[1], sys.argv[2]
shadow = {}
for path in sorted(glob.glob(os.path.join(shadow_dir, "dp*.npz"))):
    with np.load(path) as data:
        shadow.update({k: data[k] for k in data.files})
token = open(os.environ["R3_STORE_READ_TOKEN_FILE"]).read().strip()
with RoutingReader(os.environ["R3_STORE_HTTP_URLS"].split(","), token=token) as reader:
    got = reader.get_numpy(rid, sorted(shadow))
    skipped = sorted(reader.last_skipped_nodes)
exact = bool(shadow) and all(np.array_equal(got[k].astype(np.int64), v) for k, v in shadow.items())
print(json.dumps({"requests": len(shadow), "exact": exact, "skipped": skipped}))
"""


def _read_all(cluster: Cluster, store_env: dict[str, str], rollout_id: str, shadow: Path) -> dict:
    """The trainer host reading every request with RoutingReader over every URL given."""
    env = _host_env(R3_STORE_HTTP_URLS=store_env["R3_STORE_HTTP_URLS"],
                    R3_STORE_READ_TOKEN_FILE=store_env["R3_STORE_READ_TOKEN_FILE"])
    proc = subprocess.run(cluster.cmd("tr", sys.executable, "-c", _READ_ALL, rollout_id, str(shadow)),
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"reading failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _index_requests(node_root: Path, rollout_id: str) -> set[str]:
    """Requests the node has committed (its rollout index on disk; written before the ack)."""
    from r3rdma.errors import R3Error
    from r3rdma.store.rollout_index import load_index, read_file

    try:
        index = load_index(rollout_id, read_file(node_root / rollout_id), str(node_root))
    except (OSError, R3Error):  # a part being replaced right now: look again
        return set()
    return set(index.requests) if index is not None else set()


@pytest.fixture
def cluster():
    reason = _netns_usable()
    if reason:
        pytest.skip(reason)
    with Cluster() as c:
        yield c


@pytest.mark.timeout(540)
def test_cluster_recipe_two_rollout_hosts_store_host_trainer_host(cluster, tmp_path):
    nodes, shadow, rid, n = tmp_path / "nodes", tmp_path / "shadow", "netns-rollout", 10
    procs = []
    try:
        store_env = _start_store(cluster, nodes, 2)
        procs = _launch_rollout(cluster, store_env, rid, n, shadow, tmp_path)
        ranks = _wait_rollout(procs)
        assert len(ranks) == 2 and {r["backend"] for r in ranks} == {"gloo"}
        assert {r["world"] for r in ranks} == {2} and {r["tp"] for r in ranks} == {2}
        assert all(r["pushed_total"] == n for r in ranks) and all(r["pushed_by_rank"] > 0 for r in ranks)
        assert all(r["all_gathers"] == r["steps"] > 0 for r in ranks)
        result = _check(cluster, store_env, rid, shadow)
        assert result["roundtrip_exact"] is True and result["requests"] == n and result["store_nodes"] == 2
        # replicas=2 over 2 nodes: both hold every request
        assert all(len(_index_requests(nodes / f"node{i}", rid)) == n for i in range(2))
    finally:
        _kill_tree(procs)
        _stop_store(nodes)


@pytest.mark.timeout(540)
def test_cluster_store_node_killed_mid_rollout_replicas_keep_every_request(cluster, tmp_path):
    nodes, shadow, rid, n = tmp_path / "nodes", tmp_path / "shadow", "netns-kill", 24
    procs = []
    try:
        store_env = _start_store(cluster, nodes, 3)
        procs = _launch_rollout(cluster, store_env, rid, n, shadow, tmp_path)
        # Event: the first batch committed on some node (its index on disk lists a request).
        deadline, victim = time.monotonic() + 180, None
        while victim is None:
            for i in range(3):
                if _index_requests(nodes / f"node{i}", rid):
                    victim = i
                    break
            else:
                assert all(p.poll() is None for p, _ in procs), "rollout ended before any commit"
                assert time.monotonic() < deadline, "no batch committed within 180 s"
                time.sleep(0.02)
        workers = [pid for proc, _ in procs for pid in [proc.pid, *_descendants(proc.pid)]]
        for pid in workers:  # freeze the rollout so the kill falls inside it
            os.kill(pid, signal.SIGSTOP)
        try:
            os.kill(int((nodes / f"node{victim}.pid").read_text()), signal.SIGKILL)
        finally:
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        ranks = _wait_rollout(procs)
        assert len(ranks) == 2 and all(r["pushed_total"] == n for r in ranks)
        held_by_victim = _index_requests(nodes / f"node{victim}", rid)
        assert 0 < len(held_by_victim) < n, f"the killed node holds {len(held_by_victim)} of {n}: not mid-rollout"
        # The trainer, given all 3 URLs (the dead node's too, as DIR/env has them), reads every
        # request from the survivors, bit-exact against the shadow records.
        urls = store_env["R3_STORE_HTTP_URLS"].split(",")
        dead_url = urls[victim]
        read = _read_all(cluster, store_env, rid, shadow)
        assert read == {"requests": n, "exact": True, "skipped": [dead_url]}, read
        # `r3rdma check` with every URL exits 2: after reading, it sizes every source
        # (RoutingReader.stored_bytes), which refuses an unreachable node. With the live nodes'
        # URLs it passes.
        live = dict(store_env, R3_STORE_HTTP_URLS=",".join(u for u in urls if u != dead_url))
        result = _check(cluster, live, rid, shadow)
        assert result["roundtrip_exact"] is True and result["requests"] == n and result["store_nodes"] == 2
        survivors = [_index_requests(nodes / f"node{i}", rid) for i in range(3) if i != victim]
        # Acknowledged after the kill: on both survivors; before it: on the victim and one survivor.
        for r in set().union(*survivors) | held_by_victim:
            assert sum(r in s for s in [*survivors, held_by_victim]) >= 2, r
    finally:
        _kill_tree(procs)
        _stop_store(nodes)


def test_start_store_nodes_refuses_to_advertise_a_wildcard(tmp_path):
    """`--advertise-host 0.0.0.0` (or a --host 0.0.0.0 whose hostname is loopback) would put an
    address into DIR/env that no other machine can connect to: refused before anything starts."""
    proc = subprocess.run(["bash", "scripts/start_store_nodes.sh", "1", "--dir", str(tmp_path / "n"), "--host", "0.0.0.0",
                           "--advertise-host", "0.0.0.0"], env=_host_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "wildcard" in proc.stderr, proc.stderr
    assert not (tmp_path / "n").exists()
