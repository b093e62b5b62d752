"""The chaos drills in CI: a small seeded set (3 kill -9 iterations, 1 where a zone goes away and orchd
is killed during the burst of notices, 1 NATS restart, 5,000 fuzzed messages) with real nats-servers and
real orchd subprocesses. The full runs are ``python -m simulations.chaos --json`` (docs/chaos.md)."""

from __future__ import annotations

import random

import anyio
import pytest

from orchestrator.daemon.admit import Rejected, admit_heartbeat, admit_js
from simulations.chaos.__main__ import passed, run_all
from simulations.chaos.fuzz import Generator

pytestmark = pytest.mark.timeout(240)


def test_small_seeded_set(tmp_path):
    out = anyio.run(lambda: run_all(seed=7, iterations=3, n_fuzz=5000, nats_restarts=1, max_kills=2,
                                    workdir=tmp_path, burst_iterations=1), backend="asyncio")
    assert out["problems"] == [], out["problems"]
    assert out["kills"] >= 4 and out["faults_injected"] == out["kills"] + 1
    assert out["burst_notices"] >= 6 and out["burst_kills"] >= 1 and "notice_burst" in out["kill_points"]
    for key in ("lost_jobs", "unfinished_jobs", "duplicate_launches", "leaked_instances", "lost_events",
                "spurious_recoveries", "daemon_crashes"):
        assert out[key] == 0, (key, out)
    assert out["fuzzed_messages"] >= 5000
    # every fuzzed message was either dropped by the stream as a replay or counted by orchd
    assert out["rejected_counted"] + out["deduplicated_replays"] == out["fuzzed_messages"]
    assert out["counters_add_up"] and out["state_unchanged"]
    assert out["admin_error_replies"] == out["fuzz_by_target"]["admin"]
    assert out["fuzz_by_target"]["command_ack"] > 0
    assert passed(out)


def test_every_generated_message_is_one_the_daemon_must_reject():
    """The generator's contract, checked against the daemon's own decode and screen stages (the functions
    its pipeline runs: a generator bug cannot pass as a daemon bug, nor the other way round in the drill's
    figures). Admission never raises: every message is either an event for the core or ``Rejected``."""
    g = Generator(random.Random(3), "job-x", ["job-x-n1", "job-x-n2"])
    accepted = []
    reasons: set[str] = set()
    for _ in range(20_000):
        s = g.next()
        if s.target == "admin" or s.mutation == "replay":
            continue
        admit = admit_heartbeat if s.target == "heartbeat" else admit_js
        result = admit(s.subject, s.data)
        if isinstance(result, Rejected):
            reasons.add(result.reason)
        else:
            accepted.append(s)
    assert accepted == []
    assert {"bad_json", "bad_schema", "subject_mismatch", "bad_value"} <= reasons, reasons
