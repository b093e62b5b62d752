"""Policies replayed by the simulator: the online baselines, the offline optimum, and ``orchd``.

Every online policy is a ``simulations.engine.Policy``; ``optimal`` is computed by dynamic
programming over the same transition system (see ``optimal.py``).
"""

from __future__ import annotations

from simulations.policies.baselines import (
    FailoverPolicy,
    GreedySpotPolicy,
    OnDemandPolicy,
    UniformProgressPolicy,
)

ONLINE = {
    "on_demand": OnDemandPolicy,
    "greedy_spot": GreedySpotPolicy,
    "failover": FailoverPolicy,
    "uniform_progress": UniformProgressPolicy,
}
ALL_POLICIES = ("on_demand", "greedy_spot", "failover", "uniform_progress", "optimal", "orchd")

__all__ = ["ONLINE", "ALL_POLICIES", "OnDemandPolicy", "GreedySpotPolicy", "FailoverPolicy",
           "UniformProgressPolicy"]
