"""A new user's first mistakes (issue 31, items 7-10): each is one line saying what is wrong and
what to do, exit 2 from the commands, a typed R3Error from the library; never a traceback, a bare
ValueError, or an error about something else (an "unknown rollout" for a typo in a URL)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from r3rdma import R3Config, RoutingReader
from r3rdma.errors import AuthenticationError, ConfigError
from r3rdma.integrations.builders import build_writer
from r3rdma.transport import TransportLimits
from r3rdma.write.push_client import StoreNodesClient

from .store_nodes import new_token, start_node

ROOT = Path(__file__).resolve().parents[1]
# The store tokens a shell may have exported: the commands below must not find any.
TOKEN_VARS = ("R3_STORE_TOKEN", "R3_STORE_TOKEN_FILE", "R3_STORE_READ_TOKEN_FILE")


def r3rdma(*argv: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the ``r3rdma`` command as a user does (a fresh process), without store tokens set."""
    env = {k: v for k, v in (env or os.environ).items() if k not in TOKEN_VARS}
    return subprocess.run([sys.executable, "-m", "r3rdma", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def one_line(proc: subprocess.CompletedProcess, command: str) -> str:
    """The single stderr line of a failed command (exit 2), without a traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"r3rdma {command}: "), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two store nodes holding rollout roll-0 (6 requests spread over both, one copy each)."""
    from r3rdma.records import RequestRecord

    tmp = tmp_path_factory.mktemp("nodes")
    token = new_token()
    nodes = [start_node(tmp / f"node{i}", token) for i in range(2)]
    rng = np.random.default_rng(0)
    records = [RequestRecord("roll-0", f"q{i}", rng.integers(0, 16, (6 + i, 2, 2), dtype=np.uint8), (0, 1), 16)
               for i in range(6)]
    try:
        with StoreNodesClient([n.push_url for n in nodes], secret=token, replicas=1,
                              limits=TransportLimits(timeout_s=10)) as client:
            client.commit(records)
        yield nodes, records
    finally:
        for node in nodes:
            node.kill()


# -- item 8: the comma form of several URLs ---------------------------------------------------


@pytest.mark.timeout(120)
def test_reader_takes_urls_in_one_comma_separated_string(two_nodes):
    """`RoutingReader("http://a:1,http://b:2")` (as $R3_STORE_HTTP_URLS and the commands hold
    them) raised a bare `ValueError: invalid port number`; it is several sources."""
    nodes, records = two_nodes
    urls = ",".join(n.http_url for n in nodes)
    with RoutingReader(urls, token=nodes[0].read_token) as reader:
        assert reader.source_names == tuple(n.http_url for n in nodes)
        got = reader.get_numpy("roll-0", [r.request_id for r in records])
    for r in records:
        np.testing.assert_array_equal(got[r.request_id], r.ids_TLK)
    with RoutingReader(urls + ",", token=nodes[0].read_token) as reader:  # a trailing comma is no source
        assert len(reader.source_names) == 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("url, says", [
    ("http://127.0.0.1:99999", "Port out of range"),
    ("http://:8337", "names no host"),
    ("http://127.0.0.1:8337 ", "whitespace"),
    ("http://127.0.0.1:8337,http://127.0.0.1:x", "not a valid URL"),
])
def test_a_bad_url_is_a_config_error_naming_it(url, says):
    with pytest.raises(ConfigError, match=says) as caught:
        RoutingReader(url)
    bad = url.split(",")[-1].strip() if "," in url else url
    assert repr(bad) in str(caught.value)


# -- item 9: what is wrong with a source -------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_missing_directory_is_no_unknown_rollout(tmp_path):
    with pytest.raises(ConfigError, match="no such directory: '/missing'"):
        RoutingReader("/missing")
    with pytest.raises(ConfigError, match="not a directory"):
        (tmp_path / "file").write_text("x")
        RoutingReader(tmp_path / "file")
    with pytest.raises(ConfigError, match="scheme 'ucx'"):
        RoutingReader("ucx://127.0.0.1:13337")


@pytest.mark.timeout(30)
def test_host_port_without_http_asks_whether_a_url_was_meant():
    with pytest.raises(ConfigError, match=r"not a URL.*did you mean http://127\.0\.0\.1:8337\?"):
        RoutingReader("127.0.0.1:8337")
    # The engines' push addresses (R3_STORE_URLS) given to a reader: each one is named.
    with pytest.raises(ConfigError, match=r"did you mean http://store0:13337\?.*R3_STORE_URLS"):
        RoutingReader("store0:13337,store1:13337")


@pytest.mark.timeout(120)
def test_inspect_of_a_url_without_http_and_of_a_missing_directory_say_so(tmp_path):
    line = one_line(r3rdma("inspect", "127.0.0.1:8337", "roll-0"), "inspect")
    assert line.startswith("r3rdma inspect: ConfigError: ") and "did you mean http://127.0.0.1:8337?" in line
    line = one_line(r3rdma("inspect", str(tmp_path / "missing"), "roll-0"), "inspect")
    assert "ConfigError: no such directory" in line and "UnknownRollout" not in line


# -- item 10: tokens -----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_read_without_a_token_says_none_was_sent(two_nodes):
    nodes, _ = two_nodes
    with pytest.raises(AuthenticationError, match="no token was sent") as caught:
        RoutingReader(nodes[0].http_url).info("roll-0")
    assert "refused the token" not in str(caught.value) and "token=" in str(caught.value)
    with pytest.raises(AuthenticationError, match="refused the token"):  # a wrong one still says that
        RoutingReader(nodes[0].http_url, token="0" * 64).info("roll-0")
    line = one_line(r3rdma("inspect", nodes[0].http_url, "roll-0"), "inspect")
    assert "AuthenticationError" in line and "no token was sent" in line and "--read-token-file" in line


@pytest.mark.timeout(60)
def test_a_push_without_a_secret_names_the_token_file_variable(monkeypatch):
    for name in TOKEN_VARS:
        monkeypatch.delenv(name, raising=False)
    config = R3Config.from_json('{"routing_store_type": "store_nodes", "store_urls": "127.0.0.1:13337"}')
    with pytest.raises(ConfigError, match=r"set R3_STORE_TOKEN_FILE .*\(or R3_STORE_TOKEN") as caught:
        build_writer(config)
    assert "$R3_STORE_TOKEN " not in str(caught.value)


# -- item 7: one line and exit 2, not a traceback ------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("config, says", [
    ('{"bogus":1}', "unknown routing replay config keys ['bogus']"),
    ('{"routing_store_type":"store_nodes"}', "expected routing_store_type 'local', got 'store_nodes'"),
])
def test_demo_with_a_config_it_cannot_use(config, says):
    line = one_line(r3rdma("demo", "--routing-replay-config", config), "demo")
    assert line.startswith("r3rdma demo: ConfigError: ") and says in line


@pytest.mark.timeout(240)
def test_rollout_outside_torchrun():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    line = one_line(r3rdma("rollout", env=env), "rollout")
    assert "ConfigError" in line and "RANK is not set" in line and "scripts/launch_rollout.sh" in line


@pytest.mark.timeout(240)
def test_verify_of_a_dense_model_says_it_is_not_a_moe_model(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "dense")
    line = one_line(r3rdma("verify", "--model", str(tmp_path / "dense")), "verify")
    assert line.startswith("r3rdma verify: ConfigError: ") and "not a Mixture-of-Experts model" in line
    assert "ShapeMismatch" not in line and "TopKRouter" not in line


# -- item 13: scripts and help text --------------------------------------------------------


def test_train_tiny_help_shows_where_the_checkpoint_goes():
    proc = r3rdma("train-tiny", "--help", timeout=60, env=dict(os.environ, COLUMNS="200"))  # no line wrapping
    assert proc.returncode == 0
    [out] = [line for line in proc.stdout.splitlines() if line.strip().startswith("--out")]
    assert "(default: train-tiny-out, in the current directory)" in out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_script_removes_its_temporary_directory(tmp_path):
    """scripts/demo.sh left a $TMPDIR/r3rdma-demo-* (store roots, logs, tokens) behind each run."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in (*TOKEN_VARS, "R3_DEMO_DIR", "R3_STORE_URLS",
                                                             "R3_STORE_HTTP_URLS")}
    proc = subprocess.run(["bash", str(ROOT / "scripts/demo.sh")], capture_output=True, text=True, timeout=580,
                          cwd=ROOT, env=dict(env, TMPDIR=str(tmp)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["roundtrip_exact"] is True
    assert "removed at exit" in proc.stdout
    assert not list(tmp.glob("r3rdma-demo-*")), list(tmp.iterdir())
