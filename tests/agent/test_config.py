"""orch-agent configuration: TOML < ORCH_AGENT_* env < flags, the bootstrap's env names, systemd
credentials, and every problem reported at once, each named by where its value came from."""

from __future__ import annotations

import pytest

from agent.config import ConfigError, load_config
from wire.config import SettingsError

POOL = ('pool = {cloud = "aws", region = "us-east-1", zone = "us-east-1a", instance_type = "p4d.24xlarge", '
        'market = "spot"}')


def test_precedence_and_bootstrap_names(tmp_path) -> None:
    toml = tmp_path / "agent.toml"
    toml.write_text('node_id = "from-file"\nheartbeat_s = 5.0\nwarm_ranks = 8\nwork_dir = "/var/lib/x"\n' + POOL + "\n")
    env = {"ORCH_AGENT_NODE_ID": "from-env", "ORCH_AGENT_NATS_URLS": "nats://a:4222, nats://b:4222",
           "ORCH_AGENT_CLOUD": "gcp", "ORCH_AGENT_ENROL_TOKEN": "t0k", "ORCH_AGENT_HEARTBEAT_S": "3"}
    cfg = load_config(["--config", str(toml), "--heartbeat-s", "1.5"], env)
    assert cfg.node_id == "from-env"  # env over file
    assert cfg.heartbeat_s == 1.5  # flag over env
    assert cfg.warm_ranks == 8 and cfg.work_dir == "/var/lib/x"  # file over defaults
    assert cfg.nats_urls == ("nats://a:4222", "nats://b:4222")
    assert cfg.metadata == "gcp" and cfg.enrol_token == "t0k"
    assert cfg.pool is not None and cfg.pool.instance_type == "p4d.24xlarge"
    assert cfg.checkpoint_on_notice is True
    assert load_config(["--node-id", "n", "--no-checkpoint-on-notice"], {}).checkpoint_on_notice is False


def test_flags_env_and_file_values_by_type(tmp_path) -> None:
    toml = tmp_path / "agent.toml"
    toml.write_text('cloud = "azure"\nnats_url = ["nats://f:4222"]\nexit_with_parent = true\n')
    pool = '{"cloud": "gcp", "region": "r", "zone": "z", "instance_type": "t", "market": "spot"}'
    cfg = load_config(["-c", str(toml), "--nats-url", "nats://x:4222", "--nats-url", "nats://y:4222", "--pool", pool],
                      {"ORCH_AGENT_WARM_RANKS": "2", "ORCH_AGENT_CHECKPOINT_ON_NOTICE": "no"})
    assert cfg.metadata == "azure" and cfg.exit_with_parent is True  # the file's alias and bool
    assert cfg.nats_urls == ("nats://x:4222", "nats://y:4222")  # repeated flag over the file's list
    assert cfg.pool is not None and cfg.pool.zone == "z"
    assert cfg.warm_ranks == 2 and cfg.checkpoint_on_notice is False
    assert load_config([], {"ORCH_AGENT_POOL": ""}).pool is None  # an empty pool is no pool
    assert load_config([], {}).node_id  # default: the host name


def test_systemd_credentials_directory(tmp_path) -> None:
    (tmp_path / "nats.password").write_text("s3cret\n")
    (tmp_path / "nats-ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    cfg = load_config(["--node-id", "n"], {"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert cfg.nats_password == "s3cret"
    assert cfg.nats_tls_ca_file == str(tmp_path / "nats-ca.pem")
    configured = load_config(["--node-id", "n"], {"CREDENTIALS_DIRECTORY": str(tmp_path),
                                                  "ORCH_AGENT_NATS_PASSWORD": "own"})
    assert configured.nats_password == "own"  # a configured password wins


def test_every_problem_in_one_error(tmp_path) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text('heartbeat_s = "often"\ncolour = "blue"\n')
    with pytest.raises(ConfigError) as e:
        load_config(["--config", str(toml)], {"ORCH_AGENT_METADATA": "oracle", "ORCH_AGENT_WARM_RANKS": "x",
                                              "ORCH_AGENT_NOPE": "1"})
    text = str(e.value)
    for needle in (f"{toml}: heartbeat_s", f"{toml}: colour", "ORCH_AGENT_METADATA", "ORCH_AGENT_WARM_RANKS",
                   "ORCH_AGENT_NOPE"):
        assert needle in text, needle
    assert len(e.value.problems) == 5
    assert isinstance(e.value, SettingsError)


def test_bounds_and_sources_are_named(tmp_path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(["--heartbeat-s", "0", "--pool", "not json"],
                    {"ORCH_AGENT_CLOUD": "oracle", "ORCH_AGENT_WARM_RANKS": "-1",
                     "ORCH_AGENT_EXIT_WITH_PARENT": "maybe"})
    problems = e.value.problems
    assert len(problems) == 5, problems
    assert any(p.startswith("--heartbeat-s: must be > 0") for p in problems)
    assert any(p.startswith("--pool: ") for p in problems)
    assert any(p.startswith("ORCH_AGENT_CLOUD: 'oracle' is not one of") for p in problems)  # the alias as given
    assert any(p.startswith("ORCH_AGENT_WARM_RANKS: must be >= 0") for p in problems)
    assert any(p.startswith("ORCH_AGENT_EXIT_WITH_PARENT: expected true/false") for p in problems)
    with pytest.raises(ConfigError) as missing:
        load_config(["--config", str(tmp_path / "none.toml")], {})
    assert "none.toml" in str(missing.value)


def test_a_comma_separated_url_string_in_the_file_is_still_a_list(tmp_path) -> None:
    """Agent files written for earlier releases give ``nats_urls = "a,b"``: still two servers."""
    toml = tmp_path / "agent.toml"
    toml.write_text('nats_urls = "nats://a:4222, nats://b:4222"\n')
    assert load_config(["-c", str(toml)], {}).nats_urls == ("nats://a:4222", "nats://b:4222")
