"""The production drill (``python -m simulations.drill``): its scaled rules, its dashboard queries, and
the short run itself against real services.

The short run starts a 3-server NATS cluster (TLS, auth callout), two orchd (HA, local provider, per-node
credentials), Debian's Prometheus and Alertmanager and a webhook, and drives every scenario; its JSON
must show every alert of config/prometheus/alerts.yml fired and resolved, every dashboard query with
data, every metric of the live registries set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from simulations.drill import rules
from tests.conftest import IN_CI, require_tool

ROOT = Path(__file__).resolve().parents[2]


def test_auto_scale_is_derived_from_the_rules_file(tmp_path: Path) -> None:
    """The shortest range window of the rules holds 4 scrapes; a rules file without one is refused."""
    assert min(rules.range_windows()) == pytest.approx(300.0)  # deriv(orchd_event_backlog[5m])
    assert rules.auto_scale(1.0) == pytest.approx(4 / 300)
    assert rules.auto_scale(1000.0) == 1.0
    bare = tmp_path / "alerts.yml"
    bare.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up == 0"}]}]}))
    with pytest.raises(ValueError, match="no range window"):
        rules.auto_scale(1.0, bare)


def test_every_for_and_range_window_is_scaled(tmp_path: Path) -> None:
    """Each ``for:`` and each range window of the shipped rules shrinks by the factor; names, labels and
    thresholds stay; promtool accepts the result."""
    scale = rules.auto_scale(1.0)
    scaled = yaml.safe_load(rules.scaled_rules(scale))
    orig = rules.alert_rules()
    new = [r for g in scaled["groups"] for r in g["rules"]]
    assert [r["alert"] for r in new] == [r["alert"] for r in orig]
    for o, n in zip(orig, new, strict=True):
        assert ("for" in o) == ("for" in n)
        if "for" in o:
            assert rules.seconds(n["for"]) == pytest.approx(rules.seconds(o["for"]) * scale, abs=0.001)
        old_w = [rules.seconds(w) for w in rules._RANGE.findall(o["expr"]) for w in w[:1]]  # noqa: SLF001
        new_w = [rules.seconds(w) for w in rules._RANGE.findall(n["expr"]) for w in w[:1]]  # noqa: SLF001
        assert new_w == pytest.approx([w * scale for w in old_w], abs=0.001), o["alert"]
        assert n["labels"] == o["labels"]
    assert rules.range_windows() and "[4000ms]" in rules.scaled_rules(scale)
    (tmp_path / "alerts.yml").write_text(rules.scaled_rules(scale))
    res = subprocess.run([require_tool("promtool"), "check", "rules", str(tmp_path / "alerts.yml")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    with pytest.raises(ValueError, match="scale must be within"):
        rules.scaled_rules(0.0)
    with pytest.raises(ValueError, match="not a Prometheus duration"):
        rules.seconds("5 minutes")


def test_a_metric_is_set_when_a_sample_changed() -> None:
    """``changed``: a family counts as set when one of its samples differs from the scenario's start (a
    new sample counts from 0); an unchanged or a new zero sample does not."""
    from simulations.drill.run import Snapshot, changed

    a: tuple[str, tuple[tuple[str, str], ...]] = ("orchd_up", (("instance", "orchd-1"),))
    b: tuple[str, tuple[tuple[str, str], ...]] = ("orchd_jobs", (("instance", "orchd-1"), ("state", "running")))
    before: Snapshot = {"orchd_up": {a: 1.0}, "orchd_jobs": {}}
    assert changed(before, {"orchd_up": {a: 1.0}, "orchd_jobs": {b: 0.0}}) == set()
    assert changed(before, {"orchd_up": {a: 0.0}, "orchd_jobs": {b: 2.0}}) == {"orchd_up", "orchd_jobs"}


def test_dashboard_queries_have_their_variables_substituted() -> None:
    queries = rules.dashboard_queries("4s")
    dash = json.loads(rules.DASHBOARD.read_text())
    total = sum(len(p.get("targets", [])) for p in dash["panels"])
    assert len(queries) == total > 20
    assert not [q for _t, q in queries if "$" in q]
    assert any('job_id=~".*"' in q for _t, q in queries) and any("[4s]" in q for _t, q in queries)


def test_the_agents_read_the_stub_nvml() -> None:
    """The drill's agents import the stub ``pynvml`` (their PYTHONPATH), and the agent's own sampler reads
    one GPU from it; without that PYTHONPATH the real binding is imported."""
    from simulations.drill.services import STUB_NVML, agent_pythonpath

    env = {**os.environ, "PYTHONPATH": agent_pythonpath()}
    code = "import pynvml; from agent.heartbeat import SystemSampler; print(pynvml.__file__, SystemSampler().gpus())"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(str(STUB_NVML / "pynvml.py")) and "util_pct=50.0" in res.stdout
    assert "temp_c=60.0" in res.stdout
    stub = subprocess.run([sys.executable, "-c", "import pynvml; print(pynvml.__file__)"], cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, capture_output=True,
                          text=True, timeout=60)
    assert stub.returncode == 0 and str(STUB_NVML) not in stub.stdout  # the stub is the drill's alone


def test_the_drill_secrets(tmp_path: Path) -> None:
    """What the drill hands each service: files 0600; orchd's credentials directory loads as orchd's
    settings (password, CA, account seed, auth user's password); the static users carry their roles;
    nats-server accepts the servers' config with the callout include and TLS."""
    from orchestrator.natsserver import server_binary
    from orchestrator.security.nats_auth import render_server_config
    from orchestrator.settings import load_settings
    from simulations.drill.cluster_secrets import AUTH_USER, Secrets

    s = Secrets(tmp_path / "secrets")
    creds = s.orchd_credentials(tmp_path / "orchd-credentials")
    agent = s.agent_credentials(tmp_path / "agent-credentials")
    assert sorted(p.name for p in agent.iterdir()) == ["nats-ca.pem"]
    for f in [*creds.iterdir(), s.static_users, s.auth_conf, Path(s.tls.key_file)]:
        assert f.stat().st_mode & 0o777 == 0o600, f
    cfg = tmp_path / "orchd.toml"
    cfg.write_text(f'[nats]\nurls = ["tls://127.0.0.1:4222"]\nuser = "orchd"\n[credentials]\nenabled = true\n'
                   f'mode = "callout"\nstatic_users_file = "{s.static_users}"\nauth_user = "{AUTH_USER}"\n')
    settings = load_settings(cfg, env={"CREDENTIALS_DIRECTORY": str(creds)})
    assert settings.nats.password == s.passwords["orchd"] and settings.nats.tls_ca_file == str(creds / "nats-ca.pem")
    assert Path(settings.credentials.issuer_seed_file).read_text().strip() == s.issuer.seed
    roles = {u["name"]: u["role"] for u in json.loads(s.static_users.read_text())}
    assert roles == {"orchd": "orchd", "ops": "orchctl", "price-feed": "feed:local"}
    assert s.passwords["ops"] not in s.static_users.read_text()  # hashes only
    conf = tmp_path / "nats.conf"
    conf.write_text(render_server_config(auth_include="secrets/auth.conf", tls=s.tls, host="127.0.0.1", port=-1,
                                         store_dir=None, http_port=None, server_name="n"))
    res = subprocess.run([server_binary(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(os.environ.get("ORCH_DRILL") != "1" and not IN_CI,
                    reason="the short drill takes minutes and needs Debian's prometheus and prometheus-alertmanager; "
                           "CI (ORCH_CI=1) and ORCH_DRILL=1 run it")
def test_the_short_drill() -> None:
    """The drill end to end (see the module docstring)."""
    for tool in ("prometheus", "prometheus-alertmanager", "promtool"):
        require_tool(tool)
    res = subprocess.run([sys.executable, "-m", "simulations.drill", "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=1500)
    out = json.loads(res.stdout)
    print(json.dumps(out, indent=2))
    assert not out["error"], out["error"]
    alerts, panels, metrics = out["alerts"], out["panels"], out["metrics"]
    assert alerts["expected"] == len(rules.alert_names())
    assert alerts["fired"] == alerts["expected"], {n: d for n, d in alerts["details"].items()
                                                   if not (d and d["fired_prometheus"] and d["resolved_prometheus"])}
    assert panels["with_data"] == panels["total"], panels["without_data"]
    assert metrics["set"] == metrics["declared"], metrics["unset"]
    assert out["nats_security"].startswith("TLS") and out["gpu_readings"].startswith("stub NVML")
    assert res.returncode == 0
