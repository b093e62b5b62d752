"""The file-backed fake cloud writes in proportion to each call (a journal line), not the whole cloud:
it is what orchd runs on in the benchmarks and drills, inside orchd's process. What it recorded is read
back whole (snapshot plus journal) by a new FileFakeCloud and by ``read_fake_file``, across compactions
and a line cut short by a kill -9."""

from __future__ import annotations

import threading
from pathlib import Path

from providers.base import LaunchRequest
from simulations.fakecloud import COMPACT_MIN_BYTES, FileFakeCloud, journal_path, load_fake_file, read_fake_file
from wire import Market, NodeId, PoolKey

POOL = PoolKey(cloud="fake", region="r1", zone="r1a", instance_type="g.1", market=Market.SPOT)


def req(token: str, *nodes: str) -> LaunchRequest:
    return LaunchRequest(pool=POOL, node_ids=tuple(NodeId(n) for n in nodes), idempotency_token=token,
                         cluster_id="c1", job_id="j1")


def test_a_launch_appends_one_line_whatever_the_cloud_holds(tmp_path: Path) -> None:
    f = tmp_path / "fake.json"
    cloud = FileFakeCloud(f)
    i = 0
    while f.stat().st_size < 2 * COMPACT_MIN_BYTES if f.exists() else True:  # a cloud of 1,000+ instances
        cloud.launch(req(f"t{i}", f"n{i}"))
        i += 1
    snapshot = f.read_bytes()
    journal = journal_path(f)
    before = journal.stat().st_size
    cloud.launch(req("late", "n-late"))
    assert f.read_bytes() == snapshot  # the snapshot of every instance was not rewritten
    added = journal.stat().st_size - before
    assert 0 < added < 2000, added  # one line: the new instance, its token, the call count
    assert read_fake_file(f) == cloud.all_instances()


def test_what_was_recorded_reads_back_whole_across_compactions(tmp_path: Path) -> None:
    f = tmp_path / "fake.json"
    cloud = FileFakeCloud(f)
    n = 0  # at least one compaction, then a journal on top of the snapshot
    compactions, last = 0, 0
    while compactions < 2 or n % 7:
        cloud.launch(req(f"t{n}", f"n{n}a", f"n{n}b") if n % 50 == 0 else req(f"t{n}", f"n{n}a"))
        n += 1
        size = journal_path(f).stat().st_size
        compactions += size < last
        last = size
    first = cloud.all_instances()[0]
    cloud.preempt(first.instance_id)
    cloud.terminate([cloud.all_instances()[1].instance_id], "c1")
    assert journal_path(f).stat().st_size > 0  # a journal on top of the last snapshot
    again = FileFakeCloud(f)
    assert again.all_instances() == cloud.all_instances() == read_fake_file(f)
    assert load_fake_file(f)["launch_calls"] == cloud.launch_calls == n
    # the idempotency tokens survived: the same token returns the first call's instances, creates none
    assert again.launch(req("t3", "n3a", "n3b")).instances == cloud.launch(req("t3", "n3a", "n3b")).instances
    assert len(again.all_instances()) == n + len(range(0, n, 50))


def test_a_line_cut_short_by_a_kill_is_ignored(tmp_path: Path) -> None:
    f = tmp_path / "fake.json"
    cloud = FileFakeCloud(f)
    for i in range(5):
        cloud.launch(req(f"t{i}", f"n{i}"))
    whole = cloud.all_instances()
    with open(journal_path(f), "ab") as j:
        j.write(b'{"instances": [{"instance_id": "fake-0000')  # a call that never returned
    assert read_fake_file(f) == whole
    assert FileFakeCloud(f).all_instances() == whole


def test_a_reader_beside_the_writer_never_sees_an_instance_missing(tmp_path: Path) -> None:
    """Other processes read the files while orchd writes them (the benchmark, the drills): a read that
    falls on a compaction (snapshot replaced, journal emptied) still has every instance launched before it."""
    f = tmp_path / "fake.json"
    cloud = FileFakeCloud(f)
    launched = 0
    short: list[tuple[int, int]] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            before = launched
            seen = len(read_fake_file(f))
            if seen < before:
                short.append((seen, before))

    t = threading.Thread(target=reader)
    t.start()
    try:
        compactions, last = 0, 0
        while compactions < 3:
            cloud.launch(req(f"t{launched}", f"n{launched}"))
            launched += 1
            size = journal_path(f).stat().st_size
            compactions += size < last
            last = size
    finally:
        stop.set()
        t.join()
    assert short == []
