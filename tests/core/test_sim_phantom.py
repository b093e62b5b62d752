"""The simulated world the core is replayed in (simulations/world.py) never credits progress while no
member of the generation trains: a rank exit stops the training run at once (before the core terminates
the node), and a generation whose checkpoint order came before its start does not train."""

from __future__ import annotations

import numpy as np

from simulations.engine import Job
from simulations.world import World
from simulations.world_cloud import WNode
from simulations.worldparams import WorldParams
from tests.simulations.conftest import tiny_scenario
from wire import Market, NodeId, PoolKey

POOL = PoolKey(cloud="aws", region="r0", zone="r0a", instance_type="p3.2xlarge", market=Market.SPOT)


def _world() -> tuple[World, WNode]:
    sc = tiny_scenario(np.ones((1, 400)), regions_of_zones=[0], spot=np.full((1, 400), 0.3), od=[1.0])
    w = World(sc, Job(start_tick=0, work_q=100, deadline_ticks=300), WorldParams())
    n = WNode(node_id=NodeId("n1"), pool=POOL, zone=0, launched=w.now, registered=True, generation=1)
    w.nodes[n.node_id] = n
    w.live[n.node_id] = n
    w.gen, w.gen_members = 1, (n.node_id,)
    return w, n


def test_no_progress_after_the_ranks_exited_and_the_node_was_terminated() -> None:
    w, n = _world()
    w.training_since, n.training = w.now, True
    w.now += 100.0
    w.ranks_exit(1, n.node_id, "failed")
    w.stop_instance(n)  # the core's Terminate: the node is gone
    w.instance_lost(n)
    w.now += 1000.0
    assert w.progress() <= 100.0 + 1e-9


def test_a_generation_ordered_to_checkpoint_before_it_started_does_not_train() -> None:
    w, n = _world()
    w.ckpt_for_gen.add(1)  # CheckpointCmd for generation 1 arrived during its restart
    w.generation_started(1)
    assert w.training_since is None and not n.training
    w.now += 1000.0
    assert w.progress() == 0.0
