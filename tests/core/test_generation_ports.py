"""The rendezvous port of a generation: two jobs whose rank 0 share a host (the local provider runs every
node on one machine) must not get the same port for their first generations (both got base + 1 and the
second job's ranks failed with EADDRINUSE)."""

from __future__ import annotations

from orchestrator.core.inputs import JobSubmitted
from tests.core.harness import Driver, cmds, pool, price, spec
from wire import CheckpointPolicy, StartGenerationCmd


def _first_port(drv: Driver, job_id: str) -> int:
    d = drv(JobSubmitted(job_id=job_id, spec=spec(nodes=1, nodes_min=1, nodes_max=1, checkpoint=CheckpointPolicy(
        url=f"file:///ckpt/{job_id}", save_s_estimate=20.0))))
    d = drv.register(drv.launched(d))
    (start,) = cmds(d, StartGenerationCmd)
    return int(start.master_port)


def test_two_jobs_start_on_different_ports() -> None:
    drv = Driver()
    drv(price(pool(), 10.0))
    ports = {_first_port(drv, f"job-{i}") for i in range(5)}
    assert len(ports) == 5, ports
