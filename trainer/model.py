"""GPT-style decoder (pre-norm, SDPA causal attention, GELU MLP) with named sizes.

Role: the model of the built-in trainer. Pure torch, no distributed code: trainer.dist wraps it
(FSDP2 per block, then the root; or DDP). Byte-level vocabulary (256) by default.

Sizes go from "tiny" (a step in ~0.1 s on 2 CPU cores) to "1.3b" (GPT-3 XL shape: 24 layers, d=2048).
No dropout: the step is a deterministic function of (parameters, batch), which the bitwise-resume test
relies on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True, slots=True)
class GPTConfig:
    n_layer: int
    n_head: int
    d_model: int
    seq_len: int = 64
    vocab_size: int = 256
    activation_checkpointing: bool = False

    def n_params(self) -> int:
        d, v, s, L = self.d_model, self.vocab_size, self.seq_len, self.n_layer
        per_block = 12 * d * d + 13 * d  # qkv+proj (4d^2+4d), mlp (8d^2+5d), 2 layernorms (4d)
        return v * d + s * d + L * per_block + 2 * d + d * v  # emb, pos, blocks, final ln, head

    def flops_per_token(self) -> float:
        """Training FLOPs per token, PaLM appendix B: 6N (N = matmul parameters: blocks + head) plus
        12 * n_layer * d_model * seq_len for attention scores (full matrix, as PaLM counts it)."""
        n_matmul = self.n_layer * 12 * self.d_model**2 + self.d_model * self.vocab_size
        return 6.0 * n_matmul + 12.0 * self.n_layer * self.d_model * self.seq_len


SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=2, n_head=2, d_model=32),
    "mini": dict(n_layer=4, n_head=4, d_model=128),
    "small": dict(n_layer=6, n_head=6, d_model=384),
    "125m": dict(n_layer=12, n_head=12, d_model=768),
    "350m": dict(n_layer=24, n_head=16, d_model=1024),
    "760m": dict(n_layer=24, n_head=16, d_model=1536),
    "1.3b": dict(n_layer=24, n_head=16, d_model=2048),
}


def config_for(size: str, seq_len: int, activation_checkpointing: bool = False) -> GPTConfig:
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SIZES)}")
    return GPTConfig(seq_len=seq_len, activation_checkpointing=activation_checkpointing, **SIZES[size])


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.activation_checkpointing = cfg.activation_checkpointing

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and self.training:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                if name.endswith("weight"):  # layernorm gain
                    p.fill_(1.0)
                else:
                    p.zero_()
            elif name.endswith(("attn.proj.weight", "out.weight")):
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.n_layer))  # GPT-2 residual scaling
            else:
                p.normal_(0.0, std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies per sample, in fp32: shape (batch,)."""
    b, t, v = logits.shape
    ce = F.cross_entropy(logits.float().reshape(b * t, v), targets.reshape(b * t), reduction="none")
    return ce.view(b, t).sum(dim=1)
