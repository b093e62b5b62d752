"""One rank of a blocking (emergency-path) save with several writer threads, then a load into a model
initialised differently: prints ``parallel_save files=<n> tensors=<n> bitexact=<bool>`` for the test.

    ORCH_* / RANK env as the agent sets it; argv: <root url> <save threads>
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.tensor import DTensor

from trainer import dist as tdist
from trainer import store
from trainer.checkpoint import CheckpointManager
from trainer.model import GPT, config_for


def local_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of every parameter and optimizer state tensor, copied."""
    out = {f"p.{n}": p for n, p in model.named_parameters()}
    for i, st in enumerate(opt.state.values()):
        out.update({f"o{i}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in out.items()}


def build(info: tdist.DistInfo, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = tdist.wrap_fsdp(GPT(config_for("tiny", 16)), info, bf16=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 256, (2, 17))
    model(tokens[:, :-1]).float().mean().backward()
    opt.step()
    return model, opt


def main() -> None:
    root, threads = sys.argv[1], int(sys.argv[2])
    info = tdist.init()
    model, opt = build(info, seed=1)
    saved = local_tensors(model, opt)
    mgr = CheckpointManager(root, info, keep=2, async_mode="off", thread_count=1, save_threads=threads,
                            job_id="par")
    res = mgr.save(7, model, opt, {"k": 1}, reason="emergency")
    model2, opt2 = build(info, seed=2)  # different values everywhere
    chosen = mgr.resolve("latest")
    assert chosen == res.dir_url, (chosen, res.dir_url)
    extra = mgr.load(chosen, model2, opt2)
    loaded = local_tensors(model2, opt2)
    exact = saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    marker = store.read_marker(chosen) or {}
    mine = [n for n in marker.get("files", {}) if n.startswith(f"__{info.rank}_") and n.endswith(".distcp")]
    print(f"parallel_save files={len(mine)} tensors={len(saved)} bitexact={exact} step={extra['step']}", flush=True)
    tdist.shutdown()


if __name__ == "__main__":
    main()
