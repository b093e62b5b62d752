"""The daemon's handle on the decision core: the functions it calls, configured by orchd's settings.

The shell calls the core through ``CoreApi`` (so tests and benchmarks can pass the same functions, and the
shell never reaches into the core's internals); ``default_core`` is the real core with this run's settings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import msgspec

from orchestrator.core import AuditEntry, Decision, State
from orchestrator.core.inputs import CoreEvent
from orchestrator.core.model import DEFAULT_RESTART_BACKOFF_BASE_S, DEFAULT_RESTART_BACKOFF_MAX_S
from orchestrator.settings import Settings
from wire.names import is_token

_enc = msgspec.json.Encoder()


@dataclass(frozen=True)
class CoreApi:
    """The functions of the decision core the daemon calls (``orchestrator.core``'s, or a test's)."""

    decide: Callable[[State, CoreEvent, float], Decision]
    state_to_records: Callable[[State, Iterable[str]], dict[str, bytes]]
    state_from_records: Callable[[Mapping[str, bytes]], State]
    empty_state: Callable[[], State]
    encode_audit: Callable[[AuditEntry], bytes] = _enc.encode
    configure: Callable[[State], State] | None = None
    """Applied to a state restored from records, so the settings of this run (not the persisted
    ones) drive the policy; None leaves the restored state as it is."""

    def restore(self, records: Mapping[str, bytes]) -> State:
        state = self.state_from_records(records)
        return self.configure(state) if self.configure is not None else state


def default_core(settings: Settings, known_instance_types: tuple[str, ...] | None = None) -> CoreApi:
    """The real core, configured by ``settings``; ``known_instance_types`` (``registry.known_instance_types``
    of the providers): a pool of any other type is never a launch target (None: no list)."""
    from orchestrator import core

    config = core.CoreConfig(
        heartbeat_timeout_s=settings.daemon.heartbeat_timeout_s,
        tick_s=settings.daemon.tick_s,
    )
    if settings.daemon.price_confirm_s != config.confirm_s():
        # set only when not the core's default: the persisted meta record keeps the bytes older releases wrote
        config = msgspec.structs.replace(config, price_confirm_s=settings.daemon.price_confirm_s)
    if known_instance_types is not None:
        config = msgspec.structs.replace(config, known_instance_types=known_instance_types)
    d = settings.daemon
    if (d.restart_backoff_base_s, d.restart_backoff_max_s) != (DEFAULT_RESTART_BACKOFF_BASE_S,
                                                               DEFAULT_RESTART_BACKOFF_MAX_S):
        config = msgspec.structs.replace(config, restart_backoff_base_s=d.restart_backoff_base_s,
                                         restart_backoff_max_s=d.restart_backoff_max_s)
    if (d.boot_estimate_s, d.terminate_billing_s) != (config.boot_s_estimate, config.terminate_s):
        config = msgspec.structs.replace(config, boot_s_estimate=d.boot_estimate_s, terminate_s=d.terminate_billing_s)
    return CoreApi(
        decide=core.decide,
        state_to_records=core.state_to_records,
        state_from_records=core.state_from_records,
        empty_state=lambda: core.State.empty(config),
        configure=lambda s: msgspec.structs.replace(s, meta=msgspec.structs.replace(s.meta, config=config)),
    )


def park_bad_names(records: Mapping[str, bytes]) -> tuple[dict[str, bytes], dict[str, str]]:
    """The stored records minus those whose job or node id is not a token (``wire.names``: an older release
    took ids the subjects and keys of today's cannot hold), and why each was left out. A parked record stays
    in KV untouched (an operator can rename and resubmit the job); the nodes of a parked job are parked
    with it, so no node refers to a job the state does not hold."""
    parked: dict[str, str] = {}
    bad_jobs: set[str] = set()
    for key in records:
        if key.startswith("job.") and not is_token(key[4:]):
            parked[key] = "job id is not a token"
            bad_jobs.add(key[4:])
    for key, value in records.items():
        if not key.startswith("node."):
            continue
        if not is_token(key[5:]):
            parked[key] = "node id is not a token"
        elif bad_jobs and _job_of(value) in bad_jobs:
            parked[key] = "its job is parked"
    return {k: v for k, v in records.items() if k not in parked}, parked


def _job_of(record: bytes) -> str | None:
    try:
        job = msgspec.json.decode(record).get("job_id")
    except (msgspec.DecodeError, AttributeError):
        return None
    return job if isinstance(job, str) else None
