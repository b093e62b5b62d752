"""``python -m simulations.chaos [--seed S] [--iterations N] [--fuzz N] [--json]``: run the drills, print
one JSON object (``--json``) or a short table. Exit 0 when every figure that must be zero is zero and
the fuzzer's counters add up, else 1. ``--partitions`` runs the network-namespace drills instead
(``partitions.py``; root): exit 0 when every drill passed, 1 when one failed, 2 when they cannot run.
See docs/chaos.md."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from orchestrator.cli import statedir
from simulations.chaos import adversarial, fuzz, kill9, natsrestart, netns, partitions


async def run_all(*, seed: int, iterations: int, n_fuzz: int, nats_restarts: int, max_kills: int,
                  workdir: Path, progress: Any = None, burst_iterations: int = 0) -> dict[str, Any]:
    t0 = time.monotonic()
    kills = []
    for i, burst in [(i, False) for i in range(iterations)] + [(i, True) for i in range(burst_iterations)]:
        kr = await kill9.run_iteration(i, seed, workdir, max_kills=max_kills, burst=burst)
        kills.append(kr)
        if progress:
            progress(f"kill -9 {'burst ' if burst else ''}iteration {i}: {kr.notices} notice(s), {kr.kills} "
                     f"kill(s) at {kr.kill_points}, {kr.seconds} s, problems {kr.problems}")
    nats = []
    for k in range(nats_restarts):
        nr = await natsrestart.run(seed + k, workdir)
        nats.append(nr)
        if progress:
            progress(f"NATS restart {k}: outage {nr.outage_s} s, lost {nr.lost_events}, "
                     f"spurious {nr.spurious_recoveries}")
    fz = await fuzz.run(seed, workdir, n_messages=n_fuzz) if n_fuzz else None
    if progress and fz:
        progress(f"fuzz: {fz.fuzzed_messages} messages, counted {fz.rejected_counted}, deduplicated {fz.deduplicated}")
    out: dict[str, Any] = {
        "seed": seed,
        "iterations": iterations,
        "burst_iterations": burst_iterations,
        "burst_notices": sum(r.notices for r in kills if r.burst),
        "burst_kills": sum(r.kills for r in kills if r.burst),
        "cmd_id_reused": sum(r.cmd_id_reused for r in kills),
        "faults_injected": sum(r.kills for r in kills) + len(nats),
        "kills": sum(r.kills for r in kills),
        "kill_points": sorted({p for r in kills for p in r.kill_points}),
        "preemption_notices": sum(r.notices for r in kills),
        "jobs": sum(r.jobs for r in kills) + len(nats),
        "lost_jobs": sum(r.lost_jobs for r in kills),
        "unfinished_jobs": sum(r.unfinished_jobs for r in kills),
        "duplicate_launches": sum(r.duplicate_launches + r.alive_duplicates for r in kills),
        "leaked_instances": sum(r.leaked_instances for r in kills),
        "orphans_reaped": sum(r.orphans_reaped for r in kills),
        "instances_launched": sum(r.instances for r in kills),
        "nats_restarts": len(nats),
        "nats_outage_s": [r.outage_s for r in nats],
        "lost_events": sum(r.lost_events for r in nats),
        "spurious_recoveries": sum(r.spurious_recoveries for r in nats),
        "fuzzed_messages": fz.fuzzed_messages if fz else 0,
        "fuzz_by_target": fz.by_target if fz else {},
        "fuzz_by_mutation": fz.by_mutation if fz else {},
        "rejected_counted": fz.rejected_counted if fz else 0,
        "deduplicated_replays": fz.deduplicated if fz else 0,
        "counters_add_up": fz.counters_add_up if fz else True,
        "admin_error_replies": fz.admin_error_replies if fz else 0,
        "state_unchanged": fz.state_unchanged if fz else True,
        "rejected_by_reason": fz.rejected_by_reason if fz else {},
        "daemon_crashes": sum(r.daemon_crashes for r in kills) + sum(r.daemon_crashes for r in nats)
        + (fz.daemon_crashes if fz else 0),
        "problems": [f"{'burst' if r.burst else 'kill'}-{r.iteration}: {p}" for r in kills for p in r.problems]
        + [f"nats: {p}" for r in nats for p in r.problems] + ([f"fuzz: {p}" for p in fz.problems] if fz else []),
        "seconds": round(time.monotonic() - t0, 1),
    }
    return out


def passed(out: dict[str, Any]) -> bool:
    zero = ("lost_jobs", "unfinished_jobs", "duplicate_launches", "leaked_instances", "lost_events",
            "spurious_recoveries", "daemon_crashes")
    return all(out[k] == 0 for k in zero) and out["counters_add_up"] and out["state_unchanged"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations.chaos", description=__doc__)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--iterations", type=int, default=20, help="kill -9 iterations (default 20)")
    p.add_argument("--burst-iterations", type=int, default=5,
                   help="kill -9 iterations where a zone goes away: every training node noticed within "
                        f"{kill9.BURST_S} s and orchd killed during it (default 5)")
    p.add_argument("--fuzz", type=int, default=100_000, help="fuzzed messages (default 100000; 0: none)")
    p.add_argument("--nats-restarts", type=int, default=1)
    p.add_argument("--max-kills", type=int, default=3, help="kill -9s per iteration, at most")
    p.add_argument("--workdir", help="where servers and daemons keep their files (default: a temp dir; an empty "
                   "or new directory, unless --fresh)")
    p.add_argument("--fresh", action="store_true", help="clear the earlier run in --workdir first")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--adversarial", type=int, default=0, metavar="N",
                   help="run only the adversarial drill with N hostile messages (docs/chaos.md section 4)")
    p.add_argument("--adversarial-all", action="store_true",
                   help="also send the hostile kinds known to fail (adversarial.EXPECTED_FAILURES)")
    p.add_argument("--partitions", action="store_true",
                   help="run only the partition drills across network namespaces (root; docs/chaos.md section 5)")
    p.add_argument("--drills", default=",".join(partitions.DRILLS),
                   help="with --partitions: which drills, comma-separated (default: all)")
    p.add_argument("--drop-s", type=float, default=60.0, help="with --partitions: seconds of 30%% packet drops")
    p.add_argument("--sim-agents", action="store_true",
                   help="with --partitions: simulated agents (simhost.py) instead of orch-agent with ranks")
    a = p.parse_args(argv)
    if a.workdir and not _claim_workdir(a):
        return 2
    if a.partitions:
        return _partitions(a)
    if a.adversarial:
        return _adversarial(a)
    with tempfile.TemporaryDirectory(prefix="orch-chaos-") as tmp:
        workdir = Path(a.workdir or tmp)
        progress = None if a.json else (lambda line: print(line, file=sys.stderr, flush=True))
        out = anyio.run(lambda: run_all(seed=a.seed, iterations=a.iterations, n_fuzz=a.fuzz,
                                        nats_restarts=a.nats_restarts, max_kills=a.max_kills, workdir=workdir,
                                        progress=progress, burst_iterations=a.burst_iterations),
                     backend="asyncio")
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            if k not in ("rejected_by_reason", "fuzz_by_target", "fuzz_by_mutation"):
                print(f"{k:24} {v}")
    return 0 if passed(out) else 1


def _claim_workdir(a: argparse.Namespace) -> bool:
    """--workdir belongs to this run: an empty or new directory, or an earlier run's with --fresh."""
    try:
        claim = statedir.claim(Path(a.workdir), command="python -m simulations.chaos", options={"seed": a.seed},
                               fresh=a.fresh, resumable=False)
    except statedir.StateDirError as e:
        print(f"python -m simulations.chaos: {e}", file=sys.stderr)
        return False
    print(claim.message, file=sys.stderr)
    return True


def _partitions(a: argparse.Namespace) -> int:
    drills = tuple(d for d in a.drills.split(",") if d)
    unknown = [d for d in drills if d not in partitions.DRILLS]
    if unknown:
        print(f"unknown drill(s) {unknown}; known: {', '.join(partitions.DRILLS)}", file=sys.stderr)
        return 2
    reason = netns.unavailable()
    if reason:
        print(f"partition drills cannot run here: {reason}", file=sys.stderr)
        return 2
    progress = None if a.json else (lambda line: print(line, file=sys.stderr, flush=True))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="orch-partitions-") as tmp:
        results = anyio.run(lambda: partitions.run(a.seed, Path(a.workdir or tmp), drills=drills, drop_s=a.drop_s,
                                                   agents="sim" if a.sim_agents else "real", progress=progress),
                            backend="asyncio")
    out = partitions.summary(results, a.seed, time.monotonic() - t0)
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            if k != "drills":
                print(f"{k:24} {v}")
    return 0 if out["drills_passed"] == out["drills_run"] else 1


def _adversarial(a: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="orch-chaos-") as tmp:
        r = anyio.run(adversarial.run, a.seed, Path(a.workdir or tmp), a.adversarial, a.adversarial_all,
                      backend="asyncio")
    out = adversarial.as_dict(r)
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        for k in ("hostile_messages", "crashes", "unjustified_state_changes", "unjustified_launches",
                  "unjustified_terminations", "rejected_by_reason", "problems", "passed", "seconds"):
            print(f"{k:26} {out[k]}")
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
