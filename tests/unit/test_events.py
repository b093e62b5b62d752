"""Wire codecs: round trips for every record, and labelled rejections for bad input."""

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wire as ev

POOL = ev.PoolKey(cloud="aws", region="us-east-1", zone="us-east-1a", instance_type="p3.2xlarge", market=ev.Market.SPOT)

SAMPLES = [
    ev.PriceTick(id="p1", pool=POOL, gpu_type="V100", gpus_per_node=1, price_usd_h=0.92, on_demand_usd_h=3.06, ts=1.0),
    ev.PreemptionNotice(id="n1", node_id=ev.NodeId("j1-n1"), cloud="aws", deadline_ts=120.0, observed_ts=1.0),
    ev.Heartbeat(node_id=ev.NodeId("j1-n1"), seq=3, ts=2.0, state=ev.AgentState.TRAINING, step=7, loss=2.5,
                 gpus=(ev.GpuStats(index=0, util_pct=90, mem_used_mib=1, mem_total_mib=2),)),
    ev.NodeRegistered(id="r1", node_id=ev.NodeId("j1-n1"), host="10.0.0.1", ts=1.0, pool=POOL),
    ev.GenerationStarted(id="g1", node_id=ev.NodeId("j1-n1"), job_id=ev.JobId("j1"), generation=2, first_step=11,
                         ts=3.0),
    ev.CheckpointCommitted(id="c1", node_id=ev.NodeId("j1-n1"), job_id=ev.JobId("j1"), generation=2, step=10,
                           checkpoint_id="step-10", url="file:///x", save_s=1.5, deadline_margin_s=100.0, ts=3.0),
    ev.RanksExited(id="x1", node_id=ev.NodeId("j1-n1"), job_id=ev.JobId("j1"), generation=2, exit_code=75,
                   reason="emergency_checkpoint", ts=4.0),
    ev.NodeLeaving(id="l1", node_id=ev.NodeId("j1-n1"), reason="sigterm", ts=5.0),
    ev.CheckpointCmd(cmd_id="c", fencing_token=4, node_id=ev.NodeId("n"), issued_ts=1.0, reason="preemption_notice",
                     deadline_ts=30.0),
    ev.StartGenerationCmd(cmd_id="s", fencing_token=4, node_id=ev.NodeId("n"), issued_ts=1.0, node_rank=0, nnodes=3,
                          gpus_per_node=1, world_size=3, master_addr="127.0.0.1", master_port=29500, resume_from=None,
                          checkpoint_url="file:///ck", total_steps=100),
    ev.StopCmd(cmd_id="t", fencing_token=4, node_id=ev.NodeId("n"), issued_ts=1.0, reason="budget"),
    ev.AbandonGenerationCmd(cmd_id="a", fencing_token=4, node_id=ev.NodeId("n"), issued_ts=1.0, reason="peer_lost"),
    ev.DrainCmd(cmd_id="d", fencing_token=4, node_id=ev.NodeId("n"), issued_ts=1.0),
    ev.CommandAck(cmd_id="c", node_id=ev.NodeId("n"), ok=True, ts=1.0),
]


def test_every_wire_type_has_a_sample() -> None:
    assert {type(s) for s in SAMPLES} == set(ev.WIRE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: msgspec.Struct) -> None:
    data = ev.encode(msg)
    assert ev.decode(data) == msg
    assert ev.decode(data, type(msg)) == msg


def test_commands_decode_as_the_command_union_only() -> None:
    assert isinstance(ev.decode(ev.encode(SAMPLES[8]), ev.AgentCommand), ev.CheckpointCmd)
    with pytest.raises(ev.WireError) as err:
        ev.decode(ev.encode(SAMPLES[0]), ev.AgentCommand)
    assert err.value.reason == "unknown_type"


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"{", "bad_json"),
        (b"not json", "bad_json"),
        (b'{"type":"nope"}', "unknown_type"),
        (b'{"type":"heartbeat","v":2,"node_id":"n","seq":1,"ts":1,"state":"idle"}', "bad_version"),
        (b'{"type":"heartbeat","v":1,"node_id":5,"seq":1,"ts":1,"state":"idle"}', "bad_schema"),
        (b'{"type":"heartbeat","v":1,"node_id":"n","seq":1,"ts":1,"state":"dancing"}', "bad_schema"),
        (b"[]", "bad_schema"),
        (b" " * (ev.MAX_MESSAGE_BYTES + 1), "too_large"),
    ],
)
def test_rejections_are_labelled(data: bytes, reason: str) -> None:
    with pytest.raises(ev.WireError) as err:
        ev.decode(data)
    assert err.value.reason == reason


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512) | st.text(max_size=256).map(str.encode))
def test_arbitrary_bytes_never_escape_as_other_errors(data: bytes) -> None:
    try:
        ev.decode(data)
    except ev.WireError as e:
        assert e.reason in {"bad_json", "unknown_type", "bad_version", "bad_schema", "too_large"}


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "*", ">", "x>"])
def test_subject_tokens_reject_wildcards_and_dots(bad: str) -> None:
    with pytest.raises(ValueError):
        ev.subject_command(bad)


def test_subjects() -> None:
    assert ev.subject_price("aws", "us-east-1") == "orch.price.aws.us-east-1"
    assert ev.subject_notice("gcp", "j1-n2") == "orch.notice.gcp.j1-n2"
    assert ev.subject_heartbeat("j1-n2") == "orch.node.j1-n2.hb"
    assert ev.subject_node_event("j1-n2") == "orch.node.j1-n2.event"
    assert ev.subject_command("j1-n2") == "orch.cmd.j1-n2"
