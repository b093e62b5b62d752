"""``orchctl sweep``: hyperparameter sweeps (docs/sweeps.md), and the sweep controller service.

    orchctl sweep submit FILE [--id ID]   a sweep file (TOML), validated here; --id makes it idempotent
    orchctl sweep list                    every sweep in the storage
    orchctl sweep show SWEEP              the sweep, its best trial so far and each trial's state
    orchctl sweep cancel SWEEP            no new trials; running trials' jobs are cancelled
    orchctl sweep run [--interval S] [--lease-ttl S]
                                          the controller (``orch-sweep``): reconciles every sweep with
                                          orchd through the admin API until stopped, while it holds the
                                          storage's lease (orchestrator/sweeps/lease.py; else standby)

Every command takes ``--storage URL`` (default ``$ORCH_SWEEP_STORAGE``, else the systemd credential
``sweep-storage.url``): the Optuna storage that holds the sweeps. ``submit``, ``list`` and ``show`` talk
only to the storage; ``cancel`` also cancels the running trials' jobs when orchd answers; ``run`` talks to
both.

Concurrency contract: ``run`` is an anyio task on the asyncio backend; each pass runs in a worker thread
(Optuna's storage blocks) and reaches orchd's admin client on the event loop through ``from_thread``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import structlog
import yaml

from orchestrator.cli.client import AdminClient, AdminError, AdminUnreachable
from orchestrator.cli.common import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    format_time,
    render_kv,
    render_table,
    resolve_server,
)
from orchestrator.settings import NatsSettings, SettingsError
from wire import JobSpec

log = structlog.get_logger("orch.sweep")

STORAGE_ENV = "ORCH_SWEEP_STORAGE"
TRIAL_COLUMNS = ("trial", "job_id", "state", "value", "params", "job_phase", "step", "generations", "pruned_at",
                 "cost_usd", "reason")


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    store = argparse.ArgumentParser(add_help=False)
    store.add_argument("--storage", default=None,
                       help=f"Optuna storage URL (default ${STORAGE_ENV}); sqlite:///FILE is single-host")
    p = sub.add_parser("sweep", help="hyperparameter sweeps (Optuna)")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    s = verbs.add_parser("submit", parents=[common, store], help="submit a sweep file")
    s.add_argument("file")
    s.add_argument("--id", dest="sweep_id", default=None, help="sweep id (idempotent resubmit)")
    verbs.add_parser("list", parents=[common, store], help="list sweeps")
    s = verbs.add_parser("show", parents=[common, store], help="a sweep, its best trial and each trial")
    s.add_argument("sweep_id")
    s = verbs.add_parser("cancel", parents=[common, store], help="cancel a sweep and its running trials")
    s.add_argument("sweep_id")
    s = verbs.add_parser("run", parents=[common, store], help="the sweep controller (orch-sweep)")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between passes (default 2)")
    s.add_argument("--lease-ttl", type=float, default=30.0,
                   help="seconds a dead controller's lease keeps another from acting (default 30)")
    p.set_defaults(run=run)


def slug_id(name: str) -> str:
    """A fresh sweep id from a sweep's name: its slug and 4 random hex digits."""
    base = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:30].strip("-") or "sweep"
    return f"{base}-{secrets.token_hex(2)}"


# --- formatting (pure) -----------------------------------------------------------------------------


def _dump(data: Any, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    return yaml.safe_dump(data, sort_keys=False)


def format_list(rows: list[dict[str, Any]], fmt: str) -> str:
    if fmt != "table":
        return _dump({"sweeps": rows}, fmt)
    cols = ("sweep_id", "name", "state", "reason", "started", "trials", "n_complete", "n_pruned", "n_fail",
            "n_running", "best_value", "cost_usd")
    return render_table(rows, cols) if rows else "(no sweeps)\n"


def format_show(summary: dict[str, Any], trials: list[dict[str, Any]], best: dict[str, Any] | None,
                fmt: str) -> str:
    if fmt != "table":
        return _dump({"sweep": summary, "best": best, "trials": trials}, fmt)
    out = render_kv(summary)
    if best is not None:
        out += f"\nbest trial {best['trial']} ({best['job_id']}): value {best['value']:.6g}, params {best['params']}\n"
    else:
        out += "\nno completed trial yet\n"
    if trials:
        out += "\n" + render_table(trials, TRIAL_COLUMNS)
    return out


# --- commands --------------------------------------------------------------------------------------


def _stdout(s: str) -> None:
    sys.stdout.write(s)
    sys.stdout.flush()


STORAGE_CREDENTIAL = "sweep-storage.url"
"""The storage URL as a systemd credential (``LoadCredential=``, systemd/orch-sweep.service): a URL with a
password stays out of the unit, its environment and the command line."""


def _storage_url(args: argparse.Namespace, env: Any = os.environ) -> str:
    if args.storage or env.get(STORAGE_ENV):
        return str(args.storage or env.get(STORAGE_ENV))
    cdir = env.get("CREDENTIALS_DIRECTORY", "")
    try:
        return (open(os.path.join(cdir, STORAGE_CREDENTIAL), encoding="utf-8").read().strip() if cdir else "")
    except OSError:
        return ""


def run(args: argparse.Namespace, out: Callable[[str], None] | None = None,
        err: Callable[[str], None] | None = None) -> int:
    from orchestrator.sweeps.spec import SweepSpecError
    from orchestrator.sweeps.store import SweepNotFound, SweepsUnavailable

    write = out or _stdout
    ewrite = err or sys.stderr.write
    fmt = getattr(args, "output", "table")
    try:
        if args.verb == "run":
            from orchestrator.sweeps.store import SweepStore

            SweepStore(_storage_url(args))  # a bad URL or no Optuna: one clear line, before any task starts
            urls, ns = resolve_server(args)
            return anyio.run(_serve_until_signal, _storage_url(args), urls, ns, args, backend="asyncio")
        return _storage_command(args, fmt, write)
    except (SweepSpecError, SettingsError, SweepsUnavailable) as e:
        ewrite(f"orchctl sweep: {e}\n")
        return EXIT_USAGE
    except SweepNotFound as e:
        ewrite(f"orchctl sweep: no sweep {e.args[0]!r} in the storage\n")
        return EXIT_NOT_FOUND
    except KeyboardInterrupt:
        return 130


def _storage_command(args: argparse.Namespace, fmt: str, write: Callable[[str], None]) -> int:
    from orchestrator.sweeps.spec import load_sweepspec
    from orchestrator.sweeps.store import SweepStore, best_trial

    if args.verb == "submit":
        spec, text = load_sweepspec(args.file)  # before the storage: a bad file fails without Optuna/DB
        store = SweepStore(_storage_url(args))
        sweep_id = args.sweep_id or slug_id(spec.name)
        now = time.time()
        created = store.create(sweep_id, spec, text, now)
        if created and spec.deadline_ts is not None and spec.deadline_ts <= now:
            sys.stderr.write(f"orchctl sweep: warning: the sweep's deadline {format_time(spec.deadline_ts)} has "
                             "passed: no trial will start (orchd refuses them; the sweep finishes with "
                             "sweep_deadline). A relative deadline (deadline_in = \"72h\") does not expire.\n")
        write(_dump({"sweep_id": sweep_id, "created": created}, fmt) if fmt != "table"
              else f"sweep {sweep_id} {'submitted' if created else 'already there (same file)'}\n")
        return EXIT_OK
    store = SweepStore(_storage_url(args))
    if args.verb == "list":
        write(format_list([store.open(i).summary() for i in store.ids()], fmt))
        return EXIT_OK
    sw = store.open(args.sweep_id)
    if args.verb == "show":
        rows = sw.trial_rows()
        b = best_trial(sw.study)
        best = next((r for r in rows if b is not None and r["trial"] == b.number), None)
        write(format_show(sw.summary(), rows, best, fmt))
        return EXIT_OK
    assert args.verb == "cancel"
    changed = store.cancel(args.sweep_id)
    code = EXIT_OK
    try:
        n = anyio.run(_cancel_running, args, sw, backend="asyncio")
        note = f"; {n} running trial job(s) cancelled"
    except (AdminUnreachable, SettingsError) as e:
        note = f"; orchd unreachable ({e}): the controller cancels the running trials"
        code = EXIT_UNREACHABLE
    write(f"sweep {args.sweep_id} {'cancelled' if changed else 'had already ended or was cancelled'}{note}\n")
    return code


async def _cancel_running(args: argparse.Namespace, sw: Any) -> int:
    """Cancel the running trials' jobs: only a job orchd holds as a job of this sweep (its sweep id), never
    one merely named like a trial."""
    from orchestrator.sweeps import store as st

    urls, ns = resolve_server(args)
    n = 0
    async with await AdminClient.connect(urls, timeout_s=args.timeout, nats_settings=ns) as c:
        for t in sw.study.get_trials(deepcopy=False):
            if not st.is_running(t):
                continue
            if st.STOP not in t.user_attrs:
                sw.set(t, st.STOP, "sweep_cancelled")
            job_id = st.job_id_of(sw.sweep_id, t)
            try:
                if not st.is_trial_of(sw.sweep_id, (await c.job(job_id)).summary):
                    continue  # another job under the trial's name: not this sweep's to cancel
                await c.cancel(job_id, "sweep_cancelled")
                n += 1
            except AdminError as e:
                if e.code != 404:
                    raise
    return n


# --- the controller service ------------------------------------------------------------------------


_CLOSED = re.compile(r"is closed \((sweep_budget|sweep_deadline)\)")
"""orchd's refusal of a trial whose sweep is closed (core/sweeps.py, ``submit_refusal``)."""


class _AdminBridge:
    """OrchdApi for the controller's worker thread: each call runs on the event loop's admin client."""

    def __init__(self, client: AdminClient | None) -> None:
        self.client = client  # replaced on each reconnect

    def _call(self, method: str, *a: Any) -> Any:
        from orchestrator.sweeps.controller import OrchdUnavailable

        client = self.client
        if client is None:
            raise OrchdUnavailable("not connected to NATS")
        try:
            return anyio.from_thread.run(getattr(client, method), *a)
        except AdminUnreachable as e:
            raise OrchdUnavailable(str(e)) from None

    def submit(self, spec: JobSpec, job_id: str) -> None:
        from orchestrator.sweeps.controller import SweepClosed, TrialRefused

        try:
            self._call("submit", spec, job_id)
        except AdminError as e:
            if e.code == 400:  # the spec itself: refused again on every retry
                raise TrialRefused(e.message) from None
            closed = _CLOSED.search(e.message) if e.code == 409 else None
            if closed is None:
                raise
            raise SweepClosed(closed.group(1), e.message) from None

    def job(self, job_id: str) -> dict[str, Any] | None:
        try:
            r = self._call("job", job_id)
        except AdminError as e:
            if e.code == 404:
                return None
            raise
        return {"summary": r.summary, "nodes": r.nodes}

    def cancel(self, job_id: str, reason: str) -> None:
        try:
            self._call("cancel", job_id, reason)
        except AdminError as e:
            if e.code != 404:
                raise


def _try_lease(lease: Any) -> bool:
    """Take or renew the lease; a database error counts as not holding it (logged; retried next pass)."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        return bool(lease.acquire())
    except SQLAlchemyError as e:
        log.error("sweep_lease_error", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        return False


async def serve(storage_url: str, urls: list[str], ns: NatsSettings | None, *, interval_s: float = 2.0,
                timeout_s: float = 5.0, lease_ttl_s: float = 30.0,
                task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
    """The controller until cancelled: a pass every ``interval_s`` while it holds the storage's lease
    (orchestrator/sweeps/lease.py; standby otherwise); orchd or NATS away (restart, leader takeover) is
    waited out - the next pass reconnects and goes on from the storage."""
    from orchestrator.sweeps.controller import Controller, OrchdUnavailable
    from orchestrator.sweeps.lease import ControllerLease
    from orchestrator.sweeps.store import SweepStore, redact_url

    sweeps = await anyio.to_thread.run_sync(SweepStore, storage_url)
    holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
    lease = await anyio.to_thread.run_sync(ControllerLease, sweeps.storage.engine, holder, lease_ttl_s)
    client: AdminClient | None = None
    bridge = _AdminBridge(None)
    ctl = Controller(sweeps, bridge, lease.held)  # one for the service's life: it remembers the cancels it sent
    task_status.started()
    log.info("sweep_controller_started", storage=redact_url(storage_url), interval_s=interval_s, holder=holder)
    leading: bool | None = None  # unknown until the first try
    try:
        while True:
            try:
                if not await anyio.to_thread.run_sync(_try_lease, lease):
                    if leading is not False:  # said once per change
                        log.warning("sweep_controller_standby", holder=holder, lease=lease.current())
                    leading = False
                    await anyio.sleep(interval_s)
                    continue
                if not leading:
                    log.info("sweep_controller_leading", holder=holder, token=lease.token)
                    leading = True
                if client is None or client.nc.is_closed:
                    client = bridge.client = await AdminClient.connect(urls, timeout_s=timeout_s, nats_settings=ns)
                for r in await anyio.to_thread.run_sync(ctl.run_pass, time.time()):
                    if r.error:
                        log.error("sweep_pass_failed", sweep=r.sweep_id, error=r.error)
                    elif r.asked or r.submitted or r.pruned or r.told or r.cancelled or r.state != "running":
                        log.info("sweep_pass", sweep=r.sweep_id, asked=r.asked, submitted=r.submitted,
                                 pruned=r.pruned, told=r.told, cancelled=r.cancelled, state=r.state)
            except (AdminUnreachable, OrchdUnavailable) as e:
                log.warning("sweep_orchd_unreachable", error=str(e))
                if client is not None:
                    await client.close()
                client = None
            await anyio.sleep(interval_s)
    finally:
        with anyio.CancelScope(shield=True):
            if leading:
                with anyio.move_on_after(5):
                    await anyio.to_thread.run_sync(lease.release)
            if client is not None:
                await client.close()


async def _serve_until_signal(storage_url: str, urls: list[str], ns: NatsSettings | None,
                              args: argparse.Namespace) -> int:
    from wire.logs import configure

    configure(level="info")
    async with anyio.create_task_group() as tg:
        await tg.start(lambda task_status: serve(storage_url, urls, ns, interval_s=args.interval,
                                                 timeout_s=args.timeout, lease_ttl_s=args.lease_ttl,
                                                 task_status=task_status))
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                tg.cancel_scope.cancel()
                break
    return EXIT_OK
