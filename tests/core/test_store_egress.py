"""A move's cost counts the egress of reading the checkpoint from the cloud whose store holds it
(``pricing.transfer_cost_usd``) when the move leaves or enters that cloud: a gs:// root read by an Azure
node pays the cross-cloud rate; a move into the store's cloud pays none; otherwise (an unknown scheme, a
store in neither cloud) the rule of where the job wrote it."""

from __future__ import annotations

import wire as ev
from orchestrator.core.model import CoreConfig, PoolStats
from orchestrator.core.pricing import store_cloud, transfer_cost_usd

CFG = CoreConfig()
CROSS_CLOUD = CFG.checkpoint_gb_estimate * CFG.cross_cloud_usd_per_gb
CROSS_REGION = CFG.checkpoint_gb_estimate * CFG.cross_region_usd_per_gb


def _pool(cloud: str, region: str) -> PoolStats:
    return PoolStats(pool=ev.PoolKey(cloud=cloud, region=region, zone=f"{region}-a", instance_type="gpu.x",
                                      market=ev.Market.SPOT), gpu_type="A100", gpus_per_node=1)


def test_the_store_s_cloud_decides_the_egress() -> None:
    assert CROSS_CLOUD > CROSS_REGION > 0
    assert [store_cloud(u) for u in ("gs://b/p", "az://c/p", "s3://b/p", "file:///x", "sim://j", "nope")] == [
        "gcp", "azure", "aws", None, None, None]
    gcp_zone = "gcp/us-central1/us-central1-a"
    assert transfer_cost_usd(gcp_zone, _pool("azure", "eastus"), CFG, "gs://ckpt/job") == CROSS_CLOUD
    assert transfer_cost_usd("azure/eastus/eastus-1", _pool("gcp", "us-central1"), CFG, "gs://ckpt/job") == 0.0
    assert transfer_cost_usd(gcp_zone, _pool("aws", "us-east-1"), CFG, "s3://ckpt/job") == 0.0  # read in AWS
    assert transfer_cost_usd(gcp_zone, _pool("gcp", "europe-west4"), CFG, "gs://ckpt/job") == CROSS_REGION
    assert transfer_cost_usd(gcp_zone, _pool("azure", "eastus"), CFG, "file:///ckpt") == CROSS_CLOUD  # old rule
    assert transfer_cost_usd("", _pool("azure", "eastus"), CFG, "gs://ckpt/job") == 0.0  # nothing written yet
    fake = "fake/r1/r1a"  # a store in neither cloud of the move: the rule of where the job wrote it
    assert transfer_cost_usd(fake, _pool("fake", "r1"), CFG, "s3://ckpt/job") == 0.0
