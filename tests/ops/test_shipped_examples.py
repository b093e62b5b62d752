"""Every shipped job and sweep example, submitted as a user would to a real orchd (a subprocess with the
local and fake providers enabled), is accepted, or refused only because it names clouds orchd has not
enabled: no example expires (relative deadlines) or carries a value orchd refuses.

Jobs go through ``orchctl jobs submit FILE``; sweeps through ``orchctl sweep submit`` into a real Optuna
storage and one pass of the real controller, which submits the trials' jobs. The local provider has no
capacity here, so no node process starts: acceptance is what is checked, not the run
(tests/ops/test_shipped_config.py runs the local job to completion).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from orchestrator.jobspec import load_jobspec
from tests.integration.helpers import ctl

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config"
ENABLED = ("fake", "local")
JOBS = sorted((CONFIG / "jobs").iterdir())
SWEEPS = sorted((CONFIG / "sweeps").glob("*.toml"))
REFUSED_FOR_CLOUDS = "no enabled cloud can run this job: it allows clouds ["


@pytest.fixture(scope="module")
def orchd(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("examples")
    pools = ", ".join(f'"local/local-1/local-a/cpu.local/{m}" = 0' for m in ("spot", "on_demand"))
    cfg = tmp / "orchd.toml"
    cfg.write_text(f"""
[daemon]
state_dir = "{tmp / 'state'}"
tick_s = 0.5
price_confirm_s = 0.0
[metrics]
enabled = false
[log]
format = "json"
[providers]
enabled = {json.dumps(list(ENABLED))}
[providers.local]
work_dir = "{tmp / 'nodes'}"
zones = ["local-a"]
capacity = {{ {pools} }}
[providers.feeds.local]
interval_s = 1.0
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_") and k != "CREDENTIALS_DIRECTORY"}
    log = tmp / "orchd.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.daemon", "--config", str(cfg)], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    disc = tmp / "state" / "orchd.json"
    try:
        deadline = time.monotonic() + 60
        while not disc.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        yield json.loads(disc.read_text())["nats_url"], tmp
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _runs_here(clouds: tuple[str, ...]) -> bool:
    return not clouds or any(c in ENABLED for c in clouds)


def _refused_only_for_clouds(message: str, clouds: tuple[str, ...]) -> bool:
    problems = [ln.strip()[2:] for ln in message.splitlines() if ln.strip().startswith("- ")]
    return bool(problems) and all(p.startswith(REFUSED_FOR_CLOUDS + ", ".join(clouds) + "]") for p in problems)


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_job_example_is_accepted_or_refused_only_for_its_clouds(orchd, path: Path) -> None:
    url, _ = orchd
    clouds = load_jobspec(path, now=time.time()).clouds
    code, out, err = ctl(url, "jobs", "submit", str(path), "--id", f"ex-{path.stem}", "-o", "json")
    if _runs_here(clouds):
        assert code == 0 and json.loads(out)["created"] is True, err
        code, out, err = ctl(url, "jobs", "show", f"ex-{path.stem}", "-o", "json")
        deadline_ts = json.loads(out)["job"]["spec"].get("deadline_ts")
        assert deadline_ts is None or deadline_ts > time.time(), out
    else:
        assert code == 1 and _refused_only_for_clouds(err, clouds), (clouds, err)


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_sweep_example_is_accepted_or_refused_only_for_its_clouds(orchd, path: Path) -> None:
    pytest.importorskip("optuna")
    from orchestrator.cli.client import AdminClient
    from orchestrator.cli.sweep import _AdminBridge
    from orchestrator.sweeps.controller import Controller
    from orchestrator.sweeps.store import SweepStore

    url, tmp = orchd
    storage = f"sqlite:///{tmp / 'sweeps.db'}"
    sweep_id = f"ex-{path.stem}"
    code, _, err = ctl(url, "sweep", "submit", str(path), "--storage", storage, "--id", sweep_id)
    assert code == 0 and "warning" not in err, err
    sw = SweepStore(storage).open(sweep_id)
    assert sw.deadline_ts is not None and sw.deadline_ts > time.time()  # the relative deadline, resolved once
    clouds = sw.spec.template.clouds

    async def one_pass():
        client = await AdminClient.connect([url], timeout_s=10.0)
        try:
            return await anyio.to_thread.run_sync(Controller(SweepStore(storage), _AdminBridge(client)).reconcile,
                                                  sweep_id, time.time())
        finally:
            await client.close()

    res = anyio.run(one_pass)
    rows = SweepStore(storage).open(sweep_id).trial_rows()
    if _runs_here(clouds):
        assert res.submitted and len(res.submitted) == sw.spec.parallelism, (res, rows)
        assert all(r["state"] == "running" and r["reason"] is None for r in rows), rows
    else:
        assert rows and all(r["state"] == "fail" for r in rows), rows
        assert all(_refused_only_for_clouds(r["reason"], clouds) for r in rows), rows
