"""The synthetic language and the text corpus: exact entropy, reproducible independent streams."""

import math
from pathlib import Path

import pytest
import torch

from gradientmail.demo.data import MarkovSource, evaluate, synthetic, text_file


def _dense(source: MarkovSource) -> torch.Tensor:
    table = torch.zeros(source.states, source.vocab, dtype=torch.float64)
    return table.scatter_(1, source.successors, source.probs)


@pytest.mark.parametrize(("order", "vocab"), [(1, 64), (2, 16)])
def test_entropy_rate_matches_a_monte_carlo_estimate(order: int, vocab: int) -> None:
    source = MarkovSource.generate(vocab=vocab, order=order, branching=4, seed=3)
    tokens = source.sample(64, 2_000, torch.Generator().manual_seed(11))
    table = _dense(source)
    digits = vocab ** torch.arange(order - 1, -1, -1)
    windows = tokens.unfold(1, order + 1, 1)
    states = (windows[..., :order] * digits).sum(-1)
    nll = -table[states, windows[..., order]].log()
    assert torch.isfinite(nll).all(), "the sampler emitted a transition of probability 0"
    estimate = float(nll.mean())
    standard_error = float(nll.std()) / math.sqrt(nll.numel())
    assert abs(estimate - source.entropy_rate) < 5 * standard_error + 1e-3
    assert 0 < source.entropy_rate < math.log(4)


def test_stationary_distribution_is_stationary() -> None:
    source = MarkovSource.generate(vocab=16, order=2, branching=3, seed=5)
    pi = source.stationary
    table = _dense(source)
    moved = torch.zeros_like(pi)
    for token in range(source.vocab):
        nxt = (torch.arange(source.states) * source.vocab + token) % source.states
        moved.index_add_(0, nxt, pi * table[:, token])
    assert torch.allclose(moved, pi, atol=1e-10)
    assert math.isclose(float(pi.sum()), 1.0, abs_tol=1e-12)


def test_loss_floor_counts_the_short_contexts_of_a_higher_order_chain() -> None:
    first = MarkovSource.generate(vocab=32, order=1, seed=0)
    assert first.loss_floor(64) == pytest.approx(first.entropy_rate)
    second = MarkovSource.generate(vocab=16, order=2, seed=0)
    unigram = second.unigram_entropy
    bigram = second.block_entropy(2) - unigram
    expected = (bigram + 63 * second.entropy_rate) / 64
    assert second.loss_floor(64) == pytest.approx(expected)
    assert second.entropy_rate < second.loss_floor(64) < unigram


def test_unigram_entropy_matches_token_frequencies() -> None:
    source = MarkovSource.generate(vocab=32, order=1, seed=2)
    tokens = source.sample(128, 1_000, torch.Generator().manual_seed(0)).flatten()
    freq = torch.bincount(tokens, minlength=32).double() / tokens.numel()
    empirical = float(-(freq[freq > 0] * freq[freq > 0].log()).sum())
    assert empirical == pytest.approx(source.unigram_entropy, abs=0.02)
    assert source.unigram_entropy > 2 * source.entropy_rate


def test_generation_and_sampling_are_deterministic_per_seed() -> None:
    a = MarkovSource.generate(vocab=32, seed=7)
    b = MarkovSource.generate(vocab=32, seed=7)
    c = MarkovSource.generate(vocab=32, seed=8)
    assert torch.equal(a.successors, b.successors)
    assert torch.equal(a.probs, b.probs)
    assert not torch.equal(a.probs, c.probs)
    torch.manual_seed(0)
    x = a.sample(4, 50, torch.Generator().manual_seed(1))
    torch.manual_seed(1)
    y = b.sample(4, 50, torch.Generator().manual_seed(1))
    assert torch.equal(x, y), "sampling must not depend on the global RNG"


def test_shards_are_distinct_reproducible_streams_and_evaluation_is_shared() -> None:
    corpus = synthetic(length=32, vocab=32, seed=1)
    first = [next(corpus.train(shard, batch_size=4, length=32)) for shard in range(3)]
    assert all(batch.shape == (4, 33) and batch.dtype == torch.int64 for batch in first)
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first[1], first[2])
    again = corpus.train(1, batch_size=4, length=32)
    assert torch.equal(next(again), first[1])
    other_stream = corpus.train(1, batch_size=4, length=32, stream=1)
    assert not torch.equal(next(other_stream), first[1])
    evaluation = corpus.evaluation(batches=2, batch_size=4, length=32)
    assert all(
        torch.equal(x, y)
        for x, y in zip(
            evaluation, corpus.evaluation(batches=2, batch_size=4, length=32), strict=True
        )
    )
    assert not any(torch.equal(evaluation[0], batch) for batch in first)
    assert corpus.floor == pytest.approx(corpus.source.entropy_rate)


def test_generate_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="branching"):
        MarkovSource.generate(vocab=4, branching=5)
    with pytest.raises(ValueError, match="concentration"):
        MarkovSource.generate(concentration=0.0)
    with pytest.raises(ValueError, match="too many"):
        MarkovSource.generate(vocab=256, order=3)


def test_text_file_splits_shards_and_holds_out_evaluation(tmp_path: Path) -> None:
    text = bytes(range(256)) * 40
    path = tmp_path / "corpus.txt"
    path.write_bytes(text)
    corpus = text_file(path, shards=2, eval_fraction=0.1)
    assert corpus.vocab_size == 256
    assert corpus.floor is None
    cut = int(len(text) * 0.9)
    a = next(corpus.train(0, batch_size=8, length=16))
    b = next(corpus.train(1, batch_size=8, length=16))
    half = cut // 2
    assert torch.equal(a, torch.tensor(list(text[:half]))[_offsets(text[:half], a)])
    assert torch.equal(b, torch.tensor(list(text[half:cut]))[_offsets(text[half:cut], b)])
    evaluation = corpus.evaluation(batches=2, batch_size=4, length=16)
    held_out = text[cut:]
    for batch in evaluation:
        for row in batch.tolist():
            assert bytes(row) in held_out


def _offsets(part: bytes, batch: torch.Tensor) -> torch.Tensor:
    """Index of each row of ``batch`` as a window of ``part`` (the rows must occur in it)."""
    starts = [part.find(bytes(row)) for row in batch.tolist()]
    assert all(start >= 0 for start in starts), "a training window is not in its shard"
    return torch.tensor(starts)[:, None] + torch.arange(batch.shape[1])


def test_text_file_rejects_empty_and_too_short_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        text_file(empty, shards=1)
    short = tmp_path / "short.txt"
    short.write_bytes(b"abc" * 10)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        next(text_file(short, shards=4).train(0, batch_size=2, length=16))


def test_evaluate_is_the_mean_cross_entropy_in_nats() -> None:
    class Uniform(torch.nn.Module):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return torch.zeros(*tokens.shape, 10)

    batches = [torch.randint(0, 10, (3, 9)), torch.randint(0, 10, (5, 9))]
    assert evaluate(Uniform(), batches) == pytest.approx(math.log(10))
    with pytest.raises(ValueError, match="at least one batch"):
        evaluate(Uniform(), [])
