"""The adversarial drill in CI: seed 7, 300 hostile messages (docs/chaos.md section 4): the clean and the
hostile run of one scenario against a real orchd and nats-server, the oracle asserted in full (wedges
included); the generator's contract, hostile names in every name field among them."""

from __future__ import annotations

import random

import anyio
import msgspec
import pytest

import wire as ev
from simulations.chaos import adversarial
from simulations.chaos.harness import POOL_A
from simulations.chaos.hostile import HUGE_ARRAY, NEST, Ctx, Hostile
from simulations.chaos.names import DOTTED, NAMES, SUBMIT_FIELDS, TRACKING_URIS, BadNames
from wire.names import is_key, is_token

pytestmark = pytest.mark.timeout(240)
MUTATING = {("jobs", "cancel"), ("nodes", "drain"), ("nodes", "preempt"), ("nodes", "kill"), ("dead", "replay"),
            ("reap", "run")}


def test_small_seeded_adversarial_set(tmp_path):
    r = anyio.run(adversarial.run, 7, tmp_path, 300, backend="asyncio")
    assert r.problems == [], r.problems
    assert r.hostile_messages == 300
    assert r.crashes == 0 and r.alive_after_batches == [True] * 3 and r.fresh_loads_ok == [True] * 3
    assert r.wedges == [], r.notice_to_command_s
    assert r.admin_internal_errors == {}
    times = r.notice_to_command_s
    assert len(times["hostile_after_batches"]) == 3 and None not in times["hostile_after_batches"], times
    assert all(t <= times["bound_s"] <= 5.0 for t in times["hostile_after_batches"]), times
    # the new kinds were sent (records, log lines and admin bodies) and refused for their names
    sent = {k.split("/")[1].split(".")[0] for k in r.by_kind if k.startswith("bad_name/")}
    assert {"node_event", "heartbeat", "notice", "price", "log", "admin"} <= sent, r.by_kind
    assert sum(r.bad_names.values()) == sum(v for k, v in r.by_kind.items() if k.startswith("bad_name/"))
    assert any(k.endswith("/bad_name") for k in r.rejected_by_reason), r.rejected_by_reason
    assert r.unjustified_state_changes == []
    assert r.unjustified_launches == [] and r.unjustified_terminations == []
    jobs = {"adv-a": "succeeded", "adv-b": "succeeded", **{j: "cancelled" for j in adversarial.PROBES}}
    assert r.clean_jobs == r.hostile_jobs == jobs
    assert sum(r.rejected_by_reason.values()) > 0
    assert adversarial.passed(r)


def _ctx() -> Ctx:
    return Ctx(job_of={"j1-n1": "j1", "j1-n2": "j1", "j2-n3": "j2"},
               instance_of={"j1-n1": ("fake-1", POOL_A), "j1-n2": ("fake-2", POOL_A), "j2-n3": ("fake-3", POOL_A)},
               live={"j1-n2", "j2-n3"}, generation={"j1": 2, "j2": 1},
               roots={"j1": "file:///tmp/orch-chaos/j1", "j2": "file:///tmp/orch-chaos/j2"},
               terminal=set(), noticed={"j1-n1"})


def test_generator_is_seeded_and_never_sends_a_valid_mutating_admin_request():
    s1 = [Hostile(random.Random(5), _ctx(), "t").next() for _ in range(1)]
    g1, g2 = Hostile(random.Random(5), _ctx(), "t"), Hostile(random.Random(5), _ctx(), "t")
    a, b = [g1.next() for _ in range(500)], [g2.next() for _ in range(500)]
    assert [(s.kind, s.subject) for s in a] == [(s.kind, s.subject) for s in b]
    assert s1[0].kind == a[0].kind
    kinds = {s.kind.split("/")[0] for s in a}
    assert {"foreign_job", "old_generation", "foreign_instance", "ckpt_outside_root", "dead_notice",
            "extreme_price", "admin_extreme_spec", "admin_deep_nest", "admin_duplicate_keys"} <= kinds
    assert len(NEST) == 2000 and len(HUGE_ARRAY) < 256 * 1024
    skipping = Hostile(random.Random(5), _ctx(), "t", adversarial.EXPECTED_FAILURES)
    assert not any(s.kind.startswith(adversarial.EXPECTED_FAILURES) for s in (skipping.next() for _ in range(500)))
    for s in a:
        assert len(s.data) < 256 * 1024
        endpoint = tuple(s.subject.split(".")[-2:])
        if s.target == "admin" and endpoint in MUTATING:
            # a valid cancel/drain/reap is a legitimate operator's action: never generated (a dead.replay of
            # a sequence number that does not exist is harmless)
            req_type = ev.ADMIN_ENDPOINTS[endpoint][0]  # type: ignore[index]
            try:
                req = msgspec.json.decode(s.data, type=req_type)
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue
            ids = [getattr(req, f, None) for f in ("job_id", "node_id")]
            # a job or node id that is not a token names nothing that can exist: refused, never a mutation
            named = all(is_token(x) for x in ids if x is not None)
            assert req.v != 1 or endpoint == ("dead", "replay") or not named, s


def test_hostile_names_reach_every_name_field_and_are_never_valid_names():
    g = Hostile(random.Random(11), _ctx(), "t", huge_budget=0)  # no 200 KB arrays: many shots, little memory
    shots = [g.next() for _ in range(20_000)]
    fields = {s.kind.split("/", 1)[1] for s in shots if s.kind.startswith("bad_name/")}
    for want in ("node_event.node_id", "node_event.job_id", "node_event.instance_id", "node_event.pool.cloud",
                 "node_event.pool.region", "node_event.pool.zone", "node_event.pool.instance_type",
                 "heartbeat.node_id", "heartbeat.job_id", "notice.node_id", "notice.cloud", "price.pool.cloud",
                 "price.pool.region", "price.pool.zone", "price.pool.instance_type", "log.line", "log.job_id",
                 "log.node_id", "admin.jobs.show.job_id", "admin.jobs.cancel.job_id", "admin.nodes.drain.node_id",
                 "admin.nodes.list.job_id", *(f"admin.jobs.submit.{f}" for f in SUBMIT_FIELDS)):
        assert want in fields, want
    assert set(NAMES) | {DOTTED[0]} <= set(g.names.used) <= set(NAMES) | {DOTTED[0]} | set(TRACKING_URIS)
    uris = BadNames(random.Random(2), _ctx(), lambda: "x")
    assert {uris.name("tracking.uri") for _ in range(400)} == set(NAMES.values()) | set(TRACKING_URIS.values())
    assert not any(is_token(v) or is_key(v) for v in NAMES.values())
    assert is_key(DOTTED[1]) and not is_token(DOTTED[1])
    for s in shots:
        if s.kind.startswith("bad_name/"):
            assert len(s.data) < 256 * 1024
            assert is_token(s.subject.replace(".", "-"))  # the subject is a real one: the name is in the payload
            if s.kind.startswith("bad_name/admin.jobs.submit."):
                body = msgspec.json.decode(s.data)
                field = s.kind.rsplit("jobs.submit.", 1)[1]
                assert field == "job_id" or is_token(body["job_id"])  # refused for the hostile field alone
