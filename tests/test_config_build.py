"""The pipeline an R3Config names (r3rdma.integrations.builders): capturer -> writer -> store, closed by
what built it."""

import json
import signal

import numpy as np
import pytest
import torch
import zarr

from r3rdma import AuthenticationError, LocalRoutingStore, R3Config, RoutingCapturer, RoutingReader, RoutingWriter, StoreNodesClient
from r3rdma.capture.transfer import DeviceRows
from r3rdma.errors import ConfigError, DuplicateRequestError, ShapeMismatchError, StoreError
from r3rdma.integrations.builders import build_capturer, build_writer
from r3rdma.write.writer import DeviceRecordStore

from .store_nodes import new_token, start_node

LAYERS, TOP_K, EXPERTS = (0, 2, 3), 2, 16
GEOMETRY = dict(layer_map=LAYERS, top_k=TOP_K, num_experts=EXPERTS)


def fastdeploy_json(root, **extra) -> str:
    return json.dumps({"enable_routing_replay": True, "routing_store_type": "local", "local_store_dir": str(root), **extra})


def topk(request_id, start, count, layer):
    """Deterministic ids of (request, position, layer), [count, TOP_K]."""
    rng = np.random.default_rng([sum(map(ord, request_id)), start, count, layer])
    return rng.integers(0, EXPERTS, size=(count, TOP_K))


def truth(request_id, rows):
    """Rows 0..rows-1 of a request computed in one prefill (see ``prefill``)."""
    return np.stack([topk(request_id, 0, rows, layer) for layer in LAYERS], axis=1).astype(np.uint8)


def prefill(cap, request_id, rows, slots):
    cap.begin_step([request_id], [0], [rows], slots)
    for layer in LAYERS:
        cap.record(layer, torch.as_tensor(topk(request_id, 0, rows, layer), device=cap.device))
    cap.end_step()


def capture_two_requests(cap):
    """Two requests, prefill only: 'a' ends with 5 rows, 'b' with 3."""
    prefill(cap, "a", 5, [0, 1, 2, 3, 4])
    prefill(cap, "b", 3, [8, 9, 10])
    cap.finish_request("a", prompt_len=5, generated_len=1)
    cap.finish_request("b", prompt_len=3, generated_len=1)


def root_lock_is_free(root) -> bool:
    """The local root's writer lock can be taken (the store that held it was closed)."""
    try:
        LocalRoutingStore(root).close()
    except StoreError:
        return False
    return True


# -- local store, from FastDeploy's JSON ------------------------------------------------------------


def test_fastdeploy_json_builds_a_capturer_whose_rows_read_back_bit_exactly(tmp_path):
    root = tmp_path / "r3"
    config = R3Config.from_json(
        f'{{"enable_routing_replay": true, "routing_store_type": "local", "local_store_dir": "{root}"}}'
    )
    cap = build_capturer(config, **GEOMETRY, num_slots=64)
    assert isinstance(cap, RoutingCapturer) and isinstance(cap.sink, RoutingWriter)
    assert isinstance(cap.sink.store, LocalRoutingStore) and str(cap.sink.store.root) == str(root)
    assert cap.layer_map == LAYERS and cap.rollout_id == "default" and cap.transfer_mode == "staged"
    assert cap.device.type == ("cuda" if torch.cuda.is_available() else "cpu")  # slot_table_device auto
    capture_two_requests(cap)
    assert not root_lock_is_free(root)  # the built store owns the root until close
    cap.close()
    assert root_lock_is_free(root)
    got = RoutingReader(root).get_numpy("default", ["a", "b"])
    np.testing.assert_array_equal(got["a"], truth("a", 5))
    np.testing.assert_array_equal(got["b"], truth("b", 3))
    assert got["a"].dtype == np.uint8
    cap.close()  # a second close does nothing more


def test_with_block_closes_the_capturer_its_writer_and_store(tmp_path):
    with build_capturer(R3Config.from_json(fastdeploy_json(tmp_path, rollout_id="ctx")), **GEOMETRY, num_slots=64) as cap:
        capture_two_requests(cap)
        writer = cap.sink
    assert root_lock_is_free(tmp_path)
    with pytest.raises(StoreError, match="RoutingWriter is closed"):
        writer.submit(None)
    assert writer.requests_committed == 2
    assert sorted(RoutingReader(tmp_path).info("ctx").request_ids) == ["a", "b"]


def test_disabled_config_builds_nothing(tmp_path):
    cfg = R3Config.from_json(json.dumps({"enable_routing_replay": False, "local_store_dir": str(tmp_path / "r3")}))
    assert build_capturer(cfg, **GEOMETRY, num_slots=64) is None
    assert not (tmp_path / "r3").exists()  # no store opened


def test_environment_fills_the_json_and_the_json_beats_it(tmp_path, monkeypatch):
    monkeypatch.setenv("R3_FLUSH_BYTES", "4096")
    monkeypatch.setenv("R3_FLUSH_INTERVAL_S", "0.5")
    monkeypatch.setenv("R3_MAX_INFLIGHT_BYTES", "65536")
    monkeypatch.setenv("R3_ZSTD_LEVEL", "0")
    monkeypatch.setenv("R3_CHUNK_ROWS", "2")
    monkeypatch.setenv("R3_ROLLOUT_ID", "from-env")
    monkeypatch.setenv("R3_ENABLE_ROUTING_REPLAY", "false")
    with build_capturer(R3Config.from_json(fastdeploy_json(tmp_path / "env")), **GEOMETRY, num_slots=64) as cap:
        writer = cap.sink
        assert (writer.flush_bytes, writer.flush_interval_s, writer.max_inflight_bytes) == (4096, 0.5, 65536)
        assert (writer.store.zstd_level, writer.store.chunk_rows, cap.rollout_id) == (0, 2, "from-env")
        capture_two_requests(cap)
    array = _only_array(tmp_path / "env" / "from-env")
    codecs = [type(c).__name__ for c in array.compressors]
    assert codecs == ["Crc32cCodec"] and array.chunks[0] == 2  # the store wrote what the environment said

    argued = fastdeploy_json(tmp_path / "arg", flush_bytes=8192, zstd_level=5, chunk_rows=4, rollout_id="from-arg")
    with build_capturer(R3Config.from_json(argued), **GEOMETRY, num_slots=64) as cap:
        assert (cap.sink.flush_bytes, cap.sink.flush_interval_s) == (8192, 0.5)  # argument, then environment
        assert (cap.sink.store.zstd_level, cap.sink.store.chunk_rows, cap.rollout_id) == (5, 4, "from-arg")
        capture_two_requests(cap)
    array = _only_array(tmp_path / "arg" / "from-arg")
    assert [type(c).__name__ for c in array.compressors] == ["ZstdCodec", "Crc32cCodec"] and array.chunks[0] == 4
    assert R3Config.from_json(fastdeploy_json(tmp_path / "off", enable_routing_replay=False)).enable_routing_replay is False


def _only_array(rollout_dir):
    group = zarr.open_group(rollout_dir, mode="r", zarr_format=3)
    (name,) = list(group.array_keys())
    return group[name]


def test_only_last_turn_lets_a_later_turn_replace_the_stored_conversation(tmp_path):
    def two_turns(cap):
        prefill(cap, "c.t0", 4, [0, 1, 2, 3])
        cap.finish_request("c.t0", prompt_len=4, generated_len=1, store_as="c")  # rows 0..3
        cap.sink.flush()
        # Turn 2 hits turn 1's KV (rows 0..3) and computes 3 more: its full view is rows 0..6.
        cap.attach_cached("c.t1", [0, 1, 2, 3], [0, 1, 2, 3])
        cap.begin_step(["c.t1"], [4], [3], [4, 5, 6])
        for layer in LAYERS:
            cap.record(layer, torch.as_tensor(topk("c.t1", 4, 3, layer), device=cap.device))
        cap.end_step()
        cap.finish_request("c.t1", prompt_len=7, generated_len=1, store_as="c")  # start_row 0: the full view

    with build_capturer(R3Config.from_json(fastdeploy_json(tmp_path / "olt", only_last_turn=True)), **GEOMETRY, num_slots=64) as cap:
        assert cap.sink.store.only_last_turn
        two_turns(cap)
    got = RoutingReader(tmp_path / "olt").get_numpy("default", ["c"])["c"]
    turn2 = np.stack([topk("c.t1", 4, 3, layer) for layer in LAYERS], axis=1)
    np.testing.assert_array_equal(got, np.concatenate([truth("c.t0", 4), turn2]))

    cap = build_capturer(R3Config.from_json(fastdeploy_json(tmp_path / "append")), **GEOMETRY, num_slots=64)
    two_turns(cap)
    with pytest.raises(DuplicateRequestError, match="only start_row 4 would extend it"):
        cap.close()  # without only_last_turn the full re-push conflicts; the error surfaces at close
    assert root_lock_is_free(tmp_path / "append")  # and the store was closed anyway


# -- geometry, device, failures -----------------------------------------------------------------------


def test_geometry_is_required_without_a_model(tmp_path):
    cfg = R3Config.from_json(fastdeploy_json(tmp_path / "r3"))
    with pytest.raises(ConfigError, match=r"missing \['top_k', 'num_experts'\]"):
        build_capturer(cfg, layer_map=LAYERS, num_slots=64)
    with pytest.raises(ConfigError, match="num_slots must be an int >= 1, got 0"):
        build_capturer(cfg, **GEOMETRY, num_slots=0)
    assert not (tmp_path / "r3").exists()  # refused before any store was opened


def test_a_capturer_that_cannot_be_built_leaves_no_store_open(tmp_path):
    cfg = R3Config.from_json(fastdeploy_json(tmp_path))
    with pytest.raises(ShapeMismatchError, match="layer_map is empty"):
        build_capturer(cfg, layer_map=(), top_k=TOP_K, num_experts=EXPERTS, num_slots=64)
    assert root_lock_is_free(tmp_path)


def test_model_gives_the_geometry_and_arguments_must_agree(tmp_path):
    from r3rdma.integrations.hf_capture import attach_capturer
    from r3rdma.integrations.hf_models import build_model, tiny_qwen3_moe
    from r3rdma.integrations.hf_rollout import BlockAllocator, HFRolloutDriver, RolloutRequest

    model = build_model(tiny_qwen3_moe(), seed=0)  # 4 layers, layer 1 dense, 16 experts, top-4
    cfg = R3Config.from_json(fastdeploy_json(tmp_path / "r3", rollout_id="hf"))
    with pytest.raises(ConfigError, match=r"top_k: the model has 4, the argument says 2"):
        build_capturer(cfg, model=model, top_k=2, num_slots=64)
    with pytest.raises(ConfigError, match=r"layer_map: the model has \(0, 2, 3\), the argument says \(0, 1, 2\)"):
        build_capturer(cfg, model=model, layer_map=(0, 1, 2), num_slots=64)
    if not torch.cuda.is_available():  # the model is on the CPU: a CUDA slot table would not fit it
        with pytest.raises(ConfigError, match="model's device type"):
            build_capturer(R3Config.from_json(fastdeploy_json(tmp_path / "r3", slot_table_device="cuda")), model=model, num_slots=64)
    assert not (tmp_path / "r3").exists()

    allocator = BlockAllocator(num_blocks=8, block_size=16)
    requests = [RolloutRequest("p0", (5, 9, 11, 3), 3), RolloutRequest("p1", (8, 2), 4)]
    with build_capturer(cfg, model=model, num_slots=allocator.num_slots, top_k=4, num_experts=16) as cap:
        assert (cap.layer_map, cap.top_k, cap.num_experts, cap.device) == ((0, 2, 3), 4, 16, torch.device("cpu"))
        detach = attach_capturer(model, cap)
        outputs = HFRolloutDriver(model, cap, allocator=allocator, batch_size=2, eos_token_id=7, seed=0).run(requests)
        detach()
    got = RoutingReader(tmp_path / "r3").get_numpy("hf", ["p0", "p1"])
    for out in outputs:
        assert got[out.request_id].shape == (len(out.prompt) + len(out.generated) - 1, 3, 4)


# -- ownership ----------------------------------------------------------------------------------------


def test_a_hand_built_capturer_leaves_the_callers_sink_open(tmp_path):
    store = LocalRoutingStore(tmp_path)
    writer = RoutingWriter(store, flush_interval_s=0)
    with RoutingCapturer(**GEOMETRY, num_slots=64, sink=writer, rollout_id="mine") as cap:
        capture_two_requests(cap)
    prefill(cap, "late", 2, [20, 21])  # the writer is still open: the capturer can still hand it requests
    cap.finish_request("late", prompt_len=2, generated_len=1)
    cap.flush()
    writer.flush()
    assert writer.requests_committed == 3 and not root_lock_is_free(tmp_path)
    writer.close()
    assert not root_lock_is_free(tmp_path)  # the writer does not close a store it was handed either
    store.close()
    assert sorted(RoutingReader(tmp_path).info("mine").request_ids) == ["a", "b", "late"]


def test_owned_sinks_are_closed_and_must_be_closable(tmp_path):
    writer = RoutingWriter(LocalRoutingStore(tmp_path), owns_store=True)
    with RoutingCapturer(**GEOMETRY, num_slots=64, sink=writer, owns_sink=True) as cap:
        capture_two_requests(cap)
    assert root_lock_is_free(tmp_path) and writer.requests_committed == 2

    class ListSink:
        def submit(self, record):
            pass

    with pytest.raises(ConfigError, match="owns_sink=True needs a sink with close\\(\\), got ListSink"):
        RoutingCapturer(**GEOMETRY, num_slots=64, sink=ListSink(), owns_sink=True)
    with pytest.raises(ConfigError, match="owns_store=True needs a store with close\\(\\), got ListSink"):
        RoutingWriter(ListSink(), owns_store=True)


def test_device_capabilities_are_protocols(tmp_path):
    with LocalRoutingStore(tmp_path) as store, RoutingWriter(store) as writer:
        assert not isinstance(store, DeviceRecordStore) and not writer.accepts_device_rows
        with pytest.raises(ConfigError, match="gpu_direct' needs a sink that pushes device memory"):
            RoutingCapturer(**GEOMETRY, num_slots=8, sink=writer, transfer_mode="gpu_direct")
        with pytest.raises(ConfigError, match="needs a store that pushes device memory, got LocalRoutingStore"):
            writer.probe_transfer_mode()
    client = StoreNodesClient(["127.0.0.1:1"], secret=new_token())
    try:
        assert isinstance(client, DeviceRecordStore)
        with RoutingWriter(client) as writer:  # closed: its thread would outlive the test
            assert writer.accepts_device_rows
    finally:
        client.close()


# -- store nodes --------------------------------------------------------------------------------------


@pytest.fixture
def node(tmp_path):
    running = start_node(tmp_path / "node", new_token())
    yield running
    running.stop(signal.SIGKILL)


def test_store_nodes_config_pushes_through_a_real_node(node, tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(node.token + "\n")
    monkeypatch.delenv("R3_STORE_TOKEN", raising=False)
    closed = []
    original_close = StoreNodesClient.close
    monkeypatch.setattr(StoreNodesClient, "close", lambda self: (closed.append(self), original_close(self))[1])
    cfg = R3Config.from_json(json.dumps({"enable_routing_replay": True, "routing_store_type": "rdma",
                                         "store_urls": [node.push_url], "store_token_file": str(token_file),
                                         "rollout_id": "pushed"}))
    assert cfg.routing_store_type == "store_nodes"
    with build_capturer(cfg, **GEOMETRY, num_slots=64) as cap:
        client = cap.sink.store
        assert isinstance(client, StoreNodesClient) and client.nodes == [node.push_url]
        capture_two_requests(cap)
    assert closed == [client]  # the capturer closed the writer, the writer the client
    assert cap.sink.requests_committed == 2
    got = RoutingReader(node.http_url, token=node.read_token).get_numpy("pushed", ["a", "b"])
    np.testing.assert_array_equal(got["a"], truth("a", 5))
    np.testing.assert_array_equal(got["b"], truth("b", 3))


def test_a_writer_built_for_store_nodes_pushes_device_rows_that_read_back(node, tmp_path):
    """The GPU-direct path of a built writer: it says it takes DeviceRows, takes them (a CPU tensor
    here: the push reads the tensor's memory as UCX does a GPU's), and the node stores those rows."""
    token_file = tmp_path / "token"
    token_file.write_text(node.token)
    cfg = R3Config(routing_store_type="store_nodes", store_urls=(node.push_url,), store_token_file=str(token_file),
                   flush_interval_s=0)
    with build_writer(cfg) as writer:
        assert writer.accepts_device_rows
        for request_id, rows in (("a", 5), ("b", 3)):
            writer.submit(DeviceRows(rollout_id="device", request_id=request_id, ids_TLK=torch.as_tensor(truth(request_id, rows)),
                                     layer_map=LAYERS, num_experts=EXPERTS))
        writer.flush()
        assert writer.requests_committed == 2 and writer.failed_requests() == []
    got = RoutingReader(node.http_url, token=node.read_token).get_numpy("device", ["a", "b"])
    np.testing.assert_array_equal(got["a"], truth("a", 5))
    np.testing.assert_array_equal(got["b"], truth("b", 3))
    with build_writer(R3Config(local_store_dir=str(tmp_path / "local"))) as writer:
        assert not writer.accepts_device_rows  # the capturer then stages rows through host memory


def test_store_nodes_secret_from_the_environment_and_a_wrong_one_refused(node, tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(node.token)
    monkeypatch.setenv("R3_STORE_URLS", node.push_url)
    monkeypatch.setenv("R3_STORE_TOKEN_FILE", str(token_file))  # as the cluster set-up exports it
    cfg = R3Config.from_json('{"enable_routing_replay": true, "routing_store_type": "rdma", "rollout_id": "env"}')
    assert cfg.store_urls == (node.push_url,) and cfg.store_token_file == str(token_file)
    with build_capturer(cfg, **GEOMETRY, num_slots=64) as cap:
        capture_two_requests(cap)
    assert sorted(RoutingReader(node.http_url, token=node.read_token).info("env").request_ids) == ["a", "b"]

    monkeypatch.delenv("R3_STORE_TOKEN_FILE")
    monkeypatch.setenv("R3_STORE_TOKEN", new_token())  # not the node's
    cfg = R3Config.from_json('{"routing_store_type": "rdma", "rollout_id": "wrong", "transfer_mode": "staged"}')
    with pytest.raises(AuthenticationError):
        build_capturer(cfg, **GEOMETRY, num_slots=64)  # refused when built, not at the end of the rollout
    monkeypatch.delenv("R3_STORE_TOKEN")
    with pytest.raises(ConfigError, match="no transport secret"):
        build_capturer(R3Config.from_json('{"routing_store_type": "rdma"}'), **GEOMETRY, num_slots=64)


@pytest.mark.gpu
@pytest.mark.parametrize("transfer_mode", ["gpu_direct", "auto"])
def test_cuda_pipeline_from_config_pins_the_table_and_pushes_device_rows(node, tmp_path, transfer_mode):
    token_file = tmp_path / "token"
    token_file.write_text(node.token)
    cfg = R3Config.from_json(json.dumps({"routing_store_type": "rdma", "store_urls": [node.push_url],
                                         "store_token_file": str(token_file), "rollout_id": f"gpu-{transfer_mode}",
                                         "slot_table_device": "cuda", "pin_host_table": True,
                                         "transfer_mode": transfer_mode}))
    with build_capturer(cfg, **GEOMETRY, num_slots=64) as cap:
        assert cap.device.type == "cuda" and cap.table_SLK.device.type == "cuda"
        assert cap._table.host_table is not None and cap._table.host_table.is_pinned()  # the table lives in pinned host memory
        assert cap.sink.accepts_device_rows
        assert (cap.transfer_probe is not None) == (transfer_mode == "auto")
        assert cap.transfer_mode in ("gpu_direct", "staged")
        capture_two_requests(cap)
    got = RoutingReader(node.http_url, token=node.read_token).get_numpy(f"gpu-{transfer_mode}", ["a", "b"])
    np.testing.assert_array_equal(got["a"], truth("a", 5))
    np.testing.assert_array_equal(got["b"], truth("b", 3))


def test_a_device_that_is_no_device_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="device must name a torch device.*got 'gpu'"):
        build_capturer(R3Config.from_json(fastdeploy_json(tmp_path / "r3")), **GEOMETRY, num_slots=8, device="gpu")
    with pytest.raises(ConfigError, match="device must name a torch device.*got 'gpu'"):
        RoutingCapturer(**GEOMETRY, num_slots=8, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs CUDA, but torch sees no CUDA device"):
            RoutingCapturer(**GEOMETRY, num_slots=8, device="cuda")
        with pytest.raises(ConfigError, match=r"pin_memory=True \(page-locked host memory\) needs CUDA"):
            RoutingCapturer(**GEOMETRY, num_slots=8, pin_memory=True)
    assert not (tmp_path / "r3").exists()


def test_store_replicas_reach_the_push_client(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(new_token() + "\n")
    urls = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    base = {"routing_store_type": "store_nodes", "store_urls": urls, "store_token_file": str(token_file)}
    for replicas, expected in ((0, 2), (1, 1), (3, 3)):
        writer = build_writer(R3Config.from_json({**base, "store_replicas": replicas}), connect=False)  # no nodes there
        try:
            assert writer.store.replicas == expected
        finally:
            writer.close()
    monkeypatch.setenv("R3_STORE_REPLICAS", "1")
    assert R3Config.from_json(base).store_replicas == 1
    with pytest.raises(ConfigError, match="store_replicas must be in 0..3"):
        R3Config.from_json({**base, "store_replicas": 4})


def test_slice_layout_reaches_the_local_store(tmp_path):
    """A local store gets the slice layout by default; ``R3Config(slice_layout=False)`` (or
    ``R3_SLICE_LAYOUT=false``) builds one with the whole-request layout."""
    for config, want in (
        (R3Config(local_store_dir=str(tmp_path / "a")), True),
        (R3Config(local_store_dir=str(tmp_path / "b"), slice_layout=False), False),
        (R3Config.from_env(env={"R3_SLICE_LAYOUT": "false"}, local_store_dir=str(tmp_path / "c")), False),
        (R3Config.from_env(env={"R3_SLICE_LAYOUT": "true"}, local_store_dir=str(tmp_path / "d")), True),
    ):
        writer = build_writer(config)
        try:
            assert writer.store.slice_layout is want
        finally:
            writer.close()


def test_http_store_urls_are_refused_naming_the_readers_variable():
    with pytest.raises(ConfigError, match=r"store_urls takes UCX host:port; HTTP URLs are for readers \(R3_STORE_HTTP_URLS\)"):
        R3Config(routing_store_type="store_nodes", store_urls=("http://127.0.0.1:8337",))
    with pytest.raises(ConfigError, match="R3_STORE_HTTP_URLS"):
        R3Config.from_env({"R3_STORE_URLS": "127.0.0.1:9000, https://node-1:8337"})


def test_unreachable_store_nodes_fail_build_capturer(tmp_path, monkeypatch):
    import socket

    from r3rdma.errors import TransportError

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("R3_STORE_TOKEN", new_token())
    config = R3Config(routing_store_type="store_nodes", store_urls=(f"127.0.0.1:{port}",))
    with pytest.raises(TransportError, match=f"127.0.0.1:{port}"):
        build_capturer(config, num_slots=64, layer_map=(0,), top_k=2, num_experts=8)


def test_unknown_r3_variables_are_warned_about_naming_the_likely_one(caplog):
    from r3rdma.config import unknown_variables

    env = {"R3_ROLOUT_ID": "step-1", "R3_STORE_URL": "h:1", "R3_NOTHING_LIKE_IT": "1", "R3_ROLLOUT_ID": "x", "PATH": "/bin"}
    assert unknown_variables(env) == [("R3_NOTHING_LIKE_IT", None), ("R3_ROLOUT_ID", "R3_ROLLOUT_ID"), ("R3_STORE_URL", "R3_STORE_URLS")]
    with caplog.at_level("WARNING", logger="r3rdma"):
        assert R3Config.from_env({"R3_ROLOUT_ID": "step-1"}).rollout_id == "default"
    assert "R3_ROLOUT_ID is not a variable r3rdma reads, so it is ignored; did you mean R3_ROLLOUT_ID?" in caplog.text
