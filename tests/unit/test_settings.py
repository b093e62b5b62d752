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
        s.daemon.tick_s = 3  # type: ignore[misc]


def test_cross_check_heartbeat_timeout() -> None:
    with pytest.raises(SettingsError, match="greater than daemon.heartbeat_interval_s"):
        load_settings(None, env={"ORCH_DAEMON__HEARTBEAT_TIMEOUT_S": "1", "ORCH_DAEMON__HEARTBEAT_INTERVAL_S": "2"})


def test_credentials_mode_and_its_required_files_are_checked() -> None:
    with pytest.raises(SettingsError, match="credentials.mode: 'jwt' is not one of file, callout"):
        load_settings(None, env={"ORCH_CREDENTIALS__MODE": "jwt"})
    with pytest.raises(SettingsError) as err:
        load_settings(None, env={"ORCH_CREDENTIALS__ENABLED": "true", "ORCH_CREDENTIALS__MODE": "callout"})
    text = str(err.value)
    for needle in ("needs nats.urls", "credentials.static_users_file: required", "credentials.issuer_seed_file: required",
                   "credentials.auth_password_file: required"):
        assert needle in text
    assert "auth_file" not in text.replace("auth_password_file", "")  # the file mode's keys are not asked for
    s = load_settings(None, env={"ORCH_NATS__URLS": "nats://a:1", "ORCH_CREDENTIALS__ENABLED": "true",
                                 "ORCH_CREDENTIALS__MODE": "callout", "ORCH_CREDENTIALS__STATIC_USERS_FILE": "u",
                                 "ORCH_CREDENTIALS__ISSUER_SEED_FILE": "s", "ORCH_CREDENTIALS__AUTH_PASSWORD_FILE": "p"})
    assert s.credentials.mode == "callout" and s.credentials.auth_user == "orchd-auth"


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="file not found"):
        load_settings(tmp_path / "nope.toml", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[nats\n")
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings(bad, env={})


def test_logging_survives_a_closed_stream_and_redacts_secrets(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    import structlog

    from wire.logs import configure

    f = open(tmp_path / "log", "w")  # noqa: SIM115
    configure("info", "json", stream=f)
    structlog.get_logger().info("before_close", password="hunter2", fencing_token=7)
    f.close()
    structlog.get_logger().info("after_close")  # must not raise
    text = (tmp_path / "log").read_text()
    assert '"password": "***"' in text and '"fencing_token": 7' in text and "hunter2" not in text
    configure("info", "json")
