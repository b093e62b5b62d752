"""Every file shipped under config/ works as shipped.

- Every file is claimed by one check below (a new file nobody checks fails ``test_every_file_is_checked``):
  orchd settings (the example and the clouds' tables) load and build their providers (a cloud whose SDK is
  not installed is reported as such, nothing else); job specs pass the one submit-time validator; the
  NATS server configs pass ``nats-server -t`` with their TLS files and includes laid out as on a server;
  Prometheus and Grafana files have their own tests (tests/ops/test_prometheus.py, test_grafana.py).
- The job specs that run on the local provider run to completion there: a real orchd (subprocess), real
  orch-agent nodes and the built-in trainer, submitted with orchctl. The spec file is the shipped one
  with two lines changed: a tiny ``total_steps`` and a checkpoint root under the test's directory.
- orchd refuses, at submit, a spec whose trainer arguments the built-in trainer would refuse (the demo's
  arguments of the previous release), with every problem named.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from orchestrator.daemon.registry import PROVIDERS, providers_and_problems
from orchestrator.jobspec import load_jobspec
from orchestrator.natsserver import server_binary
from orchestrator.settings import load_settings
from tests.conftest import IN_CI

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config"
ORCHD = str(Path(sys.executable).parent / "orchd")
SETTINGS_FILES = ["orchd.example.toml", *(f"clouds/{p.name}" for p in sorted((CONFIG / "clouds").glob("*.toml")))]
JOB_FILES = [f"jobs/{p.name}" for p in sorted((CONFIG / "jobs").iterdir())]
NATS_SERVER_FILES = [f"nats/{p.name}" for p in sorted((CONFIG / "nats").glob("*.conf"))]
NATS_INCLUDES = ["nats/auth.conf.example", "nats/auth-callout.conf.example"]
# sweeps/: tests/sweeps/test_spec.py and tests/ops/test_shipped_examples.py
CHECKED_ELSEWHERE = ("prometheus/", "grafana/", "sweeps/")


def test_every_file_is_checked() -> None:
    shipped = sorted(str(p.relative_to(CONFIG)) for p in CONFIG.rglob("*")
                     if p.is_file() and "__pycache__" not in p.parts)
    claimed = set(SETTINGS_FILES + JOB_FILES + NATS_SERVER_FILES + NATS_INCLUDES)
    unclaimed = [f for f in shipped if f not in claimed and not f.startswith(CHECKED_ELSEWHERE)]
    assert unclaimed == [], f"config files no test loads: {unclaimed}"


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize("rel", SETTINGS_FILES)
def test_settings_file_loads_and_builds_its_providers(rel: str, tmp_path: Path) -> None:
    settings = load_settings(CONFIG / rel, env={"ORCH_DAEMON__STATE_DIR": str(tmp_path)})
    assert settings.providers.enabled, rel
    providers, problems = providers_and_problems(settings)
    no_sdk = [n for n in settings.providers.enabled if not all(map(_installed, PROVIDERS[n][1]))]
    assert [p for p in problems if "SDK not installed" not in p] == [], problems
    assert sorted(providers) == sorted(set(settings.providers.enabled) - set(no_sdk))


@pytest.mark.parametrize("rel", JOB_FILES)
def test_job_spec_passes_the_submit_validator(rel: str) -> None:
    spec = load_jobspec(CONFIG / rel, now=time.time())  # raises JobSpecError listing every problem
    assert spec.total_steps > 0


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A throwaway CA with a server certificate (one per module: keys are slow to make)."""
    if not IN_CI:
        pytest.importorskip("cryptography")
    from tests.ops.test_nats_security import _make_pki

    return _make_pki(tmp_path_factory.mktemp("pki"))


def _nats_layout(tmp: Path, pki: dict[str, Path]) -> Path:
    """config/nats as it is installed: the TLS files the configs name (the throwaway CA's), every
    /etc/nats path moved under ``tmp``."""
    etc = tmp / "etc" / "nats"
    (etc / "tls").mkdir(parents=True)
    for name, src in (("server.pem", "server"), ("server.key", "server_key"), ("ca.pem", "ca"),
                      ("route.pem", "server"), ("route.key", "server_key")):
        shutil.copy(pki[src], etc / "tls" / name)
    return etc


def _nats_test(conf: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([server_binary(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("rel", NATS_SERVER_FILES)
@pytest.mark.parametrize("include", NATS_INCLUDES)
def test_nats_config_passes_nats_server_t(rel: str, include: str, tmp_path: Path, pki: dict[str, Path]) -> None:
    etc = _nats_layout(tmp_path, pki)
    text = (CONFIG / rel).read_text().replace("/etc/nats", str(etc)).replace("/var/lib/nats", str(tmp_path / "js"))
    (etc / "server.conf").write_text(text)
    shutil.copy(CONFIG / include, etc / "auth.conf")
    res = _nats_test(etc / "server.conf")
    assert res.returncode == 0, res.stdout + res.stderr
    # the check can fail: a broken include is refused
    (etc / "auth.conf").write_text("authorization { users = [ { user: \n")
    assert _nats_test(etc / "server.conf").returncode != 0


# --- the local job specs, run -------------------------------------------------------------------------

LOCAL_STEPS = 4


def _local_spec_files() -> list[str]:
    return [rel for rel in JOB_FILES if "local" in load_jobspec(CONFIG / rel, now=time.time()).clouds]


def _orchd_config(tmp: Path) -> Path:
    cfg = tmp / "orchd.toml"
    cfg.write_text(f"""
[daemon]
state_dir = "{tmp / 'state'}"
tick_s = 0.5
price_confirm_s = 0.0
heartbeat_interval_s = 1.0
[metrics]
port = 0
[log]
format = "json"
[providers]
enabled = ["local"]
[providers.local]
work_dir = "{tmp / 'nodes'}"
zones = ["local-a"]
agent_args = ["--heartbeat-s", "1"]
agent_env = {{ OMP_NUM_THREADS = "1", MKL_NUM_THREADS = "1" }}
terminate_grace_s = 3.0
[providers.feeds.local]
interval_s = 1.0
""")
    return cfg


def _ctl(url: str, *argv: str) -> tuple[int, str, str]:
    from tests.integration.helpers import ctl

    return ctl(url, *argv)


@pytest.fixture
def orchd_local(tmp_path: Path):
    """A real orchd process with the local provider; yields its NATS URL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_") and k != "CREDENTIALS_DIRECTORY"}
    log = tmp_path / "orchd.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([ORCHD, "--config", str(_orchd_config(tmp_path))], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    discovery = tmp_path / "state" / "orchd.json"
    try:
        deadline = time.monotonic() + 60
        while not discovery.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        yield json.loads(discovery.read_text())["nats_url"], log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(300)
def test_local_job_specs_run_to_completion(orchd_local, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    url, log = orchd_local
    rels = _local_spec_files()
    assert rels == ["jobs/llama-spot.toml", "jobs/local-demo.toml"]
    for rel in rels:
        if "llama" in rel:
            pytest.importorskip("transformers")  # the [hf] extra: in [all]
        text = (CONFIG / rel).read_text()
        text, n_steps = re.subn(r"(?m)^total_steps = \d+", f"total_steps = {LOCAL_STEPS}", text)
        text, n_url = re.subn(r'(?m)^url = "file://[^"]*"', f'url = "file://{tmp_path}/ckpt/{Path(rel).stem}"', text)
        assert n_steps == n_url == 1, "the spec's layout changed: update this test"
        spec = tmp_path / Path(rel).name
        spec.write_text(text)
        code, out, err = _ctl(url, "jobs", "submit", str(spec), "-o", "json")
        assert code == 0, err
        job_id = json.loads(out)["job_id"]
        deadline = time.monotonic() + 240
        summary: dict = {}
        while summary.get("phase") not in ("succeeded", "failed", "cancelled", "stopped"):
            assert time.monotonic() < deadline, (summary, log.read_text()[-3000:])
            time.sleep(1.0)
            code, out, err = _ctl(url, "jobs", "show", job_id, "-o", "json")
            assert code == 0, err
            summary = json.loads(out)["summary"]
        assert summary["phase"] == "succeeded", (summary, log.read_text()[-3000:])
        assert summary["committed_step"] == LOCAL_STEPS, summary


def test_orchd_refuses_old_demo_arguments_at_submit(orchd_local) -> None:
    """The submit path of orchd itself (a spec over the wire, not through orchctl's file check)."""
    from orchestrator.cli.client import AdminClient, AdminError
    from wire import CheckpointPolicy, JobSpec, TrainerSpec

    url, _ = orchd_local
    spec = JobSpec(name="old-demo", total_steps=300, gpu_type="cpu", clouds=("local",),
                   trainer=TrainerSpec(args={"model": "tiny", "batch_size": 8}),
                   checkpoint=CheckpointPolicy(url="file:///tmp/orch-old-demo/ckpt"))

    async def submit() -> AdminError:
        client = await AdminClient.connect([url])
        try:
            with pytest.raises(AdminError) as e:
                await client.submit(spec, job_id="old-demo")
            return e.value
        finally:
            await client.close()

    err = anyio.run(submit)
    assert err.code == 400, err
    assert "trainer.args.batch_size: not an argument" in err.message
    assert "trainer.args.model: 'tiny' is a size of the built-in GPT: give size = 'tiny'" in err.message
