"""Shard replicas with real gloo ranks and real holder processes: a node that vanishes without notice
(its ranks, its holder's memory and its work directory destroyed) costs at most k + 1 steps, and the
resumed job is exact (bitwise the uninterrupted run's losses, every sample fed once)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from orchestrator.core.replicas import newest_complete
from tests.trainer.helpers import GPT_CMD, Generation, step_records, trainer_env
from tests.trainer.replica_nodes import Node, launch
from trainer import contract

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("replicas")]

ARGS = {"size": "tiny", "seq_len": 32, "global_batch": 6, "micro_batch": 2, "lr": 3e-3, "warmup_steps": 3, "seed": 7}
TOTAL = 14
EVERY = 1


def _losses(recs: list[contract.StepRecord]) -> dict[int, float]:
    return {r.step: r.loss for r in recs}


def _wait_step(g, step: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while g.max_step() < step:
        assert time.monotonic() < deadline, g.log()
        assert all(r.proc.poll() is None for r in g.ranks), g.log()
        time.sleep(0.01)


def _facts(nodes: list[Node]) -> list[tuple[str, int, int, int]]:
    return [(n.name, rank, step, ws) for n in nodes for (rank, step, ws, _gen) in n.inventory()]


def test_vanished_node_recovers_from_peers_memory_exactly(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    ref.mkdir()
    g = Generation(GPT_CMD, 3, trainer_env(ref, total_steps=TOTAL, args=ARGS))
    assert g.wait() == [0, 0, 0], g.log()
    reference = _losses(step_records(ref / "steps.jsonl"))

    run = tmp_path / "run"
    run.mkdir()
    env = trainer_env(run, total_steps=TOTAL, args={**ARGS, "ckpt_every": 5})
    nodes = [Node(f"n{i}", run / f"node{i}", "job-r", 1).start() for i in range(3)]
    try:
        g1 = launch(nodes, 1, env, every=EVERY)
        _wait_step(g1, 8)
        nodes[2].vanish()  # holder memory and work directory gone ...
        os.killpg(g1.ranks[2].proc.pid, signal.SIGKILL)  # ... and its rank, mid-step
        codes = g1.wait()
        assert codes[:2] == [contract.EXIT_PEER_LOST] * 2, g1.log()
        done = g1.max_step()  # the newest step any rank finished before the loss

        # orchd's choice from the survivors' reports (the replacement's holder is empty)
        replacement = Node("n3", run / "node3", "job-r", 2).start()
        members = [nodes[0], nodes[1], replacement]
        for n in members[:2]:
            n.set_generation(2)
        complete, why = newest_complete(_facts(members), [n.name for n in members], 3, not_before=5)
        assert complete, why
        step = complete[0]
        assert done - step <= EVERY + 1, (done, step)
        assert done - step <= 1, (done, step)  # the demo's figure: k = 1 loses at most the step in flight

        g2 = launch(members, 2, {**env, contract.ENV_RESUME_FROM: "latest"}, every=EVERY, replica_step=step)
        assert g2.wait() == [0, 0, 0], g2.log()
        assert any(f"replica_resumed step={step} rank=2" in line and "source=local" not in line
                   for line in g2.ranks[2].lines), g2.log()  # the lost shard came over the network
        assert any(f"replica_resumed step={step} rank=0 source=local" in line for line in g2.ranks[0].lines)
        assert not any("resumed_from dir=" in line for r in g2.ranks for line in r.lines)  # no durable load
    finally:
        for n in [*nodes, *locals().get("members", [])]:
            n.stop()

    recs = step_records(run / "steps.jsonl")
    final = {(r.step, r.rank): r for r in recs if r.generation == 1 and r.step <= step}
    final.update({(r.step, r.rank): r for r in recs if r.generation == 2})
    assert min(r.step for r in recs if r.generation == 2) == step + 1
    for s in range(1, TOTAL + 1):
        ids = sorted(i for rank in range(3) for i in final[(s, rank)].sample_ids)
        assert ids == list(range((s - 1) * 6, s * 6)), s  # every sample of the step once, none twice
        assert final[(s, 0)].loss == reference[s], (s, final[(s, 0)].loss, reference[s])  # bitwise
