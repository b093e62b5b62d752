"""End to end: an existing Hugging Face ``Trainer`` script as a spot job, through orchd.

A job spec (``trainer.command = [python, examples/hf_trainer/train.py, ...]``, ``trainer.integration = "hf"``)
goes to orchd (embedded NATS, the real core, the demo's harness ``run_demo``) on the local provider: one
orch-agent node runs the script, whose one added line is ``spot_train(trainer)``. The node gets a preemption
notice through its metadata service; the test waits until the node is dead (killed at the deadline) and
deletes its whole work directory (the Trainer's ``output_dir``, its control files, its logs), keeping only
its step log for the checks. orchd resumes the job on another node, which has nothing but the job's
checkpoint root to start from. Asserted:

- the job succeeded and every step ran; the generation after the notice ran on another node, and its first
  step came after the first node's files were gone;
- the notice lost nothing: the first step after it is the step after the last one before it (the checkpoint
  was committed within the notice; otherwise the job would have gone back to an earlier one);
- no step ran twice, none was skipped, and the trajectory that counts fed every sample of both epochs exactly
  once (the demo's ``sample_order_exact``, and the sample ids ``epoch * len + index`` cover both epochs).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

from orchestrator.cli.demo import DemoOptions, run_demo
from orchestrator.cli.demo_report import compute_report, load_step_logs, sample_order_exact
from orchestrator.jobspec import parse_jobspec
from tests.extras import needs

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(400), needs("transformers", "accelerate")]

REPO = Path(__file__).resolve().parents[2]
SAMPLES, BATCH = 120, 2
STEPS = 2 * SAMPLES // BATCH  # two epochs on one rank


def _spec(tmp: Path) -> Any:
    cmd = [sys.executable, str(REPO / "examples" / "hf_trainer" / "train.py"), "--output-dir", "hf-out",
           "--samples", str(SAMPLES), "--batch", str(BATCH), "--epochs", "10"]
    return parse_jobspec(f"""
name = "hf-trainer-script"
total_steps = {STEPS}
step_time_s_estimate = 0.2
gpu_type = "cpu"
gpus_per_node = 1
nodes = 1
nodes_min = 1
nodes_max = 1
clouds = ["local"]
market = "spot_with_fallback"
[trainer]
command = {json.dumps(cmd)}
integration = "hf"
env = {{ OMP_NUM_THREADS = "1", ORCH_COLLECTIVE_TIMEOUT_S = "10" }}
[checkpoint]
url = "file://{tmp / 'ckpt'}"
interval_s = 600
""")


def _alive(node: str) -> bool:
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE and f"--node-id {node} " in " ".join(p.cmdline()) + " ":
                return True
    return False


async def _delete_noticed_node(nodes: Path, kept: Path, done: dict[str, Any]) -> None:
    """Once the noticed node is dead: keep its step log aside, delete its work directory."""
    victim = None
    while victim is None:
        victim = next((p.parent for p in nodes.glob("*/agent.log") if '"spot_notice_received"' in p.read_text()),
                      None)
        await anyio.sleep(0.2)
    while _alive(victim.name):
        await anyio.sleep(0.2)
    (kept / victim.name / "steps").mkdir(parents=True)
    shutil.copy(victim / "steps" / "demo.jsonl", kept / victim.name / "steps" / "demo.jsonl")
    held = sorted(str(p.relative_to(victim)) for p in victim.rglob("*"))
    shutil.rmtree(victim)
    done.update(node=victim.name, ts=time.time(), held=held)


async def test_hf_trainer_script_noticed_and_resumed_by_orchd_on_another_node(tmp_path: Path) -> None:
    opts = DemoOptions(steps=STEPS, nodes=1, nodes_min=1, notice_s=5.0, notice_at=0.1, vanish=False, spike=False,
                       replica_every=0, timeout_s=300.0, state_dir=str(tmp_path / "demo"), keep=True,
                       spec=_spec(tmp_path))
    deleted: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(_delete_noticed_node, tmp_path / "demo" / "nodes", tmp_path / "kept", deleted)
        result = await run_demo(opts)
        tg.cancel_scope.cancel()
    assert result.report["job_succeeded"], result.report
    assert deleted, "the noticed node's work directory was not deleted"
    assert any(h.startswith("hf-out") for h in deleted["held"]), deleted  # the Trainer's output_dir was there

    logs = [*(tmp_path / "kept").glob("*/steps/demo.jsonl"), *(tmp_path / "demo" / "nodes").glob("*/steps/demo.jsonl")]
    recs = load_step_logs(logs)
    r = compute_report(recs, result.injections, total_steps=STEPS)
    assert r["steps_completed"] == STEPS, r
    (notice,) = r["preemptions"]
    assert notice["node"] == deleted["node"], (notice, deleted)
    assert notice["lost_steps"] == 0 and notice["first_step_after"] == notice["last_step_before"] + 1, r
    after = [g for g in r["generation_table"] if g["generation"] == notice["next_generation"]]
    assert after and deleted["node"] not in after[0]["nodes"], r["generation_table"]  # another node
    first_after = min(x.ts for x in recs if x.generation == notice["next_generation"])
    assert first_after > deleted["ts"], "the next generation stepped before the first node's files were gone"
    assert r["steps_executed_twice"] == 0, r
    assert r["sample_order_exact"] and sample_order_exact(recs), r
    fed = sorted(i for x in recs for i in x.sample_ids)
    assert fed == list(range(2 * SAMPLES)), fed  # both epochs, every sample exactly once
