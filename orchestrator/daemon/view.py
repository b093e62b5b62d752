"""What the admin service may see of the running daemon, and the one thing it may do: submit an intent.

``loop.Daemon`` has this shape; the admin service (``admin.Handlers``) is given a ``DaemonView``, never
the daemon itself, so it cannot reach into the loop's working parts. Every member is read-only except
``submit`` (an admin intent decided like any event, answered once persisted).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from orchestrator.core import State
from orchestrator.core.inputs import CoreEvent
from orchestrator.daemon.eventlog import EventLog
from orchestrator.daemon.executor import Executor
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.store import Store
from orchestrator.settings import Settings
from providers.base import CloudProvider

if TYPE_CHECKING:
    from providers.reaper import Reaper


class DaemonView(Protocol):
    """The running daemon as the admin service sees it."""

    @property
    def settings(self) -> Settings: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def providers(self) -> Mapping[str, CloudProvider]: ...
    @property
    def state(self) -> State | None: ...
    @property
    def store(self) -> Store | None: ...
    @property
    def executor(self) -> Executor | None: ...
    @property
    def events(self) -> EventLog: ...
    @property
    def started_ts(self) -> float: ...
    @property
    def nats_url(self) -> str: ...
    @property
    def metrics_url(self) -> str: ...
    @property
    def connected(self) -> bool: ...
    @property
    def fencing_token(self) -> int: ...
    @property
    def events_decided(self) -> int: ...
    @property
    def batches(self) -> int: ...

    def may_act(self) -> bool: ...

    def reaper_for(self) -> Reaper: ...

    async def submit(self, event: CoreEvent) -> None: ...
