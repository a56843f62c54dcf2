"""The demo's transformer: size, deterministic initialisation, causality, and that it learns."""

import pytest
import torch

from gradientmail.demo.data import evaluate, synthetic
from gradientmail.demo.model import GPT, GPTConfig


def test_default_model_has_about_a_million_parameters() -> None:
    assert 0.9e6 < GPT().num_parameters() < 1.1e6
    assert 9e6 < GPT(GPTConfig.medium()).num_parameters() < 11e6


def test_initialisation_is_deterministic_per_seed_and_ignores_the_global_rng() -> None:
    torch.manual_seed(0)
    a = GPT(GPTConfig.tiny(), seed=4).state_dict()
    torch.manual_seed(1)
    b = GPT(GPTConfig.tiny(), seed=4).state_dict()
    c = GPT(GPTConfig.tiny(), seed=5).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tok_emb.weight"], c["tok_emb.weight"])


def test_tied_embeddings_share_one_matrix_and_untied_do_not() -> None:
    tied = GPT(GPTConfig.tiny())
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert "lm_head.weight" not in dict(tied.named_parameters())
    untied = GPT(
        GPTConfig(
            vocab_size=64, context=32, d_model=32, n_layers=2, n_heads=2, tie_embeddings=False
        )
    )
    assert untied.num_parameters() == tied.num_parameters() + 64 * 32


def test_forward_is_causal() -> None:
    model = GPT(GPTConfig.tiny()).eval()
    tokens = torch.randint(0, 64, (2, 20))
    changed = tokens.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 64
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 20, 64)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_bad_config_and_long_input_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of n_heads"):
        GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="n_layers"):
        GPTConfig(n_layers=0)
    with pytest.raises(ValueError, match="longer than the model's context"):
        GPT(GPTConfig.tiny())(torch.zeros(1, 33, dtype=torch.int64))


def test_a_few_dozen_steps_reduce_the_loss() -> None:
    torch.set_num_threads(1)
    corpus = synthetic(length=32, vocab=64, seed=0)
    model = GPT(GPTConfig.small(context=32))
    evaluation = corpus.evaluation(batches=2, batch_size=32, length=32)
    before = evaluate(model, evaluation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = corpus.train(0, batch_size=16, length=32)
    for _ in range(40):
        loss = model.loss(next(batches))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = evaluate(model, evaluation)
    assert corpus.unigram_entropy is not None
    assert corpus.floor is not None
    assert before > corpus.unigram_entropy
    assert after < corpus.unigram_entropy - 1.0, (before, after)
    assert after > corpus.floor - 0.05
