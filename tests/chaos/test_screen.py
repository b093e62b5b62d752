"""Unit tests of ``orchestrator.daemon.admit.screen``: the checks the chaos fuzzer found missing (a node
publishing another node's events, negative prices) - pure, no I/O."""

from __future__ import annotations

import msgspec
import pytest

import wire as ev
from orchestrator.daemon.admit import screen
from orchestrator.daemon.admit import screen_hb as screen_heartbeat

POOL = ev.PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="gpu.small", market=ev.Market.SPOT)
R = msgspec.structs.replace


def tick(**kw):
    base = dict(id="p1", pool=POOL, gpu_type="A100", gpus_per_node=1, price_usd_h=1.0, on_demand_usd_h=3.0, ts=1e9)
    return ev.PriceTick(**{**base, **kw})


def test_honest_messages_pass():
    assert screen("orch.price.fake.r1", tick()) is None
    n = ev.PreemptionNotice(id="x", node_id="j-n1", cloud="fake", deadline_ts=1e9 + 120, observed_ts=1e9)
    assert screen("orch.notice.fake.j-n1", n) is None
    assert screen("orch.notice.fake.j-n1", R(n, kind=ev.NoticeKind.REBALANCE, deadline_ts=None)) is None
    c = ev.CheckpointCommitted(id="c", node_id="j-n1", job_id="j", generation=2, step=10, checkpoint_id="s",
                               url="file:///x", save_s=1.0, deadline_margin_s=-3.0, ts=1e9)
    assert screen("orch.node.j-n1.event", c) is None
    hb = ev.Heartbeat(node_id="j-n1", seq=0, ts=1e9, state=ev.AgentState.IDLE)
    assert screen_heartbeat("orch.node.j-n1.hb", hb) is None


@pytest.mark.parametrize("subject,msg", [
    ("orch.price.fake.r2", tick()),
    ("orch.price.aws.r1", tick()),
    ("orch.notice.fake.j-n2", ev.PreemptionNotice(id="x", node_id="j-n1", cloud="fake", deadline_ts=1.0,
                                                  observed_ts=1.0)),
    ("orch.notice.gcp.j-n1", ev.PreemptionNotice(id="x", node_id="j-n1", cloud="fake", deadline_ts=1.0,
                                                 observed_ts=1.0)),
    ("orch.node.evil.event", ev.RanksExited(id="r", node_id="j-n1", job_id="j", generation=1, exit_code=0,
                                            reason="completed", last_step=10**9, ts=1.0)),
])
def test_subject_must_name_the_publisher(subject, msg):
    assert screen(subject, msg) == "subject_mismatch"


@pytest.mark.parametrize("msg", [
    tick(price_usd_h=-1.0), tick(price_usd_h=float("nan")), tick(on_demand_usd_h=float("inf")),
    tick(capacity_hint=1.5), tick(gpus_per_node=0), tick(ts=-5.0), tick(id=""),
])
def test_bad_price_values(msg):
    assert screen("orch.price.fake.r1", msg) == "bad_value"


def test_bad_node_event_values_and_heartbeats():
    g = ev.GenerationStarted(id="g", node_id="n", job_id="j", generation=-1, first_step=0, ts=1.0)
    assert screen("orch.node.n.event", g) == "bad_value"
    c = ev.CheckpointCommitted(id="c", node_id="n", job_id="j", generation=1, step=1, checkpoint_id="s",
                               url="u", save_s=float("nan"), ts=1.0)
    assert screen("orch.node.n.event", c) == "bad_value"
    hb = ev.Heartbeat(node_id="n", seq=1, ts=1.0, state=ev.AgentState.IDLE)
    assert screen_heartbeat("orch.node.m.hb", hb) == "subject_mismatch"
    assert screen_heartbeat("orch.node.n.hb", R(hb, step=-1)) == "bad_value"


def test_a_replica_unusable_exit_says_why_in_bounded_words():
    x = ev.RanksExited(id="x", node_id="n", job_id="j", generation=2, exit_code=79, reason="replica_unusable",
                       ts=1.0, detail="rank 0 step 8: 10.0.0.2:4000: ProtocolError: checksum mismatch")
    assert screen("orch.node.n.event", x) is None
    assert screen("orch.node.n.event", R(x, detail="x" * (ev.MAX_EXIT_DETAIL + 1))) == "bad_value"
    assert screen("orch.node.n.event", R(x, replica_lag_max=3)) is None  # the ranks' measured loss bound
    assert screen("orch.node.n.event", R(x, replica_lag_max=-1)) == "bad_value"
