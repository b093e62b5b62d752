"""The replay plot (matplotlib Agg), read back from the figure objects: one colour per policy, the same on
every panel and chosen by name (not by plot order), no two policies alike, and the on_demand line visible
where it coincides with failover's."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.colors import to_hex

from simulations.plot import POLICY_STYLES, plot_replay, replay_figure
from simulations.policies import ALL_POLICIES
from simulations.worldparams import WorldParams

from .conftest import tiny_scenario

TICKS = 240  # 5 min ticks: 20 h


def _scenario():
    # One zone, spot out for the first ticks of each job (jobs start at 0 and TICKS // 2), so failover
    # starts on demand and stays there: its line is on_demand's; spot returns later, with two gaps.
    avail = np.ones((1, TICKS))
    for start in (0, TICKS // 2):
        avail[0, start:start + 4] = 0
    avail[0, 30:36] = avail[0, 160:166] = 0
    return tiny_scenario(avail, regions_of_zones=[0], spot=np.full((1, TICKS), 0.3))


def _figure(policies):
    return replay_figure(_scenario(), WorldParams(), job_hours=3.0, deadline_hours=5.0, nodes=1, jobs=2,
                         policies=policies)


def _policy_lines(ax) -> dict[str, object]:
    return {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}


@pytest.fixture(scope="module")
def figures():
    import matplotlib.pyplot as plt

    # the same policies in two orders: colours must follow the names, not the order of plotting
    figs = [_figure(list(ALL_POLICIES)), _figure(list(reversed(ALL_POLICIES)))]
    yield figs
    for f in figs:
        plt.close(f)


def test_each_policy_has_one_colour_on_every_panel_and_no_two_share_one(figures) -> None:
    colour: dict[str, str] = {}
    panels = 0
    for fig in figures:
        for ax in fig.axes:
            lines = _policy_lines(ax)
            assert lines, ax.get_title()
            panels += 1
            for name, ln in lines.items():
                assert colour.setdefault(name, to_hex(ln.get_color())) == to_hex(ln.get_color()), (name, ax)
            # the on-demand squares of the timeline panel take their policy's colour
            for coll in ax.collections:
                name = coll.get_gid().removesuffix(" on-demand")
                assert {to_hex(c) for c in coll.get_facecolors()} == {colour[name]}, name
    assert panels == 4
    assert set(colour) == set(ALL_POLICIES)
    assert len(set(colour.values())) == len(colour), colour
    assert colour == {p: to_hex(POLICY_STYLES[p].colour) for p in ALL_POLICIES}


def test_on_demand_is_visible_where_it_coincides_with_failover(figures) -> None:
    timeline = _policy_lines(figures[0].axes[1])
    od, fo = timeline["on_demand"], timeline["failover"]
    # the scenario makes them coincide: same points on the timeline panel
    assert np.array_equal(od.get_xydata(), fo.get_xydata())
    for fig in figures:
        for ax in fig.axes:
            lines = _policy_lines(ax)
            od, fo = lines["on_demand"], lines["failover"]
            assert od.get_zorder() > max(ln.get_zorder() for n, ln in lines.items() if n != "on_demand")
            assert od.get_linestyle() in ("--", "-.", ":") and fo.get_linestyle() == "-"  # failover shows in gaps
            assert fo.get_linewidth() > od.get_linewidth()  # and on both sides of the dashes


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no plot style for policy 'spotless'"):
        _figure(["on_demand", "spotless"])


def test_png_is_written(tmp_path) -> None:
    out = tmp_path / "replay.png"
    plot_replay(_scenario(), WorldParams(), str(out), job_hours=3.0, deadline_hours=5.0, nodes=1, jobs=2,
                policies=["on_demand", "failover"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
