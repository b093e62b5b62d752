"""A plain Hugging Face ``Trainer`` script, made a spot job by one line (``spot_train(trainer)``).

Trains a causal LM (a ``save_pretrained`` directory, or a tiny Llama from a config when none is given) on a
text column of a jsonl file (or the built-in synthetic text), packed into ``--seq-len`` blocks. Run by itself:

    python examples/hf_trainer/train.py --output-dir /tmp/out --max-steps 20

As a spot job (``trainer.command = ["python", "examples/hf_trainer/train.py"]``, ``trainer.integration = "hf"``)
the agent sets ``ORCH_CKPT_URL``, ``ORCH_RESUME_FROM``, ``ORCH_TOTAL_STEPS`` ...: a notice becomes a
checkpoint all ranks agree on, and the next generation resumes from it on any node.
"""

from trainer.signals import install_early

install_early()  # keep a checkpoint request that arrives while torch and transformers import

import argparse  # noqa: E402
import json  # noqa: E402

import datasets  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from trainer.hf.callback import spot_train  # noqa: E402


def texts(path: str) -> list[str]:
    if not path:
        from trainer.data import synthetic_corpus

        return [s + "." for s in synthetic_corpus(1 << 16).decode().split(". ") if s]
    with open(path) as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def blocks(rows: list[str], seq_len: int, limit: int) -> datasets.Dataset:
    """UTF-8 bytes as token ids, packed into seq_len blocks (labels = inputs: the model shifts them)."""
    stream = [b for t in rows for b in (t + "\n").encode()]
    n = min(limit, len(stream) // seq_len) if limit else len(stream) // seq_len
    ids = [stream[i * seq_len : (i + 1) * seq_len] for i in range(n)]
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="", help="a save_pretrained directory (default: a tiny Llama from a config)")
    p.add_argument("--data", default="", help="jsonl with a text column (default: built-in synthetic text)")
    p.add_argument("--output-dir", default="hf-out")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--samples", type=int, default=0, help="use only this many blocks (0: all)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--epochs", type=float, default=1.0)
    a = p.parse_args()
    torch.manual_seed(0)
    if a.model:
        model = AutoModelForCausalLM.from_pretrained(a.model, use_safetensors=True)
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    args = TrainingArguments(output_dir=a.output_dir, per_device_train_batch_size=a.batch, max_steps=a.max_steps,
                             num_train_epochs=a.epochs, learning_rate=3e-3, warmup_steps=2, logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=0,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=blocks(texts(a.data), a.seq_len, a.samples),
                      data_collator=default_data_collator)
    spot_train(trainer)  # the one added line: trainer.train() under the agent contract


if __name__ == "__main__":
    main()
