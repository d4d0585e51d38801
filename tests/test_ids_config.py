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
    ],
)
def test_bad_config_values(kwargs, match):
    with pytest.raises((ConfigError, InvalidIdError), match=match):
        R3Config(**kwargs)


def test_bad_env_value_names_variable():
    with pytest.raises(ConfigError, match="R3_FLUSH_BYTES"):
        R3Config.from_env({"R3_FLUSH_BYTES": "lots"})
