"""Files the Hugging Face tests build locally (nothing is downloaded): a tiny Llama saved with
``save_pretrained`` (safetensors) with a BPE tokenizer trained here, and jsonl / text datasets; the check of an
export. What needs transformers runs in a process forked from the tests' fork server (``forked.call``), which has
it imported already."""

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


def check_export(ckpt: Path, tmp: Path, initial_dir: Path) -> None:
    """``python -m trainer.export`` of the job's root writes safetensors whose logits equal those of the trained
    weights read from the DCP shards by DCP's own converter (not the export's code path), and differ from the
    initial model's. Asserts; run it in a forked process (``tests.trainer.forked.call``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.trainer.helpers import flatten, load_checkpoint_tensors
    from trainer.export import main as export_main

    out = tmp / "export"
    assert export_main([f"file://{ckpt.parent}", str(out)]) == 0  # the root: its newest committed checkpoint
    assert (out / "model.safetensors").exists() and not list(out.glob("*.bin"))
    exported = AutoModelForCausalLM.from_pretrained(str(out), use_safetensors=True).eval()
    tensors = {k[len("model."):]: v for k, v in flatten(load_checkpoint_tensors(ckpt, tmp / "c.pt")).items()
               if k.startswith("model.")}
    reference = AutoModelForCausalLM.from_config(exported.config).eval()
    reference.load_state_dict(tensors)
    initial = AutoModelForCausalLM.from_pretrained(str(initial_dir)).eval()
    ids = AutoTokenizer.from_pretrained(str(out))("The ship and the sea.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = exported(ids).logits, reference(ids).logits
        assert torch.equal(a, b)
        assert not torch.equal(a, initial(ids).logits)  # the export holds the trained weights, not the initial
