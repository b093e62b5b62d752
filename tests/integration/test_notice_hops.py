"""A notice's path through a real orchd, recorded from the code as it runs (``tests/integration/hops.py``):
docs/architecture.md shows exactly this path, and no shell module is entered twice on it except the loop
that drives the stages (and ``records``, the plain data they share)."""

from __future__ import annotations

from pathlib import Path

from orchestrator.natsserver import NatsServer
from tests.integration import hops


def test_the_documented_notice_path_is_the_one_the_code_runs(nats_server: NatsServer, tmp_path: Path) -> None:
    path = hops.trace_notice(nats_server.url, tmp_path)
    modules = [h.module for h in path]
    assert (path[0].module, path[0].function) == hops.START and not path[0].caller  # the pull loop took it in
    assert (path[-1].module, path[-1].function) == hops.STOP  # ... to its checkpoint command's first send
    for stage in ("pipeline", "admit", "core/decide", "executor"):
        assert stage in modules, (stage, modules)
    assert hops.entered_twice(path) == {}, hops.render(path)
    assert hops.render(path) == hops.doc_section(), (
        "docs/architecture.md shows another notice path than the code runs: python -m tests.integration.hops "
        "--write records it again")


def test_entering_a_module_twice_is_seen() -> None:
    """The check cannot pass by not counting: a stage called back from the executor is a second entry."""
    path = [hops.Hop("", "ingest", "on_msg"), hops.Hop("loop", "pipeline", "decide"),
            hops.Hop("pipeline", "executor", "submit_all"), hops.Hop("executor", "pipeline", "callback"),
            hops.Hop("pipeline", "records", "outbox_key"), hops.Hop("pipeline", "records", "outbox_key")]
    assert hops.entered_twice(path) == {"pipeline": 2}
