"""Hypothesis properties: random but meaningful event sequences (a tiny cloud + agents driven by the
commands decide emits) and fully random events. Checked after every step:

- decide never raises; records round-trip exactly; dirty keys cover every changed record;
- never two live nodes for one rank of a job's current generation;
- never a generation spread over two zones (state and every StartGenerationCmd batch);
- cost including the final checkpoint and termination never exceeds a job's budget;
- redelivering the event just decided produces no command, except the Terminate of an instance whose
  node the first delivery terminated (no state change).
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.core import JobPhase, NodePhase, State, decide, state_from_records, state_to_records
from orchestrator.core.commands import Launch, SendToAgent, Terminate
from orchestrator.core.costs import burn_usd_h, cost_now
from orchestrator.core.inputs import (
    AgentDisconnected,
    BusState,
    CommandFailed,
    JobCancelled,
    JobSubmitted,
    LaunchFailed,
    LeaseChanged,
    NodeDrainRequested,
    NodeGone,
    NodeLaunched,
    Tick,
)
from orchestrator.core.placement import zone_of
from orchestrator.core.records import all_keys
from orchestrator.core.tx import Tx
from tests.core.harness import pool, price, spec
from wire import (
    AgentState,
    CheckpointCommitted,
    CheckpointPolicy,
    FailureReason,
    GenerationStarted,
    Heartbeat,
    MarketPolicy,
    NodeLeaving,
    NodeRegistered,
    NoticeKind,
    PreemptionNotice,
    RanksExited,
    StartGenerationCmd,
)

POOLS = [pool("p4d.24xlarge", "z1"), pool("p5.48xlarge", "z1"), pool("p4d.24xlarge", "z2"), pool("p5.48xlarge", "z2")]
OD = 30.0
TICK_S = State.empty().config.tick_s
REASONS = ["emergency_checkpoint", "completed", "failed", "abandoned", "peer_lost", "checkpoint_failed"]

action = st.one_of(
    st.just(("auto",)),
    st.just(("auto",)),
    st.just(("auto",)),
    st.just(("auto",)),
    st.just(("auto",)),
    st.tuples(st.just("tick"), st.just(TICK_S)),
    st.tuples(st.just("tick"), st.just(TICK_S)),
    st.tuples(st.just("price"), st.integers(0, 3), st.floats(0.05, 1.0)),
    st.tuples(st.just("tick"), st.floats(0.0, TICK_S)),
    st.tuples(st.just("exec"), st.integers(0, 9), st.sampled_from(["ok", "ok", "fail", "partial"])),
    st.tuples(st.just("register"), st.integers(0, 99)),
    st.tuples(st.just("started"), st.integers(0, 99)),
    st.tuples(st.just("hb"), st.integers(0, 99), st.integers(0, 300)),
    st.tuples(st.just("notice"), st.integers(0, 99), st.booleans()),
    st.tuples(st.just("commit"), st.integers(0, 1)),
    st.tuples(st.just("exit"), st.integers(0, 99), st.sampled_from(REASONS)),
    st.tuples(st.just("gone"), st.integers(0, 99)),
    st.tuples(st.just("disconnect"), st.integers(0, 99)),
    st.tuples(st.just("leaving"), st.integers(0, 99)),
    st.tuples(st.just("drain"), st.integers(0, 99)),
    st.tuples(st.just("cmd_failed"), st.integers(0, 99)),
    st.tuples(st.just("bus"), st.booleans()),
    st.tuples(st.just("cancel"), st.integers(0, 1)),
)

job_spec = st.fixed_dictionaries(
    {
        "nodes": st.integers(1, 3),
        "nodes_min": st.integers(1, 2),
        "budget_usd": st.one_of(st.none(), st.floats(0.5, 20.0)),
        "deadline": st.one_of(st.none(), st.floats(600.0, 20_000.0)),
        "market": st.sampled_from(list(MarketPolicy)),
        "total_steps": st.integers(50, 2000),
    }
)


class World:
    """Plays cloud and agents for the commands decide emits; checks invariants after every step."""

    def __init__(self) -> None:
        self.state = State.empty()
        self.now = 1000.0
        self.launches: list[Launch] = []
        self.n = 0

    def nodes(self) -> list[Any]:
        return [self.state.nodes[k] for k in sorted(self.state.nodes.keys())]

    def pick(self, i: int) -> Any | None:
        ns = self.nodes()
        return ns[i % len(ns)] if ns else None

    def eid(self) -> str:
        self.n += 1
        return f"e{self.n}"

    def feed(self, ev: Any, redeliver_check: bool = True) -> None:
        before = self.state
        d = decide(before, ev, self.now)
        check(before, d, self.now)
        self.state = d.state
        self.launches += [c for c in d.commands if isinstance(c, Launch)]
        if redeliver_check and not isinstance(ev, (Tick, Heartbeat)) and type(ev).__name__ != "PriceTick":
            d2 = decide(self.state, ev, self.now)
            # the one exception: an instance the state does not own (its node was terminated by the
            # first delivery) is terminated again - same command, no state change, idempotent
            unowned = [c for c in d2.commands if isinstance(c, Terminate) and c.node_id not in self.state.nodes]
            assert len(unowned) == len(d2.commands), (ev, d2.commands)
            if unowned:
                assert isinstance(ev, (NodeLaunched, NodeRegistered)) and d2.state == self.state and not d2.dirty
                assert [(c.node_id, c.instance_id) for c in unowned] == [(ev.node_id, ev.instance_id)]
                assert any(isinstance(c, Terminate) and c.node_id == ev.node_id for c in d.commands)
            check(self.state, d2, self.now)
            self.state = d2.state

    def act(self, a: tuple[Any, ...]) -> None:
        kind = a[0]
        if kind == "auto":
            self.cooperate()
        elif kind == "price":
            self.feed(price(POOLS[a[1]], round(OD * a[2], 4), od=OD, ts=self.now))
        elif kind == "tick":
            self.now += a[1]
            self.feed(Tick())
        elif kind == "exec":
            self.execute_launch(a[1], a[2])
        elif kind in ("commit", "cancel", "bus"):
            self.job_action(kind, a[1])
        else:
            node = self.pick(a[1])
            if node is not None:
                self.node_action(kind, node, a)

    def cooperate(self) -> None:
        """A cooperative cloud and agents: launches succeed, nodes register and train."""
        while self.launches:
            self.execute_launch(0, "ok")
        for node in self.nodes():
            if node.node_id not in self.state.nodes:
                continue
            if node.phase == NodePhase.BOOTING:
                self.act(("register", self.nodes().index(self.state.nodes[node.node_id])))
        for job in list(self.state.jobs.values()):
            if job.phase == JobPhase.STARTING and job.gen_nodes and job.gen_nodes[0] in self.state.nodes:
                self.feed(GenerationStarted(id=self.eid(), node_id=job.gen_nodes[0], job_id=job.job_id,
                                            generation=job.generation, first_step=1, ts=self.now))
        for node in self.nodes():
            if node.node_id in self.state.nodes and node.phase in (NodePhase.RUNNING, NodePhase.REGISTERED):
                self.act(("hb", self.nodes().index(self.state.nodes[node.node_id]), 10))

    def execute_launch(self, i: int, outcome: str) -> None:
        """The cloud answers one pending Launch: all nodes, none, or the first only."""
        if not self.launches:
            return
        la = self.launches.pop(i % len(self.launches))
        ok = {"ok": la.node_ids, "fail": (), "partial": la.node_ids[:1]}[outcome]
        for nid in ok:
            self.feed(NodeLaunched(node_id=nid, job_id=la.job_id, instance_id=f"i-{nid}", pool=la.pool,
                                   token=la.token))
        failed = tuple(n for n in la.node_ids if n not in ok)
        if failed:
            self.feed(LaunchFailed(node_ids=failed, job_id=la.job_id, pool=la.pool, token=la.token,
                                   reason=FailureReason.CAPACITY))

    def job_action(self, kind: str, arg: Any) -> None:
        jobs = sorted(self.state.jobs.keys())
        if kind == "bus":
            self.feed(BusState(connected=arg))
        elif kind == "cancel":
            if jobs and arg == 0:
                self.feed(JobCancelled(job_id=jobs[0]))
        elif kind == "commit" and jobs:
            job = self.state.jobs[jobs[arg % len(jobs)]]
            if not job.gen_nodes or job.gen_nodes[0] not in self.state.nodes:
                return
            step = max([self.state.nodes[n].step for n in job.gen_nodes if n in self.state.nodes] + [0])
            self.feed(CheckpointCommitted(id=self.eid(), node_id=job.gen_nodes[0], job_id=job.job_id,
                                          generation=job.generation, step=step, checkpoint_id=f"s{step}",
                                          url=f"u{step}", save_s=5.0, emergency=True, ts=self.now))

    def node_action(self, kind: str, node: Any, a: tuple[Any, ...]) -> None:
        """What an agent / the cloud does to one node: ``a`` is the action tuple (kind, node index, ...)."""
        if kind == "register":
            self.feed(NodeRegistered(id=self.eid(), node_id=node.node_id, host=f"h-{node.node_id}", ts=self.now))
        elif kind == "started" and node.generation:
            self.feed(GenerationStarted(id=self.eid(), node_id=node.node_id, job_id=node.job_id,
                                        generation=node.generation, first_step=node.step + 1, ts=self.now))
        elif kind == "hb":
            st_ = AgentState.TRAINING if node.phase == NodePhase.RUNNING else AgentState.IDLE
            self.feed(Heartbeat(node_id=node.node_id, seq=node.hb_seq + 1, ts=self.now, state=st_,
                                job_id=node.job_id, generation=node.generation, step=node.step + a[2],
                                step_time_s=1.0))
        elif kind == "notice":
            kind_ = NoticeKind.TERMINATE if a[2] else NoticeKind.REBALANCE
            self.feed(PreemptionNotice(id=self.eid(), node_id=node.node_id, cloud="aws", kind=kind_,
                                       deadline_ts=self.now + 120 if a[2] else None, observed_ts=self.now))
        elif kind == "exit" and node.generation:
            job = self.state.jobs.get(node.job_id)
            last = job.spec.total_steps if (a[2] == "completed" and job is not None) else node.step
            self.feed(RanksExited(id=self.eid(), node_id=node.node_id, job_id=node.job_id,
                                  generation=node.generation, exit_code=0, reason=a[2], last_step=last,
                                  ts=self.now))
        elif kind == "gone":
            self.feed(NodeGone(node_id=node.node_id, reason="provider_missing"))
        elif kind == "disconnect":
            self.feed(AgentDisconnected(node_id=node.node_id))
        elif kind == "leaving":
            self.feed(NodeLeaving(id=self.eid(), node_id=node.node_id, reason="sigterm", ts=self.now))
        elif kind == "drain":
            self.feed(NodeDrainRequested(node_id=node.node_id))
        elif kind == "cmd_failed":
            self.feed(CommandFailed(node_id=node.node_id, cmd_id="x", kind="checkpoint"))


def check(before: State, d: Any, now: float) -> None:
    s = d.state
    # records: full round trip, and the dirty keys cover every record that changed
    assert state_from_records(state_to_records(s)) == s
    old, new = state_to_records(before), state_to_records(s)
    changed = {k for k in set(old) | set(new) if old.get(k) != new.get(k)}
    for k in changed:
        if k.startswith("node.") and k in old and k in new:
            # heartbeat-only changes are deliberately not dirty (docs/core.md)
            a, b = before.nodes[k[5:]], s.nodes[k[5:]]
            import msgspec

            if msgspec.structs.replace(a, last_seen=0.0, hb_seq=0, step=0, loss=None, step_time_s=None) == \
                    msgspec.structs.replace(b, last_seen=0.0, hb_seq=0, step=0, loss=None, step_time_s=None):
                continue
        assert k in d.dirty, (k, type(d))
    assert set(all_keys(s)) == set(new)
    # ranks and zones
    for job in s.jobs.values():
        members = [s.nodes[n] for n in job.gen_nodes if n in s.nodes]
        live = [n for n in members if n.generation == job.generation and n.phase in
                (NodePhase.RUNNING, NodePhase.NOTICED, NodePhase.DRAINING)]
        ranks = [n.rank for n in live]
        assert len(ranks) == len(set(ranks)), ranks
        assert len({zone_of(n.pool) for n in members}) <= 1
        for nid in job.nodes:
            assert nid in s.nodes and s.nodes[nid].job_id == job.job_id
        # no runaway launching: in-flight nodes never exceed the target, nodes never exceed twice nodes_max
        inflight = [n for n in job.nodes if s.nodes[n].phase in (NodePhase.REQUESTED, NodePhase.BOOTING)]
        assert len(inflight) <= job.target_nodes, (len(inflight), job.target_nodes)
        assert len(job.nodes) <= 2 * max(job.target_nodes, job.spec.nodes_max) + 1
        # budget: accrued + live burn + the termination tail stays under the cap
        if job.spec.budget_usd is not None:
            tx = Tx(s, "check", now)
            tail = burn_usd_h(tx, job) * s.meta.config.terminate_s / 3600.0
            cost = cost_now(tx, job)
            assert cost + tail <= job.spec.budget_usd + 1e-9, (cost, tail, job.spec.budget_usd)
    live: dict[str, int] = {}
    for n in s.nodes.values():
        assert n.node_id in s.jobs[n.job_id].nodes
        if n.phase != NodePhase.REQUESTED:
            live[n.pool_name] = live.get(n.pool_name, 0) + 1
    for name, ps in s.pools.items():
        assert ps.live == live.get(name, 0), (name, ps.live, live.get(name, 0))
    starts = [c.command for c in d.commands if isinstance(c, SendToAgent) and isinstance(c.command, StartGenerationCmd)]
    for job_id in {c.job_id for c in starts}:
        batch = [c for c in starts if c.job_id == job_id]
        assert len({zone_of(s.nodes[c.node_id].pool) for c in batch}) == 1
        assert sorted(c.node_rank for c in batch) == list(range(batch[0].nnodes))
        assert len({c.generation for c in batch}) == 1
    # audit entries and commands are plain wire data (the shell logs/persists them)
    import msgspec as _ms

    from orchestrator.core import AuditEntry
    from orchestrator.core.commands import Command

    assert _ms.json.decode(_ms.json.encode(d.audit), type=tuple[AuditEntry, ...]) == d.audit
    assert _ms.json.decode(_ms.json.encode(d.commands), type=tuple[Command, ...]) == d.commands
    for c in d.commands:
        if isinstance(c, SendToAgent):
            assert c.command.fencing_token == s.meta.fencing_token


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(job_spec, min_size=1, max_size=2), actions=st.lists(action, min_size=10, max_size=80))
def test_random_operation_keeps_invariants(specs: list[dict], actions: list[tuple]) -> None:
    w = World()
    w.feed(LeaseChanged(revision=3))
    for i, pk in enumerate(POOLS):
        w.feed(price(pk, 5.0 + i, od=OD, ts=w.now))
    for i, sp in enumerate(specs):
        deadline = sp.pop("deadline")
        sp["nodes_max"] = max(sp["nodes"], sp["nodes_min"]) + 1
        deadline_ts = None if deadline is None else w.now + deadline
        ck = CheckpointPolicy(url=f"file:///ck/job.{i}", save_s_estimate=20.0)  # one root per job
        w.feed(JobSubmitted(job_id=f"job.{i}", spec=spec(**sp, deadline_ts=deadline_ts, checkpoint=ck)))
    for a in actions:
        w.act(a)
    # Let time run out: every budgeted job ends under its cap, whatever else happened.
    for _ in range(120):
        w.now += TICK_S
        w.feed(Tick())
    for job in w.state.jobs.values():
        if job.spec.budget_usd is not None:
            assert job.cost_usd <= job.spec.budget_usd + 1e-9
            if job.phase in (JobPhase.STOPPED, JobPhase.SUCCEEDED, JobPhase.CANCELLED, JobPhase.FAILED):
                assert not job.nodes


wire_event = st.one_of(
    st.builds(Tick),
    st.builds(BusState, connected=st.booleans()),
    st.builds(NodeGone, node_id=st.sampled_from(["job_0-n1", "job_0-n2", "x"]), reason=st.text(max_size=5)),
    st.builds(AgentDisconnected, node_id=st.sampled_from(["job_0-n1", "job_0-n2", "x"])),
    st.builds(NodeRegistered, id=st.text(max_size=3), node_id=st.sampled_from(["job_0-n1", "job_0-n2", "x"]),
              host=st.text(max_size=5), ts=st.floats(allow_nan=False)),
    st.builds(RanksExited, id=st.text(max_size=3), node_id=st.sampled_from(["job_0-n1", "job_0-n2"]),
              job_id=st.sampled_from(["job.0", "nope"]), generation=st.integers(-2, 5),
              exit_code=st.integers(-1, 300), reason=st.sampled_from(REASONS + ["???"]),
              last_step=st.integers(-10, 10_000), ts=st.floats(allow_nan=False)),
    st.builds(CheckpointCommitted, id=st.text(max_size=3), node_id=st.sampled_from(["job_0-n1", "x"]),
              job_id=st.sampled_from(["job.0", "nope"]), generation=st.integers(-1, 5), step=st.integers(-5, 5000),
              checkpoint_id=st.text(max_size=3), url=st.text(max_size=5), save_s=st.floats(allow_nan=False),
              ts=st.floats(allow_nan=False)),
    st.builds(PreemptionNotice, id=st.text(max_size=3), node_id=st.sampled_from(["job_0-n1", "job_0-n2", "x"]),
              cloud=st.sampled_from(["aws", "gcp", "zz"]), deadline_ts=st.one_of(st.none(), st.floats(allow_nan=False)),
              observed_ts=st.floats(allow_nan=False)),
    st.builds(Heartbeat, node_id=st.sampled_from(["job_0-n1", "job_0-n2", "x"]), seq=st.integers(-5, 50),
              ts=st.floats(allow_nan=False), state=st.sampled_from(list(AgentState)), generation=st.integers(-1, 5),
              step=st.integers(-5, 5000), step_time_s=st.one_of(st.none(), st.floats(0, 100))),
    st.builds(lambda i, p: price(POOLS[i], p), st.integers(0, 3), st.floats(0.0, 100.0)),
    st.builds(JobCancelled, job_id=st.sampled_from(["job.0", "nope"])),
    st.builds(LeaseChanged, revision=st.integers(0, 10)),
    st.builds(NodeLaunched, node_id=st.sampled_from(["job_0-n1", "job_0-n2", "x"]),
              job_id=st.sampled_from(["job.0", "n"]), instance_id=st.text(max_size=3), pool=st.sampled_from(POOLS),
              token=st.sampled_from(["job_0-L1", "?"])),
    st.builds(LaunchFailed, node_ids=st.lists(st.sampled_from(["job_0-n1", "job_0-n2", "x"]), max_size=3).map(tuple),
              job_id=st.sampled_from(["job.0", "n"]), pool=st.sampled_from(POOLS),
              token=st.sampled_from(["job_0-L1", "?"]), reason=st.sampled_from(list(FailureReason))),
    st.builds(NodeDrainRequested, node_id=st.sampled_from(["job_0-n1", "job_0-n2", "x"])),
    st.builds(CommandFailed, node_id=st.sampled_from(["job_0-n1", "job_0-n2", "x"]), cmd_id=st.text(max_size=3),
              kind=st.text(max_size=3)),
    st.builds(GenerationStarted, id=st.text(max_size=3), node_id=st.sampled_from(["job_0-n1", "job_0-n2"]),
              job_id=st.sampled_from(["job.0", "nope"]), generation=st.integers(-1, 5), first_step=st.integers(-1, 9),
              ts=st.floats(allow_nan=False)),
    st.builds(NodeLeaving, id=st.text(max_size=3), node_id=st.sampled_from(["job_0-n1", "job_0-n2", "x"]),
              reason=st.text(max_size=3), ts=st.floats(allow_nan=False)),
    st.builds(
        lambda jid, n, lo, hi, gpn, steps, budget, dl, mk: JobSubmitted(
            job_id=jid,
            spec=spec(nodes=n, nodes_min=lo, nodes_max=hi, gpus_per_node=gpn, total_steps=steps, budget_usd=budget,
                      deadline_ts=dl, market=mk),
        ),
        st.sampled_from(["job.1", "job.2", "a b.c/d"]), st.integers(-1, 4), st.integers(-1, 4), st.integers(-1, 4),
        st.sampled_from([0, 8]), st.integers(-5, 100), st.one_of(st.none(), st.floats(-1.0, 10.0)),
        st.one_of(st.none(), st.floats(-1e9, 1e12)), st.sampled_from(list(MarketPolicy)),
    ),
)


@settings(max_examples=200, deadline=None)
@given(events=st.lists(st.tuples(wire_event, st.floats(0.0, 100.0)), max_size=40))
def test_decide_never_raises_on_arbitrary_events(events: list) -> None:
    s = State.empty()
    now = 1000.0
    s = decide(s, price(POOLS[0], 10.0), now).state
    s = decide(s, JobSubmitted(job_id="job.0", spec=spec(nodes=2)), now).state
    for ev, dt in events:
        now += dt
        d = decide(s, ev, now)
        s = d.state
        assert state_from_records(state_to_records(s)) == s
