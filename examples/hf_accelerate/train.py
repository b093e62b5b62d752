"""A plain Accelerate training loop, made a spot job by ``SpotAccelerate`` (trainer.hf.accelerate).

Trains a causal LM (a tiny Llama from a config) on UTF-8 bytes of the built-in synthetic text (or a jsonl file's
``text`` column), packed into ``--seq-len`` blocks, with a shuffled ``DataLoader`` prepared by Accelerate. Run
by itself (one process, or ``accelerate launch`` / ``python -m trainer.launch --nproc 2 --``):

    python examples/hf_accelerate/train.py --samples 24 --batch 2

As a spot job (``trainer.command = ["python", "examples/hf_accelerate/train.py"]``, ``trainer.integration = "hf"``)
the agent sets ``ORCH_CKPT_URL``, ``ORCH_RESUME_FROM``, ``ORCH_TOTAL_STEPS`` ...: a notice becomes a checkpoint
all ranks agree on, and the next generation resumes from it on any node, at the same batch.

The lines marked ``# spot`` are what the loop gained; the sample ids it passes (``epoch * len(dataset) + index``)
only feed the step log's exactly-once check.
"""

from trainer.signals import install_early

install_early()  # spot: keep a checkpoint request that arrives while torch and transformers import

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, get_linear_schedule_with_warmup  # noqa: E402

from trainer.hf.accelerate import SpotAccelerate  # noqa: E402


def texts(path: str) -> list[str]:
    if not path:
        from trainer.data import synthetic_corpus

        return [s + "." for s in synthetic_corpus(1 << 16).decode().split(". ") if s]
    with open(path) as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def blocks(rows: list[str], seq_len: int, limit: int) -> list[dict[str, torch.Tensor]]:
    """UTF-8 bytes as token ids, packed into seq_len blocks, each with its index."""
    stream = [b for t in rows for b in (t + "\n").encode()]
    n = min(limit, len(stream) // seq_len) if limit else len(stream) // seq_len
    return [{"input_ids": torch.tensor(stream[i * seq_len : (i + 1) * seq_len]), "idx": torch.tensor(i)}
            for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="", help="jsonl with a text column (default: built-in synthetic text)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--samples", type=int, default=0, help="use only this many blocks (0: all)")
    p.add_argument("--batch", type=int, default=2, help="per process")
    p.add_argument("--max-steps", type=int, default=20, help="unless ORCH_TOTAL_STEPS says")
    a = p.parse_args()
    spot = SpotAccelerate(total_steps=a.max_steps)  # spot: before Accelerator(); ORCH_TOTAL_STEPS wins
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    set_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    data = blocks(texts(a.data), a.seq_len, a.samples)
    loader = DataLoader(data, batch_size=a.batch, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, spot.total_steps * accelerator.num_processes)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    for step, batch in spot.steps(model, optimizer, loader, scheduler=scheduler):  # spot: resumes exactly
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        ids = [spot.epoch * len(data) + int(i) for i in batch["idx"]]
        spot.step(step, loss=loss.item(), sample_ids=ids)  # spot: the agreement; a notice -> commit, exit 75
    accelerator.print(json.dumps({"accelerate_loop": "done", "distributed": str(accelerator.distributed_type)}))


if __name__ == "__main__":
    main()
