"""A training script on the trainer library whose job has ``[tracking]`` (tests/integration/test_tracking_mlflow.py).

A tiny model on CPU; each step also sleeps ``step_time_s`` (ORCH_TRAINER_ARGS) so faults land mid-run, logs
the generation that ran it as an extra metric (``sess.log_metrics``), and rank 0 appends "generation step" to
the ``trace`` file: the steps each generation really executed, re-runs included.
"""

import json
import os
import time

from trainer.signals import install_early

install_early()  # first: keep checkpoint signals that arrive while torch imports

import torch  # noqa: E402

from trainer.lib import Session  # noqa: E402


def main() -> None:
    a = json.loads(os.environ.get("ORCH_TRAINER_ARGS") or "{}")
    sess = Session.from_env(device="cpu", ckpt_every=int(a.get("ckpt_every", 0)), async_mode="thread")
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    model = sess.wrap(net, mode="ddp")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.ones(8, 4)
    with sess.guard():
        for step in sess.steps(model, opt):
            loss = (model(x) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            time.sleep(float(a.get("step_time_s", 0.1)))
            sess.log_metrics(step, {"generation": float(sess.generation)})
            if sess.rank == 0 and a.get("trace"):
                with open(a["trace"], "a") as f:
                    f.write(f"{sess.generation} {step}\n")
            sess.step_done(step, loss=loss.item())


if __name__ == "__main__":
    main()
