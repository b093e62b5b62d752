"""A checkpoint command handed out before the outbox (``pipeline.dispatch_checkpoints``) must not
overtake the start of the generation it names: when one batch decides a node's ``StartGenerationCmd``
and then, from a notice, a ``CheckpointCmd`` of that very generation (the last registration starts
the generation, the notice of a member comes in the same batch), the agent would get the checkpoint
first - answered ``unknown_generation``, cached under its ``cmd_id`` - then start the generation and
train on a noticed node, while the job waits in ``checkpointing``. The real core decides the batch;
a recorder stands for the executor (``dispatch_checkpoints`` / ``dispatch`` call only ``submit_all``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import wire as ev
from orchestrator.core import State
from orchestrator.core.commands import Command, SendToAgent
from orchestrator.core.inputs import JobSubmitted
from orchestrator.core.model import CoreConfig
from orchestrator.daemon import pipeline
from orchestrator.daemon.coreapi import default_core
from orchestrator.daemon.metrics import Metrics
from orchestrator.settings import Settings
from tests.core.harness import Driver, price, spec
from tests.core.test_price_confirm import A_OD, A


@dataclass
class _Recorder:
    submitted: list[Command] = field(default_factory=list)

    def submit_all(self, commands: list[tuple[str, Command, float | None]]) -> None:
        for key, cmd, notice_ts in commands:
            self.submit(key, cmd, notice_ts=notice_ts)

    def submit(self, key: str, cmd: Command, *, notice_ts: float | None = None) -> None:
        self.submitted.append(cmd)


def _agent_commands(cmds: list[Command], node: str) -> list[str]:
    return [type(c.command).__name__ for c in cmds if isinstance(c, SendToAgent) and c.command.node_id == node]


def test_a_checkpoint_of_a_generation_started_in_the_same_batch_leaves_after_the_start() -> None:
    drv = Driver(State.empty(CoreConfig(price_confirm_s=0.0)))
    drv(price(A, 10.0))
    drv(price(A_OD, 30.0, None))
    ids = drv.launched(drv(JobSubmitted(job_id="j1", spec=spec(nodes=2, nodes_min=2, nodes_max=2, total_steps=1000))))
    drv.register(ids[:1])
    last = ids[1]
    batch = [ev.NodeRegistered(id=f"r-{last}", node_id=ev.NodeId(last), host="10.0.0.9", ts=drv.now),
             ev.PreemptionNotice(id="notice-1", node_id=ev.NodeId(last), cloud=A.cloud, deadline_ts=drv.now + 60,
                                 observed_ts=drv.now)]
    decider = pipeline.Decider(default_core(Settings()), drv.state, metrics=Metrics(), on_decision=lambda e, d: None,
                               clock=lambda: drv.now)
    assert decider.decide(batch).failed == []
    decided = decider.out
    in_order = _agent_commands(list(decided.commands.values()), last)
    assert in_order == ["StartGenerationCmd", "CheckpointCmd"]  # the batch the attack needs
    gens = {c.command.generation for c in decided.commands.values()
            if isinstance(c, SendToAgent) and c.command.node_id == last}
    assert len(gens) == 1  # the checkpoint names the generation the start begins

    rec = _Recorder()
    early = pipeline.dispatch_checkpoints(decided, rec)  # type: ignore[arg-type]
    pipeline.dispatch(decided, rec, early)  # type: ignore[arg-type]
    assert _agent_commands(rec.submitted, last) == in_order  # today: the checkpoint first
    assert sorted(map(id, rec.submitted)) == sorted(map(id, decided.commands.values()))  # each once
