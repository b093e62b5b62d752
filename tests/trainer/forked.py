"""Rank processes forked from one process that imported torch and transformers once (the Hugging Face tests).

A rank of a Hugging Face job spends most of its CPU importing torch, transformers and datasets (about 8 s on
a shared 2-core host); the tests start a dozen of them. Here the imports happen once, in multiprocessing's
fork server (``PRELOAD``), and every rank is a fresh process forked from it: its own pid, signals, gloo
process group, exit code and stdout, its environment replaced and its program run as ``__main__`` (runpy),
as the agent's warm processes do (agent/warm.py). What runs is the same program as ``python -m trainer`` or
``python script.py``; only the interpreter start and imports are shared.

``ForkedGeneration`` is ``helpers.Generation`` with forked ranks (same methods, same reports);
``notice_and_resume_elsewhere`` and ``assert_exactly_once`` are the spot job's story the script tests tell with
them. ``call(fn, ...)``
runs a function in such a process and returns its result: the tests' own Hugging Face work (building a model,
checking an export) runs there, so that the test process never imports transformers a second time. The server
also does once what every rank would repeat (``tests.trainer.hf_warm``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import runpy
import shutil
import signal
import socket
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.trainer.helpers import REPO, Generation, Rank, step_records, trainer_env
from trainer import contract
from trainer.launch import free_port, rank_env

PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.trainer", "datasets", "tokenizers",
           "safetensors.torch", "accelerate", "trainer.gpt", "trainer.lib", "trainer.hf.build", "trainer.hf.callback",
           "trainer.hf.accelerate", "trainer.hf.export", "tests.trainer.hf_fixtures", "tests.trainer.hf_warm"]

_ctx: Any = None


def _context() -> Any:
    global _ctx
    if _ctx is None:
        _ctx = multiprocessing.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def _run(argv: list[str], env: dict[str, str], cwd: str, out: socket.socket) -> None:
    """In the forked rank: stdout and stderr to ``out``, the environment replaced, ``argv`` as __main__."""
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    out.close()
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or torch.get_num_threads()))  # read at import otherwise
    if argv[1:2] == ["-m"]:
        sys.argv = argv[2:]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[1])))
        runpy.run_path(argv[1], run_name="__main__")
    sys.stdout.flush()
    sys.stderr.flush()


class _Proc:
    """The part of ``subprocess.Popen`` that ``Generation`` uses, over a forked process."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        mine, theirs = socket.socketpair()
        self.p = _context().Process(target=_run, args=(argv, env, cwd, theirs), daemon=True)
        self.p.start()
        theirs.close()
        self.pid = self.p.pid
        self.stdout = mine.makefile("r", encoding="utf-8", errors="replace")
        mine.close()

    @property
    def returncode(self) -> int | None:
        return self.p.exitcode

    def poll(self) -> int | None:
        return self.p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        self.p.join(timeout)
        if self.p.exitcode is None:
            raise subprocess.TimeoutExpired("forked rank", timeout or 0)
        return self.p.exitcode

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedGeneration(Generation):
    """``Generation`` whose ranks are forked from the preloaded fork server instead of exec'd."""

    def __init__(self, cmd: list[str], world_size: int, env: dict[str, str]) -> None:  # noqa: D107
        port = free_port()
        base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **env}
        self.ranks = []
        for r in range(world_size):
            rank = Rank(_Proc(cmd, rank_env(r, world_size, port, base), str(REPO)))  # type: ignore[arg-type]
            rank.reader = threading.Thread(target=self._read, args=(rank,), daemon=True)
            rank.reader.start()
            self.ranks.append(rank)


def _call(fn: Callable[..., Any], args: tuple[Any, ...], conn: Any) -> None:
    try:
        conn.send((True, fn(*args)))
    except BaseException:  # its traceback goes back to the test
        conn.send((False, traceback.format_exc()))


def call(fn: Callable[..., Any], *args: Any, timeout: float = 180.0) -> Any:
    """``fn(*args)`` (a module-level function; arguments and result picklable) in a process forked from the
    preloaded server; a failure there fails the test with the child's traceback."""
    ctx = _context()
    mine, theirs = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_call, args=(fn, args, theirs), daemon=True)
    p.start()
    theirs.close()
    try:
        if not mine.poll(timeout):
            raise AssertionError(f"{fn.__name__} did not return within {timeout} s")
        ok, value = mine.recv()
    finally:
        p.kill()
        p.join()
    if not ok:
        raise AssertionError(f"{fn.__name__} failed in the forked process:\n{value}")
    return value


@dataclasses.dataclass
class Resumed:
    """A job noticed on "node A" and resumed on "node B" (``notice_and_resume_elsewhere``)."""

    stop: int  # the step both ranks committed at the notice
    counted: list[contract.StepRecord]  # the trajectory that counts: gen 0 up to its commit, then gen 1
    records: list[contract.StepRecord]  # every step either generation logged
    resumed: ForkedGeneration  # node B's generation, exited


def notice_and_resume_elsewhere(cmd: Callable[[Path], list[str]], tmp: Path, ranks: int, total: int, *,
                                at_step: int, tell: list[int]) -> Resumed:
    """The job ``cmd(work_dir)`` on ``ranks`` forked ranks in "node A"'s work directory, noticed (only ranks
    ``tell`` signalled) once rank 0 reported ``at_step``: every rank exits 75 with the same step committed within
    the notice's deadline to a root outside the node. Node A's directory is deleted; "node B", in another one,
    resumes from the root alone (``resumed_from`` that step) and finishes."""
    root = f"file://{tmp / 'store' / 'ckpt'}"
    node_a, node_b = tmp / "node-a", tmp / "node-b"
    node_a.mkdir()
    node_b.mkdir()
    g = ForkedGeneration(cmd(node_a), ranks, trainer_env(node_a, total_steps=total, args={}, ckpt_url=root))
    g.wait_step(at_step, timeout=120)
    g.request_checkpoint(node_a / "control0", ranks=tell, deadline_s=20.0)
    assert g.wait() == [contract.EXIT_PREEMPTED] * ranks, g.log()
    stops = [r for r in g.reports(contract.CheckpointReport) if r.emergency]
    assert len(stops) == ranks and {r.step for r in stops} == {stops[0].step} and at_step <= stops[0].step < total
    assert all(r.deadline_margin_s is not None and r.deadline_margin_s > 0 for r in stops)  # within the notice
    stop = stops[0].step
    records = step_records(node_a / "steps.jsonl")
    shutil.rmtree(node_a)  # node A is gone with everything it wrote locally
    b = ForkedGeneration(cmd(node_b), ranks, trainer_env(node_b, total_steps=total, args={}, ckpt_url=root,
                                                         resume="latest", generation=1))
    assert b.wait() == [0] * ranks, b.log()
    assert any(f"resumed_from dir={root}/step_{stop:09d} step={stop}" in ln for ln in b.ranks[0].lines), b.log()
    records += step_records(node_b / "steps.jsonl")
    assert [r.step for r in records if r.generation == 0 and r.step > stop] == []  # nothing ran past the stop
    counted = [r for r in records if (r.generation == 0 and r.step <= stop) or r.generation == 1]
    return Resumed(stop, counted, records, b)


def assert_exactly_once(counted: list[contract.StepRecord], total: int, samples: int, batch: int) -> None:
    """Every step once per rank, ``batch`` samples each, and over ``total`` steps every sample id (``epoch *
    samples + index``) once: none twice, none skipped."""
    steps = Counter((r.step, r.rank) for r in counted)
    assert sorted({s for s, _ in steps}) == list(range(1, total + 1)) and set(steps.values()) == {1}, steps
    assert all(len(r.sample_ids) == batch for r in counted)
    fed = Counter(i for r in counted for i in r.sample_ids)
    epochs = total * len({r.rank for r in counted}) * batch // samples
    assert set(fed) == set(range(epochs * samples)) and set(fed.values()) == {1}, fed
