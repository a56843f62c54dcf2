"""Fragments: deterministic splits, mismatch reports and the staggered schedule."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.protocol.fragments import block_of, due, mismatch, offset, signature
from gradientmail.protocol.records import RunConfig

CHECKS = settings(max_examples=80, deadline=None)


def transformer(layers: int = 6, width: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    block = lambda: torch.nn.ModuleDict(  # noqa: E731
        {"attn": torch.nn.Linear(width, width), "mlp": torch.nn.Linear(width, width)}
    )
    return torch.nn.ModuleDict(
        {
            "embed": torch.nn.Embedding(16, width),
            "layers": torch.nn.ModuleList([block() for _ in range(layers)]),
            "head": torch.nn.Linear(width, 16),
        }
    )


def names(specs: tuple) -> list[list[str]]:  # type: ignore[type-arg]
    return [[p.name for p in spec.params] for spec in specs]


@pytest.mark.parametrize("pattern", ["contiguous", "strided"])
def test_signature_is_deterministic_and_complete(pattern: str) -> None:
    named = list(transformer().named_parameters())
    one = signature(named, 3, pattern)  # type: ignore[arg-type]
    two = signature(list(transformer().named_parameters()), 3, pattern)  # type: ignore[arg-type]
    assert one == two
    assert [spec.index for spec in one] == [0, 1, 2]
    flat = [p.name for spec in one for p in spec.params]
    assert sorted(flat) == sorted(name for name, _ in named)
    order = [name for name, _ in named]
    for spec in one:
        assert spec.params
        positions = [order.index(p.name) for p in spec.params]
        assert positions == sorted(positions)
    by_name = dict(named)
    for spec in one:
        for p in spec.params:
            assert p.shape == tuple(by_name[p.name].shape)
            assert p.dtype == "float32"


def test_strided_deals_layers_round_robin() -> None:
    specs = signature(list(transformer(layers=6).named_parameters()), 3, "strided")
    blocks = [sorted({block_of(p.name) for p in spec.params}) for spec in specs]
    # Blocks in order: embed, layers.0 … layers.5, head.
    assert blocks == [
        ["embed", "layers.2", "layers.5"],
        ["head", "layers.0", "layers.3"],
        ["layers.1", "layers.4"],
    ]


def test_block_of() -> None:
    assert block_of("layers.3.attn.q.weight") == "layers.3"
    assert block_of("encoder.layer.10.norm.bias") == "encoder.layer.10"
    assert block_of("embed.weight") == "embed"
    assert block_of("bias") == ""


def test_strided_with_fewer_blocks_than_fragments_deals_parameters() -> None:
    named = [(f"w{i}", torch.zeros(2)) for i in range(5)]
    assert names(signature(named, 3, "strided")) == [["w0", "w3"], ["w1", "w4"], ["w2"]]


def test_contiguous_balances_element_counts() -> None:
    named = [(f"p{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 10, 10, 10, 10])]
    assert [len(s.params) for s in signature(named, 3, "contiguous")] == [2, 2, 2]
    named = [("big", torch.zeros(100)), ("a", torch.zeros(1)), ("b", torch.zeros(1))]
    assert names(signature(named, 2, "contiguous")) == [["big"], ["a", "b"]]
    named = [("a", torch.zeros(1)), ("b", torch.zeros(1)), ("c", torch.zeros(1000))]
    assert names(signature(named, 3, "contiguous")) == [["a"], ["b"], ["c"]]


@CHECKS
@given(
    st.lists(st.integers(0, 1000), min_size=1, max_size=40),
    st.integers(1, 8),
    st.sampled_from(["contiguous", "strided"]),
)
def test_every_fragment_is_non_empty_and_ordered(
    sizes: list[int], fragments: int, pattern: str
) -> None:
    named = [(f"blocks.{i // 2}.p{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    if len(sizes) < fragments:
        with pytest.raises(ValueError, match=f"use at most {len(sizes)} fragments"):
            signature(named, fragments, pattern)  # type: ignore[arg-type]
        return
    specs = signature(named, fragments, pattern)  # type: ignore[arg-type]
    assert len(specs) == fragments
    assert all(spec.params for spec in specs)
    flat = [p.name for spec in specs for p in spec.params]
    assert sorted(flat) == sorted(name for name, _ in named)
    if pattern == "contiguous":
        assert flat == [name for name, _ in named]
        total, largest = sum(sizes), max(sizes)
        for spec in specs:
            assert spec.numel <= total / fragments + largest


@pytest.mark.parametrize(
    ("named", "fragments", "pattern", "match"),
    [
        ([("a", torch.zeros(1))], 2, "contiguous", "1 parameter tensors.*use at most 1 fragments"),
        ([("a", torch.zeros(1)), ("a", torch.zeros(1))], 1, "contiguous", "occurs twice"),
        ([("a", torch.zeros(1, dtype=torch.int64))], 1, "contiguous", "floating-point"),
        ([("", torch.zeros(1))], 1, "contiguous", "non-empty"),
        ([("a", torch.zeros(1))], 0, "contiguous", "positive integer"),
        ([("a", torch.zeros(1))], 1, "diagonal", "unknown fragment pattern"),
    ],
)
def test_signature_rejects_bad_input(
    named: list[tuple[str, torch.Tensor]], fragments: int, pattern: str, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        signature(named, fragments, pattern)  # type: ignore[arg-type]


def model_signature(**changes: torch.Tensor) -> tuple:  # type: ignore[type-arg]
    named = dict(transformer(layers=2).named_parameters())
    named.update(changes)
    return signature(list(named.items()), 2, "contiguous")


def test_mismatch_is_none_for_the_same_model() -> None:
    assert mismatch(model_signature(), model_signature()) is None


def test_mismatch_names_a_differing_shape() -> None:
    ours = model_signature(**{"layers.1.mlp.weight": torch.zeros(8, 9)})
    message = mismatch(model_signature(), ours)
    assert message is not None
    assert "'layers.1.mlp.weight'" in message
    assert "[8, 8]" in message
    assert "[8, 9]" in message


def test_mismatch_names_a_differing_dtype() -> None:
    ours = model_signature(**{"head.bias": torch.zeros(16, dtype=torch.bfloat16)})
    message = mismatch(model_signature(), ours)
    assert message is not None
    assert "'head.bias'" in message
    assert "bfloat16" in message


def test_mismatch_names_missing_and_extra_parameters() -> None:
    run = model_signature()
    named = list(transformer(layers=2).named_parameters())
    fewer = signature([p for p in named if p[0] != "layers.0.attn.bias"], 2, "contiguous")
    message = mismatch(run, fewer)
    assert message is not None
    assert "'layers.0.attn.bias'" in message
    assert "missing from this model" in message
    more = signature([*named, ("extra.scale", torch.zeros(3))], 2, "contiguous")
    message = mismatch(run, more)
    assert message is not None
    assert "'extra.scale'" in message
    assert "not in the run" in message


def test_mismatch_names_fragment_count_and_split() -> None:
    named = list(transformer(layers=2).named_parameters())
    run = signature(named, 2, "contiguous")
    message = mismatch(run, signature(named, 3, "contiguous"))
    assert message is not None
    assert "2 fragments" in message
    assert "into 3" in message
    message = mismatch(run, signature(named, 2, "strided"))
    assert message is not None
    assert "fragment 0" in message
    assert "pattern" in message


def test_offsets_and_due_steps() -> None:
    config = RunConfig(fragments=3, sync_every=8)
    assert [offset(f, config) for f in range(3)] == [2, 5, 0]
    schedule = {step: due(step, config) for step in range(20)}
    assert schedule[0] == ()
    assert [s for s, d in schedule.items() if d == (0,)] == [2, 10, 18]
    assert [s for s, d in schedule.items() if d == (1,)] == [5, 13]
    assert [s for s, d in schedule.items() if d == (2,)] == [8, 16]
    with pytest.raises(ValueError, match="local step"):
        due(-1, config)
    with pytest.raises(ValueError, match="fragment 3"):
        offset(3, config)


@CHECKS
@given(st.integers(1, 12), st.integers(0, 60), st.integers(1, 500))
def test_each_fragment_is_due_once_per_period(fragments: int, extra: int, start: int) -> None:
    config = RunConfig(fragments=fragments, sync_every=fragments + extra)
    window = [f for step in range(start, start + config.sync_every) for f in due(step, config)]
    assert sorted(window) == list(range(fragments))
    for step in range(start, start + config.sync_every):
        expected = tuple(
            f for f in range(fragments) if step % config.sync_every == offset(f, config)
        )
        assert due(step, config) == expected


@CHECKS
@given(st.integers(1, 12), st.integers(0, 60))
def test_first_snapshots_come_in_round_order(fragments: int, extra: int) -> None:
    """A learner's first due steps follow fragment order, so its first snapshots land in
    rounds 0, 1, 2, … as the syncers close them."""
    config = RunConfig(fragments=fragments, sync_every=fragments + extra)
    first = [f for step in range(1, config.sync_every + 1) for f in due(step, config)]
    assert first == list(range(fragments))
