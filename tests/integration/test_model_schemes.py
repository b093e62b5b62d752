"""Where a Hugging Face model, tokenizer or dataset may come from is orchd's configuration (``[trainer]
model_schemes``), never a job's: a real orchd (fake cloud, real nats-server) refuses at submit a spec whose sources
show another scheme (every one named, with orchd's list) and a spec that tries to set the list; the generation of a
job it accepts carries the list; the agent hands it to the ranks over any value of the job's; the trainer's check
on the node refuses what the list lacks."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import nats
import pytest

import wire as ev
from agent.ranks import RankGroup, _Rank
from orchestrator.cli.client import AdminClient, AdminError
from orchestrator.daemon.run import run_daemon
from orchestrator.jobspec import JobSpecError, parse_jobspec
from orchestrator.natsserver import NatsServer
from simulations.fakecloud import FakeCloud
from tests.integration import helpers as h
from trainer import contract
from trainer.hf.source import SourceError, classify

pytestmark = pytest.mark.anyio

ALLOWED = '[trainer]\nmodel_schemes = ["file", "gcs", "builtin"]\n'  # gcs: an alias of gs


def _spec(tmp: Path, args: str = "") -> ev.JobSpec:
    text = h.JOB_TOML.format(nodes=1).replace("file:///tmp/orch-itest-ckpt", f"file://{tmp}/ckpt")
    return parse_jobspec(text + (f"[trainer.args]\n{args}" if args else ""))


def _widening(tmp: Path) -> ev.JobSpec:
    """A spec whose trainer.env sets the list: orchctl refuses the file; over the wire, orchd must."""
    toml = h.JOB_TOML.format(nodes=1) + f'[trainer]\nenv = {{ {contract.ENV_MODEL_SCHEMES} = "file,s3" }}\n'
    with pytest.raises(JobSpecError, match=f"trainer.env.{contract.ENV_MODEL_SCHEMES}: where models"):
        parse_jobspec(toml)
    spec = _spec(tmp)
    return msgspec.structs.replace(spec, trainer=msgspec.structs.replace(
        spec.trainer, env={contract.ENV_MODEL_SCHEMES: "file,s3,gs,az,hub,builtin"}))


async def test_model_schemes_come_from_orchds_config(server: NatsServer, tmp_path: Path) -> None:
    settings = h.settings_for(tmp_path, server.url, extra=ALLOWED)
    cloud = FakeCloud()
    nc = await nats.connect(server.url)
    agent = await h.SimAgent(nc).start()
    async with anyio.create_task_group() as tg:
        d = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, task_status=task_status))
        client = await AdminClient.connect([server.url])
        try:
            with pytest.raises(AdminError) as e:  # every source outside the list, at once
                await client.submit(_spec(tmp_path, 'model = "s3://models/llama"\ndataset = "az://c/train.jsonl"\n'
                                                    'tokenizer = "/opt/tok"\n'), job_id="from-s3")
            assert e.value.code == 400, e.value.message
            assert ("trainer.args.model: scheme 's3' of 's3://models/llama' is not allowed by orchd's configuration "
                    "([trainer] model_schemes = file, gs, builtin)") in e.value.message
            assert "trainer.args.dataset: scheme 'az' of 'az://c/train.jsonl'" in e.value.message
            assert "trainer.args.tokenizer" not in e.value.message  # a local path: file is allowed
            with pytest.raises(AdminError) as e:  # a job cannot widen it
                await client.submit(_widening(tmp_path), job_id="widens")
            assert e.value.code == 400 and f"trainer.env.{contract.ENV_MODEL_SCHEMES}: where models" in e.value.message
            assert not {"from-s3", "widens"} & set(d.state.jobs)
        finally:
            await client.close()
        # a job it accepts: its generation carries orchd's list (the alias folded)
        (start,) = await h.running_job(d, cloud, nc, agent, tmp_path, server.url, "fits", nodes=1)
        assert start.model_schemes == ("file", "gs", "builtin")
        d.request_stop()
    await nc.close()

    # the agent: orchd's list for the ranks, whatever the job's trainer.env says
    job_env = {contract.ENV_MODEL_SCHEMES: "file,s3,gs,az,hub,builtin"}
    cmd = msgspec.structs.replace(start, trainer=msgspec.structs.replace(start.trainer, env=job_env))
    group = RankGroup(cmd=cmd, work_dir=tmp_path, on_report=lambda rank, report: None,
                      on_log=lambda rank, stream, line: None)
    env = group._env(_Rank(rank=0, local_rank=0))
    assert env[contract.ENV_MODEL_SCHEMES] == "file,gs,builtin"
    # the trainer on the node: what the list lacks is refused, with the list
    for what, value, scheme in (("model", "s3://models/llama", "s3"), ("dataset", "org/corpus", "hub")):
        with pytest.raises(SourceError) as err:
            classify(what, value, env=env)
        assert str(err.value) == (f"trainer.args.{what}: scheme '{scheme}' of '{value}' is not allowed by orchd's "
                                  "configuration ([trainer] model_schemes = file, gs, builtin)")
    assert classify("model", "builtin://llama-tiny", env=env).scheme == "builtin"
    assert classify("dataset", "gcs://bucket/train.jsonl", env=env).scheme == "gs"
