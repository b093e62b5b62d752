from __future__ import annotations

from simulations.overheads import FRESH, Overheads, start_table

A1, A2, G1 = ("aws", "us-east-1"), ("aws", "us-west-2"), ("gcp", "us-central1")


def test_start_costs():
    ov = Overheads(launch_delay_s=100, restart_s=50, checkpoint_s=30, notice_s=120,
                   region_migration_s=200, cloud_migration_s=900)
    assert ov.start_s(FRESH, A1) == 150
    assert ov.start_s(A1, A1) == 180
    assert ov.start_s(A1, A2) == 380
    assert ov.start_s(A1, G1) == 1080


def test_short_notice_loses_half_an_interval():
    ov = Overheads(checkpoint_s=60, notice_s=30, checkpoint_interval_s=1200)
    assert ov.lost_work_s == 600
    assert Overheads(checkpoint_s=60, notice_s=60).lost_work_s == 0


def test_quanta_round_up_and_table_shape():
    ov = Overheads(launch_delay_s=100, restart_s=51, checkpoint_s=0, region_migration_s=0)
    assert ov.start_quanta(FRESH, A1, 50.0) == 4  # 151 s -> 4 x 50 s
    tab = start_table(ov, [A1, A2], 50.0)
    assert len(tab) == 3 and all(len(r) == 2 for r in tab)
    assert tab[2] == [4, 4]
