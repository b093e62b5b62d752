"""The agent's side of the shard replicas: what the ranks are told (the holder, this generation's key, k,
orchd's buddy for the node), and the loss bound the ranks measured, carried to orchd in RanksExited."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from agent.ranks import RankGroup, _Rank
from agent.replicas import ReplicaHolder
from tests.agent.helpers import start_cmd
from trainer import contract
from trainer.replicas import protocol as p

pytestmark = pytest.mark.anyio


async def test_the_ranks_learn_their_holder_key_k_and_buddy(tmp_path: Path) -> None:
    secret = "agent-replica-secret-0123456789abcdef"
    cmd = msgspec.structs.replace(start_cmd("n", ckpt=str(tmp_path), gpus=2), nnodes=3, node_rank=1,
                                  replica_secret=secret, replica_every=2, replica_step=7, replica_buddy=0)
    holder = ReplicaHolder("127.0.0.1")
    try:
        env = await holder.prepare(cmd)
        assert env[p.ENV_HOLDER] == holder.addr and env[p.ENV_KEY] == p.generation_key(secret, 1).hex()
        assert (env[p.ENV_EVERY], env[p.ENV_STEP], env[p.ENV_BUDDY]) == ("2", "7", "0")
        assert secret not in env.values()
        # a buddy outside the generation is not passed on: the ranks fall back to the ring
        env = await holder.prepare(msgspec.structs.replace(cmd, replica_buddy=3))
        assert p.ENV_BUDDY not in env
    finally:
        holder.stop()


def test_the_largest_lag_any_rank_reported_is_kept(tmp_path: Path) -> None:
    g = RankGroup(cmd=start_cmd("n", ckpt=str(tmp_path), gpus=2), work_dir=tmp_path,
                  on_report=lambda rank, report: None, on_log=lambda rank, stream, line: None)
    ranks = [_Rank(rank=0, local_rank=0), _Rank(rank=1, local_rank=1)]
    for rank, step, lag in ((0, 1, 1), (1, 1, 1), (0, 2, 2), (1, 2, 4), (0, 3, 2)):
        report = contract.StepReport(rank=rank, generation=1, step=step, loss=1.0, step_time_s=0.1, ts=0.0,
                                     replica_lag=lag)
        g._line(ranks[rank], "stdout", contract.encode_report(report))
    assert g.replica_lag_max == 4
    plain = RankGroup(cmd=start_cmd("n", ckpt=str(tmp_path)), work_dir=tmp_path,
                      on_report=lambda rank, report: None, on_log=lambda rank, stream, line: None)
    plain._line(ranks[0], "stdout", contract.encode_report(contract.StepReport(
        rank=0, generation=1, step=1, loss=1.0, step_time_s=0.1, ts=0.0)))
    assert plain.replica_lag_max is None  # a job without replicas reports none (RanksExited leaves it unset)
