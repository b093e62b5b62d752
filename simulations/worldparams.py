"""The physics of the simulated clouds and trainer, and the random draws every policy shares.

Role: one set of fixed, sourced defaults for the faithful world (``world_cloud`` / ``world`` /
``world_policy``) and one seeded table of random draws per scenario, so that every policy meets the
same preemptions without notice, the same launch delays and the same capacity errors.

Defaults and their sources (not tuned; ``python -m simulations world-defaults`` prints the figures
that are derived from ../shared/traces):

  notice_s            AWS 120 s, GCP 30 s, Azure 30 s: the providers' documented preemption notices.
  no_notice_share     0.05 of preemptions come without a notice. No public measurement; AWS and GCP
                      both document the notice as best effort. A round assumption, stated as such.
  state_gib / save    save time = save_fixed_s + state_gib / save_gib_s. state_gib 20: the core's
                      ``checkpoint_gb_estimate`` (the size a job's checkpoint is assumed to have);
                      save_gib_s 1.119 and save_fixed_s 0.83: ``python benchmarks/checkpoint.py
                      --json`` on this project's machine, quiet run (docs/benchmarks.md, "Checkpoints":
                      save_gib_s and emergency_s of a 1.035 GiB state).
  periodic saves      asynchronous (the trainer stages to host memory and writes in a thread:
                      async_block_steps 0.07 in the same benchmark), so training goes on while the
                      save runs; the checkpoint holds the progress of the moment it started.
  launch delay        the duration of GCP's instance-create call in the persistent availability logs
                      of training_on_a_dime (March 2020), as quantiles (sampled by inverse CDF), plus
                      agent_start_s 60 (an assumption: image boot to agent registration).
  capacity_error_p    share of 1-GPU (zone, GPU) launch probes that failed in the GCP spin-up probes
                      of training_on_a_dime (a launch can fail although the trace shows capacity).
  restart_s, migration: as in ``simulations.overheads`` (trainer start + checkpoint load; copying a
                      checkpoint across regions / clouds).
  capacity hints      a noisy score like the clouds' placement scores (AWS: 1..10, never 0): the
                      zone's share of available ticks over the last ``hint_window_ticks`` ticks up to
                      now (no later trace data), plus Gaussian noise, rounded to 0.1, in [0.1, 1.0].

Pure; numpy only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import numpy as np

from simulations.overheads import Overheads

NOTICE_S = {"aws": 120.0, "gcp": 30.0, "azure": 30.0}
# quantiles 0, 0.1, ..., 1.0 of the GCP create-call duration (s), ``python -m simulations world-defaults``
LAUNCH_CALL_Q = (39.0, 41.0, 41.0, 45.0, 46.0, 46.0, 46.0, 47.0, 50.0, 221.4, 837.0)
CAPACITY_ERROR_P = 0.236


@dataclass(frozen=True, slots=True, kw_only=True)
class WorldParams:
    notice_s: dict[str, float] = field(default_factory=lambda: dict(NOTICE_S))
    notice_override_s: float | None = None  # --notice-s: one notice length for every cloud
    no_notice_share: float = 0.05
    state_gib: float = 20.0
    save_gib_s: float = 1.119
    save_fixed_s: float = 0.83
    launch_call_q: tuple[float, ...] = LAUNCH_CALL_Q
    agent_start_s: float = 60.0
    capacity_error_p: float = CAPACITY_ERROR_P
    restart_s: float = 120.0
    region_migration_s: float = 300.0
    cloud_migration_s: float = 900.0
    baseline_checkpoint_interval_s: float = 1800.0  # periodic saves of the baselines (they choose none)
    hint_window_ticks: int = 12
    hint_noise: float = 0.15
    seed: int = 0
    # The decision-step world (``step_world``): the policy sees events only at trace-tick boundaries.
    decision_step: bool = False

    def __post_init__(self) -> None:
        bad = []
        if not 0.0 <= self.no_notice_share <= 1.0:
            bad.append(f"no_notice_share {self.no_notice_share} not in [0, 1]")
        if not 0.0 <= self.capacity_error_p < 1.0:
            bad.append(f"capacity_error_p {self.capacity_error_p} not in [0, 1)")
        if self.save_gib_s <= 0 or self.state_gib < 0:
            bad.append("save_gib_s must be > 0 and state_gib >= 0")
        if self.notice_override_s is not None and self.notice_override_s < 0:
            bad.append("notice_override_s must be >= 0")
        if len(self.launch_call_q) < 2 or list(self.launch_call_q) != sorted(self.launch_call_q):
            bad.append("launch_call_q must be >= 2 ascending quantiles")
        if bad:
            raise ValueError("; ".join(bad))

    @classmethod
    def step_world(cls, restart_s: float = 0.1 * 3600.0, seed: int = 0) -> WorldParams:
        """The decision-step world of Wu et al., "Can't Be Late" (NSDI'24): time advances in steps (the
        trace's tick, 600 s on the SkyPilot traces); at each boundary the policy sees only whether spot is
        available now and chooses spot, on-demand or nothing; spot that becomes unavailable during a step
        is gone at that step's end with no notice and the step's work is lost (the progress of completed
        steps is kept: a free commit at each boundary); every change of instance, and every restart after a
        loss, costs ``restart_s`` of no progress (0.05-0.2 h in the paper); on-demand is always available
        and never preempted; launches never fail; moving a checkpoint costs nothing."""
        return cls(no_notice_share=1.0, state_gib=0.0, save_fixed_s=0.0, launch_call_q=(0.0, 0.0),
                   agent_start_s=0.0, capacity_error_p=0.0, restart_s=restart_s, region_migration_s=0.0,
                   cloud_migration_s=0.0, seed=seed, decision_step=True)

    @property
    def save_s(self) -> float:
        return self.save_fixed_s + self.state_gib / self.save_gib_s

    def notice_for(self, cloud: str) -> float:
        if self.notice_override_s is not None:
            return self.notice_override_s
        return self.notice_s.get(cloud, min(self.notice_s.values()))

    def launch_delay_s(self, u: float) -> float:
        """Inverse CDF of the launch call (piecewise linear between quantiles) + agent start."""
        q = self.launch_call_q
        x = u * (len(q) - 1)
        i = min(int(x), len(q) - 2)
        return q[i] + (q[i + 1] - q[i]) * (x - i) + self.agent_start_s

    def min_launch_delay_s(self) -> float:
        return self.launch_call_q[0] + self.agent_start_s

    def with_(self, **kw) -> WorldParams:
        return replace(self, **kw)

    def bound_overheads(self) -> Overheads:
        """The least overheads this world can charge: the offline optimum solves with these, so it
        stays a lower bound for every policy run in the world (shortest launch, saves always fit,
        quanta rounded down)."""
        return Overheads(launch_delay_s=self.min_launch_delay_s(), restart_s=self.restart_s,
                         checkpoint_s=self.save_s, notice_s=math.inf,
                         region_migration_s=self.region_migration_s, cloud_migration_s=self.cloud_migration_s,
                         round_down=True)

    def policy_overheads(self) -> Overheads:
        """What the baselines assume (their d, their on-demand start time): the median launch, a save
        that fits the notice (as published, they count no lost work)."""
        return Overheads(launch_delay_s=self.launch_delay_s(0.5), restart_s=self.restart_s,
                         checkpoint_s=self.save_s, notice_s=math.inf,
                         checkpoint_interval_s=self.baseline_checkpoint_interval_s,
                         region_migration_s=self.region_migration_s, cloud_migration_s=self.cloud_migration_s)


@dataclass(frozen=True, slots=True)
class Draws:
    """Random draws per (zone, trace tick), shared by every policy on one scenario: whether a
    preemption at that tick's start comes without notice, the launch delay quantile and whether a
    launch fails with a capacity error. Several launches in one zone and tick share the draw
    (attempt ``a`` uses the draw of tick t + a, cyclic)."""

    no_notice: np.ndarray  # (Z, T) bool
    launch_u: np.ndarray  # (Z + 1, T) float in [0, 1); the last row is for on-demand launches
    cap_error: np.ndarray  # (Z, T) bool

    @classmethod
    def make(cls, n_zones: int, n_ticks: int, wp: WorldParams) -> Draws:
        rng = np.random.default_rng([wp.seed, n_zones, n_ticks])
        nn = rng.random((n_zones, n_ticks)) < wp.no_notice_share
        lu = rng.random((n_zones + 1, n_ticks))
        ce = rng.random((n_zones, n_ticks)) < wp.capacity_error_p
        return cls(nn, lu, ce)


def capacity_scores(usable: np.ndarray, wp: WorldParams) -> np.ndarray:
    """(Z, T) noisy placement-like scores in [0.1, 1.0]: score[:, t] depends only on usable[:, :t+1]
    (the share of usable ticks in the trailing window up to t, shorter at the trace's start)."""
    Z, T = usable.shape
    w = max(1, wp.hint_window_ticks)
    cs = np.concatenate([np.zeros((Z, 1)), np.cumsum(usable.astype(float), axis=1)], axis=1)  # (Z, T + 1)
    hi = np.arange(1, T + 1)
    lo = np.maximum(0, hi - w)
    share = (cs[:, hi] - cs[:, lo]) / (hi - lo)
    rng = np.random.default_rng([wp.seed, 7919, Z, T])
    s = share + rng.normal(0.0, wp.hint_noise, size=share.shape)
    return np.clip(np.round(s, 1), 0.1, 1.0)


# --- defaults derived from ../shared/traces/training_on_a_dime ----------------------------------------

_TS = re.compile(r"\[(\S+)\] (.*)")
_PROBE = re.compile(r"Zone: (\S+), GPU type: (\S+), Number of GPUs: (\d+)")


def derive_defaults(root: Path) -> dict[str, object]:
    """Launch-call quantiles and the capacity error share from the GCP logs of training_on_a_dime."""
    base = root / "training_on_a_dime" / "raw" / "gcp"
    durs: list[float] = []
    for f in sorted((base / "availability").glob("persistent_*.out")):
        prev = None
        for ln in f.read_text().splitlines():
            m = _TS.match(ln)
            if not m:
                continue
            t = datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
            if m.group(2).startswith("Created instance") and prev is not None:
                durs.append(t - prev)  # the create call returns when the VM runs
            prev = t
    probes = []
    for f in sorted((base / "spin_up_and_shut_down").glob("*.out")):
        probes.append({m.groups() for m in map(_PROBE.match, f.read_text().splitlines()) if m and m.group(3) == "1"})
    if not durs or not probes:
        raise FileNotFoundError(f"no GCP availability logs or spin-up probes under {base}")
    tried = set().union(*probes)
    ok = sum(len(p) for p in probes) / (len(tried) * len(probes))
    q = np.quantile(np.asarray(durs), np.linspace(0, 1, 11))
    return {
        "launch_call_quantiles_s": [round(float(x), 1) for x in q],
        "launch_calls": len(durs),
        "capacity_error_p": round(1.0 - ok, 3),
        "spin_up_probes": len(probes),
        "one_gpu_combos": len(tried),
    }
