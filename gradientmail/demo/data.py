"""The demo's data: a synthetic language whose entropy rate is known exactly, or a text file.

``MarkovSource`` is a sparse random Markov chain of order ``order`` over ``vocab`` tokens,
generated from a seed: each state (the last ``order`` tokens) has ``branching`` distinct
successor tokens with Dirichlet-drawn probabilities. Its stationary distribution ``π`` and
its entropy rate ``H = Σ_s π(s) H(P(·|s))`` (nats) are computed exactly, so the lowest mean
cross-entropy any model can reach on its sequences is known (``loss_floor``).

A ``Corpus`` is what a learner trains on: the vocabulary size, the floor (None for a text
file), one independent stream of training batches per learner shard, and a fixed evaluation
set. ``synthetic(...)`` and ``text_file(path)`` build one. Batches are ``[batch, length + 1]``
int64 tensors: a model sees ``[:, :-1]`` and predicts ``[:, 1:]``.

Randomness comes only from private ``torch.Generator`` objects seeded from
``(seed, purpose, index)``, so every stream is reproducible and independent of the global
RNG and of other streams. Pure torch: no I/O except reading the text file.
"""

import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

__all__ = ["Corpus", "MarkovSource", "evaluate", "synthetic", "text_file"]


def _generator(seed: int, purpose: str, index: int = 0, stream: int = 0) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{purpose}/{index}/{stream}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)


def _entropy(p: Tensor) -> Tensor:
    """Entropy in nats along the last axis (0 log 0 = 0)."""
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)


@dataclass(frozen=True, eq=False)
class MarkovSource:
    """A Markov chain over tokens with exactly known entropy.

    States are the last ``order`` tokens, numbered in base ``vocab`` (oldest token most
    significant). ``successors[s]`` are the ``branching`` tokens that may follow state ``s``
    and ``probs[s]`` their probabilities (float64). ``stationary`` is a stationary
    distribution of the chain over states: the limit of the lazy chain started uniform, so it
    exists even if the chain is periodic or reducible, and sequences started from it are
    stationary processes.
    """

    vocab: int
    order: int
    successors: Tensor
    probs: Tensor
    stationary: Tensor

    @classmethod
    def generate(
        cls,
        *,
        vocab: int = 64,
        order: int = 1,
        branching: int = 4,
        concentration: float = 1.0,
        seed: int = 0,
    ) -> "MarkovSource":
        """Draw a chain from ``seed``: for every state, ``branching`` distinct successors
        uniformly without replacement and their probabilities from a symmetric Dirichlet of
        ``concentration``. ``ValueError`` names an argument out of range."""
        if vocab < 2 or order < 1 or not 1 <= branching <= vocab:
            raise ValueError(
                f"need vocab >= 2, order >= 1 and 1 <= branching <= vocab; got vocab={vocab}, "
                f"order={order}, branching={branching}"
            )
        if vocab**order > 1 << 20:
            raise ValueError(f"vocab**order = {vocab**order} states is too many (max 2**20)")
        if not concentration > 0:
            raise ValueError(f"concentration must be positive, got {concentration}")
        generator = _generator(seed, "markov")
        states = vocab**order
        successors = torch.rand(states, vocab, generator=generator).argsort(dim=1)[:, :branching]
        probs = _dirichlet(states, branching, concentration, generator)
        stationary = _stationary(successors, probs, vocab)
        return cls(vocab, order, successors, probs, stationary)

    @property
    def states(self) -> int:
        return int(self.successors.shape[0])

    def _next_state(self, state: Tensor, token: Tensor) -> Tensor:
        return (state * self.vocab + token) % self.states

    @property
    def entropy_rate(self) -> float:
        """``H = Σ_s π(s) H(P(·|s))`` in nats per token."""
        return float((self.stationary * _entropy(self.probs)).sum())

    def block_entropy(self, n: int) -> float:
        """The entropy of ``n`` consecutive tokens of the stationary process, in nats."""
        if n <= self.order:
            marginal = self.stationary.view(self.vocab**n, -1).sum(1)
            return float(_entropy(marginal))
        return self.block_entropy(self.order) + (n - self.order) * self.entropy_rate

    @property
    def unigram_entropy(self) -> float:
        """The entropy of one token of the stationary process (a model without context)."""
        return self.block_entropy(1)

    def loss_floor(self, length: int) -> float:
        """The lowest mean next-token cross-entropy over sequences of ``length + 1`` tokens
        (``length`` predictions, the i-th seeing ``i`` tokens of context): ``H(X_0..X_length) -
        H(X_0)`` divided by ``length``. It equals ``entropy_rate`` for an order-1 chain."""
        return (self.block_entropy(length + 1) - self.block_entropy(1)) / length

    def sample(self, batch: int, length: int, generator: torch.Generator) -> Tensor:
        """``[batch, length]`` int64 tokens, each row started from the stationary
        distribution and continued by the chain."""
        state = torch.multinomial(self.stationary, batch, replacement=True, generator=generator)
        divisors = self.vocab ** torch.arange(self.order - 1, -1, -1)
        prefix = (state[:, None] // divisors) % self.vocab
        out = torch.empty(batch, max(length, self.order), dtype=torch.int64)
        out[:, : self.order] = prefix
        for t in range(self.order, length):
            choice = torch.multinomial(self.probs[state], 1, generator=generator).squeeze(1)
            token = self.successors[state, choice]
            out[:, t] = token
            state = self._next_state(state, token)
        return out[:, :length]


def _dirichlet(rows: int, k: int, concentration: float, generator: torch.Generator) -> Tensor:
    """``rows`` draws of a symmetric Dirichlet(``concentration``) over ``k`` outcomes.

    Gamma variates by Marsaglia and Tsang on top of the generator's normals and uniforms
    (``torch._standard_gamma`` takes no generator); for ``concentration < 1`` the boost
    ``Gamma(a) = Gamma(a + 1) * U**(1/a)``.
    """
    a = concentration + 1.0 if concentration < 1 else concentration
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    out = torch.empty(rows * k, dtype=torch.float64)
    todo = torch.arange(rows * k)
    while todo.numel():
        n = todo.numel()
        x = torch.randn(n, generator=generator, dtype=torch.float64)
        u = torch.rand(n, generator=generator, dtype=torch.float64)
        v = (1 + c * x) ** 3
        ok = (v > 0) & (
            u.clamp_min(1e-300).log() < 0.5 * x**2 + d - d * v + d * v.clamp_min(1e-300).log()
        )
        out[todo[ok]] = d * v[ok]
        todo = todo[~ok]
    if concentration < 1:
        u = torch.rand(rows * k, generator=generator, dtype=torch.float64)
        out = out * u ** (1.0 / concentration)
    gammas = out.view(rows, k).clamp_min(1e-300)
    return gammas / gammas.sum(1, keepdim=True)


def _stationary(successors: Tensor, probs: Tensor, vocab: int, tol: float = 1e-13) -> Tensor:
    states = successors.shape[0]
    targets = ((torch.arange(states)[:, None] * vocab + successors) % states).reshape(-1)
    pi = torch.full((states,), 1.0 / states, dtype=torch.float64)
    for _ in range(100_000):
        flow = torch.zeros(states, dtype=torch.float64).index_add_(
            0, targets, (pi[:, None] * probs).reshape(-1)
        )
        # The lazy chain (I + P) / 2 has the same stationary distributions as P and converges
        # from any start, periodic or not.
        new = 0.5 * (pi + flow)
        if float((new - pi).abs().sum()) < tol:
            return new / new.sum()
        pi = new
    raise RuntimeError("the stationary distribution did not converge")  # pragma: no cover


class Corpus(Protocol):
    """What a learner trains and is evaluated on.

    ``vocab_size`` tokens; ``floor`` the lowest reachable mean cross-entropy of a
    ``[:, :-1] -> [:, 1:]`` prediction over ``length + 1``-token sequences (None when
    unknown); ``train(shard, ...)`` an endless, reproducible stream of batches private to one
    shard (``stream`` numbers independent streams of one shard, e.g. one per resumed session);
    ``evaluation(...)`` a fixed list of batches shared by every learner.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def floor(self) -> float | None: ...

    @property
    def unigram_entropy(self) -> float | None: ...

    @property
    def description(self) -> str: ...

    def train(
        self, shard: int, *, batch_size: int, length: int, stream: int = 0
    ) -> Iterator[Tensor]: ...

    def evaluation(self, *, batches: int, batch_size: int, length: int) -> list[Tensor]: ...


class SyntheticCorpus:
    """Sequences of a ``MarkovSource``; shard ``i`` draws from its own generator."""

    def __init__(self, source: MarkovSource, *, length: int, seed: int) -> None:
        self.source = source
        self.seed = seed
        self.vocab_size = source.vocab
        self.floor: float | None = source.loss_floor(length)
        self.unigram_entropy: float | None = source.unigram_entropy
        self.description = (
            f"Markov source: {source.vocab} tokens, order {source.order}, "
            f"{source.successors.shape[1]} successors per state, seed {seed}"
        )

    def train(
        self, shard: int, *, batch_size: int, length: int, stream: int = 0
    ) -> Iterator[Tensor]:
        generator = _generator(self.seed, "train", shard, stream)
        while True:
            yield self.source.sample(batch_size, length + 1, generator)

    def evaluation(self, *, batches: int, batch_size: int, length: int) -> list[Tensor]:
        generator = _generator(self.seed, "eval")
        return [self.source.sample(batch_size, length + 1, generator) for _ in range(batches)]


class TextCorpus:
    """Byte-level tokens of a text: the last ``eval_fraction`` is held out for evaluation,
    the rest split into contiguous shards; batches are windows at random offsets of a shard."""

    def __init__(
        self, data: bytes, *, name: str, shards: int, eval_fraction: float, seed: int
    ) -> None:
        if shards < 1:
            raise ValueError(f"shards must be a positive integer, got {shards}")
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
        cut = int(len(tokens) * (1 - eval_fraction))
        self.tokens_train, self.tokens_eval = tokens[:cut], tokens[cut:]
        self.seed = seed
        self.vocab_size = 256
        self.floor: float | None = None
        self.unigram_entropy: float | None = None
        self.description = f"bytes of {name} ({len(data)} bytes, {len(self.tokens_eval)} held out)"
        self.shards = shards

    def _windows(self, tokens: Tensor, starts: Tensor, length: int) -> Tensor:
        return tokens[starts[:, None] + torch.arange(length + 1)]

    def train(
        self, shard: int, *, batch_size: int, length: int, stream: int = 0
    ) -> Iterator[Tensor]:
        size = len(self.tokens_train) // self.shards
        part = self.tokens_train[shard % self.shards * size : (shard % self.shards + 1) * size]
        if len(part) <= length + 1:
            raise ValueError(
                f"shard {shard} of the text has {len(part)} bytes, fewer than one sequence of "
                f"{length + 1}; use a longer file or fewer learners"
            )
        generator = _generator(self.seed, "train", shard, stream)
        while True:
            starts = torch.randint(0, len(part) - length - 1, (batch_size,), generator=generator)
            yield self._windows(part, starts, length)

    def evaluation(self, *, batches: int, batch_size: int, length: int) -> list[Tensor]:
        room = len(self.tokens_eval) - length - 1
        if room < 1:
            raise ValueError(
                f"the held-out text has {len(self.tokens_eval)} bytes, fewer than one sequence "
                f"of {length + 1}; use a longer file"
            )
        starts = torch.linspace(0, room - 1, batches * batch_size).to(torch.int64)
        return [
            self._windows(self.tokens_eval, starts[i : i + batch_size], length)
            for i in range(0, len(starts), batch_size)
        ]


def synthetic(
    *,
    length: int,
    vocab: int = 64,
    order: int = 1,
    branching: int = 4,
    concentration: float = 1.0,
    seed: int = 0,
) -> SyntheticCorpus:
    """The corpus of a ``MarkovSource`` generated from ``seed``, for ``length``-token inputs."""
    source = MarkovSource.generate(
        vocab=vocab, order=order, branching=branching, concentration=concentration, seed=seed
    )
    return SyntheticCorpus(source, length=length, seed=seed)


def text_file(
    path: str | Path, *, shards: int, eval_fraction: float = 0.05, seed: int = 0
) -> TextCorpus:
    """The byte-level corpus of the file at ``path``, split into ``shards`` training shards.

    Raises ``OSError`` when the file cannot be read and ``ValueError`` when it is empty.
    """
    data = Path(path).read_bytes()
    if not data:
        raise ValueError(f"{path}: the file is empty")
    return TextCorpus(data, name=str(path), shards=shards, eval_fraction=eval_fraction, seed=seed)


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[Tensor]) -> float:
    """The mean next-token cross-entropy (nats) of ``model`` over ``batches``, every
    prediction weighted equally. The model is put in eval mode for the call and restored."""
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    was_training = model.training
    model.eval()
    try:
        total, count = 0.0, 0
        for batch in batches:
            logits = model(batch[:, :-1])
            total += float(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
                )
            )
            count += batch[:, 1:].numel()
        return total / count
    finally:
        model.train(was_training)
