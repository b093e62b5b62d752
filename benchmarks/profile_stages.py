"""Where orchd's CPU goes, stage by stage, from a py-spy profile of the running daemon.

    py-spy record --pid ORCHD_PID --duration 5 --rate 100 --format raw -o orchd.raw   # while it works
    python benchmarks/profile_stages.py orchd.raw --us-per-event 17.8 --json

Reads py-spy's raw (collapsed) stacks, drops the idle samples (threads waiting in a condition or the
selector), and assigns each active sample to the first stage below that appears in its stack:
nats-py's receive path, the decide pipeline's stages, the background work. Prints each stage's share of
the active samples and, with ``--us-per-event`` (``daemon_cpu_us_per_event`` of
``benchmarks/control_plane.py`` for the same run), its CPU per event. For the capacity phase of
control_plane.py, start py-spy about 1.5 s after the benchmark logs ``latency phase:`` (the drain) and
record 5 s. The shares are sampling estimates: a few hundred samples give a few percent of spread.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

IDLE = ("Condition.wait ", "_PollLikeSelector.select ", "EpollSelector.select ", "Event.wait ")
"""Leaf frames of a thread or loop that waits (py-spy samples them unless --idle is off)."""

STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nats_receive", ("Client._read_loop ",)),  # read loop, parser, message objects
    ("nats_flusher", ("Client._flusher ",)),  # socket writes of what orchd publishes
    ("intake_on_heartbeat", ("Intake.on_heartbeat ",)),  # the callback: rate limit, buffer
    ("subscription_plumbing", ("Subscription._wait_for_msgs ",)),  # nats-py's queue and callback per message
    ("admit", ("admit_heartbeats ", "admit_batch ")),  # decode + screen
    ("gate_and_fold", ("authorize ", "fold_heartbeats ")),  # the trust gate; heartbeats folded through the core
    ("core_decide", ("decide (orchestrator/core/decide.py",)),  # decide() one event at a time
    ("decider", ("Decider.decide ", "Decider.decide_heartbeats ")),  # the Decider's own bookkeeping
    ("liveness_settle", ("LivenessFlusher.settle ",)),
    ("observer_after_batch", ("MetricsObserver.after_batch ",)),
    ("tracking_after_batch", ("TrackingReporter.after_batch ",)),
    ("persist", ("persist (orchestrator/daemon/pipeline.py",)),  # a batch's records and outbox
    ("liveness_writes", ("LivenessFlusher._write ", "_Pipeline._on_ack ")),  # encode, publish, acks
    ("gauge_refresh", ("refresh_gauge_slices ",)),
    ("metrics_scrape", ("Renderer.render ", "_app.<locals>.app ")),
    ("process_rest", ("Daemon.process ",)),  # acks, counters, histograms
    ("decide_loop_rest", ("Daemon.decide_loop ",)),  # take, ticks, the loop itself
)


def stages(raw: str) -> tuple[int, Counter[str]]:
    """(active samples, samples per stage; ``other`` for the rest) of py-spy's raw output."""
    active = 0
    per: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        if not frames[-1].strip() or frames[-1].startswith(IDLE):
            continue
        active += int(n)
        for name, keys in STAGES:
            if any(f.startswith(k) for f in frames for k in keys):
                per[name] += int(n)
                break
        else:
            per["other"] += int(n)
    return active, per


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", type=Path, help="py-spy record --format raw output")
    p.add_argument("--us-per-event", type=float, default=None, help="CPU per event of the same run (µs)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    try:
        raw = args.raw.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"{args.raw}: cannot read it as py-spy's raw output: {e}") from None
    active, per = stages(raw)
    if not active:
        raise SystemExit(f"{args.raw}: no active sample (not py-spy's raw format, or orchd was idle)")
    out: dict[str, object] = {"active_samples": active}
    for name, n in per.most_common():
        out[f"{name}_share"] = round(n / active, 3)
        if args.us_per_event is not None:
            out[f"{name}_us"] = round(args.us_per_event * n / active, 2)
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
