"""A small GPT-style transformer: the model the demo and the benchmarks train.

Pre-LayerNorm blocks of causal self-attention and a GELU MLP, learned positions, and (by
default) the output projection tied to the token embedding. Linear layers have no bias, so
every parameter is a weight matrix, an embedding or a LayerNorm affine.

Construction is deterministic: ``GPT(config, seed=s)`` gives the same weights for the same
``(config, s)`` on every machine, whatever the global torch RNG state, because the
initialisation draws from a private ``torch.Generator``. The model has no buffers: its state
dict is its parameters (plus the alias ``lm_head.weight`` when tied).

Pure torch: no I/O, no threads.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "GPTConfig"]


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """The shape of a ``GPT``.

    ``vocab_size`` tokens, sequences of at most ``context`` tokens, ``n_layers`` blocks of
    width ``d_model`` with ``n_heads`` heads (``d_model`` must be a multiple of it) and an MLP
    of width ``d_ff`` (``4 * d_model`` when None). ``ValueError`` names a field out of range.
    """

    vocab_size: int = 64
    context: int = 64
    d_model: int = 128
    n_layers: int = 5
    n_heads: int = 4
    d_ff: int | None = None
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.d_ff is not None and self.d_ff < 1:
            raise ValueError(f"GPTConfig.d_ff must be a positive integer or None, got {self.d_ff}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})"
            )

    @property
    def hidden(self) -> int:
        """The MLP's width."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @classmethod
    def small(cls, vocab_size: int = 64, context: int = 64) -> "GPTConfig":
        """About 1M parameters: the demo's model (d=128, 5 layers, 4 heads)."""
        return cls(vocab_size=vocab_size, context=context)

    @classmethod
    def medium(cls, vocab_size: int = 64, context: int = 128) -> "GPTConfig":
        """About 10M parameters (d=320, 8 layers, 5 heads): the benchmarks' larger model."""
        return cls(vocab_size=vocab_size, context=context, d_model=320, n_layers=8, n_heads=5)

    @classmethod
    def tiny(cls, vocab_size: int = 64, context: int = 32) -> "GPTConfig":
        """About 50k parameters (d=32, 2 layers): for tests that need a real but fast model."""
        return cls(vocab_size=vocab_size, context=context, d_model=32, n_layers=2, n_heads=2)


class _Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, length, self.n_heads, width // self.n_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: Tensor = self.proj(y.transpose(1, 2).reshape(batch, length, width))
        return out


class _Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = _Attention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.fc = nn.Linear(config.d_model, config.hidden, bias=False)
        self.out = nn.Linear(config.hidden, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        out: Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class GPT(nn.Module):
    """A decoder-only transformer over ``config.vocab_size`` tokens.

    ``forward(tokens)`` maps a ``[batch, length]`` int64 tensor (``length <= context``) to
    ``[batch, length, vocab_size]`` logits; ``loss(sequences)`` is the mean next-token
    cross-entropy in nats of ``[batch, length + 1]`` sequences.

    Weights are drawn from a generator seeded with ``seed``: normal(0, 0.02) for embeddings
    and linear layers, scaled by ``1/sqrt(2 * n_layers)`` for the projections that write to
    the residual stream; LayerNorms start at the identity.
    """

    def __init__(self, config: GPTConfig | None = None, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config if config is not None else GPTConfig()
        c = self.config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = nn.Embedding(c.context, c.d_model)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self._initialise(seed)

    @torch.no_grad()
    def _initialise(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                std = residual_std if name.endswith(("attn.proj.weight", "out.weight")) else 0.02
                param.copy_(torch.randn(param.shape, generator=generator) * std)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        if length > self.config.context:
            raise ValueError(
                f"sequence of {length} tokens is longer than the model's context "
                f"({self.config.context})"
            )
        positions = torch.arange(length, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.lm_head(self.ln_f(x))
        return logits

    def loss(self, sequences: Tensor) -> Tensor:
        """Mean cross-entropy (nats) of predicting ``sequences[:, 1:]`` from the prefixes."""
        logits = self(sequences[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), sequences[:, 1:].reshape(-1))

    def num_parameters(self) -> int:
        """Distinct trainable elements (a tied matrix counted once)."""
        return sum(p.numel() for p in self.parameters())
