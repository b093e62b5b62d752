"""The adversarial drill in CI: seed 7, 300 hostile messages (docs/chaos.md section 4): the clean and the
hostile run of one scenario against a real orchd and nats-server, the oracle asserted in full."""

from __future__ import annotations

import random

import anyio
import msgspec
import pytest

import wire as ev
from simulations.chaos import adversarial
from simulations.chaos.harness import POOL_A
from simulations.chaos.hostile import HUGE_ARRAY, NEST, Ctx, Hostile

pytestmark = pytest.mark.timeout(240)
MUTATING = {("jobs", "cancel"), ("nodes", "drain"), ("nodes", "preempt"), ("nodes", "kill"), ("dead", "replay"),
            ("reap", "run")}


def test_small_seeded_adversarial_set(tmp_path):
    r = anyio.run(adversarial.run, 7, tmp_path, 300, backend="asyncio")
    assert r.problems == [], r.problems
    assert r.hostile_messages == 300
    assert r.crashes == 0 and r.alive_after_batches == [True] * 3 and r.fresh_loads_ok == [True] * 3
    assert r.unjustified_state_changes == []
    assert r.unjustified_launches == [] and r.unjustified_terminations == []
    assert r.clean_jobs == r.hostile_jobs == {"adv-a": "succeeded", "adv-b": "succeeded"}
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
            assert req.v != 1 or endpoint == ("dead", "replay"), s
