"""A replica's bytes in-process (one rank, no process group): the staging buffer is planned once and refilled
in place, the bytes restore the state bitwise, a replica can carry no code, and damaged bytes are refused."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

from trainer.replicas import snapshot


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    osd = opt.state_dict()["state"]
    return [*(v.clone() for v in model.state_dict().values()),
            *(osd[i][k].clone() for i in sorted(osd) for k in sorted(osd[i]))]


def test_one_plan_refilled_in_place_and_a_bitwise_restore() -> None:
    model, opt = _model()
    stager = snapshot.Stager()
    bodies = []
    for step in (1, 2, 3):
        _step(model, opt)
        snap = stager.capture(step, model, opt, {"step": step, "data": {"next_sample": 6 * step}})
        bodies.append(snapshot.encode(snap))
        if step == 2:
            expected, rng = _state(model, opt), torch.rand(4)
    assert stager.rebuilt == 1  # the same tensors: the buffer planned once, refilled by each capture
    other, other_opt = _model(seed=1)
    _step(other, other_opt)
    torch.manual_seed(123)
    extra = snapshot.restore(bodies[1], other, other_opt)
    assert extra["step"] == 2 and extra["data"] == {"next_sample": 12}
    assert all(torch.equal(a, b) for a, b in zip(_state(other, other_opt), expected, strict=True))
    assert torch.equal(torch.rand(4), rng)  # the RNG as it was after step 2's capture
    assert other_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_replaced_optimizer_state_is_followed() -> None:
    model, opt = _model()
    stager = snapshot.Stager()
    _step(model, opt)
    stager.capture(1, model, opt, {"step": 1})
    opt.load_state_dict(opt.state_dict() | {"state": {i: {k: v.clone() + 1 for k, v in e.items()}
                                                        for i, e in opt.state_dict()["state"].items()}})
    body = snapshot.encode(stager.capture(2, model, opt, {"step": 2}))  # new tensors, the same layout
    assert stager.rebuilt == 1
    saved = snapshot.decode(body)
    live = opt.state_dict()["state"]
    assert all(torch.equal(saved["optim"]["state"][i][k], live[i][k]) for i in live for k in live[i])


def test_state_that_is_not_plain_data_fails_at_capture() -> None:
    model, opt = _model()
    _step(model, opt)

    class Opaque:
        pass

    with pytest.raises(TypeError, match="plain containers"):
        snapshot.Stager().capture(1, model, opt, {"step": 1, "user": {"x": Opaque()}})


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, ("true",)


def test_a_replica_carries_no_code_and_damage_is_refused() -> None:
    model, opt = _model()
    _step(model, opt)
    snap = snapshot.Stager().capture(1, model, opt, {"step": 1})
    body = snapshot.encode(snap)
    evil = snapshot.Snapshot(1, snap.region, snap.static, pickle.dumps({"extra": _Evil()}))
    with pytest.raises(ValueError, match="global .*system refused"):
        snapshot.decode(snapshot.encode(evil))
    for bad in (body[:-1], body[:20], b"ORR1" + body[4:], body + b"x"):
        with pytest.raises(ValueError, match="not a replica"):
            snapshot.decode(bad)
    out = io.BytesIO()
    torch.save({"not": "a replica"}, out)
    with pytest.raises(ValueError, match="not a replica"):
        snapshot.decode(out.getvalue())
