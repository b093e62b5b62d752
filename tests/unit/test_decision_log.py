"""The daemon's line per decided command (``Daemon._log_decision``): the triggering event's job and node
with the command's own fields (the command's winning), the same entry for ``orchctl events``, and the
audit entries only at debug level."""

from __future__ import annotations

import io
import json

import pytest

import wire as ev
from orchestrator.core.commands import Launch, SendToAgent
from orchestrator.core.model import AuditEntry
from orchestrator.core.state import Decision, State
from orchestrator.daemon.coreapi import default_core
from orchestrator.daemon.loop import Daemon
from orchestrator.daemon.metrics import Metrics
from orchestrator.settings import Settings
from wire.logs import configure

POOL = ev.PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="gpu.a", market=ev.Market.SPOT)


def _decision() -> tuple[ev.PreemptionNotice, Decision]:
    notice = ev.PreemptionNotice(id="n-1", node_id=ev.NodeId("j1-n1"), cloud="fake", deadline_ts=130.0,
                                 observed_ts=10.0)
    ckpt = SendToAgent(command=ev.CheckpointCmd(cmd_id="j1-n2-c4", node_id=ev.NodeId("j1-n2"), job_id=ev.JobId("j1"),
                                                generation=3, fencing_token=1, issued_ts=10.0,
                                                reason="preemption_notice"))
    launch = Launch(job_id=ev.JobId("j1"), pool=POOL, node_ids=(ev.NodeId("j1-n9"),), token="t-1")
    audit = AuditEntry(ts=10.0, job_id="j1", event="PreemptionNotice", action="checkpoint",
                       reason="preemption_notice", alternatives=(), details={"generation": 3})
    return notice, Decision(state=State.empty(), commands=(ckpt, launch), audit=(audit,), dirty=frozenset())


@pytest.mark.parametrize("level", ["info", "debug"])
def test_a_decision_is_logged_per_command_with_its_event_context(level: str) -> None:
    out = io.StringIO()
    configure(level, "json", stream=out)
    try:
        d = Daemon(Settings(), {}, default_core(Settings()), Metrics())
        d.events.decision(*_decision())
    finally:
        configure("info", "auto")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    commands = [x for x in lines if x["event"] == "command_decided"]
    assert [(x["command"], x.get("kind"), x.get("node")) for x in commands] == [
        ("SendToAgent", "checkpoint", "j1-n2"),  # the command's node, not the notice's
        ("Launch", None, "j1-n1"),  # a launch names no node: the notice's
    ]
    assert all(x["job"] == "j1" for x in commands)
    assert commands[0]["cmd_id"] == "j1-n2-c4" and commands[1]["token"] == "***" and commands[1]["nodes"] == ["j1-n9"]
    audits = [x for x in lines if x["event"] == "decision_audit"]
    assert len(audits) == (level == "debug")
    if audits:
        assert audits[0]["node"] == "j1-n1" and "action='checkpoint'" in audits[0]["entry"]
    assert [(e["event"], e["command"], e.get("node")) for e in d.events.recent] == [
        ("PreemptionNotice", "SendToAgent", "j1-n2"), ("PreemptionNotice", "Launch", "j1-n1")]
