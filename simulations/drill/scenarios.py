"""The drill's scenarios: each makes its alerts of config/prometheus/alerts.yml fire, then undoes the
fault and waits until they resolve - in Prometheus (/api/v1/alerts), in Alertmanager (/api/v2/alerts)
and at the webhook (a "resolved" notification).

    vanish          orchctl nodes kill of every (spot) node of the job, no notice     PreemptionStorm
    notice          orchctl nodes preempt --notice 6: an emergency checkpoint in time, the job resumes
    missed          orchctl nodes preempt --notice 1: the save (1.5 s) cannot commit  EmergencyCheckpointMissed
    hang            SIGSTOP of every process of the job's nodes, then SIGCONT        NodeHeartbeatMissing,
                                                                                     TrainingStalled
    storage         the checkpoint store becomes a file, then comes back             CheckpointStorageFailing
    price spike     the pool's spot price at 95% of on-demand on the price subject   PriceSpike
    backlog         the market consumer paused under a flood of price ticks          EventBacklogGrowing
    store quota     the leader's state bucket capped at its size (discard new) and   DecideLoopStalled
                    an extra job submitted: a write that needs room is refused (503),
                    the loop retries it; the cap lifted, the extra job cancelled
    budget          a job on demand, submitted at set-up, nears its budget            BudgetNearlySpent
                    (orchd stops it; the scenario waits in its turn, then cancels it)
    leader kill     kill -9 of the leader orchd, started again as a standby          OrchdDown, OrchdNoLeader
    NATS kill       kill -9 of nats-3, then of the two others; all started again     NatsDisconnected
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psutil
from nats.js.api import DiscardPolicy
from prometheus_client.parser import text_string_to_metric_families

import wire as ev
from orchestrator import bus
from simulations.drill.drill import Drill
from simulations.drill.services import DrillError, wait_until

JOB = "drill"
BUDGET_JOB = "drill-budget"
AT_RISK_JOB = "drill-at-risk"
QUOTA_JOB = "drill-quota"
NODES = 3


@dataclass
class Scenario:
    name: str
    alerts: tuple[str, ...]
    fault: Callable[[Drill], Any]
    undo: Callable[[Drill, Any], None]
    fire_timeout_s: float = 0.0
    """0: 2 minutes plus the longest scaled range window (from the fault)."""
    at_setup: bool = False
    """The fault is made at set-up, before the other scenarios run (one that takes minutes of its own and
    reaches no other job); the scenario then waits in its turn for its alerts, counted from the fault,
    compared with what was active then."""


def _generation(d: Drill) -> int:
    return int(d.job(JOB)["generation"])


def _notice(d: Drill) -> None:
    gen = _generation(d)
    victim = wait_until(lambda: d.running_nodes(JOB, 1), 120, "a node training")[0]["node_id"]
    d.ctl("nodes", "preempt", victim, "--notice", "6")
    wait_until(lambda: d.job(JOB)["committed_step"] > 0, 60, "the emergency checkpoint")
    wait_until(lambda: d.running_nodes(JOB, 1, after_generation=gen), 120, "the job to run again")


def _missed(d: Drill) -> None:
    victim = wait_until(lambda: d.running_nodes(JOB, 1), 120, "a node training")[0]["node_id"]
    d.ctl("nodes", "preempt", victim, "--notice", "1")  # shorter than the trainer's save


def _vanish(d: Drill) -> None:
    """Every node of the job at once (spot nodes: an on-demand node killed is no preemption)."""
    nodes = wait_until(lambda: d.running_nodes(JOB, NODES), 120, f"{NODES} nodes training")
    if not all(str(n["pool"]).endswith("/spot") for n in nodes):
        raise DrillError(f"the job does not run on spot: {[n['pool'] for n in nodes]}")
    kills = [threading.Thread(target=d.ctl, args=("nodes", "kill", n["node_id"])) for n in nodes]
    for t in kills:
        t.start()
    for t in kills:
        t.join()


def _node_processes(d: Drill, node_ids: list[str]) -> list[psutil.Process]:
    procs = []
    for o in d.orchds:
        for agent in o.nodes():
            if any(f"--node-id {n} " in " ".join(agent.cmdline()) + " " for n in node_ids):
                procs += [agent, *agent.children(recursive=True)]
    return procs


def _hang(d: Drill) -> list[psutil.Process]:
    nodes = wait_until(lambda: d.running_nodes(JOB, 1), 120, "the job training")
    procs = _node_processes(d, [n["node_id"] for n in nodes])
    if not procs:
        raise DrillError("no process of the job's nodes found")
    for p in procs:
        p.send_signal(signal.SIGSTOP)
    return procs


def _resume(d: Drill, procs: list[psutil.Process]) -> None:
    for p in procs:
        if p.is_running():
            p.send_signal(signal.SIGCONT)


def _storage_fails(d: Drill) -> None:
    ckpt = d.ckpt_dir(JOB)
    wait_until(lambda: d.running_nodes(JOB, 1), 120, "the job training")
    if ckpt.exists():
        ckpt.rename(ckpt.with_name(f"{JOB}.saved"))
    ckpt.write_text("the checkpoint store is gone\n")


def _storage_back(d: Drill, _: Any) -> None:
    ckpt = d.ckpt_dir(JOB)
    ckpt.unlink()
    saved = ckpt.with_name(f"{JOB}.saved")
    if saved.exists():
        saved.rename(ckpt)


BUDGET_S = 150.0
"""The budget job's cap in seconds of its node at the on-demand price. orchd launches only what the budget
carries through boot and a termination tail at the worst price (the drill's orchd: ``boot_estimate_s`` 10,
``terminate_billing_s`` 2) and stops the job once the tail no longer fits: cost / budget passes 0.9 about
135 s after the launch, and the stop comes some 10 s later (the gauges are refreshed every 0.5 s)."""


def _budget(d: Drill) -> None:
    """A 1-node job on demand with a budget (submitted at set-up): it nears its cap, orchd stops it."""
    d.submit(BUDGET_JOB, nodes=1, budget_usd=budget_usd(), market="on_demand")


def budget_usd() -> float:
    return round(BUDGET_S * ON_DEMAND_USD_H / 3600.0, 6)


def _budget_job_gone(d: Drill, _: Any) -> None:
    d.ctl("jobs", "cancel", BUDGET_JOB, check=False)


def _on_demand_refused(d: Drill) -> None:
    """A job with a deadline on on-demand in zone local-c, which has no capacity (the drill's orchd config):
    every on-demand launch fails, orchd records deadline_at_risk and retries."""
    d.submit(AT_RISK_JOB, nodes=1, market="on_demand", zones=("local-c",),
             extra='deadline_in = "2h"\nbest_effort = true\n')


def _at_risk_job_gone(d: Drill, _: Any) -> None:
    d.ctl("jobs", "cancel", AT_RISK_JOB, check=False)


def _pool(d: Drill) -> ev.PoolKey:
    """The pool of the job's first running node ("cloud/region/zone/instance_type/market")."""
    node = wait_until(lambda: d.running_nodes(JOB, 1), 120, "the job training")[0]
    cloud, region, zone, itype, market = str(node["pool"]).split("/")
    return ev.PoolKey(cloud=cloud, region=region, zone=zone, instance_type=itype, market=ev.Market(market))


def _publish_prices(d: Drill, pool: ev.PoolKey, ratio: float, count: int = 1) -> None:
    async def go() -> None:
        nc = await d.connect("price-feed")
        try:
            js = nc.jetstream(timeout=5.0)
            for _ in range(count):
                ts = time.time()
                tick = ev.PriceTick(id=f"drill-{pool.name}-{ts}", pool=pool, gpu_type="cpu", gpus_per_node=1,
                                    price_usd_h=round(ratio * ON_DEMAND_USD_H, 4), on_demand_usd_h=ON_DEMAND_USD_H,
                                    ts=ts)
                await js.publish(ev.subject_price(pool.cloud, pool.region), ev.encode(tick),
                                 headers={"Nats-Msg-Id": tick.id})
        finally:
            await nc.close()

    d.run_async(go)


def _spike(d: Drill) -> ev.PoolKey:
    pool = _pool(d)
    _publish_prices(d, pool, 0.95)
    return pool


def _calm(d: Drill, pool: ev.PoolKey) -> None:
    _publish_prices(d, pool, 0.30)


def _flood(d: Drill) -> threading.Event:
    """Pause the market consumer (as an operator would) and publish price ticks until the event is set."""
    stop = threading.Event()
    pool = ev.PoolKey(cloud="local", region="local-1", zone="local-b", instance_type="cpu.local",
                      market=ev.Market.ON_DEMAND)

    async def pause() -> None:
        nc = await d.connect()
        try:
            until = (datetime.now(UTC) + timedelta(minutes=10)).isoformat().replace("+00:00", "Z")
            await nc.jetstream().pause_consumer(bus.STREAM_MARKET, bus.CONSUMER_MARKET, until)
        finally:
            await nc.close()

    d.run_async(pause)

    def publish() -> None:
        while not stop.is_set():
            _publish_prices(d, pool, 1.0, count=10)
            time.sleep(0.5)

    threading.Thread(target=publish, name="drill-flood", daemon=True).start()
    return stop


def _unflood(d: Drill, stop: threading.Event) -> None:
    stop.set()

    async def resume() -> None:
        nc = await d.connect()
        try:
            await nc.jetstream().resume_consumer(bus.STREAM_MARKET, bus.CONSUMER_MARKET)
        finally:
            await nc.close()

    d.run_async(resume)


def _kill_leader(d: Drill) -> Any:
    leader = wait_until(d.leader, 60, "a leader")
    leader.kill9()
    return leader


def _restart(d: Drill, orchd: Any) -> None:
    """Start the killed orchd again once the standby leads: as a standby, as systemd would after the
    takeover (started at once, it could win the lease back and the takeover would not be seen)."""
    wait_until(lambda: (lead := d.leader()) is not None and lead is not orchd, 120, "the standby leading")
    orchd.start()


def _kill_nats(d: Drill) -> list[Any]:
    """kill -9 of one server (the cluster carries on), then of the other two: orchd has no server left
    (a client reconnects to any server of the cluster it learnt of, so one down disconnects nobody)."""
    d.servers[2].kill()
    time.sleep(2.0)
    for s in d.servers[:2]:
        s.kill()
    return d.servers


def _restart_nats(d: Drill, servers: list[Any]) -> None:
    for s in servers:
        if s.proc is None:
            s.restart()  # same port, same store
    d.run_async(d.wait_jetstream)


STATE_STREAM = f"KV_{bus.KV_STATE}"
"""The stream behind orchd's state bucket (a KV bucket ``B`` is the stream ``KV_B``)."""


@dataclass
class Quota:
    """What ``_quota_reached`` changed, for ``_quota_lifted``: the stream's limits before, the leader, the
    extra submit in flight."""

    max_bytes: int
    discard: Any
    leader: Any
    submit: threading.Thread


def _cap_state_stream(d: Drill) -> tuple[int, Any]:
    """``max_bytes`` of the state stream set to its bytes now, ``discard`` new: JetStream refuses a write
    that needs more room (a new key; a record that grew past what the oldest one frees) with 503 "maximum
    bytes exceeded"; the records stored stay (a discard-new limit removes nothing). The original limits
    are returned."""
    async def go() -> tuple[int, Any]:
        nc = await d.connect()
        try:
            js = nc.jetstream(timeout=5.0)
            info = await js.stream_info(STATE_STREAM)
            cfg, old = info.config, (info.config.max_bytes, info.config.discard)
            cfg.max_bytes, cfg.discard = max(1, info.state.bytes), DiscardPolicy.NEW
            await js.update_stream(cfg)
            after = await js.stream_info(STATE_STREAM)
            if after.state.messages < info.state.messages:
                raise DrillError(f"the cap removed records: {info.state.messages} -> {after.state.messages}")
            return old
        finally:
            await nc.close()

    result: tuple[int, Any] = d.run_async(go)
    return result


def _set_state_limits(d: Drill, max_bytes: int, discard: Any) -> None:
    async def go() -> None:
        nc = await d.connect()
        try:
            js = nc.jetstream(timeout=5.0)
            cfg = (await js.stream_info(STATE_STREAM)).config
            cfg.max_bytes, cfg.discard = max_bytes, discard
            await js.update_stream(cfg)
            now = (await js.stream_info(STATE_STREAM)).config
            if (now.max_bytes, now.discard) != (max_bytes, discard):
                raise DrillError(f"{STATE_STREAM}: limits not restored: {now.max_bytes}, {now.discard}")
        finally:
            await nc.close()

    d.run_async(go)


def progress_ts(o: Any) -> float:
    """``orchd_decide_progress_timestamp_seconds`` of one orchd, from its /metrics (0.0 when unreadable)."""
    try:
        with urllib.request.urlopen(f"http://{o.target}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name == "orchd_decide_progress_timestamp_seconds":
            return float(fam.samples[0].value)
    return 0.0


def _quota_reached(d: Drill) -> Quota:
    """The leader's state bucket at its storage quota, then a write of a new key: a small extra job
    submitted (orchctl, in a thread: the submit waits while the loop retries its refused record)."""
    leader = wait_until(d.leader, 60, "a leader")
    wait_until(lambda: d.running_nodes(JOB, NODES), 180, f"{NODES} nodes of the job training")
    max_bytes, discard = _cap_state_stream(d)
    try:
        submit = threading.Thread(target=lambda: d.submit(QUOTA_JOB, nodes=1, check=False), name="drill-quota",
                                  daemon=True)
        submit.start()
        wait_until(lambda: time.time() - progress_ts(leader) > 3.0, 60, "the leader's decide loop to stall")
    except BaseException:
        _set_state_limits(d, max_bytes, discard)
        raise
    return Quota(max_bytes, discard, leader, submit)


def _quota_lifted(d: Drill, q: Quota) -> None:
    """The original limits back; the loop moves again (the refused record is stored on its next retry:
    nothing is lost), the extra job is cancelled and the drill's job runs on all its nodes."""
    _set_state_limits(d, q.max_bytes, q.discard)
    lifted = time.time()
    wait_until(lambda: progress_ts(q.leader) > lifted, 60, "the leader's decide loop to move")
    q.submit.join(90)
    wait_until(lambda: d.ctl("jobs", "show", QUOTA_JOB, check=False), 60, f"job {QUOTA_JOB} stored")
    d.ctl("jobs", "cancel", QUOTA_JOB)
    wait_until(lambda: d.running_nodes(JOB, NODES), 180, f"{NODES} nodes of the job training")


ON_DEMAND_USD_H = 3.06
"""The local provider's on-demand price (providers/local/prices.py: P3_2XLARGE_ON_DEMAND_USD_H)."""


def _none(d: Drill, _: Any) -> None:
    return None


SCENARIOS = (
    Scenario("vanish", ("OrchdPreemptionStorm",), _vanish, _none),
    Scenario("notice", (), _notice, _none),
    Scenario("missed emergency checkpoint", ("OrchdEmergencyCheckpointMissed",), _missed, _none),
    Scenario("hang", ("OrchdNodeHeartbeatMissing", "OrchdTrainingStalled"), _hang, _resume),
    Scenario("storage", ("OrchdCheckpointStorageFailing",), _storage_fails, _storage_back),
    Scenario("price spike", ("OrchdPriceSpike",), _spike, _calm),
    Scenario("on-demand refused", ("OrchdDeadlineAtRisk",), _on_demand_refused, _at_risk_job_gone),
    Scenario("backlog", ("OrchdEventBacklogGrowing",), _flood, _unflood),
    Scenario("budget", ("OrchdBudgetNearlySpent",), _budget, _budget_job_gone, fire_timeout_s=BUDGET_S + 180.0,
             at_setup=True),
    Scenario("store quota", ("OrchdDecideLoopStalled",), _quota_reached, _quota_lifted),
    Scenario("leader kill", ("OrchdDown", "OrchdNoLeader"), _kill_leader, _restart),
    Scenario("NATS kill", ("OrchdNatsDisconnected",), _kill_nats, _restart_nats),
)


def setup(d: Drill) -> None:
    """The training job every scenario works on, running on its nodes."""
    os.makedirs(d.ckpt_dir(JOB).parent, exist_ok=True)
    d.submit(JOB, nodes=NODES)
    wait_until(lambda: d.running_nodes(JOB, NODES), 180, f"{NODES} nodes of the job training")


def teardown_dirs(d: Drill) -> None:
    shutil.rmtree(d.tmp, ignore_errors=True)
