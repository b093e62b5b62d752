"""Files the Hugging Face tests build locally (nothing is downloaded): a tiny Llama saved with
``save_pretrained`` (safetensors) with a BPE tokenizer trained here, and jsonl / text datasets."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.data import synthetic_corpus

LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)


def sentences(n: int, offset: int = 0) -> list[str]:
    text = synthetic_corpus().decode()
    out = [s.strip() + "." for s in text.split(". ") if s.strip()]
    return out[offset : offset + n]


def write_jsonl(path: Path, n: int = 400, column: str = "text") -> Path:
    with open(path, "w") as f:
        for i, s in enumerate(sentences(n)):
            f.write(json.dumps({"id": i, column: s}) + "\n")
    return path


def train_tokenizer(out: Path, vocab_size: int = 160) -> Path:
    """A byte-level BPE trained on the synthetic text, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sentences(2000), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(str(out))
    return out


def save_llama(out: Path, *, seed: int = 0, with_tokenizer: bool = True) -> Path:
    """A 2-layer Llama with random weights (seeded), saved with save_pretrained (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab = 320
    if with_tokenizer:
        tok_dir = train_tokenizer(out)
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(str(tok_dir)))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **LLAMA))
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def llama_config_json(path: Path, vocab_size: int = 256) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=vocab_size, **LLAMA).to_json_file(str(path))
    return path
