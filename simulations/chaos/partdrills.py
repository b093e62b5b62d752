"""The partition drills themselves (see ``partitions`` for the list and what each asserts).

Each drill takes the ``Session`` (the world and an admin client) and its ``Drill`` record, submits its own
job, injects its fault through ``netns.Topology``, and scores what it observed into the record.
Concurrency contract: coroutines on the driver's loop; drills of ``partitions.AGENT_GROUP`` run at once.
"""

from __future__ import annotations

import time
from typing import Any

import anyio

import wire as ev
from orchestrator import bus
from simulations.chaos import common
from simulations.chaos.nsworld import instances_of
from simulations.chaos.partscore import (
    NOTICE_S,
    Drill,
    Session,
    audit,
    checked,
    duplicate_commands,
    metric_sum,
    metrics_seen,
    records_of,
    recoveries,
    sample,
    split_brain,
    store_writes,
)
from simulations.fakecloud import FileFakeCloud


async def agent_short(s: Session, d: Drill) -> None:
    """A member's link cut for a third of the heartbeat timeout: nothing may happen."""
    job, nodes = d.job_id, 2
    await s.submit(job, nodes=nodes, total_steps=200)
    gen = await s.training(job, nodes)
    n_inst = len(instances_of(s.w.fake_file, job))
    victim = s.rng(d).choice(sorted(r["host"] for r in records_of(s.w.records(), "event", "generation_started", job)))
    cut_s = round(s.t.hb_timeout_s / 3, 2)
    t0 = time.time()
    await anyio.to_thread.run_sync(s.w.topo.cut, victim)
    await anyio.sleep(cut_s)
    await anyio.to_thread.run_sync(s.w.topo.heal, victim)
    summary = await s.end_job(d, job, nodes)
    entries = await s.explain(job)
    suspects = audit(entries, "suspect")
    rec = recoveries(s.w.records(), job, t0, gen)
    extra = len(instances_of(s.w.fake_file, job)) - n_inst
    d.needless_recoveries += len(rec) + max(0, extra) + len(suspects)
    d.facts.update(cut_s=cut_s, victim=victim, suspected=len(suspects), generation=summary and summary["generation"],
                   step=summary and summary["step"])
    if rec or extra or suspects:
        d.problems.append(f"after a {cut_s} s cut: {rec}, {extra} launch(es), {len(suspects)} suspicion(s)")
    if summary and (summary["generation"] != gen or summary["step"] != 200):
        d.problems.append(f"lost steps: generation {gen} -> {summary['generation']}, step {summary['step']}/200")


async def agent_long(s: Session, d: Drill) -> None:
    """One member of a 2-node generation cut off for 2.5x the heartbeat timeout."""
    await _agent_long(s, d, 2)


async def agent_long_alone(s: Session, d: Drill) -> None:
    """The only member of a 1-node job cut off for 2.5x the heartbeat timeout: every member is suspect."""
    await _agent_long(s, d, 1)


async def _agent_long(s: Session, d: Drill, nodes: int) -> None:
    job = d.job_id
    await s.submit(job, nodes=nodes, total_steps=400)
    gen = await s.training(job, nodes)
    victim = s.rng(d).choice(sorted(r["host"] for r in records_of(s.w.records(), "event", "generation_started", job)))
    node = next(r["msg"]["node_id"] for r in records_of(s.w.records(), "event", "generation_started", job)
                if r["host"] == victim)
    cut_s = round(s.t.hb_timeout_s * 2.5, 2)
    lead = await s.w.leader()
    await anyio.to_thread.run_sync(s.w.topo.cut, victim)
    t_cut = time.time()
    ages = await sample(s, lead[0] if lead else None, "orchd_node_heartbeat_age_seconds", f'node="{node}"', cut_s)
    await anyio.to_thread.run_sync(s.w.topo.heal, victim)
    d.facts["metric_heartbeat_age_max_s"] = max(ages, default=None)
    summary = await s.end_job(d, job, nodes, timeout_s=120)
    entries = await s.explain(job)
    suspected = audit(entries, "suspect", node)
    recovered = audit(entries, "node_recovered", node)
    given_up = [e for e in audit(entries, "remove_node", node) if (e.get("details") or {}).get("lost")]
    t_given_up = min((e.get("ts", 0.0) for e in given_up), default=None)
    # checkpoints the victim wrote after orchd gave up on it (the store's own records; end_job counts any
    # that the job went on from in commits_from_given_up)
    d.facts["victim_saves_after_given_up"] = sum(
        1 for w in store_writes(s.w.ckpt_root / job)
        if w.get("node_id") == node and t_given_up is not None and w.get("t", 0.0) > t_given_up)
    d.facts.update(cut_s=cut_s, victim=victim, suspected=bool(suspected), kept=bool(recovered),
                   given_up=t_given_up is not None, generations=summary and summary["generation"],
                   first_generation=gen, provider_checked=checked(s.w, victim, t_cut),
                   timeline=[(round(e["ts"] - t_cut, 1), e["action"], e["reason"]) for e in entries
                             if e["ts"] >= t_cut and e["action"] not in ("note",)])
    if not suspected:
        d.problems.append(f"node {node} not suspected after a {cut_s} s cut")
    if not d.facts["provider_checked"]:
        d.problems.append(f"node {node}: suspected but its instance was never checked with the provider")
    if not recovered and t_given_up is None:
        d.problems.append(f"node {node} neither kept nor replaced")


async def agent_gone(s: Session, d: Drill) -> None:
    """A member's link is cut and its instance terminated at once (a host that died without a notice):
    suspected, confirmed gone by the provider, replaced, the job resumes in a new generation; a commit
    published afterwards in the dead node's name is not accepted."""
    await _agent_gone(s, d, later=False)


async def agent_gone_later(s: Session, d: Drill) -> None:
    """As ``agent_gone``, but the instance dies only after orchd checked it (still running) and kept the
    node suspect: the provider must be asked again."""
    await _agent_gone(s, d, later=True)


async def _agent_gone(s: Session, d: Drill, *, later: bool) -> None:
    w, job = s.w, d.job_id
    await s.submit(job, nodes=2, total_steps=400)
    gen = await s.training(job, 2)
    started = records_of(w.records(), "event", "generation_started", job)
    victim = s.rng(d).choice(sorted(r["host"] for r in started))
    node = next(r["msg"]["node_id"] for r in started if r["host"] == victim)
    inst = next(i for i, h in w.agents.items() if h == victim)
    lead = await w.leader()
    scrape = (lambda: w.scrape(lead[0])) if lead else (lambda: None)
    vanished0 = metric_sum(await anyio.to_thread.run_sync(scrape), "orchd_preemptions_total", 'kind="vanished"')
    t_cut = time.time()
    await anyio.to_thread.run_sync(w.topo.cut, victim)
    if later:
        with anyio.fail_after(30):
            while not audit(await s.explain(job), "suspect", node):
                await anyio.sleep(0.3)
        await anyio.sleep(1.0)
    await anyio.to_thread.run_sync(lambda: FileFakeCloud(w.fake_file, shared=True).preempt(ev.InstanceId(inst)))
    gone_at = None
    with anyio.move_on_after(30):
        while gone_at is None:
            lost = [e for e in audit(await s.explain(job), "remove_node", node)
                    if (e.get("details") or {}).get("lost")]
            gone_at = lost[0]["ts"] if lost else None
            await anyio.sleep(0.3)
    vanished1 = metric_sum(await anyio.to_thread.run_sync(scrape), "orchd_preemptions_total", 'kind="vanished"')
    if not later:  # (the later drill's window holds the other's loss: the counter is per pool, not per node)
        d.facts["metric_vanished_preemptions_delta"] = (None if vanished0 is None or vanished1 is None
                                                        else vanished1 - vanished0)
    before = (await s.job(job)) or {}
    # a zombie's commit after orchd gave up on the node: a later step than anything committed
    zombie = ev.CheckpointCommitted(id=f"zombie-{node}", node_id=ev.NodeId(node), job_id=ev.JobId(job), generation=gen,
                                    step=390, checkpoint_id="step_000000390",
                                    url=f"file://{w.ckpt_root / job}/step_000000390", save_s=0.1, ts=time.time())
    nc = await common.connect(next(iter(w.urls.values())), "partition-zombie")
    try:
        await common.publish_until_stored(nc.jetstream(timeout=2.0), ev.subject_node_event(node), zombie, zombie.id)
    finally:
        await nc.close()
    summary = await s.end_job(d, job, 2, timeout_s=120)
    entries = await s.explain(job)
    accepted = [e for e in audit(entries, "checkpoint_committed") if (e.get("details") or {}).get("url") == zombie.url]
    d.commits_from_given_up += len(accepted)
    recs = w.records()
    new_gens = sorted({r["msg"]["generation"] for r in records_of(recs, "cmd", "start_generation", job)
                       if r["msg"]["generation"] > gen})
    d.facts.update(victim=victim, suspected=bool(audit(entries, "suspect", node)),
                   provider_checked=checked(w, victim, t_cut),
                   given_up_s=None if gone_at is None else round(gone_at - t_cut, 1), new_generations=new_gens,
                   replacement_launched=len(instances_of(w.fake_file, job)) > 2, zombie_commit_accepted=bool(accepted),
                   committed_step_before_zombie=before.get("committed_step"))
    if gone_at is None:
        d.problems.append(f"node {node} not given up on 30 s after its instance was terminated")
    if not new_gens or not d.facts["replacement_launched"]:
        d.problems.append(f"not replaced: generations {new_gens}, instances {len(instances_of(w.fake_file, job))}")
    if summary and summary.get("step") != 400:
        d.problems.append(f"{job} ended at step {summary.get('step')}/400")


async def leader_cut(s: Session, d: Drill) -> None:
    w = s.w
    lead = await s.leader()
    if lead is None:
        d.problems.append("no leader before the cut")
        return
    old, old_token = lead
    other = next(n for n in w.orchds if n != old)
    await s.submit(d.job_id + "-a", nodes=1, total_steps=400)
    gen = await s.training(d.job_id + "-a", 1)
    proc = w.orchds[old].proc
    old_pid = proc.pid if proc is not None else -1
    w.orchds[old].held = True  # not restarted while cut off (it could not reach NATS); after healing, it is
    t_cut = time.time()
    await anyio.to_thread.run_sync(w.topo.cut, old)
    new = None
    while time.time() - t_cut < 6 * s.t.lease_ttl_s:
        lead = await w.leader(timeout_s=0.5)
        if lead is not None and lead[0] == other:
            new = lead
            break
        await anyio.sleep(0.1)
    answering_s = round(time.time() - t_cut, 2)
    acquired = [t for t in w.log_times(other, "lease_acquired") if t > t_cut]
    takeover_s = round(acquired[0] - t_cut, 2) if acquired else None
    d.facts.update(old_leader=old, takeover_s=takeover_s, new_leader_answering_s=answering_s,
                   lease_ttl_s=s.t.lease_ttl_s)
    if new is None or takeover_s is None:
        d.problems.append(f"no takeover in {answering_s} s")
        await anyio.to_thread.run_sync(w.topo.heal, old)
        w.orchds[old].held = False
        return
    if takeover_s > 2 * s.t.lease_ttl_s:
        d.problems.append(f"takeover took {takeover_s} s > 2x lease TTL")
    d.facts["metrics_during_cut"] = {n: metrics_seen(w.scrape(n)) for n in w.orchds}
    # the new leader launches for a new job while the old one is still cut off
    await s.submit(d.job_id + "-b", nodes=1, total_steps=200)
    await s.training(d.job_id + "-b", 1)
    await anyio.to_thread.run_sync(w.topo.heal, old)
    w.orchds[old].held = False
    t_heal = time.time()
    # the old leader exits (lease lost) and comes back as a standby
    with anyio.move_on_after(30):
        while not w.orchds[old].exits or w.orchds[old].proc is None:
            await anyio.sleep(0.2)
    after = len(w.orchds[old].log.read_text(errors="replace")) if w.orchds[old].proc is None else 0
    try:
        await anyio.to_thread.run_sync(lambda: w.wait_log(old, "standby", 30, after=after))
        standby = True
    except RuntimeError:
        standby = False
    await anyio.sleep(s.t.lease_ttl_s)
    still = await w.leader()
    d.facts["metrics_after_heal"] = {n: metrics_seen(w.scrape(n)) for n in w.orchds}
    d.facts.update(old_exit=[c for _, p, c in w.orchds[old].exits if p == old_pid], old_standby_after_heal=standby,
                   leader_after_heal=still and still[0], heal_s=round(t_heal - t_cut, 1))
    if not standby:
        d.problems.append(f"{old} not standing by after healing")
    if still is None or still[0] != other:
        d.problems.append(f"leader after healing: {still}")
    split_brain(s, d, old_pid, old_token, t_cut)
    for job in (d.job_id + "-a", d.job_id + "-b"):
        await s.end_job(d, job, 1)
    rec = recoveries(w.records(), d.job_id + "-a", t_cut, gen)
    d.needless_recoveries += len(rec)
    if rec:
        d.problems.append(f"{d.job_id}-a recovered across the takeover: {rec}")


async def nats_minority(s: Session, d: Drill, n_events: int = 30) -> None:
    w = s.w
    job = d.job_id
    await s.submit(job, nodes=2, total_steps=300)
    gen = await s.training(job, 2)
    n_inst = len(instances_of(w.fake_file, job))
    cut = s.rng(d).choice(sorted(w.urls))
    others = [u for n, u in w.urls.items() if n != cut]
    nc = await common.connect(others[0], "partition-publisher")
    js = nc.jetstream(timeout=2.0)
    sent: dict[str, float] = {}
    pools = [ev.PoolKey(cloud="fake", region="r1", zone=f"minority{k}", instance_type="gpu.small",
                        market=ev.Market.SPOT) for k in range(n_events)]
    t0 = time.time()

    async def publish() -> None:
        for k, pool in enumerate(pools):
            tick = ev.PriceTick(id=f"minority-{s.seed}-{k}", pool=pool, gpu_type="A100", gpus_per_node=1,
                                price_usd_h=1.5 + k / 1000, on_demand_usd_h=3.0, ts=time.time())
            await common.publish_until_stored(js, ev.subject_price("fake", "r1"), tick, tick.id)
            sent[pool.name] = tick.price_usd_h
            await anyio.sleep(0.2)

    cut_s = round(s.t.hb_timeout_s * 1.5, 2)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(publish)
            await anyio.sleep(0.5)
            lead = await s.leader()
            await anyio.to_thread.run_sync(w.topo.cut, cut)
            connected = await sample(s, lead[0] if lead else None, "orchd_nats_connected", "", cut_s)
            await anyio.to_thread.run_sync(w.topo.heal, cut)
            d.facts["metric_nats_connected_min"] = min(connected, default=None)
    finally:
        await nc.close()
    healed = time.time()
    await s.end_job(d, job, 2, timeout_s=120)
    # A tick the server delivered to a pull request of the leader that was then deposed (a request sent
    # before the cut that reached the consumer only as the link healed) comes back once the consumer's ack
    # wait passes (bus.ack_wait_s): late, not lost. Lost: not in orchd's prices by then.
    lost: dict[str, tuple[float, float | None]] = {}
    until = healed + bus.ack_wait_s(s.t.lease_ttl_s) + 5.0
    while True:
        prices = {p["pool"]: p["price_usd_h"] for p in (await common.call(s.client, "prices")).pools}
        lost = {name: (usd, prices.get(name)) for name, usd in sent.items()
                if abs(prices.get(name, -1.0) - usd) > 1e-9}
        if not lost or time.time() > until:
            break
        await anyio.sleep(0.5)
    d.facts["ticks_in_prices_after_heal_s"] = round(time.time() - healed, 1)
    d.lost_events += len(lost) + n_events - len(sent)
    if lost or len(sent) < n_events:
        d.problems.append(f"lost events: {len(sent)} of {n_events} ticks stored; sent vs orchd's price: {lost}")
    recs = w.records()
    dup = duplicate_commands([r for r in recs if r["msg"].get("job_id") == job])
    rec = recoveries(recs, job, t0, gen)
    extra = len(instances_of(w.fake_file, job)) - n_inst
    entries = await s.explain(job)
    d.facts.update(server_cut=cut, cut_s=cut_s, events=n_events, duplicate_commands=dup,
                   suspected=len([e for e in audit(entries, "suspect") if e["ts"] >= t0]))
    d.needless_recoveries += len(rec) + max(0, extra)
    if dup:
        d.problems.append(f"{dup} command(s) executed twice")
    if rec or extra:
        d.problems.append(f"recovery during a minority cut: {rec}, {extra} launch(es)")


async def _notice_path(s: Session, d: Drill, job: str, deadline_s: float, fault: Any, label: str,
                       total_steps: int) -> None:
    """Submit ``job`` (2 nodes, ``total_steps`` long enough to be training when the command comes), apply
    ``fault``, have one member's metadata service announce a notice, wait until every member has the
    checkpoint command or has committed a checkpoint since the notice (the noticed member's agent saves on
    the notice by itself and may be done, and terminated, before the command reaches it; the other member
    saves only on the command); record notice-to-command seconds under ``label``."""
    await s.submit(job, nodes=2, total_steps=total_steps)
    gen = await s.training(job, 2)
    hosts = sorted({r["host"] for r in records_of(s.w.records(), "event", "generation_started", job)
                    if r["msg"]["generation"] == gen})
    undo = await fault(hosts)
    try:
        await anyio.sleep(1.0)
        victim = s.rng(d).choice(hosts)
        t_notice = s.w.notice(victim, deadline_s)
        arrived: float | None = None
        with anyio.move_on_after(deadline_s + 10):
            while arrived is None:
                recs = s.w.records()
                got: dict[str, float] = {}
                for r in [*records_of(recs, "cmd", "checkpoint", job, t_notice),
                          *records_of(recs, "event", "checkpoint_committed", job, t_notice)]:
                    got[r["host"]] = min(r["t"], got.get(r["host"], r["t"]))
                if set(hosts) <= set(got):
                    arrived = max(got.values())
                await anyio.sleep(0.1)
    finally:
        await undo()
    took = None if arrived is None else round(arrived - t_notice, 2)
    d.facts[label] = took
    if took is None or took > deadline_s:
        d.late_commands += 1
        d.problems.append(f"{label}: checkpoint command {took} s after a {deadline_s} s notice")
    await s.end_job(d, job, 2, timeout_s=120)


async def _asymmetric(s: Session, d: Drill, direction: str) -> None:
    """The leader can send but not receive (``in`` blocked) or receive but not send (``out``)."""
    w = s.w
    lead = await s.leader()
    if lead is None:
        d.problems.append("no leader")
        return
    name, token = lead
    proc = w.orchds[name].proc
    pid = proc.pid if proc is not None else -1
    d.facts["blocked"] = f"{name} {direction}"
    t_fault = [time.time()]

    async def fault(_hosts: list[str]) -> Any:
        t_fault[0] = time.time()
        await anyio.to_thread.run_sync(w.topo.block, name, direction)

        async def undo() -> None:
            await anyio.to_thread.run_sync(w.topo.clear, name)
        return undo

    # the command comes after the consumers' ack wait (10 s at this TTL): 400 steps (20 s) leave room
    await _notice_path(s, d, d.job_id, NOTICE_S, fault, "notice_to_command_s", 400)
    await s.leader()  # the blocked leader lost its lease; someone leads again
    split_brain(s, d, pid, token, t_fault[0])


async def asymmetric_out(s: Session, d: Drill) -> None:
    await _asymmetric(s, d, "out")


async def asymmetric_in(s: Session, d: Drill) -> None:
    await _asymmetric(s, d, "in")


async def drops(s: Session, d: Drill, drop_s: float, share: float = 0.3) -> None:
    w = s.w

    async def fault(hosts: list[str]) -> Any:
        links = sorted(h for h in w.agent_dirs if h in w.topo.hosts)
        for h in links:
            await anyio.to_thread.run_sync(w.topo.drop, h, share)
        t0 = time.time()

        async def undo() -> None:
            await anyio.sleep(max(0.0, drop_s - (time.time() - t0)))
            for h in links:
                await anyio.to_thread.run_sync(w.topo.clear, h)
        return undo

    d.facts.update(drop_share=share, drop_s=drop_s)
    await _notice_path(s, d, d.job_id, NOTICE_S, fault, "notice_to_command_s", 300)
