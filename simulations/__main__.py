"""``python -m simulations``: replay spot traces through the baselines, the offline optimum and orchd.

Commands:
  replay   run policies over traces given on the command line (see --help)
  explain  one job through orchd: the core's decision audit and the world's events in virtual time
  table    the documented results table over ../shared/traces (docs/simulations.md)
  tune     grid-search orchd's CoreConfig overrides on the tuning trace family
  synth    write a seeded synthetic trace set (SkyPilot JSON, one file per zone)
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

try:
    from simulations import scenario as scen
    from simulations import traces
    from simulations.cli import format_table, progress_bar, to_json
    from simulations.engine import Job
    from simulations.policies import ALL_POLICIES
    from simulations.replay import make_jobs, replay
    from simulations.worldparams import WorldParams
except ModuleNotFoundError as e:  # a base install: numpy/matplotlib come with the [sim] extra
    if e.name not in ("numpy", "matplotlib"):
        raise
    sys.exit(f"python -m simulations needs {e.name}: pip install 'spot-orchestrator[sim]' (or -e '.[sim]')")


_WORLD_FLAGS = {  # flag -> (WorldParams field, type, help)
    "notice-s": ("notice_override_s", float, "one notice length for every cloud (default: AWS 120 s, GCP/Azure 30 s)"),
    "no-notice-share": ("no_notice_share", float, "share of preemptions without a notice"),
    "state-gib": ("state_gib", float, "checkpoint size; save time = fixed + size / bandwidth"),
    "save-gib-s": ("save_gib_s", float, "checkpoint write bandwidth"),
    "capacity-error-p": ("capacity_error_p", float, "chance a spot launch fails although the trace has room"),
    "restart-s": ("restart_s", float, "trainer start and checkpoint load"),
    "region-migration-s": ("region_migration_s", float, "copy a checkpoint to another region"),
    "cloud-migration-s": ("cloud_migration_s", float, "copy a checkpoint to another cloud"),
    "checkpoint-interval-s": ("baseline_checkpoint_interval_s", float, "periodic saves of the baselines"),
    "seed": ("seed", int, "seed of the shared random draws"),
}


def _overhead_args(p: argparse.ArgumentParser) -> None:
    d = WorldParams()
    g = p.add_argument_group("the world (shared by every policy; defaults and sources: docs/simulations.md)")
    for flag, (f, typ, hlp) in _WORLD_FLAGS.items():
        g.add_argument("--" + flag, dest=f, type=typ, default=getattr(d, f), metavar="X",
                       help=f"{hlp} (default {getattr(d, f)})")


def _overheads(a: argparse.Namespace) -> WorldParams:
    return WorldParams(**{f: getattr(a, f) for f, _, _ in _WORLD_FLAGS.values()})


def _table_args(t: argparse.ArgumentParser) -> None:
    t.add_argument("--traces-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "traces"))
    t.add_argument("--jobs", type=int, default=8, help="jobs per setting (start times spread over the trace; "
                   "those the tuning does not use are summarised apart too)")
    t.add_argument("--tune-jobs", type=int, default=4, help="jobs per family at each tuning setting")
    t.add_argument("--workers", type=int, default=2)
    t.add_argument("--family", action="append", help="only these families (repeatable; default all)")
    t.add_argument("--nodes", type=int, action="append", help="job sizes (default 1, 4, 16)")
    t.add_argument("--notice-s", type=float, action="append",
                   help="notices (default 120, 30); with --world step: restart overheads r in s (default 180, 720)")
    t.add_argument("--world", choices=("faithful", "step"), default="faithful",
                   help="the faithful world (default) or the decision-step world of Can't Be Late (no notices, "
                        "decisions at the trace's ticks, a fixed restart overhead)")
    t.add_argument("--shape", action="append", metavar="JOB_H/DEADLINE_H",
                   help="job/deadline hours (default 12/24, 24/36, 48/72, 48/60)")
    t.add_argument("--spot-price-ratio", type=float, action="append", help="spot/on-demand (default 0.25, 0.33, 0.5)")
    t.add_argument("--no-loo", dest="loo", action="store_false",
                   help="skip leave-one-family-out tuning (orchd with the core's defaults)")
    t.add_argument("--json", action="store_true")
    t.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m simulations", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("replay", help="replay policies over traces")
    r.add_argument("--trace", nargs="+", required=True, metavar="FILE",
                   help="availability/preemption traces, one per zone (SkyPilot JSON or Bamboo logs)")
    r.add_argument("--zone", action="append", help="zone name per trace (default: from the file name)")
    r.add_argument("--region", default=None, help="region for Bamboo logs (default us-east-1)")
    r.add_argument("--instance-type", default=None)
    r.add_argument("--bamboo-gap-s", type=float, default=60.0, help="sampling of Bamboo event logs")
    r.add_argument("--prices", default=None, metavar="FILE", help="AWS spot price CSV or GCP price change log")
    r.add_argument("--price-start", default=None, help="UTC date the trace's first tick maps to in the price file")
    r.add_argument("--spot-price-ratio", type=float, default=None, help="spot/on-demand without a price file")
    r.add_argument("--on-demand-price", type=float, default=None, help="USD per node-hour")
    r.add_argument("--job-hours", type=float, required=True)
    r.add_argument("--deadline-hours", type=float, required=True)
    r.add_argument("--nodes", type=int, default=1)
    r.add_argument("--probe-nodes", type=int, default=None, metavar="N",
                   help="nodes each trace's probe asked for (default: N-node folder name, else 1 for "
                        "SkyPilot 1-node files; required for Bamboo fleet logs)")
    r.add_argument("--truncate", action="store_true",
                   help="cut every zone to the shortest trace (otherwise traces of different lengths are an error)")
    r.add_argument("--policy", action="append", choices=ALL_POLICIES,
                   help="repeatable; default all")
    r.add_argument("--jobs", type=int, default=10, help="jobs, evenly spaced start times over the trace")
    r.add_argument("--tick-s", type=float, default=300.0, help="minimum simulation tick")
    r.add_argument("--quantum-s", type=float, default=150.0, help="progress quantum (overheads round up to it)")
    r.add_argument("--workers", type=int, default=1, help="processes (each runs a share of the jobs of every policy)")
    r.add_argument("--orchd-capacity-hints", action=argparse.BooleanOptionalAction, default=True,
                   help="send the core a noisy placement-like score per zone (past ticks only, never 0); "
                        "--no-orchd-capacity-hints: none, it learns from launch failures only")
    r.add_argument("--json", action="store_true")
    r.add_argument("--plot", default=None, metavar="OUT.png")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    _overhead_args(r)

    e = sub.add_parser("explain", parents=[], help="one job through orchd: the core's decisions in virtual time")
    for act in r._actions:
        if act.dest in ("help", "json", "plot", "policy", "workers", "progress"):
            continue
        e._add_action(act)
    e.add_argument("--job-index", type=int, default=0)
    e.add_argument("--limit", type=int, default=200, help="timeline lines to print")

    _table_args(sub.add_parser("table", help="the documented results table over ../shared/traces"))

    u = sub.add_parser("tune", help="grid-search orchd's CoreConfig overrides on the tuning family")
    u.add_argument("--traces-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "traces"))
    u.add_argument("--jobs", type=int, default=4)
    u.add_argument("--workers", type=int, default=2)

    d = sub.add_parser("world-defaults", help="print the world's defaults derived from ../shared/traces")
    d.add_argument("--traces-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "traces"))

    s = sub.add_parser("synth", help="write a seeded synthetic trace set")
    s.add_argument("--out", required=True)
    s.add_argument("--days", type=float, default=45.0)
    s.add_argument("--zones", type=int, default=9)
    s.add_argument("--gap-s", type=float, default=600.0)
    s.add_argument("--seed", type=int, default=0)
    return ap


def _scenario(a: argparse.Namespace):
    zones = a.zone or []
    if zones and len(zones) != len(a.trace):
        raise SystemExit("--zone must be given once per --trace")
    trs = []
    for i, f in enumerate(a.trace):
        kw = {"zone": zones[i] if zones else None, "instance_type": a.instance_type, "probe_nodes": a.probe_nodes}
        if not Path(f).read_text()[:64].lstrip().startswith("{"):
            kw.update(gap_s=a.bamboo_gap_s, region=a.region or "us-east-1")
        trs.append(traces.load_trace(f, **kw))
    book = traces.load_prices(a.prices) if a.prices else None
    start = None
    if a.price_start:
        start = datetime.fromisoformat(a.price_start).replace(tzinfo=UTC).timestamp()
    return scen.build(trs, prices=book, spot_price_ratio=a.spot_price_ratio, on_demand_usd_h=a.on_demand_price,
                      price_start_ts=start, min_tick_s=a.tick_s, quantum_s=a.quantum_s, truncate=a.truncate)


def cmd_replay(a: argparse.Namespace) -> int:
    sc = _scenario(a)
    ov = _overheads(a)
    for zone, ticks in sc.truncated:
        print(f"note: {zone} cut from {ticks} to {sc.n_ticks} ticks (--truncate)", file=sys.stderr)
    jobs = make_jobs(sc, job_hours=a.job_hours, deadline_hours=a.deadline_hours, nodes=a.nodes, count=a.jobs)
    policies = a.policy or list(ALL_POLICIES)
    with progress_bar(len(jobs) * len(policies), "replay", a.progress) as adv:
        res = replay(sc, jobs, policies, ov, progress=adv, workers=a.workers,
                     orchd_kw={"capacity_hints": a.orchd_capacity_hints})
    meta = {
        "zones": [z.name for z in sc.zones],
        "tick_s": sc.tick_s,
        "quantum_s": sc.quantum_s,
        "ticks": sc.n_ticks,
        "prices": sc.price_source,
        "job_hours": a.job_hours,
        "deadline_hours": a.deadline_hours,
        "nodes": a.nodes,
        "jobs": len(jobs),
        "orchd_capacity_hints": a.orchd_capacity_hints,
        "world": {f: getattr(ov, f) for f, _, _ in _WORLD_FLAGS.values()},
        "truncated": [list(x) for x in sc.truncated],
    }
    if a.json:
        print(to_json(res, **meta))
    else:
        print(f"zones {', '.join(meta['zones'])}; tick {sc.tick_s:.0f} s; {len(jobs)} jobs of "
              f"{a.job_hours} h, deadline {a.deadline_hours} h, {a.nodes} node(s); prices: {sc.price_source}")
        print(format_table(res))
    if a.plot:
        from simulations.plot import plot_replay

        plot_replay(sc, ov, a.plot, job_hours=a.job_hours, nodes=a.nodes, jobs=min(a.jobs, 10),
                    policies=policies, deadline_hours=a.deadline_hours)
        print(f"plot written to {a.plot}", file=sys.stderr)
    return 0


def cmd_explain(a: argparse.Namespace) -> int:
    """One job through orchd with the core's decision audit and the world's events, in virtual time."""
    from simulations.orchd_policy import core_config, run_orchd_job

    sc = _scenario(a)
    ov = _overheads(a)
    jobs = make_jobs(sc, job_hours=a.job_hours, deadline_hours=a.deadline_hours, nodes=a.nodes, count=a.jobs)
    job = jobs[a.job_index]
    jr, wr = run_orchd_job(sc, job, ov, config=core_config(), record=True, capacity_hints=a.orchd_capacity_hints)
    print(f"job {a.job_index}: start tick {job.start_tick}; phase {wr.phase}; deadline met {jr.deadline_met}; "
          f"cost_ratio {jr.cost_usd / jr.od_work_cost_usd:.3f}; on-demand node-hours {wr.od_node_s / 3600:.2f} of "
          f"{wr.billed_node_s / 3600:.2f}; preemptions {wr.preemptions}; decide() calls {wr.decisions}")
    for t, what, detail in wr.timeline[: a.limit]:
        print(f"{t / 3600:9.3f} h  {what:38s} {detail}")
    if len(wr.timeline) > a.limit:
        print(f"... {len(wr.timeline) - a.limit} more")
    top = sorted(wr.actions.items(), key=lambda kv: -kv[1])[:12]
    print("audit actions:", ", ".join(f"{k}={v}" for k, v in top))
    print(f"orchd: idle {wr.idle_capacity_s / 3600:.2f} h while a zone had room for the job, "
          f"{wr.idle_backoff_s / 3600:.2f} h of it with every such zone's spot pool in launch backoff")
    _explain_baselines(sc, job, ov)
    return 0


def _explain_baselines(sc: scen.Scenario, job: Job, ov: WorldParams) -> None:
    """The same job under greedy_spot and uniform_progress, in the same world (the same draws)."""
    from simulations.orchd_policy import world_job_result
    from simulations.policies import ONLINE
    from simulations.world_policy import run_policy_job

    for name in ("greedy_spot", "uniform_progress"):
        r = run_policy_job(ONLINE[name](), sc, job, ov, record=True)
        jr = world_job_result(sc, job, r)
        print(f"{name}: cost_ratio {jr.cost_usd / jr.od_work_cost_usd:.3f}; on-demand node-hours "
              f"{r.od_node_s / 3600:.2f} of {r.billed_node_s / 3600:.2f}; preemptions {r.preemptions}; "
              f"idle {r.idle_capacity_s / 3600:.2f} h while a zone had room for the job")


def cmd_table(a: argparse.Namespace) -> int:
    from simulations import results as res

    fams: tuple[res.Family, ...] = res.FAMILIES
    if a.family:
        unknown = set(a.family) - {f.key for f in res.FAMILIES}
        if unknown:
            raise ValueError(f"unknown families {sorted(unknown)}; known: {', '.join(f.key for f in res.FAMILIES)}")
        fams = tuple(f for f in res.FAMILIES if f.key in a.family)
    shapes: tuple[tuple[float, float], ...] = res.SHAPES
    if a.shape:
        try:
            shapes = tuple((float(x.split("/")[0]), float(x.split("/")[1])) for x in a.shape)
        except (IndexError, ValueError):
            raise ValueError(f"--shape takes JOB_H/DEADLINE_H, got {a.shape}") from None
    notices = tuple(a.notice_s or (res.RESTARTS if a.world == "step" else res.NOTICES))
    grid = res.settings(nodes=tuple(a.nodes or res.NODES), notices=notices, shapes=shapes,
                        ratios=tuple(a.spot_price_ratio or res.RATIOS), world=a.world)
    rows = res.run_table(Path(a.traces_dir), jobs=a.jobs, progress=a.progress, families=fams, grid=grid,
                         workers=a.workers, tune_jobs=a.tune_jobs, loo=a.loo)
    print(res.results_json(rows) if a.json else res.format_results(rows))
    return 0


def cmd_tune(a: argparse.Namespace) -> int:
    from simulations.tune import tune

    print(tune(Path(a.traces_dir), jobs=a.jobs, workers=a.workers))
    return 0


def cmd_world_defaults(a: argparse.Namespace) -> int:
    import json

    from simulations.worldparams import derive_defaults

    print(json.dumps(derive_defaults(Path(a.traces_dir)), indent=2))
    return 0


def cmd_synth(a: argparse.Namespace) -> int:
    from simulations.synth import write_synthetic

    paths = write_synthetic(Path(a.out), days=a.days, zones=a.zones, gap_s=a.gap_s, seed=a.seed)
    print("\n".join(str(p) for p in paths))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        return {"replay": cmd_replay, "explain": cmd_explain, "table": cmd_table, "synth": cmd_synth,
                "tune": cmd_tune, "world-defaults": cmd_world_defaults}[a.cmd](a)
    except (traces.TraceFormatError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
