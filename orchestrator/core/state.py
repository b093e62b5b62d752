"""The core's whole state (``State``: jobs, nodes, pools, meta and the derived timer index) and what one
decision gives back (``Decision``). The records themselves are in ``model.py``; the index in ``timers.py``.
"""

from __future__ import annotations

import immutables
import msgspec

from orchestrator.core.commands import Command
from orchestrator.core.model import DEFAULT_CONFIG, AuditEntry, CoreConfig, Job, Meta, Node, PoolStats
from orchestrator.core.timers import Timers


class State(msgspec.Struct, frozen=True):
    jobs: immutables.Map[str, Job]  # job id -> Job
    nodes: immutables.Map[str, Node]  # node id -> Node
    pools: immutables.Map[str, PoolStats]  # pool name -> PoolStats
    meta: Meta
    # What comes due, in time order (timers.py): derived from the records, never persisted and never
    # compared (any two indexes are equal). None: not built yet - ``decide`` builds it from the records.
    timers: Timers | None = None

    @classmethod
    def empty(cls, config: CoreConfig = DEFAULT_CONFIG) -> State:
        return cls(immutables.Map(), immutables.Map(), immutables.Map(), Meta(config=config), Timers())

    @property
    def config(self) -> CoreConfig:
        return self.meta.config


class Decision(msgspec.Struct, frozen=True):
    state: State
    commands: tuple[Command, ...]
    audit: tuple[AuditEntry, ...]
    dirty: frozenset[str]
