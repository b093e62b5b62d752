"""Equal inputs give equal decisions, also across processes with different hash seeds (a restarted
daemon must re-derive the same node ids, tokens and cmd ids)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import msgspec
from orchestrator.core import State, decide, state_to_records
from orchestrator.core.inputs import JobSubmitted, Tick, LaunchFailed
from orchestrator.core.commands import Launch
from wire import CheckpointPolicy, FailureReason
from tests.core.harness import pool, price, spec

s, now, out = State.empty(), 1000.0, []
for i, z in enumerate(["a", "b", "c"]):
    for t in ["p4d", "p5"]:
        s = decide(s, price(pool(t, z), 10.0 + i), now).state
pending = []
for j in range(12):
    ck = CheckpointPolicy(url=f"file:///ck/job{j}", save_s_estimate=20.0)  # one root per job
    d = decide(s, JobSubmitted(job_id=f"job{j}", spec=spec(nodes=2, nodes_min=1, nodes_max=3, checkpoint=ck)), now)
    s = d.state; out.append(d.commands); pending += [c for c in d.commands if isinstance(c, Launch)]
while pending:  # every launch fails until all pools are in backoff; Ticks then re-place many jobs at once
    la = pending.pop(0)
    d = decide(s, LaunchFailed(node_ids=la.node_ids, job_id=la.job_id, pool=la.pool, token=la.token,
                               reason=FailureReason.CAPACITY), now)
    s = d.state; out.append(d.commands)
    pending += [c for c in d.commands if isinstance(c, Launch)]
for t in range(380):
    now += 5.0
    d = decide(s, Tick(), now)
    s = d.state; out.append(d.commands); out.append(tuple(a.action for a in d.audit))
enc = msgspec.json.Encoder(order="sorted")
print(enc.encode(out).decode())
print(enc.encode(sorted(state_to_records(s).items())).decode())
"""


def run(seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_same_decisions_under_different_hash_seeds() -> None:
    a, b = run("1"), run("2")
    assert len(a) > 1000 and a.count('"launch"') > 20
    assert a == b
