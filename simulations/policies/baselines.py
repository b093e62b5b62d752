"""Online baseline policies (the yardsticks besides the offline optimum).

- ``on_demand``: on-demand from start to end.
- ``greedy_spot``: spot whenever some zone has capacity (stay in the current zone while it lasts,
  else the cheapest one), otherwise wait; switch to on-demand for good once waiting one more tick
  could miss the deadline.
- ``failover``: SkyPilot managed jobs with EAGER_NEXT_REGION: on preemption relaunch spot in the next
  zone (in the order given) that has capacity; on-demand only when no zone has any, and then stay
  there (SkyPilot recovers only on preemption, so it never moves back). Deadline-unaware.
- ``uniform_progress``: Can't Be Late (Wu et al., NSDI'24), extended to several zones by picking the
  current/cheapest zone with capacity: (1) when idle and behind the uniform line
  ep(t) = W * t / D, go on-demand; (2) take spot whenever available and stay until preempted;
  (3) on on-demand, stay until progress >= ep(t + 2d); (4) safety net: when less than 2d of slack is
  left, on-demand until the end. d = the restart overhead of the shared model.

All see only the current tick (capacity of every zone, prices) and their own state.
"""

from __future__ import annotations

import numpy as np

from simulations.engine import IDLE, OD, Policy, Run


def _pick_spot(run: Run) -> int:
    """Current zone if it still has capacity, else the zone with the lowest effective price."""
    m = run.modes
    if run.mode < m.Z and run.usable[run.mode]:
        return run.mode
    if not run.usable.any():
        return IDLE
    cand = np.flatnonzero(run.usable)
    if len(cand) == 1:
        return int(cand[0])
    # prefer no migration: compare price x (1 + overhead share) crudely via lowest price then overhead
    over = np.asarray([run.start_q(int(z)) for z in cand])
    price = run.prices[cand]
    best = np.lexsort((over, price))[0]
    return int(cand[best])


def _must_go_od(run: Run, margin_q: int = 0) -> bool:
    """Waiting one more tick (no progress) and then starting on-demand could miss the deadline."""
    return (run.ticks_left() - 1) * run.Q < run.job.work_q - run.p + run.od_start_q() + margin_q


class OnDemandPolicy(Policy):
    name = "on_demand"

    def act(self, run: Run) -> int:
        return OD if run.mode < run.modes.Z or run.mode >= run.modes.Z + run.modes.R else run.mode


class GreedySpotPolicy(Policy):
    name = "greedy_spot"

    def reset(self, run: Run) -> None:
        self.od = False

    def act(self, run: Run) -> int:
        m = run.modes
        if self.od or (m.Z <= run.mode < m.Z + m.R):
            return run.mode if run.mode >= m.Z else OD
        if _must_go_od(run):
            self.od = True
            return OD
        return _pick_spot(run)


class FailoverPolicy(Policy):
    name = "failover"

    def act(self, run: Run) -> int:
        m = run.modes
        if m.Z <= run.mode < m.Z + m.R:
            return run.mode  # on-demand: stays
        if run.mode < m.Z and run.usable[run.mode]:
            return run.mode
        first = run.mode + 1 if run.mode < m.Z else 0
        for i in range(m.Z):
            z = (first + i) % m.Z
            if run.usable[z]:
                return z
        return OD


class UniformProgressPolicy(Policy):
    name = "uniform_progress"

    def reset(self, run: Run) -> None:
        self.final_od = False
        self.d_q = run.ovq[0][0] if run.modes.R else 0  # restart overhead d, in quanta

    def _ep(self, run: Run, k: float) -> float:
        return run.job.work_q * min(1.0, k / run.job.deadline_ticks)

    def act(self, run: Run) -> int:
        m = run.modes
        on_od = m.Z <= run.mode < m.Z + m.R
        if self.final_od:
            return run.mode if on_od else OD
        if _must_go_od(run, margin_q=self.d_q):
            self.final_od = True
            return run.mode if on_od else OD
        if run.mode < m.Z and run.usable[run.mode]:
            return run.mode  # exploitation: stay on spot until preempted
        if on_od:
            ahead = run.p >= self._ep(run, run.k + 2 * self.d_q / run.Q)
            if ahead and run.usable.any():
                return _pick_spot(run)
            return run.mode
        spot = _pick_spot(run)
        if spot != IDLE:
            return spot
        return OD if run.p < self._ep(run, run.k) else IDLE
