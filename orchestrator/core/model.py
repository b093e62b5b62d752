"""The decision core's state: frozen records for jobs, nodes, pools and the daemon's own counters.

Role: pure data. Every record is a frozen ``msgspec.Struct`` so it encodes to one JSON value per
persistence key (see ``records.py``); collections are ``immutables.Map`` (a HAMT) so that changing one
node of 10,000 costs O(log n) instead of a dict copy.

Concurrency contract: none needed - everything here is immutable; ``decide`` returns a new ``State``.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Final

import msgspec

from wire.messages import InstanceId, JobId, JobSpec, NodeId, PoolKey

# Characters allowed in ids we mint (node ids are NATS subject tokens and KV key parts).
_ID_OK: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def safe_token(value: str) -> str:
    """``value`` with every character that is not ``[A-Za-z0-9_-]`` replaced by ``_`` (never empty)."""
    out = "".join(c if c in _ID_OK else "_" for c in value)
    return out or "_"


def fin(x: float | None) -> float | None:
    """``x`` when it is a finite number, else None: non-finite floats never enter the state (they do
    not survive JSON, and no decision can use them)."""
    return x if x is not None and math.isfinite(x) else None


def pool_record_key(pool_name: str) -> str:
    return "pool." + pool_name.replace("/", "_")


class JobPhase(StrEnum):
    PENDING = "pending"  # submitted; no feasible pool yet (waits for prices / backoff)
    PLACING = "placing"  # first nodes launched, waiting for them to register
    STARTING = "starting"  # StartGenerationCmd sent, waiting for GenerationStarted / a training heartbeat
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"  # CheckpointCmd sent; waiting for the commit and every rank's exit
    RECOVERING = "recovering"  # a node was lost: AbandonGenerationCmd sent, waiting for the survivors' exit
    RESIZING = "resizing"  # between generations: waiting for enough registered nodes to start the next
    PAUSED = "paused"  # price above the pause ratio: checkpointed, no nodes
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    STOPPED = "stopped"  # budget exhausted: final checkpoint committed (or hard stop), no nodes


TERMINAL_JOB_PHASES: Final = frozenset(
    {JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED, JobPhase.STOPPED}
)
# Phases in which a generation of trainer ranks may be alive on the job's nodes.
GEN_PHASES: Final = frozenset(
    {JobPhase.STARTING, JobPhase.RUNNING, JobPhase.CHECKPOINTING, JobPhase.RECOVERING}
)


class NodePhase(StrEnum):
    REQUESTED = "requested"  # Launch emitted, no instance yet
    BOOTING = "booting"  # NodeLaunched: the cloud has an instance; the agent has not registered
    REGISTERED = "registered"  # agent registered; not in a running generation (idle)
    RUNNING = "running"  # member of the job's current generation (rank = node.rank)
    NOTICED = "noticed"  # preemption notice: leaves after the checkpoint (or dies at the deadline)
    DRAINING = "draining"  # we decided to remove it (admin drain, zone move, scale down)
    GONE = "gone"  # lost (provider says gone / confirmed failure); record deleted
    TERMINATED = "terminated"  # we sent Terminate; record deleted


LIVE_NODE_PHASES: Final = frozenset(
    {
        NodePhase.REQUESTED,
        NodePhase.BOOTING,
        NodePhase.REGISTERED,
        NodePhase.RUNNING,
        NodePhase.NOTICED,
        NodePhase.DRAINING,
    }
)


class Intent(StrEnum):
    """Why the current generation is being ended (what happens at its end)."""

    NONE = ""
    PREEMPTION = "preemption"
    GROW = "grow"
    MIGRATE = "migrate"
    PAUSE = "pause"
    BUDGET = "budget"
    CANCEL = "cancel"
    DRAIN = "drain"
    RECOVER = "recover"
    SWEEP_BUDGET = "sweep_budget"  # the job's sweep reached its total budget (core/sweeps.py): stopped
    SWEEP_DEADLINE = "sweep_deadline"  # the job's sweep passed its deadline (core/sweeps.py): stopped


DEFAULT_MAX_PRICE_USD_H: Final = 1000.0  # per node-hour, spot or on-demand
DEFAULT_MAX_SPOT_OVER_ON_DEMAND: Final = 10.0  # spot at most this many times the on-demand price
DEFAULT_PRICE_CONFIRM_S: Final = 60.0  # a new price acts only once it has held this long
DEFAULT_RESTART_BACKOFF_BASE_S: Final = 30.0  # the first restart hold; doubles with each hold in a row
DEFAULT_RESTART_BACKOFF_MAX_S: Final = 900.0
DEFAULT_DEADLINE_MARGIN_RESTARTS: Final = 3.0  # the deadline margin, in restarts (restart + boot + save)
DEFAULT_LINE_SLACK_SHARE: Final = 0.5  # share of the uniform-progress line's slack kept before on-demand
DEFAULT_SPOT_RETURNS_PER_H: Final = 1.0  # moves from on-demand back to spot per job in any hour
DEFAULT_RECLAIM_WINDOW_S: Final = 600.0  # a pool with a notice or a loss this recent is no refuge
DEFAULT_WAIT_PROBE_S: Final = 300.0  # a job with nothing to train on retries a failed pool at least this often


class CoreConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Tunables of the decision policy. Units are in the names."""

    heartbeat_timeout_s: float = 10.0
    tick_s: float = 5.0  # the shell feeds a Tick at least this often (budget margins rely on it)
    notice_window_aws_s: float = 120.0
    notice_window_gcp_s: float = 30.0
    notice_window_azure_s: float = 30.0
    notice_window_default_s: float = 30.0
    notice_save_margin_s: float = 5.0  # an emergency save must finish this long before the deadline
    launch_timeout_s: float = 900.0  # Launch -> agent registered; after it the node is given up
    checkpoint_timeout_s: float = 300.0  # extra wait for a generation to end before abandoning it
    boot_s_estimate: float = 240.0  # launch -> trainer running, for cost/deadline estimates
    restart_overhead_s: float = 120.0  # new generation -> first step (load + warm-up)
    terminate_s: float = 60.0  # billing still accrues this long after Terminate
    max_restarts: int = 3  # trainer failures (exit "failed") before the job fails
    master_port_base: int = 29500
    master_port_span: int = 500
    # Preemption statistics per pool: decayed counts with a prior.
    stats_half_life_s: float = 3 * 86400.0
    spot_prior_rate_h: float = 0.05  # preemptions per node-hour before any observation
    prior_weight_h: float = 20.0  # node-hours of pseudo-exposure the prior is worth
    on_demand_rate_h: float = 0.0005
    preempted_penalty: float = 1.0  # expected cost x (1 + penalty * decay) right after a preemption
    preempted_penalty_half_life_s: float = 1800.0
    # After a terminate notice, no new launch into that spot pool until the notice's deadline + this
    # (its capacity is going away: a node launched there now is preempted a minute later).
    notice_skip_grace_s: float = 60.0
    # Launch failures: per-pool exponential backoff.
    backoff_base_s: float = 60.0
    backoff_max_s: float = 1800.0
    # Checkpoint interval (Young/Daly).
    ckpt_interval_min_s: float = 120.0
    ckpt_interval_max_s: float = 4 * 3600.0
    unfit_interval_factor: float = 0.5  # when the emergency save cannot fit the notice window
    # Price policy.
    scale_up_below_ratio: float = 0.5  # grow toward nodes_max when spot/on-demand is below this
    migrate_cooldown_s: float = 1800.0
    price_eval_interval_s: float = 60.0  # migration / scale-up evaluated at most this often per job
    # Migration re-ranks the pools only when a pool record changed, a launch backoff or notice skip
    # expired, the job started a generation or left its cooldown since its last evaluation - and at
    # least once per window of this many seconds (decaying penalties and remaining work move costs
    # slowly without any event).
    price_rerank_max_s: float = 1800.0
    max_price_evals_per_tick: int = 50  # spreads that work over ticks (no latency spike at 10k nodes)
    migrate_horizon_h: float = 6.0
    checkpoint_gb_estimate: float = 20.0
    cross_region_usd_per_gb: float = 0.02
    cross_cloud_usd_per_gb: float = 0.09
    transfer_gbps: float = 1.0
    # Deadline margin as a share of the remaining work: no longer used (the margin is in time, see
    # deadline_margin_restarts); kept so that older configs and records still load.
    deadline_margin: float = 0.1
    # Slack-aware on-demand (policy.py, placement.py): under spot_with_fallback with a deadline, launch
    # on-demand only once the spare slack (deadline - now - remaining work - one restart) no longer covers
    # the expected cost of waiting for spot (the deadline margin + the expected restarts of the rest on
    # spot + progress_line_margin_s); before that, wait for spot. progress_line=False: on-demand at once.
    progress_line: bool = True
    progress_line_margin_s: float = 0.0
    max_alternatives: int = 5
    # Bounds on prices (PriceTick): a tick outside them is ignored (audit ``bad_price``), so the cost and
    # budget arithmetic never sees an absurd number (1e308 $/h x 60 s overflows to inf). Any price, spot or
    # on-demand, at most ``price_ceiling_usd_h()`` per node-hour; a spot price at most ``spot_band()`` x
    # the on-demand price the tick carries (else the pool's, else the on-demand pool's of the same key; no
    # band while none is known). UNSET = the defaults below, and an UNSET field is not encoded: the
    # persisted meta record of a default config keeps the bytes older releases wrote.
    max_price_usd_h: float | msgspec.UnsetType = msgspec.UNSET
    max_spot_over_on_demand: float | msgspec.UnsetType = msgspec.UNSET
    # Two signals before a price moves money: a new price of a pool is *pending* until it has held (every
    # tick in between within PRICE_TOLERANCE of it) for ``confirm_s()`` (UNSET = DEFAULT_PRICE_CONFIRM_S;
    # 0 = at once). Pause, migration, scale-up, cost accrual and budgets see confirmed prices only.
    price_confirm_s: float | msgspec.UnsetType = msgspec.UNSET
    # "cloud/instance_type" entries the providers can launch (the pools orchd's providers declare, the
    # simulator's world's pools). When set, a pool of any other instance type is never a launch target;
    # an entry "cloud/*" (written by an older release) matches nothing. UNSET = no list (core tests).
    known_instance_types: tuple[str, ...] | msgspec.UnsetType = msgspec.UNSET
    # Restart hold: after a generation ends by the trainer's doing (a counted exit, or exit 0 before
    # total_steps) or by a storage error (not counted), the next generation waits base x 2^k seconds (k =
    # holds in a row since the job last committed a checkpoint), at most max. UNSET = the defaults above.
    restart_backoff_base_s: float | msgspec.UnsetType = msgspec.UNSET
    restart_backoff_max_s: float | msgspec.UnsetType = msgspec.UNSET
    # Deadline fallback margin in restarts: the job is forced on-demand when the slack no longer covers
    # the remaining work + one restart + this many restarts (restart + boot + save each); it goes back
    # to spot once the slack covers twice the margin again. UNSET = DEFAULT_DEADLINE_MARGIN_RESTARTS.
    deadline_margin_restarts: float | msgspec.UnsetType = msgspec.UNSET
    # The deadline safety net (pricing.safety_net_s) is in time and not a knob: decision_interval_s is the
    # longest time until the core acts again (the Tick period, a price feed's period, a slow control host);
    # UNSET = tick_s, and never less than tick_s. The margins above only add slack on top of the net.
    decision_interval_s: float | msgspec.UnsetType = msgspec.UNSET
    # Moves from on-demand back to spot per job in any hour (moves to on-demand are never bounded).
    # UNSET = DEFAULT_SPOT_RETURNS_PER_H.
    spot_returns_per_h: float | msgspec.UnsetType = msgspec.UNSET
    # A job fleeing a reclaim (a notice or a loss of its node) does not launch into a spot pool that had a
    # notice or a loss within this many seconds. UNSET = DEFAULT_RECLAIM_WINDOW_S.
    reclaim_window_s: float | msgspec.UnsetType = msgspec.UNSET
    # Slack-aware on-demand: the spare slack a waiting job keeps is at least this share of the uniform-
    # progress line's (initial slack x time left / time from submit to deadline): 1 = on-demand as soon
    # as the job is behind the line, 0 = only when the slack is down to the margin and the expected
    # restarts. UNSET = DEFAULT_LINE_SLACK_SHARE.
    line_slack_share: float | msgspec.UnsetType = msgspec.UNSET
    # Slack-aware on-demand by the job's own pace (pricing.projected_wait_s): a waiting job keeps the slack
    # the rest of its work is expected to spend not training at its pace so far, which assumes this many
    # hours of uninterrupted work before any observation (large: wait for spot as greedy does; 0: the
    # uniform-progress line). UNSET = off: a tuning, not a default (as the only reserve, with no margin above
    # the safety net, it let deadlines slip in the faithful world's table; docs/core.md "Deadline").
    progress_prior_h: float | msgspec.UnsetType = msgspec.UNSET
    # A job that has nothing to train on (it waits for capacity) may retry a pool in launch backoff this
    # long after the failure that set the backoff, however long the backoff: waiting costs its slack,
    # a failed launch costs nothing. Moves of running jobs keep the whole backoff. UNSET =
    # DEFAULT_WAIT_PROBE_S; 0, < 0 or nan: no probes (a waiting job waits out the backoff too - else it
    # would answer each LaunchFailed with a Launch into the pool that just failed).
    wait_probe_s: float | msgspec.UnsetType = msgspec.UNSET

    def probe_s(self) -> float:
        v = self.wait_probe_s
        return DEFAULT_WAIT_PROBE_S if isinstance(v, msgspec.UnsetType) else v

    def slack_share(self) -> float:
        v = self.line_slack_share
        return DEFAULT_LINE_SLACK_SHARE if isinstance(v, msgspec.UnsetType) else v

    def pace_prior_h(self) -> float | None:
        v = self.progress_prior_h
        return None if isinstance(v, msgspec.UnsetType) else v

    def margin_restarts(self) -> float:
        v = self.deadline_margin_restarts
        return DEFAULT_DEADLINE_MARGIN_RESTARTS if isinstance(v, msgspec.UnsetType) else v

    def decision_s(self) -> float:
        v = self.decision_interval_s
        return self.tick_s if isinstance(v, msgspec.UnsetType) or not v > self.tick_s else v

    def returns_per_h(self) -> float:
        v = self.spot_returns_per_h
        return DEFAULT_SPOT_RETURNS_PER_H if isinstance(v, msgspec.UnsetType) else v

    def reclaim_s(self) -> float:
        v = self.reclaim_window_s
        return DEFAULT_RECLAIM_WINDOW_S if isinstance(v, msgspec.UnsetType) else v

    def restart_backoff_s(self, holds: int) -> float:
        base, top = self.restart_backoff_base_s, self.restart_backoff_max_s
        b = DEFAULT_RESTART_BACKOFF_BASE_S if isinstance(base, msgspec.UnsetType) else base
        m = DEFAULT_RESTART_BACKOFF_MAX_S if isinstance(top, msgspec.UnsetType) else top
        return min(m, b * 2.0 ** min(holds, 30))

    def confirm_s(self) -> float:
        v = self.price_confirm_s
        return DEFAULT_PRICE_CONFIRM_S if isinstance(v, msgspec.UnsetType) else v

    def knows(self, pool: PoolKey) -> bool:
        """The pool's instance type is one the providers can launch (always, without a list). No wildcard:
        an entry "cloud/*" never matches (no instance type is named "*")."""
        known = self.known_instance_types
        return isinstance(known, msgspec.UnsetType) or f"{pool.cloud}/{pool.instance_type}" in known

    def price_ceiling_usd_h(self) -> float:
        v = self.max_price_usd_h
        return DEFAULT_MAX_PRICE_USD_H if isinstance(v, msgspec.UnsetType) else v

    def spot_band(self) -> float:
        v = self.max_spot_over_on_demand
        return DEFAULT_MAX_SPOT_OVER_ON_DEMAND if isinstance(v, msgspec.UnsetType) else v

    def notice_window_s(self, cloud: str) -> float:
        if cloud == "aws":
            return self.notice_window_aws_s
        if cloud == "gcp":
            return self.notice_window_gcp_s
        if cloud == "azure":
            return self.notice_window_azure_s
        return self.notice_window_default_s


class Job(msgspec.Struct, frozen=True, kw_only=True):
    job_id: JobId
    spec: JobSpec
    phase: JobPhase = JobPhase.PENDING
    phase_ts: float
    submitted_ts: float
    intent: Intent = Intent.NONE
    reason: str = ""  # why the last phase change happened (terminal reason for terminal phases)
    target_nodes: int  # desired node count (spec.nodes, raised toward nodes_max when spot is cheap)
    zone: str = ""  # "cloud/region/zone" the job lives in (or moves to); "" before placement
    nodes: tuple[NodeId, ...] = ()  # every live node of the job, any phase
    generation: int = 0
    gen_nodes: tuple[NodeId, ...] = ()  # members of the current generation, in rank order
    gen_exited: tuple[NodeId, ...] = ()  # members whose ranks exited (or that were lost)
    gen_ts: float | None = None  # when the current generation was started
    gen_confirmed: bool = False  # GenerationStarted / a training heartbeat seen
    step: int = 0  # progress known at the last generation end (live progress is on the nodes)
    committed_step: int = 0
    committed_url: str | None = None
    committed_ts: float | None = None
    save_s: float | None = None  # measured checkpoint save time (EWMA)
    step_time_s: float | None = None  # measured step time (from heartbeats, at generation end)
    ckpt_interval_s: float | None = None  # the interval sent with the last StartGenerationCmd
    cost_usd: float = 0.0  # cost of the job's nodes already gone, incl. their termination tail; the
    # live nodes' part is derived from the pools' price integrals (lifecycle.cost_now / job_cost_usd)
    force_on_demand: bool = False  # deadline fallback engaged
    failures: int = 0  # trainer failures (exit "failed")
    migrate_ts: float | None = None
    price_eval_ts: float = 0.0  # last migration / scale-up evaluation
    avoid_pools: tuple[str, ...] = ()  # pools being left (price migration): their nodes go at the next checkpoint
    # Restart hold (CoreConfig.restart_backoff_s): no generation starts before hold_until; hold_reason says
    # why (a RanksExited reason, or "exited_early"); holds counts holds in a row since the last commit.
    # UNSET (not encoded) when the job was never held.
    hold_until: float | msgspec.UnsetType = msgspec.UNSET
    hold_reason: str | msgspec.UnsetType = msgspec.UNSET
    holds: int | msgspec.UnsetType = msgspec.UNSET
    # The job's MLflow run ([tracking], core/tracking.py), once the shell created it. UNSET (not encoded)
    # for a job without tracking and until then.
    tracking_run_id: str | msgspec.UnsetType = msgspec.UNSET
    # The loss the trainer reported for its last step when the job completed (RanksExited.last_loss): a
    # sweep's objective (docs/sweeps.md). UNSET (not encoded) when none was reported.
    final_loss: float | msgspec.UnsetType = msgspec.UNSET
    # The last node number of this job: its nodes are <job>-n1, -n2, ... in launch order. UNSET (not
    # encoded) for a job of an older release, whose nodes keep the deployment-wide count (Meta.node_seq).
    node_seq: int | msgspec.UnsetType = msgspec.UNSET
    # Shard replicas (core/replicas.py), UNSET (not encoded) for a job without them: the job's secret (from
    # the submit, never in the audit), the replicas the nodes reported (node, rank, step, world size), steps
    # a generation could not restore, and the replica step the current generation resumed from.
    replica_secret: str | msgspec.UnsetType = msgspec.UNSET
    replica_held: tuple[tuple[str, int, int, int], ...] | msgspec.UnsetType = msgspec.UNSET
    replica_refused: tuple[int, ...] | msgspec.UnsetType = msgspec.UNSET
    replica_step: int | msgspec.UnsetType = msgspec.UNSET
    # (generation, steps): the most steps a loss would have sent back that the newest reporting generation's
    # ranks saw (RanksExited.replica_lag_max): k + 1 when copies keep up, more when the ranks skipped copies.
    replica_lag: tuple[int, int] | msgspec.UnsetType = msgspec.UNSET
    # When (whole seconds) the job moved from on-demand back to spot within the last hour
    # (CoreConfig.spot_returns_per_h bounds them). UNSET (not encoded) for a job that never did.
    spot_returns: tuple[int, ...] | msgspec.UnsetType = msgspec.UNSET

    def held(self, now: float) -> bool:
        """A restart hold is in force: no new generation yet."""
        return not isinstance(self.hold_until, msgspec.UnsetType) and now < self.hold_until


class Node(msgspec.Struct, frozen=True, kw_only=True):
    node_id: NodeId
    job_id: JobId
    pool: PoolKey
    pool_name: str
    token: str  # idempotency token of the Launch that created it
    phase: NodePhase = NodePhase.REQUESTED
    phase_ts: float
    requested_ts: float
    launched_ts: float | None = None
    instance_id: InstanceId | None = None
    host: str = ""
    last_seen: float = 0.0
    hb_seq: int = 0
    step: int = 0
    loss: float | None = None
    step_time_s: float | None = None
    generation: int = 0
    rank: int = -1
    notice_deadline: float | None = None
    suspect_since: float | None = None  # heartbeat timeout seen, CheckInstance sent
    disconnected: bool = False  # AgentDisconnected seen (second signal)
    cmd_seq: int = 0
    cost0: float = 0.0  # the pool's price integral (PoolStats.cum_usd) when billing started


class PoolStats(msgspec.Struct, frozen=True, kw_only=True):
    pool: PoolKey
    gpu_type: str
    gpus_per_node: int
    price_usd_h: float | None = None
    on_demand_usd_h: float | None = None
    price_ts: float = 0.0  # when the confirmed price was first observed
    cum_usd: float = 0.0  # integral of the price over time ($ per node) up to cum_ts: exact cost accrual
    cum_ts: float = 0.0  # without touching any job when a price changes
    capacity_hint: float | None = None
    # Decayed preemption statistics (decayed to stats_ts).
    preemptions: float = 0.0
    exposure_h: float = 0.0  # node-hours observed, decayed to stats_ts (live nodes add live x time)
    live: int = 0  # billed nodes in this pool now
    stats_ts: float = 0.0
    last_preempted_ts: float | None = None
    # The job whose node was preempted at last_preempted_ts: more of its nodes lost within
    # PREEMPTION_EVENT_S of it are the same event (a zone-wide loss counts once per job, see pricing.py).
    # UNSET (not encoded) until a preemption with a known job.
    last_preempted_job: str | msgspec.UnsetType = msgspec.UNSET
    noticed_until: float = 0.0  # a terminate notice's deadline + notice_skip_grace_s: no new launches here before
    changed_ts: float = 0.0  # last write of this record (Tx.put_pool): lets a job skip re-ranking unchanged pools
    # Launch failures.
    failures: int = 0
    backoff_until: float = 0.0
    # A price observed but not yet confirmed (CoreConfig.price_confirm_s): the spot (or on-demand) price,
    # the on-demand price it came with, and when it was first seen. UNSET (not encoded) when none.
    seen_usd_h: float | msgspec.UnsetType = msgspec.UNSET
    seen_od_usd_h: float | None | msgspec.UnsetType = msgspec.UNSET
    seen_ts: float | msgspec.UnsetType = msgspec.UNSET
    # A waiting job launched into the pool while it was in launch backoff (a probe, placement.retry_at): no
    # other waiting job probes it before then, so many waiting jobs send one probe per ``wait_probe_s``,
    # not one each. UNSET (not encoded) when none.
    probe_until: float | msgspec.UnsetType = msgspec.UNSET


class Meta(msgspec.Struct, frozen=True, kw_only=True):
    config: CoreConfig = CoreConfig()
    fencing_token: int = 0
    node_seq: int = 0
    launch_seq: int = 0
    bus_connected: bool = True
    detect_paused_until: float = 0.0  # failure detection off until then (bus outage, restart)
    budget_jobs: tuple[JobId, ...] = ()  # non-terminal jobs with a budget (re-checked on price rises)
    # This deployment's identity, kept once set (the shell generates it for a new state): it tags the
    # instances, MLflow runs and checkpoint roots this cluster makes. Unset in states of older releases.
    cluster_id: str | msgspec.UnsetType = msgspec.UNSET


DEFAULT_CONFIG: Final = CoreConfig()


class AuditEntry(msgspec.Struct, frozen=True, kw_only=True):
    ts: float
    job_id: str | None
    event: str  # the type name of the event decided on
    action: str
    reason: str
    alternatives: tuple[tuple[str, float, float], ...] = ()  # (pool name, price_usd_h, expected_cost_usd)
    details: dict[str, object] = {}  # JSON values
