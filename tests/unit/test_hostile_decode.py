"""Hostile bytes at the codec and the pipeline's admission: deep nesting, oversize, decoder surprises.

msgspec reports JSON nested beyond the interpreter's recursion limit as ``RecursionError`` (not
``DecodeError``); ``wire.codec.decode`` maps it to ``WireError("too_deep")`` so every user of the codec
(orchd, the agent) rejects such a message instead of dying on it. The pipeline's ``admit_*`` functions
turn any other exception of decode or screen into a rejection.
"""

from __future__ import annotations

import time

import pytest

import wire as ev
from orchestrator.daemon import admit


def deep(depth: int = 1000) -> bytes:
    """A well-formed heartbeat with an ignored field nested ``depth`` levels: ~2 KB at 1,000."""
    hb = ev.encode(ev.Heartbeat(node_id="n1", seq=1, ts=time.time(), state=ev.AgentState.TRAINING))
    return b'{"zz":' + b"[" * depth + b"]" * depth + b"," + hb[1:]


@pytest.mark.parametrize("kind", [ev.Heartbeat, ev.PriceTick, ev.NodeEvent, None])
def test_decode_maps_deep_nesting_to_too_deep(kind: object) -> None:
    data = deep()
    assert len(data) < 2500
    with pytest.raises(ev.WireError) as e:
        if kind is None:
            ev.decode(data)
        else:
            ev.decode(data, kind)  # type: ignore[call-overload]
    assert e.value.reason == "too_deep"


def test_decode_rejects_oversize_before_parsing() -> None:
    data = b" " * (ev.MAX_MESSAGE_BYTES + 1)
    with pytest.raises(ev.WireError) as e:
        ev.decode(data, ev.Heartbeat)
    assert e.value.reason == "too_large"


def test_decode_still_accepts_moderate_nesting() -> None:
    hb = ev.decode(deep(50), ev.Heartbeat)
    assert hb.node_id == "n1"


def test_admission_rejects_deep_nesting_on_every_path() -> None:
    r = admit.admit_heartbeat("orch.node.n1.hb", deep())
    assert isinstance(r, admit.Rejected) and (r.kind, r.reason) == ("heartbeat", "too_deep")
    for subject, kind in (("orch.price.aws.us-east-1", "price"), ("orch.node.n1.event", "node_event"),
                          ("orch.notice.aws.n1", "notice"), ("orch.other", "other")):
        r2 = admit.admit_js(subject, deep())
        assert isinstance(r2, admit.Rejected) and (r2.kind, r2.reason) == (kind, "too_deep")


def test_any_exception_of_decode_or_screen_is_a_rejection(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: object) -> object:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(admit, "decode_heartbeat", boom)  # where admit_* find it
    monkeypatch.setattr(admit, "decode_js", boom)
    r = admit.admit_heartbeat("orch.node.n1.hb", b"{}")
    assert isinstance(r, admit.Rejected) and r.reason == "undecodable" and "RecursionError" in r.detail
    r2 = admit.admit_js("orch.price.aws.r1", b"{}")
    assert isinstance(r2, admit.Rejected) and (r2.kind, r2.reason) == ("price", "undecodable")
    monkeypatch.undo()

    def bad_screen(*_a: object) -> None:
        raise TypeError("screen bug")

    monkeypatch.setattr(admit, "screen_heartbeat", bad_screen)
    hb = ev.encode(ev.Heartbeat(node_id="n1", seq=1, ts=time.time(), state=ev.AgentState.TRAINING))
    r3 = admit.admit_heartbeat("orch.node.n1.hb", hb)
    assert isinstance(r3, admit.Rejected) and r3.reason == "unscreenable"
