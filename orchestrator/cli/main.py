"""orchctl: the admin CLI of orchd. Parses, calls the typed client, formats with a pure function.

    orchctl [--server URL] [--config FILE] [--state-dir DIR] [--timeout S] [-o table|json|yaml] COMMAND
      status                          daemon, bus, counts                                  [--watch]
      jobs submit FILE [--id ID]      TOML/YAML job spec, validated here and by orchd
      jobs list | show JOB | cancel JOB [--reason R]                                        [--watch]
      nodes list [--job JOB] | drain NODE                                                   [--watch]
      nodes preempt NODE [--notice S] | kill NODE   local nodes only: inject a reclaim / a host failure
      prices                          pools, prices, preemption statistics                  [--watch]
      events [--follow]               decided commands, newest last (tail; --follow polls)
      explain JOB                     the audit of the core's decisions for a job
      reap --dry-run | --yes          orphan instances per provider (plan only with --dry-run)
      dead list [--limit N] | replay SEQ   dead letters (ORCH_DEAD): messages orchd gave up on;
                                      replay republishes one to its original subject
      logs JOB [--node N] [--follow]  trainer output shipped by the agents (orchestrator/cli/logs.py)
      demo [--model gpt-tiny|llama-tiny]  the whole loop on this machine (orchestrator/cli/demo.py)
      checkpoint owner URL | take-over URL ... | export URL OUT   checkpoint roots; a Hugging Face export
      sweep submit FILE | list | show SWEEP | cancel SWEEP | run   Optuna sweeps (orchestrator/cli/sweep.py)
      completion bash|zsh             print the shell completion script
      examples DIR [--force] | --list the example configs, systemd units, alert rules, dashboard
    orchctl --version

Where orchd is: --server, else $ORCH_SERVER, else nats.urls of --config, else <state-dir>/orchd.json
written by a running orchd (default state dir ./var/orchd; removed on a clean stop), else nats://127.0.0.1:4222.

Times in tables are UTC with their date (2026-11-25 20:10:46Z); -o json|yaml gives epoch seconds.

Exit codes (common.EXIT_CODES): 0 ok, 1 orchd answered with an error, 2 usage error (arguments, invalid
job spec or --config), 66 not found (orchd's 404; logs of an unknown job), 69 NATS or orchd unreachable,
or orchd's 503 (it lost the leader lease or is stopping; transient: retry), 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import shtab
import yaml

from orchestrator.cli import ckptroot, demo, examples, sweep
from orchestrator.cli import logs as logs_cmd
from orchestrator.cli.client import AdminClient, AdminError, AdminUnreachable
from orchestrator.cli.common import (
    EXIT_CODES,
    EXIT_DAEMON,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    package_version,
    render_kv,
    render_table,
    resolve_server,
    unreachable_hint,
)
from orchestrator.jobspec import JobSpecError, load_jobspec
from orchestrator.settings import NatsSettings, SettingsError
from wire.admin import MAX_NOTICE_S, KillNodeRequest, PreemptNodeRequest

# --- pure formatting -------------------------------------------------------------------------------

_COLUMNS: dict[str, tuple[str, ...]] = {
    "jobs": ("job_id", "phase", "nodes", "target_nodes", "generation", "step", "total_steps", "cost_usd", "zone"),
    "nodes": ("node_id", "job_id", "phase", "pool", "instance_id", "generation", "rank", "step", "heartbeat_age_s"),
    "pools": ("pool", "gpu_type", "price_usd_h", "on_demand_usd_h", "ratio", "preemptions", "exposure_h"),
    "events": ("seq", "ts", "event", "command", "kind", "job", "node", "pool", "reason"),
    "entries": ("ts", "event", "action", "reason", "details"),
    "messages": ("seq", "ts", "subject", "reason", "deliveries", "size", "preview"),
}


def _notice_seconds(text: str) -> float:
    """``--notice``: seconds within 0 .. MAX_NOTICE_S (a usage error, exit 2, otherwise)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.0 <= v <= MAX_NOTICE_S:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be within 0 .. {MAX_NOTICE_S:g} seconds, got {text}")
    return v


def format_reply(kind: str, reply: Any, fmt: str) -> str:
    """Render a typed reply as table/json/yaml text. Pure."""
    data = msgspec.to_builtins(reply)
    if isinstance(data, dict):
        data.pop("v", None)
    if fmt == "json":
        return json.dumps(data, indent=2, sort_keys=False) + "\n"
    if fmt == "yaml":
        return yaml.safe_dump(data, sort_keys=False)
    if kind in ("jobs", "nodes", "pools", "events"):
        rows = data[kind]
        return render_table(rows, _COLUMNS[kind]) if rows else f"(no {kind})\n"
    if kind == "dead":
        rows = data["messages"]
        return render_table(rows, _COLUMNS["messages"]) if rows else "(no dead letters)\n"
    if kind == "job":
        out = render_kv(data["summary"])
        if data["nodes"]:
            out += "\n" + render_table(data["nodes"], _COLUMNS["nodes"])
        return out
    if kind == "explain":
        rows = data["entries"]
        if not rows:
            return f"(no decisions recorded for {data['job_id']})\n"
        return render_table(rows, _COLUMNS["entries"])
    if kind == "status":
        return render_kv(data)
    if kind == "reap":
        return yaml.safe_dump(data["report"], sort_keys=False)
    return render_kv(data) if isinstance(data, dict) else f"{data}\n"


# --- arguments -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-o", "--output", choices=("table", "json", "yaml"), default=argparse.SUPPRESS)
    watch = argparse.ArgumentParser(add_help=False)
    watch.add_argument("--watch", "-w", action="store_true", help="repeat every --interval seconds")
    watch.add_argument("--interval", type=float, default=2.0)

    p = argparse.ArgumentParser(prog="orchctl", description="Admin CLI of orchd", parents=[common],
                                epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    p.add_argument("--server", "-s", help="NATS URL(s), comma separated (default: see below)")
    p.add_argument("--config", "-c", help="orchd's TOML config (for nats.urls and credentials)")
    p.add_argument("--state-dir", default=None, help="orchd's state dir (for orchd.json)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for orchd (default 5)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    sub.add_parser("status", parents=[common, watch], help="daemon status")
    jobs = sub.add_parser("jobs", help="jobs").add_subparsers(dest="verb", required=True, metavar="VERB")
    s = jobs.add_parser("submit", parents=[common], help="submit a job spec file")
    s.add_argument("file").complete = shtab.FILE  # type: ignore[attr-defined]
    s.add_argument("--id", dest="job_id", default=None, help="job id (idempotent resubmit)")
    jobs.add_parser("list", parents=[common, watch], help="list jobs")
    s = jobs.add_parser("show", parents=[common, watch], help="show one job")
    s.add_argument("job_id")
    s = jobs.add_parser("cancel", parents=[common], help="cancel a job")
    s.add_argument("job_id")
    s.add_argument("--reason", default="admin")

    nodes = sub.add_parser("nodes", help="nodes").add_subparsers(dest="verb", required=True, metavar="VERB")
    s = nodes.add_parser("list", parents=[common, watch], help="list nodes")
    s.add_argument("--job", default=None)
    s = nodes.add_parser("drain", parents=[common], help="drain a node")
    s.add_argument("node_id")
    s.add_argument("--reason", default="admin")
    s = nodes.add_parser("preempt", parents=[common], help="local nodes: inject a spot reclaim with a notice")
    s.add_argument("node_id")
    s.add_argument("--notice", type=_notice_seconds, default=30.0, metavar="SECONDS", dest="notice_s",
                   help="seconds from the notice to the kill (default 30)")
    s = nodes.add_parser("kill", parents=[common], help="local nodes: kill every process of the node, no notice")
    s.add_argument("node_id")

    sub.add_parser("prices", parents=[common, watch], help="pools and prices")
    s = sub.add_parser("events", parents=[common], help="tail decided commands")
    s.add_argument("--follow", "-f", "--watch", action="store_true", dest="follow")
    s.add_argument("--limit", type=int, default=50)
    s.add_argument("--interval", type=float, default=1.0)
    s = sub.add_parser("explain", parents=[common], help="audit of a job's decisions")
    s.add_argument("job_id")
    s.add_argument("--limit", type=int, default=200)
    s = sub.add_parser("reap", parents=[common], help="orphan instances")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--dry-run", action="store_true", help="plan and report only")
    g.add_argument("--yes", action="store_true", help="terminate orphans past their grace period")
    dead = sub.add_parser("dead", help="dead letters").add_subparsers(dest="verb", required=True, metavar="VERB")
    s = dead.add_parser("list", parents=[common], help="messages orchd gave up on (ORCH_DEAD)")
    s.add_argument("--limit", type=int, default=100)
    s = dead.add_parser("replay", parents=[common], help="republish one to its original subject")
    s.add_argument("seq", type=int)
    # subcommands that live in their own modules (args.run)
    logs_cmd.add_parser(sub, common)
    demo.add_parser(sub, common)
    examples.add_parser(sub, common)
    ckptroot.add_parser(sub, common)
    sweep.add_parser(sub, common)
    s = sub.add_parser("completion", help="print the shell completion script (bash or zsh)")
    s.add_argument("shell", choices=("bash", "zsh"))
    s.set_defaults(run=lambda a: _completion(p, a.shell))
    return p


_EPILOG = "exit codes: " + ", ".join(f"{code} {what}" for code, what in EXIT_CODES.items()) + """

shell completion:
  bash: orchctl completion bash > /etc/bash_completion.d/orchctl   (or: eval "$(orchctl completion bash)")
  zsh:  orchctl completion zsh > "${fpath[1]}/_orchctl"
"""


def _completion(parser: argparse.ArgumentParser, shell: str) -> int:
    sys.stdout.write(shtab.complete(parser, shell=shell))
    sys.stdout.flush()
    return EXIT_OK


# --- commands --------------------------------------------------------------------------------------


async def _run(args: argparse.Namespace, urls: list[str], ns: NatsSettings | None, out: Callable[[str], None]) -> int:
    fmt = getattr(args, "output", "table")
    submit = (args.cmd, getattr(args, "verb", None)) == ("jobs", "submit")
    spec = load_jobspec(args.file, now=time.time()) if submit else None  # deadline_in: from now, once
    async with await AdminClient.connect(urls, timeout_s=args.timeout, nats_settings=ns) as c:
        cmd, verb = args.cmd, getattr(args, "verb", None)

        async def once() -> tuple[str, Any]:
            match (cmd, verb):
                case ("status", _):
                    return "status", await c.status()
                case ("jobs", "list"):
                    return "jobs", await c.jobs()
                case ("jobs", "show"):
                    return "job", await c.job(args.job_id)
                case ("nodes", "list"):
                    return "nodes", await c.nodes(args.job)
                case ("prices", _):
                    return "pools", await c.prices()
            raise AssertionError((cmd, verb))

        if (cmd, verb) == ("jobs", "submit"):
            assert spec is not None
            out(format_reply("submit", await c.submit(spec, args.job_id), fmt))
            return EXIT_OK
        if (cmd, verb) == ("jobs", "cancel"):
            out(format_reply("ok", await c.cancel(args.job_id, args.reason), fmt))
            return EXIT_OK
        if (cmd, verb) == ("nodes", "drain"):
            out(format_reply("ok", await c.drain(args.node_id, args.reason), fmt))
            return EXIT_OK
        if (cmd, verb) == ("nodes", "preempt"):
            req = PreemptNodeRequest(node_id=args.node_id, notice_s=args.notice_s)
            out(format_reply("ok", await c.call("nodes", "preempt", req), fmt))
            return EXIT_OK
        if (cmd, verb) == ("nodes", "kill"):
            out(format_reply("ok", await c.call("nodes", "kill", KillNodeRequest(node_id=args.node_id)), fmt))
            return EXIT_OK
        if cmd == "explain":
            out(format_reply("explain", await c.explain(args.job_id, args.limit), fmt))
            return EXIT_OK
        if cmd == "reap":
            out(format_reply("reap", await c.reap(dry_run=args.dry_run), fmt))
            return EXIT_OK
        if cmd == "dead":
            reply = await (c.dead(args.limit) if verb == "list" else c.replay(args.seq))
            out(format_reply("dead" if verb == "list" else "ok", reply, fmt))
            return EXIT_OK
        if cmd == "events":
            after = 0
            first = True
            while True:
                page = await c.events(after_seq=after, limit=args.limit)
                if page.events or first:
                    out(format_reply("events", page, fmt))
                first = False
                after = page.last_seq
                if not args.follow:
                    return EXIT_OK
                await anyio.sleep(args.interval)
        while True:
            kind, reply = await once()
            text = format_reply(kind, reply, fmt)
            if getattr(args, "watch", False) and fmt == "table" and sys.stdout.isatty():
                text = "\x1b[2J\x1b[H" + text
            out(text)
            if not getattr(args, "watch", False):
                return EXIT_OK
            await anyio.sleep(args.interval)


def _stdout(s: str) -> None:
    sys.stdout.write(s)
    sys.stdout.flush()


def _stderr(s: str) -> None:
    sys.stderr.write(s)


def main(argv: list[str] | None = None, *, out: Callable[[str], None] = _stdout,
         err: Callable[[str], None] = _stderr) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0) if e.code in (0, None) else EXIT_USAGE
    if not hasattr(args, "output"):
        args.output = "table"
    if hasattr(args, "run"):  # orchctl demo, orchctl logs, orchctl completion, orchctl sweep
        try:
            if args.cmd == "sweep":
                return int(sweep.run(args, out, err))
            return int(args.run(args))
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
    try:
        urls, ns = resolve_server(args)
    except SettingsError as e:
        err(f"orchctl: {e}\n")
        return EXIT_USAGE
    try:
        return anyio.run(_run, args, urls, ns, out, backend="asyncio")
    except JobSpecError as e:
        err(f"orchctl: {e}\n")
        return EXIT_USAGE
    except AdminUnreachable as e:
        err(f"orchctl: orchd unreachable: {e}\n" + unreachable_hint(args, urls))
        return EXIT_UNREACHABLE
    except AdminError as e:
        err(f"orchctl: orchd error {e.code}: {e.message}\n")
        if e.code == 503:  # the leader lost its lease or is stopping: transient, the next one answers
            err("orchctl: retry: a standby takes over within twice the lease TTL, a restarted orchd in seconds\n")
            return EXIT_UNREACHABLE
        return EXIT_NOT_FOUND if e.code == 404 else EXIT_DAEMON
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def sweep_service_main(argv: list[str] | None = None) -> int:
    """``orch-sweep [--server URL] [--config FILE] [--state-dir DIR] [--timeout S] [--storage URL]
    [--interval S]``: ``orchctl sweep run`` with orchctl's global options in their place."""
    g = argparse.ArgumentParser(add_help=False)
    for opt in ("--server", "--config", "--state-dir", "--timeout"):
        g.add_argument(opt)
    known, rest = g.parse_known_args(sys.argv[1:] if argv is None else argv)
    if "--version" in rest:  # the program's own, as orchd, orchctl and orch-agent answer it
        print(f"orch-sweep {package_version()}")
        return EXIT_OK
    if "-h" in rest or "--help" in rest:  # the help below is `orchctl sweep run`'s: say what else is taken
        print("orch-sweep also takes orchctl's global options: --server URL, --config FILE, --state-dir DIR, "
              "--timeout S (where orchd is: see `orchctl --help`)\n")
    front = [x for opt, v in vars(known).items() if v is not None for x in ("--" + opt.replace("_", "-"), v)]
    return int(main([*front, "sweep", "run", *rest]))
