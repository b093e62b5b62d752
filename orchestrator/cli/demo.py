"""``orchctl demo``: the whole loop on this machine, on CPU, in one command.

Role: start an embedded NATS and orchd in this process (``run_daemon`` with the local provider), a
price feed, and a job of the tiny GPT on 3 local nodes (``orch-agent`` processes, one trainer rank
each); then inject, as the clouds would:

1. a preemption WITH a notice (the node's fake metadata service announces it; the node is killed at
   the deadline),
2. a node that VANISHES (kill -9 of the node's processes, no notice),
3. a price spike in the job's zone (the spot price goes above the pause ratio: orchd moves the job),

show live progress (nodes, generation, step, loss, events) and end with a report derived from the
trainer's step logs (``demo_report``), plus the local cloud's own bill (``--tracking``: and its MLflow run,
demo_tracking.py). ``--json`` (or ``-o json``) prints the report as one JSON object, ``-o yaml`` as YAML.

State: a temp directory that goes at the end, or ``--state-dir DIR``, which belongs to one run
(``statedir``): an earlier run there is refused unless ``--resume`` (same options, not ended) or
``--fresh`` (cleared first).

Stopping: SIGINT (Ctrl-C) or SIGTERM cancels the run; the teardown then stops the nodes (the local
provider's ``close``), orchd and its embedded nats-server, and finally terminates any descendant process
still alive (``reap_descendants``: each of them runs in its own session, so none would get the
terminal's signal). Exit 130 (SIGINT) or 143 (SIGTERM).

Concurrency contract: one anyio (asyncio) event loop hosts the daemon, the price feed, the scenario
driver and the display; the provider's blocking calls run in the daemon's executor threads.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from agent.warm import module_of
from orchestrator.cli import demo_tracking, statedir
from orchestrator.cli.demo_display import View, format_report, render, status_line
from orchestrator.cli.demo_job import MODELS, demo_jobspec, missing_extra
from orchestrator.cli.demo_report import Injection, compute_report, load_step_logs

JOB_ID = "demo"


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions:
    steps: int = 200
    nodes: int = 3
    nodes_min: int = 2
    seed: int = 0
    ckpt_interval_s: float = 2.0
    """Periodic checkpoint interval the job fixes (orchd passes it to the trainer as ORCH_CKPT_INTERVAL_S;
    left to orchd, Young/Daly on a real spot market gives minutes, longer than this whole demo)."""
    replica_every: int = 1
    """Shard replicas in the next node's memory every N steps (0: none, the vanished node then costs the steps
    since the last periodic checkpoint)."""
    notice_s: float = 20.0
    """Notice lead time of the noticed preemption (AWS gives 120 s, GCP/Azure 30 s)."""
    notice_at: float = 0.12
    vanish_at: float = 0.35
    spike_at: float = 0.55
    """Fractions of the steps at which each fault is injected (each waits for the previous recovery). The
    spike needs enough steps left: the job moves only after the new nodes booted, while it keeps training."""
    spike: bool = True
    vanish: bool = True
    model: str = "gpt-tiny"
    """What the nodes train: ``gpt-tiny`` (the built-in GPT) or ``llama-tiny`` (a Hugging Face Llama; the [hf]
    extra), demo_job.MODELS."""
    spec: Any = None
    """A whole job (a wire JobSpec) instead of ``model``: e.g. your own trainer command (the e2e tests); its
    total_steps and nodes must be ``steps`` and ``nodes``."""
    prices: str = "fixed"
    """fixed | replay (the bundled AWS p3.2xlarge us-west-2 history, 1 trace hour per second)."""
    timeout_s: float = 175.0
    state_dir: str | None = None
    keep: bool = False
    live: bool = True
    tracking: str = ""  # "" none; "local": an mlflow server under the state directory; else a tracking URI


@dataclass(slots=True)
class DemoResult:
    report: dict[str, Any]
    state_dir: Path
    injections: list[Injection] = field(default_factory=list)
    timeline: list[tuple[float, str]] = field(default_factory=list)
    step_logs: list[Path] = field(default_factory=list)


def demo_settings(state_dir: Path) -> Any:
    from orchestrator.settings import (
        DaemonSettings,
        FeedSettings,
        LogSettings,
        MetricsSettings,
        ProvidersSettings,
        Settings,
    )

    return Settings(
        daemon=DaemonSettings(state_dir=str(state_dir / "orchd"), cluster_id="orch-demo", heartbeat_interval_s=1.0,
                              heartbeat_timeout_s=3.0, tick_s=0.5, command_ack_timeout_s=2.0),
        metrics=MetricsSettings(enabled=False),
        log=LogSettings(level="info", format="json"),
        providers=ProvidersSettings(enabled=("local",), feeds={"local": FeedSettings(interval_s=1.0)}),
    )


def demo_core(settings: Any) -> Any:
    """The real decision core with timings scaled to a CPU demo (seconds instead of minutes)."""
    from orchestrator import core
    from orchestrator.daemon.coreapi import CoreApi

    config = core.CoreConfig(heartbeat_timeout_s=settings.daemon.heartbeat_timeout_s, tick_s=settings.daemon.tick_s,
                             boot_s_estimate=5.0, restart_overhead_s=10.0, terminate_s=5.0, launch_timeout_s=60.0,
                             checkpoint_timeout_s=30.0, backoff_base_s=5.0, price_confirm_s=2.0)
    return CoreApi(decide=core.decide, state_to_records=core.state_to_records,
                   state_from_records=core.state_from_records, empty_state=lambda: core.State.empty(config))


def demo_provider(state_dir: Path, opts: DemoOptions) -> Any:
    from providers.local import LocalConfig, LocalProvider

    return LocalProvider(LocalConfig(
        work_dir=str(state_dir / "nodes"),
        zones=("local-a", "local-b", "local-c"),
        metadata={"local-a": "aws", "local-b": "gcp", "local-c": "azure"},
        spot_usd_h={"local-a": 0.92, "local-b": 0.98, "local-c": 1.04},
        prices=opts.prices,
        agent_args=("--heartbeat-s", "1", "--metadata-poll-s", "0.25", "--sigterm-grace-s", "10", "--warm-ranks",
                    "1" if _runs_warm(opts) else "0"),
        agent_env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        terminate_grace_s=3.0,
    ))


def _runs_warm(opts: DemoOptions) -> bool:
    """Whether the job's ranks can start in the agents' warm processes (``python -m MODULE``: the built-in trainer);
    a script's command cannot, and a warm process would only compete with its ranks for the CPU."""
    command = opts.spec.trainer.command if opts.spec is not None else None
    return not command or module_of(list(command)) is not None


# --- the run ----------------------------------------------------------------------------------------


async def run_demo(opts: DemoOptions, *, progress: Any = None, scenario: Any = None) -> DemoResult:
    """Run the scenario; return the report. ``progress(view)`` is called about twice a second. ``scenario``
    replaces the demo's faults (``_scenario``'s signature: simulations/replica_drill.py's drills)."""

    from wire.logs import configure

    state_dir = Path(opts.state_dir or tempfile.mkdtemp(prefix="orch-demo-")).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    log_stream = open(state_dir / "demo.log", "a")  # noqa: SIM115 - closed below
    configure("info", "json", stream=log_stream)
    settings = demo_settings(state_dir)
    provider = demo_provider(state_dir, opts)
    view = View(opts, JOB_ID)
    injections: list[Injection] = []
    spec = demo_jobspec(state_dir, opts)
    finished = anyio.Event()
    tracked = demo_tracking.Tracked(opts.tracking, state_dir)
    try:
        spec = await anyio.to_thread.run_sync(tracked.start, spec)  # the job's MLflow run (demo_tracking.py)
        settings = tracked.settings(settings)
        result = await _run_and_report(opts, state_dir, settings, provider, view, injections, spec, finished,
                                       progress, scenario or _scenario)
        result.report.update(await anyio.to_thread.run_sync(tracked.report, JOB_ID))
        return result
    finally:
        await anyio.to_thread.run_sync(tracked.stop)
        log_stream.close()
        if not opts.keep and opts.state_dir is None:
            shutil.rmtree(state_dir, ignore_errors=True)


async def _run_and_report(opts: DemoOptions, state_dir: Path, settings: Any, provider: Any, view: View,
                          injections: list[Injection], spec: Any, finished: anyio.Event, progress: Any,
                          scenario: Any) -> DemoResult:
    from orchestrator.cli.client import AdminClient
    from orchestrator.daemon.run import run_daemon

    try:
        async with anyio.create_task_group() as tg:
            d = await tg.start(functools.partial(run_daemon, core=demo_core(settings)), settings, {"local": provider})
            view.event(f"orchd up, embedded NATS {d.nats_url}")
            client = await AdminClient.connect(d.nats_url.split(","), timeout_s=5.0)

            async def monitor() -> None:
                while not finished.is_set():
                    try:
                        reply = await client.job(JOB_ID)
                        view.update(reply.summary, reply.nodes)
                    except Exception:  # the daemon is busy or stopping: keep the last view
                        pass
                    if d.state is not None:
                        for nid, node in d.state.nodes.items():
                            view.loss[nid] = node.loss
                    if progress is not None:
                        progress(view)
                    if view.job.get("phase") in ("succeeded", "failed", "cancelled", "stopped"):
                        finished.set()
                    await anyio.sleep(0.5)

            async with anyio.create_task_group() as tasks:
                await _wait_for_prices(client, finished)  # orchd's price feed polls the provider every second
                await client.submit(spec, JOB_ID)
                view.event(f"job submitted: {spec.nodes} nodes x {spec.name}, {spec.total_steps} steps")
                tasks.start_soon(monitor)
                tasks.start_soon(scenario, opts, provider, view, injections, finished)
                with anyio.move_on_after(opts.timeout_s):
                    await finished.wait()
                if not finished.is_set():
                    view.event(f"timeout after {opts.timeout_s:.0f}s")
                    finished.set()
                tasks.cancel_scope.cancel()
            view.event(f"job {view.job.get('phase', '?')}")
            await client.close()
            d.request_stop()
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(provider.close)
    bill = provider.bill()
    logs = sorted((state_dir / "nodes").glob(f"*/steps/{JOB_ID}.jsonl"))
    report = compute_report(load_step_logs(logs), injections, total_steps=opts.steps, node_pools=provider.node_pools())
    report = {
        "job_succeeded": view.job.get("phase") == "succeeded",
        **report,
        "cost_usd": round(bill["cost_usd"], 4),
        "on_demand_cost_usd": round(bill["on_demand_cost_usd"], 4),
        "orchd_cost_estimate_usd": view.job.get("cost_usd"),
        "node_seconds": round(bill["node_seconds"], 1),
        "wall_s": round(time.time() - view.t0, 1),
        "injected": [{"kind": i.kind, "node": i.node, "t_s": round(i.ts - view.t0, 1), "detail": i.detail}
                     for i in injections],
        "state_dir": str(state_dir) if opts.keep or opts.state_dir is not None else None,
    }
    return DemoResult(report, state_dir, injections, view.events, logs)


async def _wait_for_prices(client: Any, finished: anyio.Event, timeout_s: float = 15.0) -> None:
    """Submit once orchd knows the pools (else the first placement waits for the next price round)."""
    with anyio.move_on_after(timeout_s):
        while not finished.is_set():
            try:
                if (await client.prices()).pools:
                    return
            except Exception:  # orchd still starting
                pass
            await anyio.sleep(0.2)


def _gen_nodes(view: View) -> list[dict[str, Any]]:
    g = view.job.get("generation", 0)
    return [n for n in view.nodes if n.get("generation") == g and n.get("phase") == "running"]


async def _wait(view: View, finished: anyio.Event, pred: Any) -> bool:
    while not finished.is_set():
        if view.job and pred():
            return True
        await anyio.sleep(0.2)
    return False


async def _scenario(opts: DemoOptions, provider: Any, view: View, injections: list[Injection],
                    finished: anyio.Event) -> None:
    steps = opts.steps

    def running_at(frac: float, after_gen: int) -> Any:
        want = min(2, opts.nodes)
        return lambda: (view.job.get("phase") == "running" and view.job.get("generation", 0) > after_gen
                        and view.job.get("step", 0) >= frac * steps and len(_gen_nodes(view)) >= want)

    # 1. a preemption with a notice, on the highest rank of the running generation
    if not await _wait(view, finished, running_at(opts.notice_at, 0)):
        return
    gen = view.job["generation"]
    victim = max(_gen_nodes(view), key=lambda n: n["rank"])["node_id"]
    await anyio.to_thread.run_sync(provider.preempt, victim, opts.notice_s)
    injections.append(Injection("notice", time.time(), victim, f"deadline in {opts.notice_s:.0f}s"))
    view.notice(victim, opts.notice_s)
    # 2. a node that vanishes, once the job runs again (a later generation)
    if not opts.vanish or not await _wait(view, finished, running_at(opts.vanish_at, gen)):
        return
    gen = view.job["generation"]
    candidates = [n for n in _gen_nodes(view) if n["node_id"] != victim]
    spot = [n for n in candidates if str(n.get("pool", "")).endswith("/spot")]  # a preemption, not a failure
    gone = max(spot or candidates, key=lambda n: n["rank"])["node_id"]
    await anyio.to_thread.run_sync(provider.vanish, gone)
    injections.append(Injection("vanished", time.time(), gone, "kill -9, no notice"))
    view.event(f"NODE VANISHED: {gone} (kill -9, no notice)")
    # 3. a price spike in the job's zone
    if not opts.spike or not await _wait(view, finished, running_at(opts.spike_at, gen)):
        return
    zone = str(view.job.get("zone") or "").rsplit("/", 1)[-1]
    if zone:
        od = provider.price_source.on_demand_usd_h
        provider.price_source.override(zone, round(0.97 * od, 3))
        injections.append(Injection("price_spike", time.time(), "", f"{zone} spot -> {0.97 * od:.2f} USD/h"))
        view.event(f"PRICE SPIKE in {zone}: spot {0.97 * od:.2f} USD/h (on-demand {od:.2f})")


# --- command line -----------------------------------------------------------------------------------


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("demo", parents=[common],
                       help="the whole loop on this machine (embedded NATS, orchd, 3 local CPU nodes)")
    s.add_argument("--json", action="store_true", help="print the report as one JSON object (= -o json)")
    s.add_argument("--steps", type=int, default=None, help="training steps (default 200, --fast 90)")
    s.add_argument("--fast", action="store_true", help="shorter run: fewer steps, shorter notice, no price spike")
    s.add_argument("--prices", choices=("fixed", "replay"), default="fixed")
    s.add_argument("--model", dest="demo_model", choices=sorted(MODELS), default="gpt-tiny",
                   help="what the nodes train: the built-in GPT, or a Hugging Face Llama (the [hf] extra)")
    s.add_argument("--state-dir", dest="demo_state_dir", default=None,
                   help="keep everything here (an empty or new directory, unless --resume or --fresh)")
    again = s.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue the unfinished run in --state-dir (same options); says what it resumes")
    again.add_argument("--fresh", action="store_true", help="clear the earlier run in --state-dir first")
    s.add_argument("--timeout", dest="demo_timeout", type=float, default=None)
    demo_tracking.add_arguments(s)
    s.set_defaults(run=run)


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    fast = bool(getattr(args, "fast", False))
    steps = args.steps or (90 if fast else 200)
    kw: dict[str, Any] = dict(steps=steps, prices=args.prices, state_dir=args.demo_state_dir,
                              keep=args.demo_state_dir is not None, model=getattr(args, "demo_model", "gpt-tiny"))
    if fast:
        kw.update(notice_s=10.0, spike=False, notice_at=0.15, vanish_at=0.5)
    if kw["model"] != "gpt-tiny":  # a Hugging Face model: each rank imports transformers, steps are slower
        kw["timeout_s"] = 360.0
    if args.demo_timeout:
        kw["timeout_s"] = args.demo_timeout
    kw["tracking"] = getattr(args, "tracking_uri", None) or ("local" if getattr(args, "tracking", False) else "")
    return DemoOptions(**kw)


def run_options(opts: DemoOptions) -> dict[str, Any]:
    """The options that shape the run: a run is resumed only with the same ones."""
    return {"steps": opts.steps, "notice_s": opts.notice_s, "spike": opts.spike, "prices": opts.prices,
            "model": opts.model}


def run(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    missing = missing_extra(opts.model)
    if missing is not None:
        sys.stderr.write(missing)
        return 2
    if demo_tracking.refuse_without_package(opts.tracking):  # said why on stderr
        return 2
    if opts.state_dir is not None:
        try:
            claim = statedir.claim(Path(opts.state_dir), command="orchctl demo", options=run_options(opts),
                                   resume=bool(getattr(args, "resume", False)),
                                   fresh=bool(getattr(args, "fresh", False)))
        except statedir.StateDirError as e:
            sys.stderr.write(f"orchctl demo: {e}\n")
            return 2
        sys.stderr.write(claim.message + "\n")
    tty = sys.stderr.isatty()
    live = None
    if tty:
        from rich.console import Console
        from rich.live import Live

        live = Live(console=Console(stderr=True), refresh_per_second=4, transient=False)
        live.start()
    last = [0.0]

    def progress(view: View) -> None:
        if live is not None:
            live.update(render(view))
        elif time.time() - last[0] > 5:
            last[0] = time.time()
            sys.stderr.write(status_line(view))

    stopped_by: list[int] = []
    try:
        result = anyio.run(_until_signalled, opts, progress, stopped_by, backend="asyncio")
    except KeyboardInterrupt:  # a SIGINT before the signal receiver is installed
        stopped_by.append(signal.SIGINT)
        result = None
    finally:
        if live is not None:
            live.stop()
        reap_descendants()
    if result is None:
        sig = stopped_by[0] if stopped_by else signal.SIGINT
        sys.stderr.write(f"orchctl demo: stopped by {signal.Signals(sig).name}; nodes, orchd and NATS stopped\n")
        return 128 + int(sig)
    if opts.state_dir is not None:
        ended = "succeeded" if result.report["job_succeeded"] else "did not succeed"
        statedir.finish(Path(opts.state_dir), f"job {ended}")
    fmt = "json" if getattr(args, "json", False) else getattr(args, "output", "table")
    if fmt == "json":
        sys.stdout.write(json.dumps(result.report) + "\n")
    elif fmt == "yaml":
        import yaml

        sys.stdout.write(yaml.safe_dump(result.report, sort_keys=False))
    else:
        sys.stdout.write(format_report(result.report))
    return 0 if result.report["job_succeeded"] else 1


async def _until_signalled(opts: DemoOptions, progress: Any, stopped_by: list[int]) -> DemoResult | None:
    """``run_demo`` until it ends or SIGINT/SIGTERM arrives (then cancelled: its teardown runs; None)."""
    result: list[DemoResult] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as sigs:
                async for sig in sigs:
                    stopped_by.append(int(sig))
                    tg.cancel_scope.cancel()
                    return

        async def demo() -> None:
            result.append(await run_demo(opts, progress=progress))
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        tg.start_soon(demo)
    return result[0] if result and not stopped_by else None


def reap_descendants(timeout_s: float = 5.0) -> list[int]:
    """Terminate (then kill) every process this one started that is still alive: the safety net behind
    the orderly teardown (nats-server and the nodes run in their own sessions). Returns their pids."""
    import psutil

    procs = psutil.Process().children(recursive=True)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _gone, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout_s)
    return [p.pid for p in procs]


def main(argv: list[str] | None = None) -> int:
    """``python -m orchestrator.cli.demo``: the same as ``orchctl demo``."""
    p = argparse.ArgumentParser(prog="orchctl")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_parser(sub, argparse.ArgumentParser(add_help=False))
    return run(p.parse_args(["demo", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
