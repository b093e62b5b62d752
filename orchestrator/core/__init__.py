"""The pure decision core: ``decide(state, event, now) -> Decision``.

No I/O, no clock, no logging, no randomness (an import-linter contract in pyproject.toml keeps it so).
``CoreEvent`` is the union of the events ``decide`` accepts, ``Command`` the union of the commands a
``Decision`` carries (the shell's side of the contract: ``Callable[[State, CoreEvent, float], Decision]``).
See docs/core.md for the state machines, the policies and the persistence contract.
"""

from orchestrator.core.commands import Command
from orchestrator.core.decide import decide
from orchestrator.core.gate import authorize
from orchestrator.core.inputs import CoreEvent
from orchestrator.core.model import AuditEntry, CoreConfig, Intent, Job, JobPhase, Meta, Node, NodePhase, PoolStats
from orchestrator.core.records import state_from_records, state_to_records
from orchestrator.core.state import Decision, State
from orchestrator.core.transitions import JOB_TRANSITIONS, NODE_TRANSITIONS, IllegalTransition
from orchestrator.core.views import job_burn_usd_h, job_cost_usd, job_step

__all__ = [
    "AuditEntry",
    "Command",
    "CoreConfig",
    "CoreEvent",
    "Decision",
    "IllegalTransition",
    "Intent",
    "JOB_TRANSITIONS",
    "Job",
    "JobPhase",
    "Meta",
    "NODE_TRANSITIONS",
    "Node",
    "NodePhase",
    "PoolStats",
    "State",
    "authorize",
    "decide",
    "job_burn_usd_h",
    "job_cost_usd",
    "job_step",
    "state_from_records",
    "state_to_records",
]
