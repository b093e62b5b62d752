"""orch-agent configuration: TOML < ORCH_AGENT_* env < flags, the bootstrap's env names, systemd
credentials, and every problem reported at once."""

from __future__ import annotations

import pytest

from agent.config import ConfigError, load_config


def test_precedence_and_bootstrap_names(tmp_path) -> None:
    toml = tmp_path / "agent.toml"
    toml.write_text('node_id = "from-file"\nheartbeat_s = 5.0\nwarm_ranks = 8\nwork_dir = "/var/lib/x"\n'
                    'pool = {cloud = "aws", region = "us-east-1", zone = "us-east-1a", instance_type = "p4d.24xlarge", market = "spot"}\n')
    env = {"ORCH_AGENT_NODE_ID": "from-env", "ORCH_AGENT_NATS_URLS": "nats://a:4222, nats://b:4222",
           "ORCH_AGENT_CLOUD": "gcp", "ORCH_AGENT_ENROL_TOKEN": "t0k", "ORCH_AGENT_HEARTBEAT_S": "3"}
    cfg = load_config(["--config", str(toml), "--heartbeat-s", "1.5"], env)
    assert cfg.node_id == "from-env"  # env over file
    assert cfg.heartbeat_s == 1.5  # flag over env
    assert cfg.warm_ranks == 8 and cfg.work_dir == "/var/lib/x"  # file over defaults
    assert cfg.nats_urls == ("nats://a:4222", "nats://b:4222")
    assert cfg.metadata == "gcp"
    assert cfg.pool is not None and cfg.pool.instance_type == "p4d.24xlarge"
    assert cfg.checkpoint_on_notice is True
    assert load_config(["--node-id", "n", "--no-checkpoint-on-notice"], {}).checkpoint_on_notice is False


def test_systemd_credentials_directory(tmp_path) -> None:
    (tmp_path / "nats.password").write_text("s3cret\n")
    (tmp_path / "nats-ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    cfg = load_config(["--node-id", "n"], {"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert cfg.nats_password == "s3cret"
    assert cfg.nats_tls_ca_file == str(tmp_path / "nats-ca.pem")


def test_every_problem_in_one_error(tmp_path) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text('heartbeat_s = "often"\ncolour = "blue"\n')
    with pytest.raises(ConfigError) as e:
        load_config(["--config", str(toml)], {"ORCH_AGENT_METADATA": "oracle", "ORCH_AGENT_WARM_RANKS": "x",
                                              "ORCH_AGENT_NOPE": "1"})
    text = str(e.value)
    for needle in ("heartbeat_s", "colour", "ORCH_AGENT_METADATA", "ORCH_AGENT_WARM_RANKS", "ORCH_AGENT_NOPE"):
        assert needle in text, needle
    assert len(e.value.problems) == 5
