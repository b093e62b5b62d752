"""One job, one checkpoint root: normalisation and overlap (roots.py), the refusal at submit and
``start_from`` (decide.py ``_job_submitted``, lifecycle.py ``start_generation``)."""

from __future__ import annotations

import msgspec
import pytest

from orchestrator.core import JobPhase, state_from_records, state_to_records
from orchestrator.core.inputs import JobSubmitted
from orchestrator.core.roots import find_overlap, normalise, relation, start_from
from tests.core.harness import (
    CheckpointCommitted,
    Driver,
    RanksExited,
    StartGenerationCmd,
    cmds,
    pool,
    price,
    spec,
)
from wire import CheckpointPolicy


@pytest.mark.parametrize(("url", "want"), [
    ("file:///a/b/", "file:///a/b"),
    ("file:///a//b/./c/../", "file:///a/b"),
    ("file:///a/../../b", "file:///b"),
    ("file://localhost/a/b", "file:///a/b"),
    ("file:///", "file:///"),
    ("S3://Bucket/x//y/", "s3://bucket/x/y"),
    ("s3://bucket/", "s3://bucket"),
    ("gs://b/p/.", "gs://b/p"),
    ("  az://c/p  ", "az://c/p"),
    ("/plain//path/", "/plain/path"),
])
def test_normalise(url: str, want: str) -> None:
    assert normalise(url) == want


@pytest.mark.parametrize(("a", "b", "want"), [
    ("file:///ck/j1", "file:///ck/j1/", "equal"),
    ("file:///ck/./j1", "file:///ck/x/../j1", "equal"),
    ("file:///ck/j1/run2", "file:///ck/j1", "inside"),
    ("file:///ck", "file:///ck/j1", "contains"),
    ("s3://b", "s3://b/any/thing", "contains"),
    ("file:///a/b", "file:///a/bc", None),  # siblings with a common prefix
    ("file:///a/bc", "file:///a/b", None),
    ("s3://b1/ck", "s3://b2/ck", None),  # other bucket
    ("s3://b/ck", "gs://b/ck", None),  # other scheme
    ("s3://B/ck", "s3://b/ck/", "equal"),
    ("az://cont/ck", "abfs://cont@acct.dfs.core.windows.net/ck/j", "contains"),  # one Azure family
    ("abfs://c1@acct/ck", "az://c2/ck", None),
])
def test_relation(a: str, b: str, want: str | None) -> None:
    assert relation(a, b) == want
    flip = {"inside": "contains", "contains": "inside"}
    assert relation(b, a) == (flip.get(want, want) if want else None)


def test_find_overlap_names_the_lowest_job_id() -> None:
    jobs = [("z", "file:///ck"), ("b", "file:///ck/j/x"), ("a", "file:///other")]
    clash = find_overlap(jobs, "file:///ck/j/")
    assert clash is not None and (clash.job_id, clash.relation) == ("b", "contains")
    assert (clash.root, clash.other_root) == ("file:///ck/j", "file:///ck/j/x")
    assert find_overlap(jobs, "file:///ck2") is None
    assert find_overlap([], "file:///ck") is None


def test_start_from_unset_null_and_empty_mean_none() -> None:
    assert start_from(CheckpointPolicy(url="file:///a")) is None
    assert start_from(CheckpointPolicy(url="file:///a", start_from=None)) is None
    assert start_from(CheckpointPolicy(url="file:///a", start_from=" ")) is None
    assert start_from(CheckpointPolicy(url="file:///a", start_from="file:///b/step_2")) == "file:///b/step_2"
    # unset is not encoded: records written before the field existed keep their bytes
    assert b"start_from" not in msgspec.json.encode(CheckpointPolicy(url="file:///a"))


# --- the core -----------------------------------------------------------------------------------------


def _driver() -> Driver:
    drv = Driver()
    drv(price(pool(), 10.0))
    return drv


def _finish(drv: Driver, job_id: str, url: str) -> None:
    """Run job ``job_id`` (one node) to completion with a commit at step 200 under ``url``."""
    d = drv(JobSubmitted(job_id=job_id, spec=spec(nodes=1, nodes_max=1, total_steps=200,
                                                  checkpoint=CheckpointPolicy(url=url))))
    ids = drv.launched(d)
    drv.register(ids)
    drv(CheckpointCommitted(id=f"c-{job_id}", node_id=ids[0], job_id=job_id, generation=1, step=200,
                            checkpoint_id="s200", url=f"{url}/step_000000200", save_s=1.0, ts=drv.now), dt=5)
    drv(RanksExited(id=f"x-{job_id}", node_id=ids[0], job_id=job_id, generation=1, exit_code=0,
                    reason="completed", last_step=200, ts=drv.now))
    assert drv.job(job_id).phase == JobPhase.SUCCEEDED


@pytest.mark.parametrize(("url", "relation_"), [
    ("file:///ck/a", "equal"), ("file:///ck/a/", "equal"), ("file:///ck/a/b", "inside"), ("file:///ck", "contains"),
])
def test_a_root_overlapping_a_finished_job_is_refused_with_a_reason(url: str, relation_: str) -> None:
    drv = _driver()
    _finish(drv, "a", "file:///ck/a")
    before = drv.state
    d = drv(JobSubmitted(job_id="b", spec=spec(checkpoint=CheckpointPolicy(url=url))))
    assert "b" not in d.state.jobs and not d.commands
    assert d.state.jobs == before.jobs and not d.dirty  # nothing persisted, the finished job untouched
    (entry,) = d.audit
    assert (entry.job_id, entry.action, entry.reason) == ("b", "submit_refused", "checkpoint_root_overlap")
    assert entry.details["other_job"] == "a" and entry.details["relation"] == relation_
    assert entry.details["other_root"] == "file:///ck/a"
    # redelivered: refused again, the same way
    again = drv(JobSubmitted(job_id="b", spec=spec(checkpoint=CheckpointPolicy(url=url))))
    assert "b" not in again.state.jobs and again.audit[0].action == "submit_refused"


def test_a_running_job_root_is_refused_and_siblings_are_accepted() -> None:
    drv = _driver()
    drv(JobSubmitted(job_id="a", spec=spec(checkpoint=CheckpointPolicy(url="s3://bkt/ck/a"))))
    assert drv(JobSubmitted(job_id="b", spec=spec(checkpoint=CheckpointPolicy(url="s3://bkt/ck/a")))).audit[0].action \
        == "submit_refused"
    for jid, url in (("c", "s3://bkt/ck/ab"), ("d", "s3://other/ck/a"), ("e", "gs://bkt/ck/a")):
        d = drv(JobSubmitted(job_id=jid, spec=spec(checkpoint=CheckpointPolicy(url=url))))
        assert jid in d.state.jobs and d.audit[0].action == "submit"


def test_start_from_resumes_the_first_generation_and_writes_under_its_own_root() -> None:
    drv = _driver()
    _finish(drv, "a", "file:///ck/a")
    other = "file:///ck/a/step_000000200"
    sp = spec(nodes=1, nodes_max=1, total_steps=400, checkpoint=CheckpointPolicy(url="file:///ck/b", start_from=other))
    d = drv(JobSubmitted(job_id="b", spec=sp))
    assert "b" in d.state.jobs and d.audit[0].details["start_from"] == other
    ids = drv.launched(d)
    d = drv.register(ids)
    (start,) = cmds(d, StartGenerationCmd)
    assert (start.resume_from, start.checkpoint_url) == (other, "file:///ck/b")
    assert [a.details["resume_from"] for a in d.audit if a.action == "start_generation"] == [other]
    # the spec survives the records round trip; the finished job's checkpoint is still its own
    assert state_from_records(state_to_records(d.state)).jobs["b"].spec.checkpoint.start_from == other
    assert drv.job("a").committed_url == other and drv.job("a").phase == JobPhase.SUCCEEDED
    # once the job committed its own checkpoint, it resumes from that one
    drv(CheckpointCommitted(id="cb", node_id=ids[0], job_id="b", generation=1, step=250, checkpoint_id="s250",
                            url="file:///ck/b/step_000000250", save_s=1.0, ts=drv.now), dt=5)
    d = drv(RanksExited(id="xb", node_id=ids[0], job_id="b", generation=1, exit_code=77, reason="peer_lost",
                        last_step=251, ts=drv.now))  # restarts at once (a trainer failure would be held)
    (start2,) = cmds(d, StartGenerationCmd)
    assert start2.generation == 2 and start2.resume_from == "file:///ck/b/step_000000250"


def test_without_start_from_the_first_generation_starts_fresh() -> None:
    drv = _driver()
    d = drv(JobSubmitted(job_id="j1", spec=spec(nodes=1, nodes_max=1)))
    d = drv.register(drv.launched(d))
    (start,) = cmds(d, StartGenerationCmd)
    assert start.resume_from is None and "start_from" not in drv.decisions[1].audit[0].details
