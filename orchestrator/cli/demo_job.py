"""The demo's job: which model it trains (``orchctl demo --model``) and the extras that needs on this host.

- ``gpt-tiny`` (default): the built-in GPT (``size = "tiny"``), needs the ``[trainer]`` extra (torch);
- ``llama-tiny``: a Hugging Face Llama built from the config shipped with the trainer
  (``builtin://llama-tiny``, byte tokenizer, the built-in text) under the same FSDP2 trainer; needs the
  ``[hf]`` extra as well.

The demo runs its nodes on this host, so what the ranks will import must be importable here (extras.py says
which extra is missing; nothing is imported: orchctl stays torch-free).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from orchestrator.cli import extras

MODELS: dict[str, dict[str, str | int | float | bool]] = {
    "gpt-tiny": {"size": "tiny"},
    "llama-tiny": {"model": "builtin://llama-tiny", "tokenizer": "bytes", "seq_len": 64, "global_batch": 8,
                   "micro_batch": 4},
}


def missing_extra(model: str) -> str | None:
    """What to install before the demo can train ``model`` on this host (None: nothing)."""
    return extras.missing(f"orchctl demo --model {model}", hf=model != "gpt-tiny")


def demo_jobspec(state_dir: Path, opts: Any) -> Any:
    """The demo's job (a wire JobSpec): ``opts.spec`` when given, else the model ``opts.model`` on
    ``opts.nodes`` local nodes, checkpoints under the state directory."""
    from wire import CheckpointPolicy, JobSpec, MarketPolicy, TrainerSpec

    if opts.spec is not None:
        return opts.spec
    if opts.model not in MODELS:
        raise ValueError(f"model: {opts.model!r} is not one of {', '.join(sorted(MODELS))}")
    return JobSpec(
        name=f"{opts.model}-demo",
        trainer=TrainerSpec(args={**MODELS[opts.model], "seed": opts.seed},
                            env={"ORCH_COLLECTIVE_TIMEOUT_S": "10", "OMP_NUM_THREADS": "1"}),
        total_steps=opts.steps, step_time_s_estimate=0.3, gpu_type="cpu", gpus_per_node=1,
        nodes=opts.nodes, nodes_min=min(opts.nodes_min, opts.nodes), nodes_max=opts.nodes, clouds=("local",),
        market=MarketPolicy.SPOT_WITH_FALLBACK,
        checkpoint=CheckpointPolicy(url=f"file://{state_dir / 'checkpoints'}", interval_s=opts.ckpt_interval_s,
                                    save_s_estimate=1.0, replica_every=opts.replica_every or msgspec.UNSET),
    )
