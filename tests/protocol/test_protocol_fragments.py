"""Fragments: deterministic splits, mismatch reports and the staggered schedule."""

import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.protocol.codec import ENCODINGS, encode_fragment
from gradientmail.protocol.fragments import (
    block_of,
    due,
    mismatch,
    offset,
    preview,
    signature,
)
from gradientmail.protocol.records import Manifest, RunConfig, decode, encode
from gradientmail.protocol.sparse import delta_sparsity

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


@pytest.mark.parametrize("pattern", ["contiguous", "strided", "balanced"])
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
    st.sampled_from(["contiguous", "strided", "balanced"]),
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


def lstm_language_model() -> list[tuple[str, torch.Tensor]]:
    """pytorch/examples' word_language_model at 128 units, 2 layers, an 18,375-word vocabulary
    (the issue's port), as shapes only."""
    vocab, width = 18_375, 128
    shapes: list[tuple[str, tuple[int, ...]]] = [("encoder.weight", (vocab, width))]
    for layer in range(2):
        shapes += [
            (f"rnn.weight_ih_l{layer}", (4 * width, width)),
            (f"rnn.weight_hh_l{layer}", (4 * width, width)),
            (f"rnn.bias_ih_l{layer}", (4 * width,)),
            (f"rnn.bias_hh_l{layer}", (4 * width,)),
        ]
    shapes += [("decoder.weight", (vocab, width)), ("decoder.bias", (vocab,))]
    return [(name, torch.empty(shape, device="meta")) for name, shape in shapes]


def test_balanced_splits_the_lstm_as_evenly_as_whole_tensors_allow() -> None:
    named = lstm_language_model()
    sizes = {
        pattern: [spec.numel for spec in signature(named, 4, pattern)]  # type: ignore[arg-type]
        for pattern in ("contiguous", "strided", "balanced")
    }
    # The figures: contiguous and strided leave two fragments far under a quarter.
    assert sizes["contiguous"] == [2_352_000, 132_096, 132_096, 2_370_375]
    assert min(sizes["strided"]) == 1_024
    # Each embedding matrix is 47% of the model, so it gets a fragment to itself and the
    # LSTM and the decoder's bias share the other two.
    assert sizes["balanced"] == [2_352_000, 149_447, 133_120, 2_352_000]
    specs = signature(named, 4, "balanced")
    assert [p.name for p in specs[0].params] == ["encoder.weight"]
    assert [p.name for p in specs[3].params] == ["decoder.weight"]


def best_largest_fragment(sizes: list[int], fragments: int) -> int:
    """The smallest possible largest fragment over every split of whole tensors."""
    best = sum(sizes)
    for assignment in itertools.product(range(fragments), repeat=len(sizes)):
        if len(set(assignment)) < fragments:
            continue
        loads = [0] * fragments
        for size, f in zip(sizes, assignment, strict=True):
            loads[f] += size
        best = min(best, max(loads))
    return best


@CHECKS
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=7), st.integers(1, 3))
def test_balanced_is_within_four_thirds_of_the_best_split(sizes: list[int], fragments: int) -> None:
    if len(sizes) < fragments:
        return
    named = [(f"p{i}", torch.empty(n, device="meta")) for i, n in enumerate(sizes)]
    specs = signature(named, fragments, "balanced")
    largest = max(spec.numel for spec in specs)
    assert 3 * largest <= 4 * best_largest_fragment(sizes, fragments)
    total = sum(sizes)
    order = [name for name, _ in named]
    firsts = [order.index(spec.params[0].name) for spec in specs]
    assert firsts == sorted(firsts)
    for spec in specs:
        for param in spec.params:
            if param.numel * fragments > total:
                assert len(spec.params) == 1, "a tensor over 1/F of the model shares a fragment"


def test_balanced_fills_every_fragment_even_with_empty_tensors() -> None:
    named = [(f"p{i}", torch.zeros(0)) for i in range(3)] + [("w", torch.zeros(5))]
    assert names(signature(named, 4, "balanced")) == [["p0"], ["p1"], ["p2"], ["w"]]


def test_a_manifest_keeps_its_pattern_so_a_new_default_cannot_resplit_old_runs() -> None:
    named = list(transformer(layers=2).named_parameters())
    manifest = Manifest(
        created_by="learner-0",
        config=RunConfig(fragments=2, sync_every=8, pattern="contiguous"),
        fragments=signature(named, 2, "contiguous"),
        theta0=(),
    )
    data = encode(manifest)
    assert json.loads(data)["config"]["pattern"] == "contiguous"
    config = decode(data, Manifest).config
    assert mismatch(manifest.fragments, signature(named, 2, config.pattern)) is None


def test_preview_sizes_are_the_blobs_a_run_writes() -> None:
    model = transformer(layers=3)
    config = RunConfig(fragments=3, sync_every=30, pattern="balanced", delta_encoding="int4")
    shown = preview(model.named_parameters(), config)
    specs = signature(list(model.named_parameters()), 3, "balanced")
    by_name = dict(model.named_parameters())
    assert shown.params == sum(p.numel() for p in model.parameters())
    for spec, size in zip(specs, shown.fragments, strict=True):
        assert (size.index, size.tensors, size.params) == (spec.index, len(spec.params), spec.numel)
        tensors = [by_name[p.name] for p in spec.params]
        for encoding in ENCODINGS:
            blob = encode_fragment(tensors, spec, encoding, block_size=config.block_size)
            assert size.blob_bytes[encoding] == len(blob)
    up, down = shown.bytes_per_period()
    assert up == sum(f.blob_bytes["int4"] for f in shown.fragments)
    assert down == sum(f.blob_bytes["fp32"] for f in shown.fragments)
    text = str(shown)
    assert "pattern=balanced" in text
    assert "more than 1/3" not in text


def test_preview_shows_the_topk_bytes_a_learner_moves() -> None:
    """A ``topk`` delta of no particular pattern takes about the preview's size (its index
    codes depend on where its selection lies: packed together it takes less); a learner's
    bytes per period are the deltas up and, for ``topk`` updates, one learner's selection
    down."""
    model = transformer(layers=2, width=64)
    config = RunConfig(
        fragments=2, sync_every=30, delta_encoding="topk", update_encoding="topk", topk_chunk=512
    )
    shown = preview(model.named_parameters(), config)
    specs = signature(list(model.named_parameters()), 2, config.pattern)
    sparsity = delta_sparsity(config)
    generator = torch.Generator().manual_seed(7)
    for spec, size in zip(specs, shown.fragments, strict=True):
        deltas = [torch.randn(p.shape, generator=generator) for p in spec.params]
        blob = encode_fragment(deltas, spec, "topk", block_size=1, sparsity=sparsity)
        assert abs(len(blob) - size.blob_bytes["topk"]) < 0.05 * size.blob_bytes["topk"]
        assert size.blob_bytes["topk"] < size.blob_bytes["int4"]
        packed = [torch.ones(p.shape) for p in spec.params]
        blob = encode_fragment(packed, spec, "topk", block_size=1, sparsity=sparsity)
        assert len(blob) < size.blob_bytes["topk"]
        assert size.blob_bytes["topk"] < size.topk_update_bytes < 2 * size.blob_bytes["topk"]
    up, down = shown.bytes_per_period()
    assert up == sum(f.blob_bytes["topk"] for f in shown.fragments)
    assert down == sum(f.topk_update_bytes for f in shown.fragments)
    assert "(topk updates) of one learner's selection" in str(shown)
    closing = shown.closing_bytes()
    assert closing == (
        sum(f.blob_bytes["int4"] for f in shown.fragments),
        sum(f.blob_bytes["int4"] for f in shown.fragments),
    )
    assert "at the close, once: " in str(shown)
    assert "at the close" not in str(preview(model.named_parameters(), RunConfig(fragments=2)))


def test_preview_says_when_one_tensor_outweighs_a_fragment() -> None:
    named = [("big", torch.zeros(1000)), ("a", torch.zeros(10)), ("b", torch.zeros(10))]
    shown = preview(named, RunConfig(fragments=2, sync_every=8, pattern="balanced"))
    assert [f.params for f in shown.fragments] == [1000, 20]
    assert shown.largest_tensor == ("big", 1000)
    assert "'big' (1,000 parameters) is more than 1/2 of the model" in str(shown)
    with pytest.raises(ValueError, match="use at most 3 fragments"):
        preview(named, RunConfig(fragments=4, sync_every=8, pattern="balanced"))


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
