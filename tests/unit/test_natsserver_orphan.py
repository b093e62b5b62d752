"""An embedded nats-server that outlived its orchd (kill -9 of orchd: the server runs in a session of its
own) is stopped before the next start opens the same JetStream directory - two servers on one store made
the next start rebuild every stream's state ("Stream state outdated"). A server of another store whose
pid a stale ports file names is left alone."""

from __future__ import annotations

from pathlib import Path

from orchestrator.natsserver import NatsServer, _running


def test_an_orphan_server_on_the_same_store_is_stopped_and_another_stores_is_not(tmp_path: Path) -> None:
    orphan = NatsServer(tmp_path / "a").start()
    other = NatsServer(tmp_path / "b").start()
    assert orphan.proc is not None and other.proc is not None
    orphan_pid, other_pid = orphan.proc.pid, other.proc.pid
    orphan.proc = None  # its orchd is gone: nobody will stop it
    # a stale ports file in a's directory naming b's server (a pid reused by another server)
    (tmp_path / "a" / "ports" / f"nats-server_{other_pid}.ports").write_text("{}")
    again = NatsServer(tmp_path / "a")
    try:
        again.start()
        assert again.proc is not None and again.proc.pid != orphan_pid
        assert not _running(orphan_pid)
        assert _running(other_pid)
    finally:
        again.stop()
        other.stop()
