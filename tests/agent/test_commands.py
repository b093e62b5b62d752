"""The command handler without NATS: decoding, wrong node, dedup by cmd_id, fencing, and what each
command does to an idle node (the generation cases run with real ranks in test_agent.py)."""

from __future__ import annotations

import time

import pytest

from agent.commands import CommandHandler
from agent.config import AgentConfig
from agent.generations import GenerationRunner
from agent.outbox import NodePublisher, Outbox
from wire import AbandonGenerationCmd, CheckpointCmd, DrainCmd, NodeId, StopCmd, encode

pytestmark = pytest.mark.anyio

NODE = NodeId("n-1")


def _handler(tmp_path) -> tuple[CommandHandler, list[str]]:
    publisher = NodePublisher(NODE)
    publisher.outbox = Outbox(js=None)  # put() never touches the server
    drains: list[str] = []
    runner = GenerationRunner(AgentConfig(node_id=NODE), tmp_path, publisher)
    return CommandHandler(NODE, runner, drains.append, remember=2), drains


def _ckpt(cmd_id: str, token: int, node: str = NODE) -> CheckpointCmd:
    return CheckpointCmd(cmd_id=cmd_id, fencing_token=token, node_id=NodeId(node), job_id="j1", generation=1,
                         issued_ts=time.time(), reason="test")


async def test_bad_and_misdirected_commands(tmp_path) -> None:
    h, _ = _handler(tmp_path)
    bad = await h.handle(b"{not json")
    assert not bad.ok and bad.error is not None and bad.error.startswith("bad_command:") and bad.cmd_id == ""
    other = await h.handle(encode(_ckpt("c-0", 1, node="n-2")))
    assert other.error == "wrong_node" and h.fencing_token == 0  # not ours: no effect on fencing


async def test_dedup_and_fencing(tmp_path) -> None:
    h, drains = _handler(tmp_path)
    first = await h.handle(encode(_ckpt("c-1", 5)))
    assert first.error == "unknown_generation" and h.fencing_token == 5  # idle node: nothing to checkpoint
    assert await h.handle(encode(_ckpt("c-1", 5))) is first  # a retry: the very same ack
    stale = await h.handle(encode(_ckpt("c-2", 4)))
    assert stale.error == "stale_fencing_token" and h.fencing_token == 5
    stop = StopCmd(cmd_id="s-1", fencing_token=6, node_id=NODE, issued_ts=time.time(), reason="test")
    abandon = AbandonGenerationCmd(cmd_id="a-1", fencing_token=6, node_id=NODE, issued_ts=time.time(), reason="t")
    assert (await h.handle(encode(stop))).ok and (await h.handle(encode(abandon))).ok  # nothing runs: no-ops
    drain = DrainCmd(cmd_id="d-1", fencing_token=6, node_id=NODE, issued_ts=time.time(), reason="scale_in")
    assert (await h.handle(encode(drain))).ok and drains == ["drain:scale_in"]
    assert len(h._acks) == 2  # only the last ``remember`` acks are kept
    again = await h.handle(encode(_ckpt("c-1", 6)))  # forgotten: executed again, a new ack
    assert again is not first and again.error == "unknown_generation"


async def test_a_cmd_id_that_comes_back_naming_another_command_is_executed(tmp_path) -> None:
    """A retry (same cmd_id, same kind, job and generation) gets the first ack and has no second effect.
    The same cmd_id naming another command - what an orchd that crashed after sending a checkpoint command
    it had not stored yet decides next for this node - is executed, not answered with the checkpoint's ack."""
    h, drains = _handler(tmp_path)
    first = await h.handle(encode(_ckpt("n-1-c5", 5)))
    assert await h.handle(encode(_ckpt("n-1-c5", 5))) is first
    drain = DrainCmd(cmd_id="n-1-c5", fencing_token=5, node_id=NODE, issued_ts=time.time(), reason="scale_in")
    ack = await h.handle(encode(drain))
    assert ack is not first and ack.ok and drains == ["drain:scale_in"]
    assert await h.handle(encode(drain)) is ack  # and its own retries are deduplicated again
    other_gen = CheckpointCmd(cmd_id="n-1-c5", fencing_token=5, node_id=NODE, job_id="j1", generation=2,
                              issued_ts=time.time(), reason="test")
    assert (await h.handle(encode(other_gen))) is not ack  # another generation: another command
