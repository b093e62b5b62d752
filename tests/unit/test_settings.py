from pathlib import Path

import pytest

from orchestrator.settings import Settings, SettingsError, load_settings


def test_defaults_without_file() -> None:
    s = load_settings(None, env={})
    assert s == Settings()
    assert s.nats.urls == ()  # embedded server


def test_every_bad_key_is_listed_in_one_error(tmp_path: Path) -> None:
    f = tmp_path / "orchd.toml"
    f.write_text(
        """
[nats]
bogus = 1
[daemon]
heartbeat_timeout_s = "ten"
tick_s = -1
[log]
level = "loud"
[providers]
enabled = ["aws", "ibm"]
[frobnicate]
x = 1
"""
    )
    with pytest.raises(SettingsError) as err:
        load_settings(f, env={"ORCH_EXECUTOR__MAX_ATTEMPTS": "many"})
    text = str(err.value)
    for needle in [
        "nats.bogus: unknown key",
        "daemon.heartbeat_timeout_s: expected a number",
        "daemon.tick_s: must be > 0",
        "log.level: 'loud' is not one of",
        "providers.enabled[1]: 'ibm' is not one of",
        "frobnicate: unknown key",
        "executor.max_attempts: expected an integer",
    ]:
        assert needle in text
    assert len(err.value.problems) == 7


def test_env_overrides_and_lists() -> None:
    s = load_settings(None, env={"ORCH_NATS__URLS": "nats://a:1,nats://b:2", "ORCH_DAEMON__TICK_S": "0.5"})
    assert s.nats.urls == ("nats://a:1", "nats://b:2")
    assert s.daemon.tick_s == 0.5


def test_settings_are_frozen() -> None:
    s = load_settings(None, env={})
    with pytest.raises(AttributeError):
        s.daemon.tick_s = 3  # type: ignore[misc]  # frozen: mypy refuses the assignment this test makes


def test_cross_check_heartbeat_timeout() -> None:
    with pytest.raises(SettingsError, match="greater than daemon.heartbeat_interval_s"):
        load_settings(None, env={"ORCH_DAEMON__HEARTBEAT_TIMEOUT_S": "1", "ORCH_DAEMON__HEARTBEAT_INTERVAL_S": "2"})


def test_credentials_mode_and_its_required_files_are_checked() -> None:
    with pytest.raises(SettingsError, match="credentials.mode: 'jwt' is not one of file, callout"):
        load_settings(None, env={"ORCH_CREDENTIALS__MODE": "jwt"})
    with pytest.raises(SettingsError) as err:
        load_settings(None, env={"ORCH_CREDENTIALS__ENABLED": "true", "ORCH_CREDENTIALS__MODE": "callout"})
    text = str(err.value)
    for needle in ("needs nats.urls", "credentials.static_users_file: required",
                   "credentials.issuer_seed_file: required", "credentials.auth_password_file: required"):
        assert needle in text
    assert "auth_file" not in text.replace("auth_password_file", "")  # the file mode's keys are not asked for
    s = load_settings(None, env={"ORCH_NATS__URLS": "nats://a:1", "ORCH_CREDENTIALS__ENABLED": "true",
                                 "ORCH_CREDENTIALS__MODE": "callout", "ORCH_CREDENTIALS__STATIC_USERS_FILE": "u",
                                 "ORCH_CREDENTIALS__ISSUER_SEED_FILE": "s",
                                 "ORCH_CREDENTIALS__AUTH_PASSWORD_FILE": "p"})
    assert s.credentials.mode == "callout" and s.credentials.auth_user == "orchd-auth"


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="file not found"):
        load_settings(tmp_path / "nope.toml", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[nats\n")
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings(bad, env={})


def test_logging_survives_a_closed_stream_and_redacts_secrets(tmp_path: Path) -> None:
    import structlog

    from wire.logs import configure

    with open(tmp_path / "log", "w") as f:
        configure("info", "json", stream=f)
        structlog.get_logger().info("before_close", password="hunter2", fencing_token=7)
    structlog.get_logger().info("after_close")  # the stream is closed now: must not raise
    text = (tmp_path / "log").read_text()
    assert '"password": "***"' in text and '"fencing_token": 7' in text and "hunter2" not in text
    configure("info", "json")


# --- environment overrides are typed by the field they address (wire.config.from_env) ----------------


def test_env_string_field_keeps_digits_and_commas() -> None:
    s = load_settings(None, env={"ORCH_DAEMON__CLUSTER_ID": "2024"})
    assert s.daemon.cluster_id == "2024"  # not the integer 2024 ("expected a string" before)
    s = load_settings(None, env={"ORCH_DAEMON__STATE_DIR": "a,b", "ORCH_NATS__USER": "true"})
    assert s.daemon.state_dir == "a,b" and s.nats.user == "true"  # a comma splits only a list field


def test_env_list_fields_split_on_commas() -> None:
    s = load_settings(None, env={"ORCH_PROVIDERS__ENABLED": "fake, local", "ORCH_NATS__URLS": "nats://a:1"})
    assert s.providers.enabled == ("fake", "local")
    assert s.nats.urls == ("nats://a:1",)  # one item, still a list
    assert load_settings(None, env={"ORCH_NATS__URLS": ""}).nats.urls == ()


@pytest.mark.parametrize(("text", "value"), [("true", True), ("1", True), ("yes", True), ("on", True),
                                             ("FALSE", False), ("0", False), ("no", False), ("off", False)])
def test_env_booleans(text: str, value: bool) -> None:
    assert load_settings(None, env={"ORCH_DAEMON__HA": text}).daemon.ha is value


def test_env_numbers_per_field_type() -> None:
    s = load_settings(None, env={"ORCH_METRICS__PORT": "0", "ORCH_NATS__CONNECT_TIMEOUT_S": "3",
                                 "ORCH_DAEMON__TICK_S": "0.25", "ORCH_METRICS__ENABLED": "0"})
    assert s.metrics.port == 0 and type(s.metrics.port) is int  # an int field: 0 is not False
    assert s.metrics.enabled is False  # a bool field: 0 is False
    assert s.nats.connect_timeout_s == 3.0 and type(s.nats.connect_timeout_s) is float
    assert s.daemon.tick_s == 0.25
    with pytest.raises(SettingsError) as err:
        load_settings(None, env={"ORCH_METRICS__PORT": "1.5", "ORCH_DAEMON__HA": "2", "ORCH_DAEMON__TICK_S": "nan"})
    text = str(err.value)
    assert "metrics.port: expected an integer, got '1.5'" in text
    assert "daemon.ha: expected true/false, got '2'" in text
    assert "daemon.tick_s: expected a number, got nan" in text  # NaN would pass every bound
    assert len(err.value.problems) == 3


def test_env_table_entries_are_typed_by_the_table_values() -> None:
    s = load_settings(None, env={"ORCH_PROVIDERS__FEEDS__AWS__ENABLED": "no",
                                 "ORCH_PROVIDERS__FEEDS__GCP": '{"interval_s": 60}',
                                 "ORCH_PROVIDERS__FEEDS__GCP__ENABLED": "off"})
    assert not s.providers.feeds["aws"].enabled and s.providers.feeds["aws"].interval_s == 300.0
    assert s.providers.feeds["gcp"].interval_s == 60.0 and not s.providers.feeds["gcp"].enabled  # the key wins
    # a provider's own table is untyped here (its Config checks it): JSON or TOML values, else text
    s = load_settings(None, env={"ORCH_PROVIDERS__AWS__REGIONS": '["us-east-1", "us-west-2"]',
                                 "ORCH_PROVIDERS__AWS__MAX_ATTEMPTS": "3", "ORCH_PROVIDERS__AWS__PROFILE": "dev"})
    assert s.providers.aws == {"regions": ["us-east-1", "us-west-2"], "max_attempts": 3, "profile": "dev"}


def test_unknown_and_conflicting_env_keys_are_reported() -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(None, env={"ORCH_DAEMON__TICK": "1", "ORCH_FROB__X": "1", "ORCH_DAEMON__TICK_S__X": "1",
                                 "ORCH_PROVIDERS__FEEDS__AWS__BOGUS": "1", "ORCH_PROVIDERS__LOCAL": "5",
                                 "ORCH_PROVIDERS__LOCAL__SLOTS": "2", "ORCH_DAEMON__": "1",
                                 "ORCH_CI": "1", "PATH": "/bin"})  # no "__" or another prefix: not ours
    problems = err.value.problems
    for needle in ("ORCH_DAEMON__TICK: unknown setting daemon.tick",
                   "ORCH_FROB__X: unknown setting frob",
                   "ORCH_DAEMON__TICK_S__X: daemon.tick_s is not a table",
                   "ORCH_PROVIDERS__FEEDS__AWS__BOGUS: unknown setting providers.feeds.aws.bogus",
                   "ORCH_PROVIDERS__LOCAL__SLOTS: ORCH_PROVIDERS__LOCAL already sets providers.local to a non-table",
                   "providers.local: expected a table, got int",
                   "ORCH_DAEMON__: empty path component"):
        assert any(p.startswith(needle) for p in problems), needle
    assert len(problems) == 7


def test_every_bad_key_of_file_and_env_in_one_error(tmp_path: Path) -> None:
    f = tmp_path / "orchd.toml"
    f.write_text('[daemon]\ncluster_id = 2024\ntick_s = 0\n[metrics]\nport = "high"\nbogus = true\n')
    env = {"ORCH_DAEMON__HEARTBEAT_S": "1", "ORCH_EXECUTOR__MAX_ATTEMPTS": "many", "ORCH_LOG__LEVEL": "loud",
           "ORCH_METRICS__PORT": "9000"}  # the environment fixes the file's port
    with pytest.raises(SettingsError) as err:
        load_settings(f, env=env)
    assert err.value.source == str(f)
    assert sorted(err.value.problems) == sorted([
        "ORCH_DAEMON__HEARTBEAT_S: unknown setting daemon.heartbeat_s",
        "daemon.cluster_id: expected a string, got 2024",  # TOML's 2024 is an integer; the env's is text
        "daemon.tick_s: must be > 0, got 0.0",
        "metrics.bogus: unknown key (known: enabled, host, port, refresh_s)",
        "executor.max_attempts: expected an integer, got 'many'",
        "log.level: 'loud' is not one of debug, info, warning, error",
    ])


def test_model_schemes_are_a_key_of_orchds_config(tmp_path: Path) -> None:
    """``[trainer] model_schemes``: a file without it (every stored config before it) loads with every scheme the
    trainer knows; aliases are accepted; an unknown scheme or an empty list is a problem listed with the others."""
    old = tmp_path / "old.toml"
    old.write_text('[daemon]\ntick_s = 2.0\n')
    assert load_settings(old, env={}).trainer.model_schemes == ("file", "s3", "gs", "az", "hub", "builtin")
    assert load_settings(None, env={"ORCH_TRAINER__MODEL_SCHEMES": "file,gcs"}).trainer.model_schemes == ("file", "gcs")
    bad = tmp_path / "bad.toml"
    bad.write_text('[trainer]\nmodel_schemes = ["file", "ftp", "http"]\n[daemon]\ntick_s = -1\n')
    with pytest.raises(SettingsError) as e:
        load_settings(bad, env={})
    assert "trainer.model_schemes: 'ftp', 'http' not among file, s3, gs, az, hub, builtin" in str(e.value)
    assert "daemon.tick_s" in str(e.value)
    with pytest.raises(SettingsError, match="trainer.model_schemes: name at least one of"):
        load_settings(None, env={"ORCH_TRAINER__MODEL_SCHEMES": ""})
