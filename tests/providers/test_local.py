"""The local provider against the shared contract, without agent processes: a node is what a cloud would
be asked to keep (an Instance plus its metadata service), so terminate's ownership check is exercised on
the provider's own node table. Launching real agents is covered in tests/agent/test_local_provider.py."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path

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
