"""The local provider against the shared contract, without agent processes: a node is what a cloud would
be asked to keep (an Instance plus its metadata service), so terminate's ownership check is exercised on
the provider's own node table. Launching real agents is covered in tests/agent/test_local_provider.py."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec
import pytest
import structlog

from providers.base import TAG_CLUSTER, ForeignInstanceError, Instance, InstanceState, LaunchRequest
from providers.local.provider import LocalConfig, LocalProvider, _Node
from tests.providers.contract import check_cloud_provider_contract
from wire import InstanceId, NodeId

_FOREIGN = itertools.count(1)


class _NoMetadata:
    def stop(self) -> None:
        pass


class _Processless(LocalProvider):
    """Launches record the node without starting an agent (nothing in these tests talks to one)."""

    def _spawn(self, iid: InstanceId, node_id: NodeId, request: LaunchRequest, urls: Sequence[str]) -> Instance:
        inst = Instance(instance_id=iid, node_id=node_id, pool=request.pool, state=InstanceState.RUNNING,
                        tags=request.instance_tags(node_id), launched_ts=1.0, private_ip="127.0.0.1")
        self._put(inst)
        return inst

    def _put(self, inst: Instance) -> None:
        with self._lock:
            self._nodes[inst.instance_id] = _Node(inst, _NoMetadata(), None, None,  # type: ignore[arg-type]
                                                  self.work_dir, "aws")
            if inst.node_id is not None:
                self._by_node[str(inst.node_id)] = inst.instance_id

    def foreign(self, tags: Mapping[str, str]) -> InstanceId:
        """A node this provider did not launch (another workload on the same host), tagged as given."""
        iid = InstanceId(f"other-{next(_FOREIGN):05d}")
        self._put(Instance(instance_id=iid, node_id=None, pool=self.pool("local-a"), state=InstanceState.RUNNING,
                           tags=dict(tags), launched_ts=1.0))
        return iid


def _provider(tmp_path: Path) -> _Processless:
    return _Processless(LocalConfig(work_dir=str(tmp_path), terminate_grace_s=0.1))


def test_satisfies_the_cloud_provider_contract(tmp_path: Path) -> None:
    lp = _provider(tmp_path)
    try:
        check_cloud_provider_contract(lp, lp.pool("local-a"), "c-contract", unknown_id="local-99999",
                                      configured=lp.pools(), priced=lp.pools(), foreign=lp.foreign)
    finally:
        lp.close()


def test_refusal_is_logged_as_terminate_refused(tmp_path: Path) -> None:
    lp = _provider(tmp_path)
    try:
        other = lp.foreign({TAG_CLUSTER: "someone-else"})
        with structlog.testing.capture_logs() as logs, pytest.raises(ForeignInstanceError):
            lp.terminate([other], "c1")
        (row,) = [r for r in logs if r["event"] == "terminate_refused"]
        assert row["instance"] == other and row["cluster"] == "c1" and row["instance_cluster"] == "someone-else"
        assert lp.describe([other])[0].alive
    finally:
        lp.close()


def test_agent_environment_carries_the_nodes_own_secret_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-node credentials (orchd's ``[credentials]``): each agent gets its own node's enrolment token as
    ``ORCH_AGENT_ENROL_TOKEN``, as the cloud bootstrap writes it (the shared token is for a launch without
    per-node credentials); orchd's own ``$CREDENTIALS_DIRECTORY`` is never passed on, ``agent_env`` may
    name the node's."""
    from providers.base import NodeBootstrap

    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path / "orchd-secrets"))
    lp = LocalProvider(LocalConfig(work_dir=str(tmp_path), agent_env={"ORCH_AGENT_LOG_LEVEL": "debug"}))
    try:
        per_node = LaunchRequest(pool=lp.pool("local-a"), node_ids=(NodeId("n1"), NodeId("n2")),
                                 idempotency_token="t", cluster_id="c", job_id="j",
                                 bootstrap=NodeBootstrap(nats_urls=("nats://x:4222",),
                                                         node_credentials={"n1": "tok-1", "n2": "tok-2"}))
        env1, env2 = lp.agent_environment(NodeId("n1"), per_node), lp.agent_environment(NodeId("n2"), per_node)
        assert (env1["ORCH_AGENT_ENROL_TOKEN"], env2["ORCH_AGENT_ENROL_TOKEN"]) == ("tok-1", "tok-2")
        assert "ORCH_AGENT_NATS_TOKEN" not in env1 and "CREDENTIALS_DIRECTORY" not in env1
        assert env1["ORCH_AGENT_LOG_LEVEL"] == "debug"
        shared = msgspec.structs.replace(per_node, bootstrap=NodeBootstrap(nats_urls=("nats://x:4222",),
                                                                           credential="shared"))
        env = lp.agent_environment(NodeId("n1"), shared)
        assert env["ORCH_AGENT_NATS_TOKEN"] == "shared" and "ORCH_AGENT_ENROL_TOKEN" not in env
    finally:
        lp.close()
    own = LocalProvider(LocalConfig(work_dir=str(tmp_path), agent_env={"CREDENTIALS_DIRECTORY": "/run/node"}))
    try:
        req = LaunchRequest(pool=own.pool("local-a"), node_ids=(NodeId("n1"),), idempotency_token="u", cluster_id="c",
                            job_id="j")
        assert own.agent_environment(NodeId("n1"), req)["CREDENTIALS_DIRECTORY"] == "/run/node"
    finally:
        own.close()


def test_a_provider_started_again_never_reuses_an_instance_id(tmp_path: Path) -> None:
    """orchd's state keeps the instance ids of the last run's nodes; a Terminate decided for one of them
    after a restart must not reach a node the new provider launched (ids once restarted at local-00001)."""
    ids = []
    for _run in range(2):
        lp = _provider(tmp_path)
        try:
            pool = lp.pool("local-a")
            req = LaunchRequest(pool=pool, node_ids=(NodeId("n1"),), cluster_id="c1", idempotency_token="t", job_id="j")
            ids += [i.instance_id for i in lp.launch(req).instances]
        finally:
            lp.close()
    assert len(ids) == 2 and ids[0] != ids[1], ids
