"""Issue 19, item 2: the push secret never travels over HTTP. Readers hold a read token derived
from it (which can neither push nor delete), operators an admin token for DELETE."""

import asyncio
import hashlib
import hmac
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from aiohttp import ClientSession

from r3rdma import RoutingReader
from r3rdma.cli import main as cli_main
from r3rdma.errors import AuthenticationError, ConfigError
from r3rdma.store.retention import delete_older_than, delete_rollout
from r3rdma.transport import (
    TransportLimits,
    UcxxClient,
    configure_ucx_env,
    derive_admin_token,
    derive_read_token,
    load_token_file,
)
from r3rdma.write.push_client import StoreNodesClient

from .store_nodes import new_token, start_node

ROOT = Path(__file__).resolve().parents[1]


def test_derivation_is_the_documented_hmac():
    secret = new_token()
    read = derive_read_token(secret)
    assert read == hmac.new(secret.encode(), b"r3rdma read v1", hashlib.sha256).hexdigest()
    assert derive_admin_token(secret) == hmac.new(secret.encode(), b"r3rdma admin v1", hashlib.sha256).hexdigest()
    assert len(read) == 64 and read == read.lower() and all(c in "0123456789abcdef" for c in read)
    assert derive_read_token(secret.encode()) == read  # bytes and str secrets: the same key
    assert read != secret and read != derive_admin_token(secret) and read != derive_read_token(new_token())
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        derive_read_token("short")


def test_token_file_loading(tmp_path):
    f = tmp_path / "t"
    f.write_text("  abc123\n")
    assert load_token_file(f) == "abc123"
    f.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        load_token_file(f)
    f.write_bytes(b"ab\x00cd")
    with pytest.raises(ConfigError, match="printable ASCII"):
        load_token_file(f)
    with pytest.raises(ConfigError, match="cannot read the token file"):
        load_token_file(tmp_path / "absent")


def test_read_token_file_replaces_whatever_was_there_with_mode_600(tmp_path):
    from r3rdma.store.cli import write_read_token

    path = tmp_path / "secret.read"
    path.write_text("stale")
    path.chmod(0o644)
    assert write_read_token(str(path), "tok") == str(path)
    assert path.read_text() == "tok\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["secret.read"]  # no temporary file left
    with pytest.raises(ConfigError, match="cannot write the read token file"):
        write_read_token(str(tmp_path / "no" / "such" / "dir"), "tok")


async def _status(method: str, url: str, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with ClientSession() as session:
        async with session.request(method, url, headers=headers) as response:
            await response.read()
            return response.status


def status(method: str, url: str, token: str | None) -> int:
    return asyncio.run(_status(method, url, token))


@pytest.fixture
def node(tmp_path):
    n = start_node(tmp_path / "node", new_token())
    yield n
    n.stop(signal.SIGKILL)


@pytest.mark.timeout(180)
def test_each_token_does_only_its_job(node, tmp_path, make_record, capsys):
    secret, read, admin = node.token, node.read_token, node.admin_token
    # The node wrote the read token next to the secret file, mode 600, and named it when ready.
    assert node.read_token_file == node.root.parent / f".{node.root.name}.token.read"
    assert node.read_token_file.read_text() == read + "\n"
    assert stat.S_IMODE(node.read_token_file.stat().st_mode) == 0o600
    assert str(node.read_token_file) in node.log.read_text()  # and logged where

    recs = [make_record(f"r{i}", rows=25 + i) for i in range(3)]
    limits = TransportLimits(timeout_s=10)
    with StoreNodesClient([node.push_url], secret=secret, limits=limits) as client:
        client.commit(recs)
    ids = [r.request_id for r in recs]

    # Reads: the read token only. The push secret over HTTP is a 401 like any wrong token.
    with RoutingReader(node.http_url, token=secret) as reader, pytest.raises(AuthenticationError, match="HTTP 401"):
        reader.info("roll-0")
    with RoutingReader(node.http_url, token=admin) as reader, pytest.raises(AuthenticationError, match="HTTP 403"):
        reader.info("roll-0")
    with RoutingReader(node.http_url, token=read) as reader:
        got = reader.get_numpy("roll-0", ids)
    for r in recs:
        np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)
    base = node.http_url
    assert status("HEAD", f"{base}/zarr/roll-0/zarr.json", read) == 200
    assert status("HEAD", f"{base}/zarr/roll-0/zarr.json", secret) == 401
    assert status("GET", f"{base}/metrics", read) == 200
    assert status("GET", f"{base}/metrics", secret) == 401

    # The read token cannot push over UCX (it is not the secret): refused in the hello.
    with StoreNodesClient([node.push_url], secret=read, limits=limits) as client:
        with pytest.raises(AuthenticationError):
            client.commit([make_record("intruder")])
    configure_ucx_env()

    async def ucx_push() -> None:
        c = UcxxClient(node.host, node.ucx_port, secret=read, limits=limits)
        try:
            await c.push([make_record("intruder2")])
        finally:
            await c.close()

    with pytest.raises(AuthenticationError):
        asyncio.run(asyncio.wait_for(ucx_push(), 60))

    # Deletes: the admin token only; the read token is known (403) but not allowed.
    assert status("DELETE", f"{base}/v1/rollouts/roll-0", read) == 403
    assert status("DELETE", f"{base}/v1/rollouts/roll-0", secret) == 401
    assert status("DELETE", f"{base}/v1/rollouts?older_than_s=0", read) == 403
    with pytest.raises(AuthenticationError, match="HTTP 403"):
        delete_rollout([base], "roll-0", token=read)
    with pytest.raises(AuthenticationError, match="HTTP 401"):
        delete_older_than([base], 0, token=secret)
    with RoutingReader(node.http_url, token=read) as reader:
        assert sorted(reader.info("roll-0").request_ids) == sorted(ids)  # nothing was deleted or pushed

    # `r3rdma delete` given the push secret file derives the admin token and deletes.
    secret_file = tmp_path / "secret"
    secret_file.write_text(secret + "\n")
    assert cli_main(["delete", "--nodes", base, "--rollout", "roll-0", "--token-file", str(secret_file)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"deleted": {"roll-0": {base: True}}}
    # Given the read token file instead, it derives nonsense from it: refused, nothing deleted.
    with StoreNodesClient([node.push_url], secret=secret, limits=limits) as client:
        client.commit([make_record("again", rollout_id="roll-1")])
    assert cli_main(["delete", "--nodes", base, "--rollout", "roll-1", "--token-file", str(node.read_token_file)]) == 2
    err = capsys.readouterr().err
    # Issue 30: it says what the docs say (a read token is refused with 403) and which file deletes.
    assert err.startswith(f"r3rdma delete: AuthenticationError: {node.read_token_file} is a read token file")
    assert "HTTP 403" in err and "nothing was sent" in err and "push secret file" in err and "DIR/token" in err
    assert len(err.strip().splitlines()) == 1 and read not in err
    wrong = tmp_path / "wrong-secret"
    wrong.write_text(new_token() + "\n")  # a secret, but not the nodes': its admin token gets 401
    assert cli_main(["delete", "--nodes", base, "--rollout", "roll-1", "--token-file", str(wrong)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("r3rdma delete: AuthenticationError: ") and "HTTP 401" in err
    assert f"derived from {wrong} was refused" in err and "push secret file" in err
    with RoutingReader(node.http_url, token=read) as reader:
        assert reader.info("roll-1").request_ids == ("again",)
    assert delete_rollout([base], "roll-1", token=admin) == {base: True}

    node.stop()
    log = node.log.read_text()
    assert secret not in log and read not in log and admin not in log


@pytest.mark.timeout(180)
def test_check_reads_with_the_read_token_file_or_derives_it_from_the_secret(node, tmp_path, make_record, capsys,
                                                                            monkeypatch):
    recs = [make_record(f"c{i}", rows=10 + i) for i in range(4)]
    with StoreNodesClient([node.push_url], secret=node.token, limits=TransportLimits(timeout_s=10)) as client:
        client.commit(recs)
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    np.savez(shadow / "dp0.npz", **{r.request_id: r.ids_TLK.astype(np.int64) for r in recs})
    for var in ("R3_STORE_READ_TOKEN_FILE", "R3_STORE_TOKEN_FILE", "R3_STORE_TOKEN", "R3_STORE_HTTP_URLS"):
        monkeypatch.delenv(var, raising=False)
    common = ["check", "--http-urls", node.http_url, "--rollout-id", "roll-0", "--shadow-dir", str(shadow)]

    def check(*extra: str) -> int:
        code = cli_main([*common, *extra])
        out, err = capsys.readouterr()
        if code == 0:
            assert json.loads(out.strip().splitlines()[-1])["roundtrip_exact"] is True
        else:
            assert err.startswith("r3rdma check: AuthenticationError: ") and "HTTP 401" in err
        return code

    assert check("--read-token-file", str(node.read_token_file)) == 0
    secret_file = tmp_path / "secret"
    secret_file.write_text(node.token)
    assert check("--token-file", str(secret_file)) == 0  # derived here; the secret is not sent
    monkeypatch.setenv("R3_STORE_READ_TOKEN_FILE", str(node.read_token_file))  # as DIR/env sets it
    assert check() == 0
    wrong = tmp_path / "wrong"
    wrong.write_text(node.token)  # the push secret given as if it were the read token: refused
    assert check("--read-token-file", str(wrong)) == 2
    with pytest.raises(SystemExit):  # one or the other, not both
        cli_main([*common, "--read-token-file", str(node.read_token_file), "--token-file", str(secret_file)])


@pytest.mark.timeout(180)
def test_start_store_nodes_writes_the_read_token_file_into_its_env(tmp_path):
    env = dict(os.environ, R3_STORE_BIN=str(Path(sys.executable).parent / "r3rdma-store"))
    for var in ("R3_STORE_TOKEN_FILE", "R3_STORE_TOKEN"):
        env.pop(var, None)
    nodes = tmp_path / "nodes"
    proc = subprocess.run(["bash", "scripts/start_store_nodes.sh", "1", "--dir", str(nodes)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        exported = dict(line.removeprefix("export ").split("=", 1) for line in (nodes / "env").read_text().splitlines())
        secret_file, read_file = Path(exported["R3_STORE_TOKEN_FILE"]), Path(exported["R3_STORE_READ_TOKEN_FILE"])
        assert secret_file == nodes / "token" and read_file == nodes / "token.read"
        assert str(read_file) in proc.stdout
        read = derive_read_token(secret_file.read_bytes().rstrip(b"\r\n"))
        assert read_file.read_text() == read + "\n" and stat.S_IMODE(read_file.stat().st_mode) == 0o600
        url = exported["R3_STORE_HTTP_URLS"]
        assert status("GET", f"{url}/v1/rollouts", load_token_file(read_file)) == 200
        assert status("GET", f"{url}/v1/rollouts", secret_file.read_text().strip()) == 401
    finally:
        subprocess.run(["bash", "scripts/stop_store_nodes.sh", str(nodes)], cwd=ROOT, capture_output=True, timeout=120)


@pytest.mark.timeout(180)
def test_token_arguments_are_stripped_and_a_malformed_one_is_a_config_error(node, make_record):
    """Issue 30: ``token=open(path).read()`` keeps the file's newline; it is stripped. A token with
    whitespace or control characters inside is a ConfigError saying so (an R3Error, never the bare
    ValueError of the HTTP client), and never echoes the token."""
    with StoreNodesClient([node.push_url], secret=node.token, limits=TransportLimits(timeout_s=10)) as client:
        client.commit([make_record("n0", rows=9)])
    with open(node.read_token_file) as f:
        as_read = f.read()
    assert as_read.endswith("\n")
    with RoutingReader(node.http_url, token=as_read) as reader:
        assert reader.info("roll-0").request_ids == ("n0",)
    with RoutingReader([node.http_url], token=f"  {node.read_token}\r\n".encode()) as reader:
        assert reader.get_numpy("roll-0", ["n0"])["n0"].shape[0] == 9
    half = node.read_token[:32]
    for bad, says in ((f"{half} {half}", "' '"), (f"{half}\n{half}", "'\\n'"), (f"{half}\x00", "'\\x00'"),
                      (f"{half}\u00e9", "'\u00e9'"), ("\n", "empty")):
        with pytest.raises(ConfigError, match="the read token") as caught:
            RoutingReader(node.http_url, token=bad)
        assert says in str(caught.value) and half not in str(caught.value)
    with pytest.raises(ConfigError, match="the admin token .* holds characters"):
        delete_rollout([node.http_url], "roll-0", token="a b")
    assert delete_rollout([node.http_url], "roll-0", token=node.admin_token + "\n") == {node.http_url: True}
