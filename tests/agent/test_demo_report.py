"""The demo report's figures from synthetic step logs (pure functions)."""

from __future__ import annotations

import json

from orchestrator.cli.demo_report import (
    Injection,
    Rec,
    compute_report,
    load_step_logs,
    loss_by_step,
    sample_order_exact,
)


def _gen(g: int, steps: range, ws: int, t0: float, dt: float = 1.0) -> list[Rec]:
    return [Rec(g, s, r, ws, 10.0 / s, tuple(range(s * 8 + r * 8 // ws, s * 8 + (r + 1) * 8 // ws)), t0 + i * dt,
                f"n{r}") for i, s in enumerate(steps) for r in range(ws)]


def test_report_attributes_lost_steps_and_recovery() -> None:
    recs = (_gen(1, range(1, 21), 3, 0.0)  # notice at t=19.5 -> checkpoint at step 20, gen 2 at t=30
            + _gen(2, range(21, 41), 2, 30.0)  # vanish at t=45 (step 36); last checkpoint at 30
            + _gen(3, range(31, 61), 3, 52.0))
    inj = [Injection("notice", 19.5, "n2"), Injection("vanished", 45.2, "n1"), Injection("price_spike", 70.0)]
    r = compute_report(recs, inj, total_steps=60, node_pools={"n0": "local-a/spot"})
    assert r["steps_completed"] == 60 and r["final_loss"] == round(10.0 / 60, 6)
    assert r["generations"] == 3
    notice, vanished = r["preemptions"]
    assert (notice["kind"], notice["lost_steps"], notice["recovery_s"]) == ("notice", 0, 10.5)
    assert (vanished["kind"], vanished["lost_steps"], vanished["recovery_s"]) == ("vanished", 10, 6.8)
    assert r["steps_executed_twice"] == 10
    assert r["sample_order_exact"]
    assert r["generation_table"][0]["nodes"] == {"n0": "local-a/spot", "n1": "", "n2": ""}


def test_sample_order_checks() -> None:
    ok = _gen(1, range(1, 5), 2, 0.0)
    assert sample_order_exact(ok)
    dup = ok + [Rec(2, 5, 0, 1, 1.0, (9,), 10.0)]  # sample 9 was step 1's
    assert not sample_order_exact(dup)
    other = ok + [Rec(2, 4, 0, 1, 1.0, (1000,), 10.0)]  # step 4 re-executed with other samples
    assert not sample_order_exact(other)
    assert loss_by_step(ok + [Rec(2, 4, 0, 1, 7.0, (32, 33, 34, 35, 36, 37, 38, 39), 10.0)])[4] == 7.0


def test_load_step_logs_tags_nodes_and_skips_torn_lines(tmp_path) -> None:
    p = tmp_path / "node-7" / "steps" / "job.jsonl"
    p.parent.mkdir(parents=True)
    rec = {"generation": 1, "step": 1, "rank": 0, "world_size": 1, "loss": 2.5, "sample_ids": [0, 1], "ts": 1.0}
    p.write_text(json.dumps(rec) + "\n" + '{"generation": 1, "st')  # cut by a kill -9
    (got,) = load_step_logs([p])
    assert got.node == "node-7" and got.sample_ids == (0, 1)


def test_demo_display_and_text_report_render() -> None:
    from rich.console import Console

    from orchestrator.cli.demo import DemoOptions, View, format_report, render

    view = View(DemoOptions())
    console = Console(record=True, width=120)
    console.print(render(view))  # before the job exists
    view.job = {"phase": "running", "generation": 2, "step": 40, "total_steps": 200, "committed_step": 30,
                "zone": "local/local-1/local-a", "cost_usd": 0.01}
    view.nodes = [{"node_id": "demo-n1", "phase": "running", "pool": "local/local-1/local-a/cpu.local/spot",
                   "generation": 2, "rank": 0, "step": 40, "heartbeat_age_s": 0.4},
                  {"node_id": "demo-n4", "phase": "booting", "pool": "local/local-1/local-a/cpu.local/on_demand",
                   "generation": 0, "rank": -1, "step": 0, "heartbeat_age_s": None}]
    view.loss = {"demo-n1": 2.5}
    view.event("PREEMPTION NOTICE for demo-n3")
    console.print(render(view))
    text = console.export_text()
    assert "demo-n1" in text and "local-a/on_demand" in text and "PREEMPTION NOTICE" in text
    recs = _gen(1, range(1, 11), 2, 0.0) + _gen(2, range(11, 21), 2, 20.0)
    r = compute_report(recs, [Injection("notice", 15.0, "n1"), Injection("price_spike", 16.0, "", "x")], total_steps=20)
    r.update(job_succeeded=True, wall_s=30.0, cost_usd=0.01, on_demand_cost_usd=0.03, orchd_cost_estimate_usd=0.012)
    out = format_report(r)
    assert "SUCCEEDED" in out and "lost_steps=0" in out and "price spike (x)" in out


def test_interrupted_step_is_not_a_sample_order_error() -> None:
    full = _gen(1, range(1, 6), 2, 0.0)
    cut = [Rec(1, 6, 1, 2, 1.0, (52, 53, 54, 55), 6.0, "n1")]  # rank 1 logged step 6, then its peer died
    redo = _gen(2, range(6, 9), 2, 10.0)
    assert sample_order_exact(full + cut + redo)
    wrong = [Rec(1, 6, 1, 2, 1.0, (99,), 6.0, "n1")]
    assert not sample_order_exact(full + wrong + redo)
    assert not sample_order_exact(full + cut)  # step 6 never completed


def test_a_vanished_on_demand_node_is_a_failure_not_a_preemption() -> None:
    from orchestrator.cli.demo import DemoOptions, format_report

    recs = _gen(1, range(1, 21), 3, 0.0) + _gen(2, range(21, 41), 2, 30.0) + _gen(3, range(31, 61), 3, 52.0)
    inj = [Injection("notice", 19.5, "n2"), Injection("vanished", 45.2, "n1")]
    pools = {"n0": "local-a/spot", "n1": "local-b/on_demand", "n2": "local-a/spot"}
    r = compute_report(recs, inj, total_steps=60, node_pools=pools)
    assert [(p["kind"], p["market"]) for p in r["preemptions"]] == [("notice", "spot")]
    (failure,) = r["node_failures"]
    assert (failure["kind"], failure["node"], failure["market"], failure["lost_steps"]) == ("vanished", "n1",
                                                                                           "on_demand", 10)
    r.update(job_succeeded=True, wall_s=60.0, cost_usd=0.01, on_demand_cost_usd=0.03, orchd_cost_estimate_usd=0.01)
    text = format_report(r)
    assert "preemption (vanished)" not in text and "node lost (vanished, on_demand: not a preemption) n1" in text
    assert DemoOptions().steps == 200


def test_the_display_says_why_the_step_goes_back_and_when_a_notice_is_due() -> None:
    from orchestrator.cli.demo import DemoOptions, View

    view = View(DemoOptions())
    assert view.step_text() == "step -/200 (orchd starting)"
    view.update({"phase": "placing", "generation": 0, "step": 0, "total_steps": 200, "target_nodes": 3},
                [{"node_id": "demo-n1", "phase": "booting"}])
    assert view.step_text() == "step -/200 (waiting for nodes: 0 of 3 up)"
    view.update({"phase": "running", "generation": 1, "step": 81, "total_steps": 200, "committed_step": 66}, [])
    assert view.step_text() == "step 81/200" and not view.events
    view.notice("demo-n3", 20.0)
    assert "demo-n3 killed in 20s" in view.notice_text() or "demo-n3 killed in 19s" in view.notice_text()
    view.update({"phase": "running", "generation": 2, "step": 67, "total_steps": 200, "committed_step": 66}, [],
                now=view.notices["demo-n3"] + 0.1)
    said = [msg for _, msg in view.events]
    assert any(m.startswith("step 81 -> 67: generation 2 resumed from the last committed checkpoint (step 66); "
                            "steps 67-81 run again") for m in said), said
    assert "notice deadline of demo-n3 passed: its VM is gone" in said and view.notice_text() == ""
