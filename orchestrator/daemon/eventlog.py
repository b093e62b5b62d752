"""What ``orchctl events`` shows and the log says of each decision: commands decided, refusals of the gate.

``EventLog`` keeps the recent entries (a bounded deque with a sequence number, read by the admin
service's ``events.tail``) and writes the log lines; the pipeline's ``Decider`` calls ``decision`` for each
decision with commands or audit and ``rejection`` for each refusal of the trust gate (rate-limited per
sender and reason: ``RejectionLog``).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import structlog

from orchestrator.core import Decision
from orchestrator.core.commands import CheckInstance, Command, Launch, SendToAgent, Terminate
from orchestrator.core.inputs import CoreEvent
from orchestrator.daemon.records import agent_command_kind

log = structlog.get_logger("orchd")

RECENT_MAX = 2000


class EventLog:
    """The recent decided commands and refusals, for ``orchctl events``, and their log lines."""

    def __init__(self, maxlen: int = RECENT_MAX) -> None:
        self.recent: deque[dict[str, object]] = deque(maxlen=maxlen)  # each with its "seq"
        self._seqs: deque[int] = deque(maxlen=maxlen)  # the entries' seq, typed (``tail`` reads it)
        self.seq = 0
        self.rejections = RejectionLog()  # the trust gate's refusals in ``recent``, rate-limited

    def tail(self, after_seq: int, limit: int) -> list[dict[str, object]]:
        """The entries after ``after_seq``, at most the last ``limit`` of them."""
        recent = [e for seq, e in zip(self._seqs, self.recent, strict=True) if seq > after_seq]
        return recent[-max(1, limit):]

    def _append(self, entry: dict[str, object]) -> None:
        self.seq += 1
        self._seqs.append(self.seq)
        self.recent.append({"seq": self.seq, **entry})

    def rejection(self, event: CoreEvent, reason: str) -> None:
        """A refusal of the trust gate: logged and shown in ``orchctl events``, at most once per
        (sender node, reason) per 10 s (``RejectionLog``; the entry counts the ones folded into it)."""
        ts = time.time()
        entry = self.rejections.entry(event, reason, ts)
        if entry is None:
            return
        log.warning("event_refused", **{("event_type" if k == "event" else k): v for k, v in entry.items()})
        self._append({"ts": ts, **entry})

    def decision(self, event: CoreEvent, d: Decision) -> None:
        """A log line per command (the triggering event's job and node with it, the command's own fields
        winning), kept for ``orchctl events`` too; the audit entries at debug level."""
        ctx = summarize_event(event)
        where = {k: v for k, v in ctx.items() if k != "event"}  # "event" is the log line's own name
        lg = log.bind()  # one logger for the decision's lines: the module's lazy proxy binds on each call
        for c in d.commands:
            info = describe_command(c)
            lg.info("command_decided", **{**where, **info})
            self._append({"ts": time.time(), "event": type(event).__name__, **ctx, **info})
        if d.audit and lg.is_enabled_for(logging.DEBUG):  # the entry's text only when it is written
            for a in d.audit:
                lg.debug("decision_audit", **where, entry=str(a)[:300])


def describe_command(c: Command) -> dict[str, object]:
    """The fields of a command for the log and ``orchctl events``."""
    info: dict[str, object] = {"command": type(c).__name__}
    match c:
        case SendToAgent(command=inner):
            info.update(kind=agent_command_kind(inner), node=inner.node_id, cmd_id=inner.cmd_id, job=inner.job_id,
                        generation=inner.generation)
        case Launch():
            info.update(job=c.job_id, token=c.token, pool=c.pool.name, nodes=list(c.node_ids))
        case Terminate():
            info.update(node=c.node_id, reason=c.reason)
            if c.pool is not None:
                info["pool"] = c.pool.name
        case CheckInstance():
            info.update(node=c.node_id, pool=c.pool.name)
    return info


def summarize_event(event: CoreEvent) -> dict[str, str]:
    """job/node context of an event, for bound_contextvars."""
    out: dict[str, str] = {"event": type(event).__name__}
    job = getattr(event, "job_id", None)
    node = getattr(event, "node_id", None)
    if job:
        out["job"] = str(job)
    if node:
        out["node"] = str(node)
    return out


class RejectionLog:
    """Events the trust gate refused, for ``orchctl events`` - rate-limited so that a noisy node
    cannot flood the in-memory log: at most one entry per (sender node, reason) per ``window_s``;
    the rejections folded in between are counted into that key's next entry (``count``: this one
    and the ones not shown since the previous entry). Keys idle for a window are forgotten."""

    def __init__(self, window_s: float = 10.0, max_keys: int = 10_000) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._shown: dict[tuple[str, str], tuple[float, int]] = {}  # key -> (last shown ts, folded since)

    def entry(self, event: CoreEvent, reason: str, now: float) -> dict[str, object] | None:
        """The entry to show for this rejection, or None when it is folded into a later one."""
        node = str(getattr(event, "node_id", "") or "")
        key = (node, reason)
        last = self._shown.get(key)
        if last is not None and now - last[0] < self.window_s:
            self._shown[key] = (last[0], last[1] + 1)
            return None
        if len(self._shown) >= self.max_keys:
            self._forget(now)
        self._shown[key] = (now, 0)
        out: dict[str, object] = {**summarize_event(event), "command": "rejected", "reason": reason,
                                  "count": 1 + (last[1] if last is not None else 0)}
        return out

    def _forget(self, now: float) -> None:
        old = [k for k, (ts, _n) in self._shown.items() if now - ts >= self.window_s]
        for k in old:
            del self._shown[k]
        if len(self._shown) >= self.max_keys:  # all recent: forget the oldest half
            for k in sorted(self._shown, key=lambda k: self._shown[k][0])[: self.max_keys // 2]:
                del self._shown[k]
