"""The chaos drills in CI: a small seeded set (3 kill -9 iterations, 1 NATS restart, 5,000 fuzzed
messages) with real nats-servers and real orchd subprocesses. The full runs are
``python -m simulations.chaos --json`` (docs/chaos.md)."""

from __future__ import annotations

import random

import anyio
import pytest

import wire as ev
from orchestrator import bus
from orchestrator.daemon.loop import _EXPECTED, _HB_DECODER, _JS_TYPES
from orchestrator.daemon.ingest import screen, screen_heartbeat
from simulations.chaos.__main__ import passed, run_all
from simulations.chaos.fuzz import Generator

pytestmark = pytest.mark.timeout(240)


def test_small_seeded_set(tmp_path):
    out = anyio.run(lambda: run_all(seed=7, iterations=3, n_fuzz=5000, nats_restarts=1, max_kills=2,
                                    workdir=tmp_path), backend="asyncio")
    assert out["problems"] == [], out["problems"]
    assert out["kills"] >= 3 and out["faults_injected"] == out["kills"] + 1
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
    """The generator's contract, checked against the daemon's own decoders and screens (so a generator
    bug cannot pass as a daemon bug, nor the other way round in the drill's figures)."""
    g = Generator(random.Random(3), "job-x", ["job-x-n1", "job-x-n2"])
    accepted = []
    for _ in range(20_000):
        s = g.next()
        if s.target == "admin" or s.mutation == "replay":
            continue
        try:
            if s.target == "heartbeat":
                if len(s.data) > ev.MAX_MESSAGE_BYTES:
                    continue
                hb = _HB_DECODER.decode(s.data)
                reason = "bad_version" if hb.v != 1 else screen_heartbeat(s.subject, hb)
            else:
                reason = screen(s.subject, ev.decode(s.data, _EXPECTED.get(bus.message_kind(s.subject), _JS_TYPES)))
        except Exception:
            continue
        if reason is None:
            accepted.append(s)
    assert accepted == []
