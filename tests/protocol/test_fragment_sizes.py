"""The default split is balanced by size on common models, a large tensor split by rows."""

import itertools
import math

import msgspec
import pytest
import torch
from torch import nn

from gradientmail._node.sharded import Layout
from gradientmail.protocol.fragments import preview, signature, window
from gradientmail.protocol.records import Manifest, RunConfig

LIMIT = 1.5


class WordLM(nn.Module):
    """pytorch/examples word_language_model's LSTM with its defaults on Wikitext-2."""

    def __init__(self, ntoken: int = 33278, emsize: int = 200, nhid: int = 200) -> None:
        super().__init__()
        self.encoder = nn.Embedding(ntoken, emsize)
        self.rnn = nn.LSTM(emsize, nhid, 2, dropout=0.2)
        self.decoder = nn.Linear(nhid, ntoken)


class GPT(nn.Module):
    """GPT-2 small's shapes: token and position embeddings, 12 pre-norm blocks, a head."""

    def __init__(self, vocab: int = 50257, width: int = 768, layers: int = 12) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(1024, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 12, 4 * width, norm_first=True) for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)


def _basic(inp: int, out: int) -> nn.Module:
    return nn.ModuleDict(
        {
            "conv1": nn.Conv2d(inp, out, 3, padding=1, bias=False),
            "bn1": nn.BatchNorm2d(out),
            "conv2": nn.Conv2d(out, out, 3, padding=1, bias=False),
            "bn2": nn.BatchNorm2d(out),
            "down": nn.Conv2d(inp, out, 1, bias=False) if inp != out else nn.Identity(),
        }
    )


class ResNet18(nn.Module):
    """ResNet-18's shapes: a 7x7 stem, four stages of two basic blocks, a 1000-way head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn = nn.BatchNorm2d(64)
        widths = [64, 64, 128, 256, 512]
        self.stages = nn.ModuleList(
            nn.ModuleList([_basic(widths[i], widths[i + 1]), _basic(widths[i + 1], widths[i + 1])])
            for i in range(4)
        )
        self.fc = nn.Linear(512, 1000)


class ViT(nn.Module):
    """ViT-B/16's shapes: patch embedding, class token, position embedding, 12 blocks, head."""

    def __init__(self, width: int = 768, layers: int = 12) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, width, 16, stride=16)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.pos = nn.Parameter(torch.zeros(1, 197, width))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 12, 4 * width, norm_first=True) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1000)


MODELS = {"word-lm": WordLM, "gpt": GPT, "resnet": ResNet18, "vit": ViT}


def _named(name: str) -> list[tuple[str, torch.Tensor]]:
    with torch.device("meta"):
        return list(MODELS[name]().named_parameters())


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("fragments", [2, 3, 4, 8])
def test_the_default_split_is_balanced_by_size(name: str, fragments: int) -> None:
    named = _named(name)
    config = RunConfig(fragments=fragments)
    sizes = [spec.numel for spec in signature(named, fragments, config.pattern)]
    assert sum(sizes) == sum(t.numel() for _, t in named)
    assert max(sizes) / min(sizes) <= LIMIT, f"{name}: fragments of {sizes}"


def test_word_lm_splits_its_embeddings_by_rows() -> None:
    named = _named("word-lm")
    specs = signature(named, RunConfig().fragments, RunConfig().pattern)
    sizes = [spec.numel for spec in specs]
    # Before rows could be split, this model's four fragments held 47.2% / 2.7% / 2.7% / 47.5%.
    assert max(sizes) / min(sizes) < 1.001
    encoder = [p for spec in specs for p in spec.params if p.name == "encoder.weight"]
    assert [(p.start, p.shape) for p in encoder] == [(0, (17485, 200)), (17485, (15793, 200))]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_parts_of_a_split_tensor_are_its_rows_in_order(name: str) -> None:
    named = _named(name)
    specs = signature(named, 8, "even")
    rows: dict[str, list[tuple[int, int]]] = {}
    for spec in specs:
        assert spec.params
        for p in spec.params:
            start = 0 if isinstance(p.start, msgspec.UnsetType) else p.start
            rows.setdefault(p.name, []).append((start, start + (p.shape[0] if p.shape else 1)))
    by_name = dict(named)
    assert list(rows) == list(by_name)
    for param, ranges in rows.items():
        whole = by_name[param]
        assert ranges[0][0] == 0
        assert ranges[-1][1] == (whole.shape[0] if whole.dim() else 1)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_a_window_is_a_view_written_in_place() -> None:
    model = WordLM(ntoken=1000, emsize=8, nhid=8)
    named = list(model.named_parameters())
    specs = signature(named, 4, "even")
    part = next(
        p for spec in specs for p in spec.params if not isinstance(p.start, msgspec.UnsetType)
    )
    whole = dict(named)[part.name]
    with torch.no_grad():
        window(whole, part).fill_(7.0)
    assert part.start is not msgspec.UNSET
    assert torch.all(whole[part.start : part.start + part.shape[0]] == 7.0)
    assert int((whole == 7.0).all(dim=-1).sum()) == part.shape[0]


@pytest.mark.parametrize("world", [2, 3, 5])
def test_a_sharded_rank_holds_its_rows_of_each_part(world: int) -> None:
    model = WordLM(ntoken=101, emsize=4, nhid=4)
    named = list(model.named_parameters())
    specs = signature(named, 3, "even")
    manifest = Manifest(created_by="a", config=RunConfig(fragments=3), fragments=specs, theta0=())
    layouts = []
    for rank in range(world):
        local, rows = {}, {}
        for name, tensor in named:
            count = tensor.shape[0]
            size = math.ceil(count / world)
            start, end = min(rank * size, count), min(rank * size + size, count)
            local[name], rows[name] = tensor.detach()[start:end], (start, end)
        layouts.append(Layout(local, rows))
    by_name = dict(named)
    for f, spec in enumerate(specs):
        for i, param in enumerate(spec.params):
            ranges = [layout.fragment_rows(manifest)[f][i] for layout in layouts]
            assert ranges[0][0] == 0
            assert ranges[-1][1] == param.shape[0]
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            pieces = [layout.params(manifest)[f][i] for layout in layouts]
            assert [len(p) for p in pieces] == [b - a for a, b in ranges]
            assert torch.equal(torch.cat(pieces), window(by_name[param.name], param).detach())


def test_preview_counts_the_model_tensors_and_shows_no_unsplittable_warning() -> None:
    model = WordLM(ntoken=3000, emsize=20, nhid=20)
    shown = preview(model.named_parameters())
    assert shown.tensors == 11
    text = str(shown)
    assert "in 11 tensors, fragments=4 pattern=even" in text
    assert "more than 1/4" not in text
    assert max(f.params for f in shown.fragments) / min(f.params for f in shown.fragments) < 1.01
