"""benchmarks/profile_stages.py: py-spy's raw stacks -> orchd's stages (idle samples dropped, a sample
counted once, in the first stage of the list its stack holds), and a clear error on a file it cannot use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_stages.py"
LOOP = "main (orchestrator/daemon/run.py:426);Daemon.decide_loop (orchestrator/daemon/loop.py:192)"
RAW = "\n".join([
    f"{LOOP};Daemon.process (orchestrator/daemon/loop.py:222);decide_batch (orchestrator/daemon/pipeline.py:300);"
    "Decider.decide_heartbeats (orchestrator/daemon/pipeline.py:210);"
    "fold_heartbeats (orchestrator/core/decide.py:230) 6",
    f"{LOOP};Daemon.process (orchestrator/daemon/loop.py:222);decide_batch (orchestrator/daemon/pipeline.py:296);"
    "admit_heartbeats (orchestrator/daemon/admit.py:130) 3",
    "run (nats/aio/client.py:1);Client._read_loop (nats/aio/client.py:2100);"
    "Parser.parse (nats/protocol/parser.py:80) 1",
    "Thread._bootstrap (threading.py:995);Condition.wait (threading.py:320) 50",  # idle: not counted
])


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_stages_of_a_profile(tmp_path: Path) -> None:
    raw = tmp_path / "orchd.raw"
    raw.write_text(RAW + "\n")
    out = run(str(raw), "--us-per-event", "10", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["active_samples"] == 10
    assert (got["gate_and_fold_share"], got["admit_share"], got["nats_receive_share"]) == (0.6, 0.3, 0.1)
    assert (got["gate_and_fold_us"], got["admit_us"], got["nats_receive_us"]) == (6.0, 3.0, 1.0)


def test_a_file_it_cannot_use_is_named(tmp_path: Path) -> None:
    missing = run(str(tmp_path / "none.raw"))
    assert missing.returncode == 1 and "none.raw: cannot read it" in missing.stderr
    (tmp_path / "idle.raw").write_text("Thread._bootstrap (threading.py:995);Condition.wait (threading.py:320) 5\n")
    idle = run(str(tmp_path / "idle.raw"))
    assert idle.returncode == 1 and "no active sample" in idle.stderr
