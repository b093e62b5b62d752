"""What reaches the logs, at what rate: orchd's price feed (a debug line per round, an info summary
every few minutes), the ranks' progress in ``orchctl logs`` (step/loss lines, rate-limited), and a lost
peer (one line with the reason, no torch traceback)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import anyio
import nats
import pytest

from agent.main import AgentConfig
from orchestrator.cli.logs import read_logs
from orchestrator.daemon.feeds import run_price_feed
from providers.local import LocalConfig, LocalProvider
from tests.agent.helpers import ensure_events_stream, running_agent, send, start_cmd, wait_for
from wire.logs import configure


def _json_lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.startswith("{")]


@pytest.mark.anyio
async def test_price_feed_logs_a_summary_not_every_round(nats_url: str, tmp_path: Path) -> None:
    from nats.js.api import StreamConfig

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="ORCH_MARKET_T", subjects=["orch.price.>"], duplicate_window=10))
    provider = LocalProvider(LocalConfig(work_dir=str(tmp_path / "nodes"), prices="fixed"))
    buf = io.StringIO()
    configure("info", "json", stream=buf)  # orchd's own logging set-up, at orchd's default level
    rounds: list[object] = []
    try:
        with anyio.move_on_after(2.0):
            await run_price_feed(js, provider, interval_s=0.05, summary_s=0.6, on_round=rounds.append)
    finally:
        configure("info", "json")
        await nc.close()
    lines = _json_lines(buf)
    assert len(rounds) >= 10, rounds
    assert not [x for x in lines if x["event"] == "price_feed_round"]  # debug: filtered at info
    summaries = [x for x in lines if x["event"] == "price_feed_summary"]
    assert 2 <= len(summaries) <= 3, summaries
    assert sum(s["rounds"] for s in summaries) <= len(rounds)
    assert all(s["cloud"] == "local" and s["quotes"] == 6 * s["rounds"] and s["failed"] == 0 for s in summaries)
    assert len(lines) == len(summaries)  # nothing else at info from a healthy feed


@pytest.mark.anyio
async def test_step_and_loss_lines_reach_orchctl_logs_rate_limited(nats_url: str, tmp_path: Path) -> None:
    from agent.logship import ensure_logs_stream

    nc = await nats.connect(nats_url)
    await ensure_events_stream(nc)
    await ensure_logs_stream(nc)
    node = "n-steplines"
    cfg = AgentConfig(node_id=node, nats_urls=(nats_url,), work_dir=str(tmp_path / node), heartbeat_s=0.3)
    async with running_agent(cfg) as agent:
        agent.generations.step_line_interval_s = 0.5
        cmd = start_cmd(node, steps=120, step_time_s=0.02, ckpt=str(tmp_path / "ckpt"))
        assert (await send(nc, cmd)).ok
        await wait_for(lambda: agent.group is not None and agent.group.done.is_set(), timeout_s=30)
        await agent.logs.flush(2.0)  # type: ignore[union-attr]
    out: list[str] = []
    await read_logs([nats_url], "j1", node=node, out=out.append, idle_s=1.0)
    await nc.close()
    steps = [line for line in out if "| step " in line]
    assert steps, out
    assert "| step 1/120 loss " in steps[0]  # the first step of the generation is always shown
    # 120 steps of 20 ms (>= 2.4 s) at one line per 0.5 s: a handful, never one per step
    assert 2 <= len(steps) <= 12, steps


@pytest.mark.slow  # real multi-process generation (gloo, CPU, tiny GPT); run in CI too
def test_lost_peer_is_one_line_with_the_reason_not_a_traceback(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tests.trainer.helpers import GPT_CMD, Generation, trainer_env
    from trainer import contract

    args = {"size": "tiny", "seq_len": 32, "global_batch": 4, "micro_batch": 2, "lr": 3e-3, "seed": 7}
    env = trainer_env(tmp_path, total_steps=100000, args=args, extra={contract.ENV_COLLECTIVE_TIMEOUT_S: "5"})
    g = Generation(GPT_CMD, 2, env)
    g.wait_step(2)
    g.ranks[1].proc.kill()
    codes = g.wait(timeout=60)
    assert codes[0] == contract.EXIT_PEER_LOST, g.log()
    survivor = g.ranks[0].lines
    assert not [line for line in survivor if "Traceback" in line], g.log()
    lost = [line for line in survivor if line.startswith("peer_lost: ")]
    assert len(lost) == 1 and len(lost[0]) > len("peer_lost: RuntimeError: "), g.log()
    exit_reports = [r for r in g.ranks[0].reports() if isinstance(r, contract.ExitReport)]
    assert exit_reports and exit_reports[0].reason
