import pytest

from r3rdma import R3Config, R3Error
from r3rdma.errors import ConfigError, InvalidIdError
from r3rdma.ids import validate_id


@pytest.mark.parametrize("good", ["a", "rollout-0", "step:12.req_3", "A" * 200, "x.y", "a-b:c_d.e"])
def test_valid_ids(good):
    assert validate_id(good) == good


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "../etc", "a..b", "a b", "é", "A" * 201, "a\\b", "a\0b", "%2e%2e"])
def test_invalid_ids_refused(bad):
    with pytest.raises(InvalidIdError) as info:
        validate_id(bad, "request_id")
    assert isinstance(info.value, ValueError) and isinstance(info.value, R3Error)
    assert "request_id" in str(info.value)


def test_non_string_id():
    with pytest.raises(InvalidIdError, match="must be a str"):
        validate_id(7)


def test_fastdeploy_json_keys():
    cfg = R3Config.from_json(
        '{"enable_routing_replay": true, "routing_store_type": "local", "local_store_dir": "/tmp/r3", "only_last_turn": true}'
    )
    assert cfg.enable_routing_replay and cfg.local_store_dir == "/tmp/r3" and cfg.only_last_turn
    assert R3Config.from_json('{"routing_store_type": "rdma", "store_urls": ["h:1"]}').routing_store_type == "store_nodes"


def test_unknown_json_key_refused():
    with pytest.raises(ConfigError, match="unknown routing replay config keys"):
        R3Config.from_json('{"enable_routing_replay": true, "use_fused_put": 1}')


def test_precedence_argument_env_default():
    env = {"R3_FLUSH_BYTES": "4096", "R3_ONLY_LAST_TURN": "true", "R3_ROLLOUT_ID": "from-env"}
    cfg = R3Config.from_env(env, rollout_id="from-arg")
    assert cfg.flush_bytes == 4096 and cfg.only_last_turn and cfg.rollout_id == "from-arg"
    assert R3Config.from_env({}).flush_bytes == R3Config().flush_bytes


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"routing_store_type": "s3"}, "routing_store_type"),
        ({"routing_store_type": "store_nodes"}, "store_urls"),
        ({"flush_bytes": 0}, "flush_bytes"),
        ({"flush_bytes": 10, "max_inflight_bytes": 5}, "must not exceed"),
        ({"zstd_level": 30}, "zstd_level"),
        ({"rollout_id": "../x"}, "rollout_id"),
        ({"transfer_mode": "rdma"}, "transfer_mode must be one of"),
        ({"slot_table_device": "gpu"}, "slot_table_device must be auto, cpu, cuda or cuda:<n>, got 'gpu'"),
        ({"transfer_mode": "gpu_direct"}, "gpu_direct' pushes device memory to store nodes"),
        ({"pin_host_table": True, "slot_table_device": "cpu"}, "pin_host_table keeps a CUDA slot table"),
        ({"routing_store_type": "rdma", "store_urls": ("nohost",)}, "host:port, got 'nohost'"),
        ({"routing_store_type": "rdma", "store_urls": ("h:1",), "only_last_turn": True}, "only_last_turn needs routing_store_type 'local'"),
        ({"routing_store_type": "rdma", "store_urls": ("h:1",), "zstd_level": 5}, "zstd_level is a setting of the store nodes"),
        ({"routing_store_type": "rdma", "store_urls": ("h:1",), "chunk_rows": 64}, "chunk_rows is a setting of the store nodes"),
        ({"routing_store_type": "rdma", "store_urls": ("h:1",), "slice_layout": False}, "slice_layout is a setting of the store nodes"),
        ({"flush_bytes": "8M"}, "flush_bytes: expected int, got str '8M'"),
        ({"enable_routing_replay": "false"}, "enable_routing_replay: expected bool, got str"),
        ({"store_urls": [1]}, r"store_urls: expected tuple\[str, ...\], got list"),
    ],
)
def test_bad_config_values(kwargs, match):
    with pytest.raises((ConfigError, InvalidIdError), match=match):
        R3Config(**kwargs)


def test_values_are_normalised():
    cfg = R3Config(routing_store_type="rdma", store_urls="a:1, b:2", store_token_file="", flush_interval_s=1,
                   slot_table_device="cuda:1", transfer_mode="gpu_direct")
    assert cfg.store_urls == ("a:1", "b:2") and cfg.store_token_file is None and cfg.flush_interval_s == 1.0
    # Addresses of the other store type are not consulted, so an environment may set both kinds.
    assert R3Config(store_urls=("a:1",), store_token_file="/t").routing_store_type == "local"
    assert R3Config.from_json(R3Config(local_store_dir="/x", zstd_level=0).to_json()) == R3Config(local_store_dir="/x", zstd_level=0)


def test_bad_json_refused():
    with pytest.raises(ConfigError, match="not valid JSON"):
        R3Config.from_json('{"enable_routing_replay": tru}')
    with pytest.raises(ConfigError, match="must be a JSON object, got list"):
        R3Config.from_json("[1]")


def test_json_keys_beat_environment():
    env = {"R3_FLUSH_BYTES": "4096", "R3_LOCAL_STORE_DIR": "/env", "R3_STORE_TOKEN_FILE": "/tok"}
    cfg = R3Config.from_json('{"local_store_dir": "/json"}', env=env)
    assert (cfg.flush_bytes, cfg.local_store_dir, cfg.store_token_file) == (4096, "/json", "/tok")


def test_bad_env_value_names_variable():
    with pytest.raises(ConfigError, match="R3_FLUSH_BYTES"):
        R3Config.from_env({"R3_FLUSH_BYTES": "lots"})


def test_a_refused_environment_value_names_its_variable():
    """A value the field's check refuses says which R3_* variable set it (an argument does not)."""
    with pytest.raises(ConfigError, match=r"transfer_mode must be one of .*got 'fast' \(from the environment: R3_TRANSFER_MODE\)"):
        R3Config.from_env({"R3_TRANSFER_MODE": "fast"})
    with pytest.raises(ConfigError, match=r"got 'fast'$"):
        R3Config.from_env({"R3_TRANSFER_MODE": "auto"}, transfer_mode="fast")
