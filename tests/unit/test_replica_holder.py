"""The replica holder as a real process over TCP: complete or absent, versioned by step, and the trust
model (another job, an old generation, a wrong key are refused and counted); faults of the copy path."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import pytest

from trainer.replicas import protocol as p
from trainer.replicas.client import HolderClient, start_holder

SECRET = "holder-test-secret-0123456789abcdef"


@pytest.fixture
def holder() -> Iterator[str]:
    proc, addr = start_holder("job-a", SECRET, 3, allow_debug=True)
    yield addr
    assert proc.stdin is not None
    proc.stdin.close()  # the parent's pipe closes: the holder leaves by itself
    assert proc.wait(10) == 0


def _rank(addr: str, gen: int = 3, job: str = "job-a") -> HolderClient:
    return HolderClient(addr, job, gen, p.generation_key(SECRET, gen))


def _agent(addr: str) -> HolderClient:
    return HolderClient(addr, "job-a", 0, SECRET.encode(), role=p.ROLE_AGENT)


def test_versions_keep_the_newest_two_and_a_rerun_drops_later_steps(holder: str) -> None:
    with _rank(holder) as c:
        for step in (1, 2, 3):
            c.put(0, step, 2, f"r0s{step}".encode() * 100)
        c.put(1, 3, 2, b"r1s3" * 100)
        assert sorted(c.inventory()) == [(0, 2, 2, 3), (0, 3, 2, 3), (1, 3, 2, 3)]
        assert c.get(0, 1) is None and c.get(0, 3) == (b"r0s3" * 100, 2)
        c.put(0, 2, 2, b"again" * 10)  # another run of step 2 (after a recovery from an older source)
        assert sorted(x[1] for x in c.inventory() if x[0] == 0) == [2]


def test_certified_steps_free_the_older_versions_at_most_two_per_rank(holder: str) -> None:
    """What a rank's buddy keeps at k = 1: the newest step every rank finished copying, and the one arriving."""
    body = b"x" * 1000
    with _rank(holder) as c:
        c.put(0, 1, 2, body)
        c.put(1, 1, 2, body)
        c.put(0, 2, 2, body, certified=1)  # step 1 is complete on every rank: nothing older is needed
        c.put(1, 2, 2, body, certified=1)
        assert sorted(c.inventory()) == [(0, 1, 2, 3), (0, 2, 2, 3), (1, 1, 2, 3), (1, 2, 2, 3)]
        c.put(0, 3, 2, body, certified=2)  # drops step 1 of both ranks before step 3 arrives
        assert sorted(c.inventory()) == [(0, 2, 2, 3), (0, 3, 2, 3), (1, 2, 2, 3)]
        assert c.stats()["peak_bytes"] == 4 * len(body)  # 2 ranks x (certified + arriving)
        assert c.commit(3, 2) == len(body)  # no put follows at once (k > 1): the commit frees rank 0's step 2
        # rank 1's copy of step 3 has not arrived here (its node was lost mid-copy): it keeps its step 2
        assert sorted(c.inventory()) == [(0, 3, 2, 3), (1, 2, 2, 3)]
        c.put(2, 2, 3, body)  # a rank of a larger, older world (a resharded resume left it)
        c.put(0, 4, 2, body, certified=3)
        assert sorted(c.inventory()) == [(0, 3, 2, 3), (0, 4, 2, 3), (1, 2, 2, 3)]


def test_refused_and_counted_another_job_an_old_generation_a_wrong_key(holder: str) -> None:
    with _agent(holder) as a:
        a.set_generation(4)
    with pytest.raises(p.ProtocolError, match="stale_generation"):
        _rank(holder, gen=3)  # the key of the previous generation: refused
    with pytest.raises(p.ProtocolError, match="bad_mac"):
        HolderClient(holder, "job-a", 4, b"x" * 32)
    with pytest.raises(p.ProtocolError):
        _rank(holder, gen=4, job="job-b")
    with pytest.raises(p.ProtocolError, match="bad_mac"):  # a rank's key does not make it the agent
        HolderClient(holder, "job-a", 4, p.generation_key(SECRET, 4), role=p.ROLE_AGENT)
    with _rank(holder, gen=4) as c:
        c.put(0, 7, 1, b"ok")
        assert c.stats()["refused"]["stale_generation"] == 1 and c.stats()["refused"]["bad_mac"] == 2
        with pytest.raises(p.ProtocolError, match="refused"):
            c.set_generation(9)  # only the agent moves the generation


def test_a_copy_cut_off_midway_leaves_nothing_and_a_bad_checksum_is_refused(holder: str) -> None:
    with _rank(holder) as c:
        c.put(0, 5, 1, b"complete" * 1000)
    c = _rank(holder)
    c.sock.sendall(p.encode_frame({"op": "put", "rank": 0, "step": 6, "world_size": 1, "nbytes": 8000, "crc": 1}))
    c.sock.sendall(b"half" * 500)  # the buddy vanishes in the middle of the copy
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    with _rank(holder) as c:
        assert [x[1] for x in c.inventory()] == [5]  # step 6 is absent, not half there
        with pytest.raises(p.ProtocolError, match="checksum"):
            c.put(0, 6, 1, b"data", crc=12345)
        assert [x[1] for x in c.inventory()] == [5]


def test_a_replica_that_fails_its_checksum_is_not_served_as_good(holder: str) -> None:
    body = os.urandom(4096)
    with _rank(holder) as c:
        c.put(0, 5, 1, body)
    with _agent(holder) as a:
        assert a.corrupt(0, 5)  # a bit flips in the holder's memory
    with _rank(holder) as c, pytest.raises(p.ProtocolError, match="checksum mismatch"):
        c.get(0, 5)


def test_hostile_frames_do_not_crash_the_holder(holder: str) -> None:
    for junk in (b"\xff\xff\xff\xff", p.LEN.pack(5) + b"notjs", p.encode_frame({"op": "auth", "job": ["x"]})):
        with socket.create_connection(p_addr(holder)) as s:
            p.recv_header(s)
            s.sendall(junk)
            s.settimeout(5)
            with contextlib.suppress(OSError):
                s.recv(100)
    with _rank(holder) as c:
        c.put(0, 1, 1, b"still serving")
        with pytest.raises(p.ProtocolError):
            c.put(3, 1, 2, b"rank beyond the world")


def p_addr(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host, int(port)
