"""The trace families the results table replays: where each one's files lie under the traces' root, and
how a family becomes a scenario. ``results`` (the table) and ``tune`` (the leave-one-family-out tuning)
both read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from simulations import scenario as scen
from simulations import traces

SKY = "skypilot-spot-traces"
AV22 = f"{SKY}/availability/1-node/aws-10-26-2022"


@dataclass(frozen=True)
class Family:
    key: str
    glob: str  # under ../shared/traces
    probe_nodes: int | None = None  # None: from the files (N-node folder, or 1 for 0/1 files)
    probe_note: str = ""
    gap_s: float = 60.0  # sampling of event logs


FAMILIES = (
    Family("aws-2022-k80", f"{AV22}/*_k80_1.json"),
    Family("aws-2022-k80x8", f"{AV22}/*_k80_8.json"),
    Family("aws-2022-v100", f"{AV22}/*_v100_1.json"),
    Family("aws-2022-v100x8", f"{AV22}/*_v100_8.json"),
    Family("aws-2023-04-19-r5", f"{SKY}/preemption/1-node/aws-04-19-2023/*.json"),
    Family("aws-2023-04-22-v100", f"{SKY}/preemption/1-node/aws-04-22-2023/*.json"),
    Family("aws-2023-08-03-v100x4", f"{SKY}/preemption/4-node/aws-08-03-2023/*.json"),
    Family("gcp-2023-04-30-c3", f"{SKY}/preemption/1-node/gcp-04-30-2023/*.json"),
    Family("bamboo-aws-p3", "bamboo/traces/p3-trace.csv", 32, "fleet of up to 32 (README)"),
    Family("bamboo-aws-g4dn", "bamboo/traces/g4dn-trace.csv", 24, "fleet of up to 24 (README)"),
    Family("bamboo-gcp-a100", "bamboo/traces/gcloud/a100x1-east1b.txt", 80,
           "group size not recorded: 80, the largest count of the two GCP group logs"),
    Family("bamboo-gcp-v100", "bamboo/traces/gcloud/v100x1-east1c.txt", 80,
           "group size not recorded: 80, the largest count of the two GCP group logs"),
)
NOT_FAMILIES = (
    "training_on_a_dime: price history and VM lifetimes, no availability series (its GCP logs set the "
    "world's launch defaults)",
    "google-cloud-pricing-cost-calculator, spotinfo-aws-spot-advisor: prices only",
)


def load_family(root: Path, fam: Family) -> tuple[list[traces.AvailabilityTrace], int]:
    files = sorted(root.glob(fam.glob))
    if not files:
        raise FileNotFoundError(f"no traces for {fam.key} under {root / fam.glob}")
    trs = [traces.load_trace(f, gap_s=fam.gap_s, probe_nodes=fam.probe_nodes) for f in files]
    return trs, min(t.nodes_probed for t in trs)


def family_scenario(trs: list[traces.AvailabilityTrace], ratio: float) -> scen.Scenario:
    return scen.build(trs, spot_price_ratio=ratio, truncate=True)
