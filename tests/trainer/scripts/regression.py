"""A non-GPT training script that uses the trainer library in a few lines (driven by the tests).

Trains a small MLP on a synthetic regression set; args come from ORCH_TRAINER_ARGS like the built-in
trainer's. Everything about preemption, checkpoints and exact data order is trainer.lib's.
"""

import json
import os

from trainer.signals import install_early

install_early()  # first: keep checkpoint signals that arrive while torch imports

import torch  # noqa: E402

from trainer.data import ExactlyOnceSampler  # noqa: E402
from trainer.lib import Session  # noqa: E402


def main() -> None:
    a = json.loads(os.environ.get("ORCH_TRAINER_ARGS") or "{}")
    sess = Session.from_env(device="cpu", ckpt_every=a.get("ckpt_every", 0), async_mode=a.get("async_mode", "thread"),
                            storage_options=a.get("storage_options"))
    g = torch.Generator().manual_seed(0)
    X = torch.randn(512, 8, generator=g)
    y = X @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(512, 1, generator=g)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model = sess.wrap(net, mode=a.get("mode", "ddp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = ExactlyOnceSampler(len(X), global_batch=8, seed=1)

    with sess.guard():
        for step in sess.steps(model, opt, sampler=sampler):
            ids = sampler.next_step(sess.rank, sess.world_size)
            idx = torch.tensor([c for _, c in ids], dtype=torch.long)
            share = ((model(X[idx]) - y[idx]) ** 2).sum() / sampler.global_batch  # this rank's part of the mean
            (share * sess.world_size).backward()  # DDP averages over ranks
            opt.step()
            opt.zero_grad()
            sess.step_done(step, loss=share.item() * sess.world_size, sample_ids=[i for i, _ in ids])


if __name__ == "__main__":  # required by process-based async checkpointing (spawn)
    main()
