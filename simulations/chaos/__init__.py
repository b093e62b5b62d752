"""Chaos drills of orchd (issue 7): kill -9 at seeded random points, a NATS server restart mid-training,
and a fuzzer of malformed / hostile messages on every subject and the admin service.

Everything is real except the GPU hosts: a real ``nats-server`` (``orchestrator.natsserver``), orchd as a
real subprocess (``python -m orchestrator.daemon``), the file-backed fake cloud of
``simulations.fakecloud.FileFakeCloud`` (so launches survive orchd's death and are counted on the cloud
side, from the file), and simulated agents (``agents.SimFleet``: NATS clients that register, ack
commands, heartbeat, train at a fixed step rate and report checkpoint commits) instead of orch-agent with
trainer processes, to keep a drill in seconds. The partition drills run the real orch-agent instead.

    python -m simulations.chaos [--seed S] [--iterations N] [--fuzz N] [--json]
    python -m simulations.chaos --adversarial N [--seed S] [--adversarial-all] [--json]
    python -m simulations.chaos --partitions [--seed S] [--drills a,b] [--drop-s S] [--sim-agents] [--json]

Modules: ``harness`` (nats-server, the orchd subprocess, metrics, cloud-side counting), ``agents``
(simulated agents), ``kill9`` (kill -9 drill), ``natsrestart`` (NATS restart drill), ``fuzz`` (the
fuzzer), ``hostile`` / ``adversarial`` (well-formed attacks from real ids, and the clean-vs-hostile
drill with its oracle), ``netns`` / ``nsworld`` / ``realhost`` / ``parttrainer`` / ``simhost`` /
``partdrills`` / ``partscore`` / ``partitions`` (each process in its own network namespace, the real
orch-agent with a torch-free trainer; cuts, one-way blocks and random drops; the partition drills), ``__main__`` (the
command). See docs/chaos.md.
"""
