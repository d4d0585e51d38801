"""`r3rdma inspect`: summary and expert-load heatmap of a rollout, local root and store node URL."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from r3rdma import LocalRoutingStore
from r3rdma.cli import main as cli_main
from r3rdma.cli.inspect import inspect_rollout
from r3rdma.errors import AuthenticationError, TransportError
from r3rdma.write.push_client import StoreNodesClient

from r3rdma.transport import derive_read_token

from .store_nodes import new_token, start_node

ROOT = Path(__file__).resolve().parents[1]


def _expected_load(records, layers, experts):
    load = np.zeros((layers, experts), dtype=np.int64)
    for r in records:
        for layer in range(layers):
            load[layer] += np.bincount(r.ids_TLK[:, layer].reshape(-1).astype(np.int64), minlength=experts)
    return load


def test_inspect_local_root_summary_and_png(tmp_path, make_record, capsys):
    records = [make_record(f"q{i}", rows=10 + 7 * i, layers=3, k=2, num_experts=16) for i in range(6)]
    with LocalRoutingStore(tmp_path / "root") as store:
        store.commit(records[:3])
        store.commit(records[3:])  # two batch arrays
    summary, load = inspect_rollout(str(tmp_path / "root"), "roll-0")
    assert summary.requests == 6
    assert summary.tokens == sum(r.num_rows for r in records)
    assert (summary.num_layers, summary.top_k, summary.num_experts, summary.dtype) == (3, 2, 16, "uint8")
    assert (summary.rows_min, summary.rows_max) == (10, 45)
    assert summary.raw_uint8_bytes == summary.tokens * 3 * 2 and summary.raw_int32_bytes == 4 * summary.raw_uint8_bytes
    assert summary.stored_bytes > 0
    np.testing.assert_array_equal(load, _expected_load(records, 3, 16))
    assert load.sum() == summary.tokens * 3 * 2

    png = tmp_path / "load.png"
    assert cli_main(["inspect", str(tmp_path / "root"), "roll-0", "--png", str(png)]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["requests"] == 6 and last["png"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_unknown_rollout_is_a_key_error(tmp_path, make_record):
    with LocalRoutingStore(tmp_path / "root") as store:
        store.commit([make_record("a")])
    with pytest.raises(KeyError):
        inspect_rollout(str(tmp_path / "root"), "nope")


def test_inspect_store_node_url_with_token(tmp_path, make_record, capsys):
    token = new_token()
    node = start_node(tmp_path / "node", token)
    try:
        records = [make_record(f"r{i}", rows=30, layers=2, k=4, num_experts=32) for i in range(4)]
        with StoreNodesClient([node.push_url], secret=token) as client:
            client.commit(records)
        summary, load = inspect_rollout(node.http_url, "roll-0", token=node.read_token)
        assert summary.requests == 4 and summary.tokens == 120
        np.testing.assert_array_equal(load, _expected_load(records, 2, 32))
        with pytest.raises(AuthenticationError, match="HTTP 401"):  # the push secret is no HTTP token
            inspect_rollout(node.http_url, "roll-0", token=token)
        # The read token file the node wrote, and (compatibility) the push secret file, from
        # which the command derives the read token and sends only that.
        assert cli_main(["inspect", node.http_url, "roll-0", "--read-token-file", str(node.read_token_file)]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == 120
        token_file = tmp_path / "tok"
        token_file.write_text(token + "\n")
        assert cli_main(["inspect", node.http_url, "roll-0", "--token-file", str(token_file)]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == 120
    finally:
        node.stop(signal.SIGKILL)


@pytest.mark.timeout(120)
def test_inspect_wrong_token_and_refused_connection_exit_with_one_line(tmp_path, make_record, capsys):
    """A refused token and a node that is not there: the library raises AuthenticationError /
    TransportError; the command prints one line naming the error type (never the token) and
    exits 2, no traceback."""
    token, wrong = new_token(), new_token()
    node = start_node(tmp_path / "node", token)
    try:
        with StoreNodesClient([node.push_url], secret=token) as client:
            client.commit([make_record("a", rows=12)])
        with pytest.raises(AuthenticationError, match="HTTP 401"):
            inspect_rollout(node.http_url, "roll-0", token=wrong)
        token_file = tmp_path / "wrong"
        token_file.write_text(wrong + "\n")
        capsys.readouterr()
        assert cli_main(["inspect", node.http_url, "roll-0", "--token-file", str(token_file)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1
        assert err.startswith("r3rdma inspect: AuthenticationError: ") and node.http_url in err
        assert wrong not in err and token not in err and "Traceback" not in err
        assert derive_read_token(wrong) not in err and node.read_token not in err
    finally:
        node.stop(signal.SIGKILL)

    with socket.socket() as bound:  # bound, not listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        with pytest.raises(TransportError):
            inspect_rollout(url, "roll-0", token=token)
        assert cli_main(["inspect", url, "roll-0", "--token-file", str(token_file)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("r3rdma inspect: TransportError: ") and url in err and "Traceback" not in err


def test_inspect_missing_token_file_is_one_line(tmp_path, capsys):
    assert cli_main(["inspect", str(tmp_path), "roll-0", "--token-file", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("r3rdma inspect: ConfigError: cannot read the secret file") and len(err.strip().splitlines()) == 1


def test_png_without_matplotlib_prints_the_summary_then_names_the_extra(tmp_path, make_record, capsys, monkeypatch):
    """Issue 30: no matplotlib -> the JSON summary first, then one line naming the plot extra, exit 2."""
    with LocalRoutingStore(tmp_path / "root") as store:
        store.commit([make_record(f"q{i}", rows=12) for i in range(3)])
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    png = tmp_path / "load.png"
    assert cli_main(["inspect", str(tmp_path / "root"), "roll-0", "--png", str(png)]) == 2
    out, err = capsys.readouterr()
    last = json.loads(out.strip().splitlines()[-1])
    assert last["requests"] == 3 and "png" not in last
    assert err.strip() == 'r3rdma inspect: ConfigError: --png needs matplotlib, which is not installed: ' \
                          'pip install "r3rdma[plot]"'
    assert not png.exists()


@pytest.mark.timeout(120)
def test_output_into_a_closed_pipe_ends_quietly(tmp_path, make_record):
    """Issue 30: `r3rdma inspect ... | head` -> no BrokenPipeError traceback. The pipe's read end is
    closed before the command starts, so its first write fails (no race with the reader)."""
    with LocalRoutingStore(tmp_path / "root") as store:
        store.commit([make_record(f"q{i}", rows=12) for i in range(3)])
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "r3rdma.cli", "inspect", str(tmp_path / "root"), "roll-0"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=100, cwd=ROOT)
    finally:
        os.close(write_end)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.fixture
def replicated_with_one_dead(tmp_path, make_record):
    """Three store nodes, every request on two of them (replicas=2), then one node SIGKILLed:
    (records, every node's URL, the dead one's URL, the read token file)."""
    from concurrent.futures import ThreadPoolExecutor

    from r3rdma.transport import TransportLimits

    token = new_token()
    with ThreadPoolExecutor(3) as pool:
        nodes = list(pool.map(lambda i: start_node(tmp_path / f"node{i}", token), range(3)))
    try:
        records = [make_record(f"q{i}", rows=8 + i, layers=2, k=2, num_experts=16) for i in range(12)]
        with StoreNodesClient([n.push_url for n in nodes], secret=token, replicas=2,
                              limits=TransportLimits(timeout_s=10)) as client:
            client.commit(records)
        nodes[0].kill()
        token_file = tmp_path / "read-token"
        token_file.write_text(nodes[1].read_token + "\n")
        yield records, [n.http_url for n in nodes], nodes[0].http_url, token_file
    finally:
        for node in nodes:
            node.kill()


@pytest.mark.timeout(180)
def test_inspect_with_a_replica_node_dead_reads_the_live_ones(replicated_with_one_dead):
    """Issue: with one of the nodes dead, `r3rdma inspect URLS ROLLOUT` exited 2 ("cannot size every
    source", printed twice) although every request was on a live replica. Now it summarises the
    rollout from the live nodes and names the dead one once."""
    records, urls, dead, token_file = replicated_with_one_dead
    proc = subprocess.run([sys.executable, "-m", "r3rdma", "inspect", ",".join(urls), "roll-0",
                           "--read-token-file", str(token_file)],
                          capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["requests"] == 12 and last["tokens"] == sum(r.num_rows for r in records)
    assert last["stored_bytes"] > 0 and list(last["unreachable"]) == [dead]
    named = [line for line in proc.stderr.splitlines() if dead in line]
    assert len(named) == 1 and "could not be reached" in named[0], proc.stderr
    assert "Traceback" not in proc.stderr and "cannot size" not in proc.stderr


@pytest.mark.timeout(180)
def test_check_with_a_replica_node_dead_reports_the_nodes_read_and_their_bytes(replicated_with_one_dead, tmp_path):
    """Issue: `r3rdma check` in the same state exited 0 saying "from 3 store nodes" with
    "stored_bytes": 0. Now it counts the nodes it read from and sizes their data."""
    records, urls, dead, token_file = replicated_with_one_dead
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    np.savez(shadow / "dp0.npz", **{r.request_id: r.ids_TLK.astype(np.int64) for r in records})
    proc = subprocess.run([sys.executable, "-m", "r3rdma", "check", "--http-urls", ",".join(urls),
                           "--read-token-file", str(token_file), "--rollout-id", "roll-0", "--shadow-dir", str(shadow)],
                          capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["roundtrip_exact"] is True and last["requests"] == 12
    assert last["store_nodes"] == 2 and last["unreachable_nodes"] == [dead]
    # Each request is stored twice, on the two live nodes or on one of them and the dead one.
    assert last["stored_bytes"] > sum(r.ids_TLK.nbytes for r in records) // 2
    assert "from 2 of 3 store nodes" in proc.stdout
    assert len([line for line in proc.stderr.splitlines() if dead in line]) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
