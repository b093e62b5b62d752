"""The overhead model of the tick engine and the offline optimum (the faithful world's physics are
``simulations.worldparams``, which derives the optimum's least overheads and the baselines' estimates
from it as ``Overheads``).

Role: turn the physical costs of moving a training job (launch, checkpoint, restart, migration) into
the integer "quanta" of progress that the tick engine (``simulations.engine``) and the dynamic
programme (``simulations.policies.optimal``) both use. Because both read the same table, the offline
optimum is a true lower bound for every online policy on the same inputs.

A (re)start of a job costs wall-clock time during which the nodes are billed but the job makes no
progress:

    first start  = launch_delay_s + restart_s
    any resume   = launch_delay_s + restart_s + checkpoint_s + lost_work_s + migration_s(src, dst)

``checkpoint_s`` is the save of the interrupted run (emergency save inside the preemption notice, or
a planned save before a voluntary move), charged at the resume so that a job which waits idle in
between pays it exactly once. ``lost_work_s`` is zero when the notice is long enough for that save
(AWS: 120 s notice); otherwise half a periodic checkpoint interval is redone. Checkpoints live in
regional object storage, so moving between zones of one region costs nothing extra; moving between
regions adds ``region_migration_s`` and between clouds ``cloud_migration_s``.

Pure; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FRESH = None  # source "region" of a job that has never run (no checkpoint anywhere)


@dataclass(frozen=True, slots=True, kw_only=True)
class Overheads:
    launch_delay_s: float = 120.0  # launch request -> node booted and agent registered
    restart_s: float = 120.0  # trainer start, checkpoint load, warm-up, until the first step
    checkpoint_s: float = 60.0  # save of the interrupted run
    notice_s: float = 120.0  # preemption warning (AWS 120 s, GCP/Azure ~30 s)
    checkpoint_interval_s: float = 1800.0  # periodic checkpoints (used only when notice < save)
    region_migration_s: float = 300.0  # copy a checkpoint to another region
    cloud_migration_s: float = 900.0  # copy a checkpoint to another cloud
    round_down: bool = False  # quanta rounded down (a lower bound of a world that charges to the second)

    @property
    def lost_work_s(self) -> float:
        return 0.0 if self.notice_s >= self.checkpoint_s else self.checkpoint_interval_s / 2.0

    def migration_s(self, src: tuple[str, str] | None, dst: tuple[str, str]) -> float:
        """Extra seconds to move the checkpoint from ``src`` to ``dst`` ((cloud, region) pairs)."""
        if src is None or src == dst:
            return 0.0
        if src[0] != dst[0]:
            return self.cloud_migration_s
        return self.region_migration_s

    def start_s(self, src: tuple[str, str] | None, dst: tuple[str, str]) -> float:
        """Seconds without progress when a job (re)starts in ``dst`` with its checkpoint in ``src``."""
        if src is FRESH:
            return self.launch_delay_s + self.restart_s
        return (
            self.launch_delay_s
            + self.restart_s
            + self.checkpoint_s
            + self.lost_work_s
            + self.migration_s(src, dst)
        )

    def start_quanta(self, src: tuple[str, str] | None, dst: tuple[str, str], quantum_s: float) -> int:
        """``start_s`` rounded UP (DOWN with ``round_down``) to whole progress quanta (the unit the engine
        and the DP count in)."""
        x = self.start_s(src, dst) / quantum_s
        return int(math.floor(x + 1e-9)) if self.round_down else int(math.ceil(x - 1e-9))


def start_table(overheads: Overheads, regions: list[tuple[str, str]], quantum_s: float) -> list[list[int]]:
    """O[src][dst] in quanta; src index len(regions) is FRESH (never ran)."""
    rows = [[overheads.start_quanta(s, d, quantum_s) for d in regions] for s in regions]
    rows.append([overheads.start_quanta(FRESH, d, quantum_s) for d in regions])
    return rows
