"""What ``orchctl demo`` shows while it runs, and its text report.

Role: ``View`` holds what the monitor last read from orchd (the job's summary, its nodes, the losses)
and the events of the run; ``View.update`` turns changes the user would otherwise puzzle over into
events: the nodes booting before the first step, a step count that goes back (the next generation
resumed from the last committed checkpoint), a notice's deadline passing. ``render`` draws the live
display (Rich), ``status_line`` the one-line progress for a terminal that is not a TTY, ``format_report``
the final text report. Pure functions of the view and the time, no I/O.
"""

from __future__ import annotations

import time
from typing import Any

from orchestrator.cli import demo_tracking


class View:
    """What the display shows; updated by the monitor, rendered by ``render``."""

    def __init__(self, opts: Any, job_id: str = "demo") -> None:
        self.opts = opts
        self.job_id = job_id
        self.t0 = time.time()
        self.job: dict[str, Any] = {}
        self.nodes: list[dict[str, Any]] = []
        self.loss: dict[str, float | None] = {}
        self.events: list[tuple[float, str]] = []
        self.notices: dict[str, float] = {}  # node -> when its notice's deadline passes (wall time)
        self._last = (0, 0)  # (generation, step) last seen

    def event(self, text: str) -> None:
        self.events.append((time.time(), text))

    def notice(self, node: str, deadline_s: float) -> None:
        """A preemption notice was sent to ``node``: it is killed ``deadline_s`` from now."""
        self.notices[node] = time.time() + deadline_s
        self.event(f"PREEMPTION NOTICE for {node}: it is killed at t={self.notices[node] - self.t0:.0f}s")

    def update(self, job: dict[str, Any], nodes: list[dict[str, Any]], now: float | None = None) -> None:
        """Take orchd's new view of the job; note a rollback and notices whose deadline passed."""
        now = time.time() if now is None else now
        self.job, self.nodes = job, nodes
        gen, step = int(job.get("generation") or 0), int(job.get("step") or 0)
        last_gen, last_step = self._last
        if step and step < last_step:
            committed = int(job.get("committed_step") or 0)
            self.event(f"step {last_step} -> {step}: generation {gen} resumed from the last committed checkpoint "
                       f"(step {committed}); steps {committed + 1}-{last_step} run again")
        if step or gen != last_gen:
            self._last = (gen, step)
        for node, deadline in list(self.notices.items()):
            if now >= deadline:
                del self.notices[node]
                self.event(f"notice deadline of {node} passed: its VM is gone")

    def step_text(self) -> str:
        """The step, or what the job waits for before its first one."""
        j = self.job
        total = j.get("total_steps", self.opts.steps)
        if j.get("step"):
            return f"step {j['step']}/{total}"
        up = sum(1 for n in self.nodes if n.get("phase") == "running")
        if not j:
            return f"step -/{total} (orchd starting)"
        want = j.get("target_nodes") or self.opts.nodes
        if up >= want:
            return f"step -/{total} (generation {j.get('generation', 0)} starting on {up} nodes)"
        return f"step -/{total} (waiting for nodes: {up} of {want} up)"

    def notice_text(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        return "  ".join(f"NOTICE: {n} killed in {max(0.0, d - now):.0f}s" for n, d in sorted(self.notices.items()))


def render(view: View) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    j = view.job
    now = time.time()
    head = Text(f"orchctl demo  t={now - view.t0:5.1f}s  job {view.job_id}: {j.get('phase', 'starting')}  "
                f"generation {j.get('generation', 0)}  {view.step_text()}  "
                f"committed {j.get('committed_step', 0)}  zone {j.get('zone') or '-'}  "
                f"orchd cost ${j.get('cost_usd', 0) or 0:.4f}", style="bold")
    table = Table(expand=False)
    for col in ("node", "phase", "pool", "gen", "rank", "step", "loss", "hb age"):
        table.add_column(col)
    for n in view.nodes:
        loss = view.loss.get(n["node_id"])
        pool = str(n.get("pool", "")).split("/")
        table.add_row(n["node_id"], n["phase"], "/".join(pool[2:3] + pool[4:5]), str(n.get("generation", "")),
                      str(n.get("rank", "")), str(n.get("step", "")), f"{loss:.4f}" if loss is not None else "-",
                      f"{n['heartbeat_age_s']:.1f}" if n.get("heartbeat_age_s") is not None else "-")
    parts: list[Any] = [head, table]
    pending = view.notice_text(now)
    if pending:
        parts.append(Text(pending, style="bold red"))
    parts.append(Text("\n".join(f"{ts - view.t0:6.1f}s  {msg}" for ts, msg in view.events[-8:])))
    return Group(*parts)


def status_line(view: View) -> str:
    """One line of progress (stderr that is not a terminal)."""
    j = view.job
    pending = view.notice_text()
    return (f"[{time.time() - view.t0:5.1f}s] {j.get('phase', 'starting')} gen {j.get('generation', 0)} "
            f"{view.step_text()} " + (pending + " " if pending else "")
            + (view.events[-1][1] if view.events else "") + "\n")


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"job {'SUCCEEDED' if r['job_succeeded'] else 'DID NOT SUCCEED'} in {r['wall_s']}s: "
        f"{r['steps_completed']}/{r['total_steps']} steps, final loss {r['final_loss']}, "
        f"{r['generations']} generations",
        f"cost ${r['cost_usd']:.4f} (local cloud bill; orchd's estimate ${r['orchd_cost_estimate_usd']}) vs "
        f"${r['on_demand_cost_usd']:.4f} for the same node-hours on-demand",
        f"steps executed twice: {r['steps_executed_twice']}; sample order exact: {r['sample_order_exact']}",
    ]
    for p in r["preemptions"]:
        lines.append(f"  preemption ({p['kind']}) of {p['node']}: lost_steps={p['lost_steps']} "
                     f"recovery_s={p['recovery_s']} (generation {p.get('generation')} -> {p.get('next_generation')})")
    for p in r.get("node_failures", []):
        lines.append(f"  node lost ({p['kind']}, {p.get('market')}: not a preemption) {p['node']}: "
                     f"lost_steps={p['lost_steps']} recovery_s={p['recovery_s']} "
                     f"(generation {p.get('generation')} -> {p.get('next_generation')})")
    for p in r.get("price_spikes", []):
        lines.append(f"  price spike ({p['detail']}): generation {p.get('generation')} -> {p.get('next_generation')}, "
                     f"lost_steps={p.get('lost_steps')}, first step after it {p.get('move_s')}s later")
    lines += demo_tracking.format_lines(r.get("tracking"))
    lines.append("  generations:")
    for g in r["generation_table"]:
        where = ", ".join(f"{n} {p}" for n, p in g["nodes"].items())
        lines.append(f"    g{g['generation']}: world size {g['world_size']}, "
                     f"steps {g['first_step']}-{g['last_step']} on {where}")
    return "\n".join(lines) + "\n"
