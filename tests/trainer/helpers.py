"""Run real rank processes (subprocess, gloo on CPU) the way the agent does, and read their reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer import contract
from trainer.launch import free_port, rank_env

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Rank:
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def reports(self) -> list:
        return [r for r in map(contract.parse_report, self.lines) if r is not None]


class Generation:
    """One generation: ``world_size`` rank processes of ``cmd`` with ORCH_* env."""

    def __init__(self, cmd: list[str], world_size: int, env: dict[str, str]) -> None:
        port = free_port()
        base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **env}
        self.ranks: list[Rank] = []
        for r in range(world_size):
            proc = subprocess.Popen(cmd, env=rank_env(r, world_size, port, base), cwd=REPO, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1)
            rank = Rank(proc)
            rank.reader = threading.Thread(target=self._read, args=(rank,), daemon=True)
            rank.reader.start()
            self.ranks.append(rank)

    @staticmethod
    def _read(rank: Rank) -> None:
        assert rank.proc.stdout is not None
        for line in rank.proc.stdout:
            rank.lines.append(line.rstrip("\n"))

    def wait_step(self, step: int, timeout: float = 60.0, rank: int = 0) -> None:
        """Block until ``rank`` reported ``step`` (fails if it exited first)."""
        deadline = time.monotonic() + timeout
        r = self.ranks[rank]
        while time.monotonic() < deadline:
            if any(isinstance(x, contract.StepReport) and x.step >= step for x in r.reports()):
                return
            if r.proc.poll() is not None:
                raise AssertionError(f"rank {rank} exited {r.proc.returncode} before step {step}:\n" + self.log())
            time.sleep(0.005)
        raise AssertionError(f"timeout waiting for step {step}:\n" + self.log())

    def request_checkpoint(self, control_dir: Path, *, ranks: list[int] | None = None, deadline_s: float = 30.0,
                           sig: int = signal.SIGUSR1) -> None:
        now = time.time()
        contract.write_checkpoint_request(str(control_dir), contract.CheckpointRequest(
            request_id=f"t{now}", reason="preemption_notice", deadline_ts=now + deadline_s, issued_ts=now))
        for i in ranks if ranks is not None else range(len(self.ranks)):
            self.ranks[i].proc.send_signal(sig)

    def wait(self, timeout: float = 120.0) -> list[int]:
        codes = []
        for r in self.ranks:
            try:
                codes.append(r.proc.wait(timeout=timeout))
            except subprocess.TimeoutExpired as e:
                for x in self.ranks:
                    x.proc.kill()
                raise AssertionError("generation did not exit:\n" + self.log()) from e
            assert r.reader is not None
            r.reader.join(timeout=10)
        return codes

    def log(self) -> str:
        return "\n".join(f"[{i}] {line}" for i, r in enumerate(self.ranks) for line in r.lines[-60:])

    def reports(self, kind: type) -> list:
        return [x for r in self.ranks for x in r.reports() if isinstance(x, kind)]


def trainer_env(tmp: Path, *, total_steps: int, args: dict, resume: str = "", generation: int = 0,
                ckpt_url: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    control = tmp / f"control{generation}"
    control.mkdir(exist_ok=True)
    return {
        contract.ENV_CKPT_URL: ckpt_url or f"file://{tmp / 'ckpt'}",
        contract.ENV_RESUME_FROM: resume,
        contract.ENV_TOTAL_STEPS: str(total_steps),
        contract.ENV_CONTROL_DIR: str(control),
        contract.ENV_STEP_LOG: str(tmp / "steps.jsonl"),
        contract.ENV_GENERATION: str(generation),
        contract.ENV_COLLECTIVE_TIMEOUT_S: "20",
        contract.ENV_TRAINER_ARGS: json.dumps(args),
        **(extra or {}),
    }


GPT_CMD = [sys.executable, "-m", "trainer"]


def step_records(path: Path) -> list[contract.StepRecord]:
    import msgspec

    return [msgspec.json.decode(line, type=contract.StepRecord)
            for line in path.read_text().splitlines() if line.strip()]


def load_checkpoint_tensors(dir_path: Path, out: Path) -> dict:
    """All tensors of a DCP checkpoint (model + optimizer), via DCP's own converter, no process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(dir_path), str(out))
    return torch.load(out, weights_only=False)


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
