"""Leave-one-family-out tuning (simulations/tune.py): what a configuration is scored on."""

from __future__ import annotations

import itertools

import pytest

from simulations import tune
from simulations.families import FAMILIES, family_scenario, load_family
from simulations.replay import make_jobs, replay
from simulations.results import NOTICES, SHAPES
from simulations.worldparams import WorldParams


def test_tuning_settings_cover_every_notice_and_shape_of_the_table():
    # one setting (30 s, 24/36 h, 3 jobs) chose overrides that did not carry to the table's other rows
    # (docs/simulations.md, finding 14): the tuning scores 1-node jobs at every notice and shape
    got = {(st["notice_s"], (st["job_h"], st["deadline_h"])) for st in tune.TUNING}
    assert got == set(itertools.product(NOTICES, SHAPES))
    assert len(tune.TUNING) == len(NOTICES) * len(SHAPES)
    assert {st["ratio"] for st in tune.TUNING} == {0.33}


def test_a_configuration_scores_the_mean_over_the_tuning_settings(shared, monkeypatch):
    fam = next(f for f in FAMILIES if f.key == "gcp-2023-04-30-c3")
    loaded = {fam.key: load_family(shared, fam)}
    monkeypatch.setattr(tune, "GRID", ({},))
    s = tune.scores(shared, [fam], loaded, jobs=1)
    each = []
    for st in tune.TUNING:
        sc = family_scenario(loaded[fam.key][0], st["ratio"])
        js = make_jobs(sc, job_hours=st["job_h"], deadline_hours=st["deadline_h"], nodes=1, count=1)
        r = replay(sc, js, ["orchd"], WorldParams(notice_override_s=st["notice_s"]))["orchd"]
        assert r.deadline_met == 1.0
        each.append(r.cost_ratio)
    assert s.shape == (1, 1)
    assert s[0, 0] == pytest.approx(sum(each) / len(each))
    assert len(set(each)) > 1  # the settings differ: one of them alone would be another score
