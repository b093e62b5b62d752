"""The agent's command cache against the retries orchd really sends.

A cmd_id that names two commands (an orchd restarted from a record older than what it sent reuses the
id for its next command to the node): each of the two is executed once, and a retry of EITHER is
answered from the cache. The first one's retries keep coming after the second arrived: orchd's
executor retries it with the same cmd_id while its ack is late, and a restarted orchd re-executes it
from the outbox until the batch that decides its result. Keyed by cmd_id alone, the second command's
entry replaced the first's, and the first's retry was executed again (here: a second drain).

A retry answered from the cache still carries its sender's fencing token: a new leader's re-execution
of its predecessor's outbox makes that token the highest seen, so the deposed leader is fenced."""

from __future__ import annotations

import time

import pytest

from agent.commands import CommandHandler
from agent.config import AgentConfig
from agent.generations import GenerationRunner
from agent.outbox import NodePublisher, Outbox
from wire import CheckpointCmd, DrainCmd, NodeId, encode

pytestmark = pytest.mark.anyio

NODE = NodeId("n-1")


async def test_a_retry_of_the_first_command_under_a_reused_id_is_not_executed_again(tmp_path) -> None:
    publisher = NodePublisher(NODE)
    publisher.outbox = Outbox(js=None)  # put() never touches the server
    drains: list[str] = []
    h = CommandHandler(NODE, GenerationRunner(AgentConfig(node_id=NODE), tmp_path, publisher), drains.append)
    drain = DrainCmd(cmd_id="n-1-c5", fencing_token=5, node_id=NODE, issued_ts=time.time(), reason="scale_in")
    first = await h.handle(encode(drain))
    assert first.ok and drains == ["drain:scale_in"]
    ckpt = CheckpointCmd(cmd_id="n-1-c5", fencing_token=5, node_id=NODE, job_id="j1", generation=1,
                         issued_ts=time.time(), reason="preemption_notice")
    second = await h.handle(encode(ckpt))  # another command under the same id: executed
    assert second is not first and second.error == "unknown_generation"  # idle node: nothing to checkpoint
    assert await h.handle(encode(drain)) is first  # the drain's retry: its own ack, no second drain
    assert drains == ["drain:scale_in"]
    assert await h.handle(encode(ckpt)) is second  # and the checkpoint's retry its own


async def test_a_retry_that_carries_a_newer_fencing_token_fences_the_older_leader(tmp_path) -> None:
    """A new leader re-executes its predecessor's outbox: the same command under the same cmd_id, with its
    own, greater fencing token - answered from the cache, and that token is now the highest seen: a
    command of the deposed leader (one its executor still retries) is refused after it."""
    publisher = NodePublisher(NODE)
    publisher.outbox = Outbox(js=None)
    drains: list[str] = []
    h = CommandHandler(NODE, GenerationRunner(AgentConfig(node_id=NODE), tmp_path, publisher), drains.append)
    old = CheckpointCmd(cmd_id="n-1-c5", fencing_token=1, node_id=NODE, job_id="j1", generation=1,
                        issued_ts=time.time(), reason="preemption_notice")
    first = await h.handle(encode(old))
    again = CheckpointCmd(cmd_id="n-1-c5", fencing_token=2, node_id=NODE, job_id="j1", generation=1,
                          issued_ts=time.time(), reason="preemption_notice")
    assert await h.handle(encode(again)) is first  # the new leader's re-execution: a retry, no second effect
    deposed = DrainCmd(cmd_id="n-1-c6", fencing_token=1, node_id=NODE, issued_ts=time.time(), reason="scale_in")
    ack = await h.handle(encode(deposed))
    assert ack.error == "stale_fencing_token" and drains == []  # today: executed (the highest seen stayed 1)
