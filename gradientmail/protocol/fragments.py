"""How a model is split into fragments, how two splits are compared, and when each is due.

``signature`` is deterministic: the same named parameters, fragment count and pattern give
the same ``FragmentSpec``s on every machine, parameters in the model's order within a
fragment. The patterns: ``even`` (the default: one stream of rows cut into ``F`` runs, a
tensor split by rows between neighbouring fragments), ``contiguous``, ``strided`` (Streaming
DiLoCo's layers ``f, f+F, …``) and ``balanced`` (whole tensors placed by size); their rules
are in docs/protocol.md, "Fragments and the schedule". ``mismatch`` names the first
difference between a run's split and ours.

The schedule: fragment ``f`` is due after every local step ``s > 0`` with
``s ≡ offset(f) (mod H)``, ``offset(f) = (f + 1)·H // F mod H`` (``H = sync_every``), so
fragments come due one at a time, about ``H / F`` steps apart, in round order.

``preview`` shows a split before a run exists: each fragment's tensors, elements and blob
size in every encoding, and what a run moves and keeps (``protocol.costs``).

Pure: no I/O.
"""

import bisect
import heapq
import itertools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec
import torch
from torch import Tensor

from gradientmail.protocol.codec import ENCODINGS, decode_fragment, encode_fragment
from gradientmail.protocol.config import Encoding, Pattern, RunConfig
from gradientmail.protocol.costs import Costs, costs
from gradientmail.protocol.records import FragmentSpec, ParamSpec
from gradientmail.protocol.sparse import TOPK, delta_sparsity, sent_as, update_sparsity

__all__ = [
    "FragmentSize",
    "Preview",
    "assembled",
    "block_of",
    "due",
    "joined_phase",
    "mismatch",
    "offset",
    "preview",
    "signature",
    "window",
]

_DIGITS = re.compile(r"[0-9]+")


def block_of(name: str) -> str:
    """The block a parameter belongs to under the ``strided`` pattern (see the module doc)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if _DIGITS.fullmatch(part):
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1])


def _param(name: str, tensor: Tensor) -> ParamSpec:
    if not isinstance(name, str) or not name:
        raise ValueError(f"parameter names must be non-empty strings, got {name!r}")
    if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
        raise ValueError(
            f"parameter {name!r} is not a floating-point tensor "
            f"({getattr(tensor, 'dtype', type(tensor).__name__)}); only floating-point "
            "parameters can be trained together"
        )
    return ParamSpec(
        name=name, shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch.")
    )


def _contiguous(params: Sequence[ParamSpec], fragments: int) -> list[list[int]]:
    prefix = list(itertools.accumulate((param.numel for param in params), initial=0))
    total = prefix[-1]
    n = len(params)
    cuts = [0]
    for k in range(1, fragments):
        low, high = cuts[-1] + 1, n - (fragments - k)
        target = total * k / fragments
        i = bisect.bisect_left(prefix, target, low, high + 1)
        candidates = [c for c in (i - 1, i) if low <= c <= high] or [min(max(i, low), high)]
        cuts.append(min(candidates, key=lambda c: (abs(prefix[c] - target), c)))
    cuts.append(n)
    return [list(range(a, b)) for a, b in itertools.pairwise(cuts)]


def _strided(params: Sequence[ParamSpec], fragments: int) -> list[list[int]]:
    blocks: dict[str, list[int]] = {}
    for i, param in enumerate(params):
        blocks.setdefault(block_of(param.name), []).append(i)
    units = list(blocks.values()) if len(blocks) >= fragments else [[i] for i in range(len(params))]
    groups: list[list[int]] = [[] for _ in range(fragments)]
    for k, unit in enumerate(units):
        groups[k % fragments].extend(unit)
    return [sorted(group) for group in groups]


def _balanced(params: Sequence[ParamSpec], fragments: int) -> list[list[int]]:
    largest_first = sorted(range(len(params)), key=lambda i: (-params[i].numel, i))
    # (elements so far, parameters so far, fragment): the least-filled fragment pops first.
    heap = [(0, 0, f) for f in range(fragments)]
    groups: list[list[int]] = [[] for _ in range(fragments)]
    for i in largest_first:
        numel, count, f = heapq.heappop(heap)
        groups[f].append(i)
        heapq.heappush(heap, (numel + params[i].numel, count + 1, f))
    return sorted(sorted(group) for group in groups)


def _rows(param: ParamSpec) -> int:
    return param.shape[0] if param.shape else 1


def _even(params: Sequence[ParamSpec], fragments: int) -> list[list[ParamSpec]]:
    rows = [_rows(param) for param in params]
    widths = [p.numel // count if count else 0 for p, count in zip(params, rows, strict=True)]
    row_at = list(itertools.accumulate(rows, initial=0))
    elements_at = list(itertools.accumulate((p.numel for p in params), initial=0))
    total_rows, total = row_at[-1], elements_at[-1]
    if total_rows < fragments:
        raise ValueError(
            f"the model's parameters have {total_rows} rows in all, fewer than the "
            f"{fragments} fragments asked for; use at most {total_rows} fragments"
        )

    def elements(row: int) -> int:
        i = bisect.bisect_right(row_at, row) - 1
        return elements_at[i] + (row - row_at[i]) * widths[i] if i < len(params) else total

    cuts = [0]
    for k in range(1, fragments):
        low, high = cuts[-1] + 1, total_rows - (fragments - k)
        target = total * k / fragments
        i = max(bisect.bisect_right(elements_at, target) - 1, 0)
        i = min(i, len(params) - 1)
        near = row_at[i] + int((target - elements_at[i]) // max(widths[i], 1))
        candidates = {min(max(r, low), high) for r in (near, near + 1)}
        cuts.append(min(candidates, key=lambda r: (abs(elements(r) - target), r)))
    cuts.append(total_rows)
    groups: list[list[ParamSpec]] = [[] for _ in range(fragments)]
    for param, first, count in zip(params, row_at, rows, strict=False):
        if count == 0:
            groups[min(bisect.bisect_right(cuts, first), fragments) - 1].append(param)
        for f, (a, b) in enumerate(itertools.pairwise(cuts)):
            lo, hi = max(first, a), min(first + count, b)
            if (lo, hi) == (first, first + count) and count:
                groups[f].append(param)
            elif lo < hi:
                shape = (hi - lo, *param.shape[1:])
                groups[f].append(msgspec.structs.replace(param, shape=shape, start=lo - first))
    return groups


def _whole(
    split: Callable[[Sequence[ParamSpec], int], list[list[int]]],
) -> Callable[[Sequence[ParamSpec], int], list[list[ParamSpec]]]:
    def pick(params: Sequence[ParamSpec], fragments: int) -> list[list[ParamSpec]]:
        return [[params[i] for i in group] for group in split(params, fragments)]

    return pick


_SPLITS = {
    "contiguous": _whole(_contiguous),
    "strided": _whole(_strided),
    "balanced": _whole(_balanced),
    "even": _even,
}


def window(tensor: Tensor, param: ParamSpec) -> Tensor:
    """The part of ``tensor`` (the whole parameter) that ``param`` holds: ``tensor`` itself,
    or for a parameter split by rows a view of its rows (written in place)."""
    if isinstance(param.start, msgspec.UnsetType):
        return tensor
    return tensor.narrow(0, param.start, param.shape[0])


def assembled(
    specs: Sequence[FragmentSpec], thetas: Sequence[Sequence[Tensor]]
) -> dict[str, Tensor]:
    """Every parameter by name, in the model's order, from each fragment's tensors
    (``thetas[f]`` in ``specs[f].params`` order; a parameter split by rows put back
    together), cast to its dtype in the model."""
    parts: dict[str, list[tuple[int, Tensor]]] = {}
    for spec, tensors in zip(specs, thetas, strict=True):
        for param, tensor in zip(spec.params, tensors, strict=True):
            start = 0 if isinstance(param.start, msgspec.UnsetType) else param.start
            parts.setdefault(param.name, []).append((start, tensor))
    named: dict[str, Tensor] = {}
    for spec in specs:
        for param in spec.params:
            if param.name not in named:
                pieces = sorted(parts[param.name], key=lambda part: part[0])
                whole = torch.cat([t for _, t in pieces]) if len(pieces) > 1 else pieces[0][1]
                named[param.name] = whole.to(getattr(torch, param.dtype))
    return named


def signature(
    named: Sequence[tuple[str, Tensor]], fragments: int, pattern: Pattern
) -> tuple[FragmentSpec, ...]:
    """Split ``named`` (``model.named_parameters()`` order) into ``fragments`` fragments.

    Every fragment is non-empty. Raises ``ValueError`` for fewer parameter tensors than
    fragments (under ``even``: fewer rows; use fewer fragments), a repeated or empty name, a
    parameter that is not a floating-point tensor, a fragment count below 1 or an unknown
    pattern.
    """
    if not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"fragments must be a positive integer, got {fragments!r}")
    params = [_param(name, tensor) for name, tensor in named]
    seen: set[str] = set()
    for param in params:
        if param.name in seen:
            raise ValueError(f"parameter name {param.name!r} occurs twice")
        seen.add(param.name)
    if len(params) < fragments and pattern != "even":
        raise ValueError(
            f"the model has {len(params)} parameter tensors, fewer than the {fragments} "
            f"fragments asked for; use at most {len(params)} fragments"
        )
    split = _SPLITS.get(pattern)
    if split is None:
        raise ValueError(
            f"unknown fragment pattern {pattern!r}: use one of {', '.join(map(repr, _SPLITS))}"
        )
    return tuple(
        FragmentSpec(index=index, params=tuple(group))
        for index, group in enumerate(split(params, fragments))
    )


def _key(param: ParamSpec) -> tuple[str, int | None]:
    return param.name, None if isinstance(param.start, msgspec.UnsetType) else param.start


def _named(param: ParamSpec) -> str:
    if isinstance(param.start, msgspec.UnsetType):
        return repr(param.name)
    return f"{param.name!r} rows [{param.start}, {param.start + param.shape[0]})"


def _describe(param: ParamSpec) -> str:
    return f"{_named(param)} (shape {list(param.shape)}, {param.dtype})"


def mismatch(run: Sequence[FragmentSpec], ours: Sequence[FragmentSpec]) -> str | None:
    """None if ``ours`` is the run's signature, else a sentence naming the first difference.

    Checked in order: the run's parameters in fragment order (one missing from this model, or
    of another shape or dtype), then parameters this model has that the run lacks, then the
    fragment count, then which parameters each fragment holds.
    """
    theirs = [param for spec in run for param in spec.params]
    mine = {_key(param): param for spec in ours for param in spec.params}
    advice = "build the model exactly as the run's creator did, or start a new run"
    for param in theirs:
        other = mine.get(_key(param))
        if other is None:
            return f"the run's parameter {_describe(param)} is missing from this model; {advice}"
        if other.shape != param.shape or other.dtype != param.dtype:
            return (
                f"parameter {_named(param)}: the run has shape {list(param.shape)}, "
                f"{param.dtype}; this model has shape {list(other.shape)}, {other.dtype}; {advice}"
            )
    known = {_key(param) for param in theirs}
    for spec in ours:
        for param in spec.params:
            if _key(param) not in known:
                return f"this model's parameter {_describe(param)} is not in the run; {advice}"
    if len(run) != len(ours):
        return (
            f"the run has {len(run)} fragments, this node split the model into {len(ours)}; "
            "join with the run's config"
        )
    for a, b in zip(run, ours, strict=True):
        names_a, names_b = [_named(p) for p in a.params], [_named(p) for p in b.params]
        if names_a != names_b:
            first = next(x or y for x, y in itertools.zip_longest(names_a, names_b) if x != y)
            return (
                f"fragment {a.index} holds {len(a.params)} parameters in the run and "
                f"{len(b.params)} here (first difference at {first}); join with the run's "
                "fragment pattern"
            )
    return None


def offset(fragment: int, config: RunConfig) -> int:
    """The local step, modulo ``sync_every``, at which ``fragment`` is due:
    ``(fragment + 1) · sync_every // fragments mod sync_every``."""
    if not 0 <= fragment < config.fragments:
        raise ValueError(f"fragment {fragment} is not in [0, {config.fragments})")
    return (fragment + 1) * config.sync_every // config.fragments % config.sync_every


def joined_phase(seen_round: int, config: RunConfig) -> int:
    """The schedule's phase of a learner that joined a run in progress, taken at its first
    step, ``seen_round`` the newest round whose record it had seen by then (-1: none): the
    round after it comes due at that first step, and the rounds after that in order, a
    fragment's interval apart. Phase 0 before round 0: learners that start a run together
    come due together a fragment's interval in.

    A joiner cannot tell how far the others are into the interval of the round they are
    in; due at once, it is ahead of them by at most that interval, and the wait at its
    overlap step (``RunConfig.overlap``; unpaced, its schedule holds) brings it back in
    step, while the others' rounds do not wait for it. Due an interval after joining, it
    would be behind them by as much, and they would wait for it instead."""
    if seen_round < 0:
        return 0
    return (offset((seen_round + 1) % config.fragments, config) - 1) % config.sync_every


def due(step: int, config: RunConfig) -> tuple[int, ...]:
    """The fragments due after local step ``step`` (1-based; 0 means no step yet, nothing due).

    Offsets are distinct (``sync_every >= fragments``), so at most one fragment is due.
    Raises ``ValueError`` for a negative step.
    """
    if step < 0:
        raise ValueError(f"local step must be >= 0, got {step}")
    if step == 0:
        return ()
    phase = step % config.sync_every
    # Inverts offset(): for 0 < phase, (f + 1) = ceil(phase · F / H) is the only candidate.
    if phase == 0:
        fragment = config.fragments - 1
    else:
        fragment = -(-phase * config.fragments // config.sync_every) - 1
    return (fragment,) if offset(fragment, config) == phase else ()


@dataclass(frozen=True, slots=True)
class FragmentSize:
    """One fragment of a ``Preview``: its parameter tensors, elements, and the bytes of one
    blob of it in each encoding (safetensors header and int8/int4 scales included; ``topk``:
    a delta selecting all it may under the config's ``topk_*``). ``topk_update_bytes``: a
    ``topk`` update holding one such selection (the union of ``K`` learners' selections is
    up to ``K`` times as large)."""

    index: int
    tensors: int
    params: int
    blob_bytes: Mapping[Encoding, int]
    topk_update_bytes: int


@dataclass(frozen=True, slots=True)
class Preview:
    """How ``config`` splits a model, before any run exists (``preview``).

    ``largest_tensor`` names the model's largest parameter and its element count: when it is
    above ``1/F`` of the model no split of whole tensors is more even than that tensor (the
    ``even`` pattern splits it by rows). ``tensors`` counts the model's parameter tensors
    (a fragment's ``tensors`` counts each part of a split one). ``str(preview)`` is a table
    for a terminal.
    """

    config: RunConfig
    fragments: tuple[FragmentSize, ...]
    largest_tensor: tuple[str, int]
    tensors: int
    learners: int = 2
    """How many learners ``costs`` and the table count on."""

    @property
    def params(self) -> int:
        return sum(fragment.params for fragment in self.fragments)

    def bytes_per_period(self) -> tuple[int, int]:
        """``(up, down)`` bytes of blobs one learner moves per ``sync_every`` steps, when every
        fragment is synchronized once: its deltas in ``delta_encoding`` up, the updates in
        ``update_encoding`` down (records of a few hundred bytes each not counted)."""
        up = sum(f.blob_bytes[self.config.delta_encoding] for f in self.fragments)
        if self.config.update_encoding == TOPK:
            return up, sum(f.topk_update_bytes for f in self.fragments)
        down = sum(f.blob_bytes[self.config.update_encoding] for f in self.fragments)
        return up, down

    def closing_bytes(self) -> tuple[int, int]:
        """``(up, down)`` bytes of blobs one learner moves in the run's final rounds: its
        final snapshots and their rounds' updates, dense in a ``topk`` run
        (``sparse.sent_as``)."""
        config = self.config
        up = sum(f.blob_bytes[sent_as(config, "delta", final=True)] for f in self.fragments)
        down = sum(f.blob_bytes[sent_as(config, "update", final=True)] for f in self.fragments)
        return up, down

    def costs(self) -> Costs:
        """What a run of this split with ``learners`` learners costs (``protocol.costs``;
        a ``topk`` update counted as the union of every learner's selection, its most)."""
        config, fragments = self.config, self.fragments
        if config.update_encoding == TOPK:
            update = [self.learners * f.topk_update_bytes for f in fragments]
        else:
            update = [f.blob_bytes[config.update_encoding] for f in fragments]
        delta = [f.blob_bytes[config.delta_encoding] for f in fragments]
        fp32 = [f.blob_bytes["fp32"] for f in fragments]
        return costs(delta, update, fp32, config, self.learners)

    def __str__(self) -> str:
        config, total = self.config, self.params
        lines = [
            f"{total:,} parameters in {self.tensors} tensors, "
            f"fragments={config.fragments} pattern={config.pattern} "
            f"block_size={config.block_size}",
            f"{'fragment':>8} {'tensors':>7} {'parameters':>12} {'share':>6}"
            + "".join(f" {encoding:>10}" for encoding in (*ENCODINGS, TOPK)),
        ]
        for f in self.fragments:
            lines.append(
                f"{f.index:>8} {f.tensors:>7} {f.params:>12,} {f.params / max(total, 1):>6.1%}"
                + "".join(f" {_megabytes(f.blob_bytes[e]):>10}" for e in (*ENCODINGS, TOPK))
            )
        up, down = self.bytes_per_period()
        lines.append(
            f"one learner per {config.sync_every} steps: {_megabytes(up)} up "
            f"({config.delta_encoding} deltas), {_megabytes(down)} down "
            f"({config.update_encoding} updates)"
            + (
                " of one learner's selection: the union of K learners' is up to K times that"
                if config.update_encoding == TOPK
                else ""
            )
        )
        if TOPK in (config.delta_encoding, config.update_encoding):
            up, down = self.closing_bytes()
            lines.append(
                f"one learner at the close, once: {_megabytes(up)} up "
                f"({sent_as(config, 'delta', final=True)} final snapshots), "
                f"{_megabytes(down)} down ({sent_as(config, 'update', final=True)} updates)"
            )
        lines.extend(self.costs().lines())
        name, numel = self.largest_tensor
        if numel * config.fragments > total and config.pattern != "even":
            lines.append(
                f"{name!r} ({numel:,} parameters) is more than 1/{config.fragments} of the "
                "model: its fragment cannot be smaller than it"
            )
        return "\n".join(lines)


def _topk_bytes(spec: FragmentSpec, config: RunConfig) -> tuple[int, int]:
    """A ``topk`` delta of ``spec`` selecting all it may (magnitudes 1 to 2, so every
    selected element is sent, at places drawn at random with a fixed seed: the gaps its
    index codes take are those of a selection of no particular pattern) and the ``topk``
    update of that selection."""
    generator = torch.Generator().manual_seed(0)
    values = [torch.rand(param.shape, generator=generator).add_(1) for param in spec.params]
    delta = encode_fragment(values, spec, TOPK, block_size=1, sparsity=delta_sparsity(config))
    selected = decode_fragment(delta, spec)
    update = encode_fragment(selected, spec, TOPK, block_size=1, sparsity=update_sparsity(config))
    return len(delta), len(update)


def _megabytes(size: float) -> str:
    return f"{size / 1e6:.3f} MB"


def preview(
    named: Iterable[tuple[str, Tensor]], config: RunConfig | None = None, *, learners: int = 2
) -> Preview:
    """How ``config`` (default ``RunConfig()``) would split ``named`` (a model's
    ``named_parameters()``), with each fragment's blob size in every encoding and what a run
    of ``learners`` learners costs (``Preview.costs``).

    Sizes are exact: each fragment is encoded once per encoding from zeros of its shapes, one
    fragment at a time (so it briefly allocates one fragment's fp32 copy). Raises what
    ``signature`` raises.
    """
    config = config if config is not None else RunConfig()
    named = list(named)
    specs = signature(named, config.fragments, config.pattern)
    sizes = []
    for spec in specs:
        zeros = [torch.zeros(param.shape) for param in spec.params]
        blob_bytes = {
            encoding: len(encode_fragment(zeros, spec, encoding, block_size=config.block_size))
            for encoding in ENCODINGS
        }
        delta, update = _topk_bytes(spec, config)
        blob_bytes[TOPK] = delta
        sizes.append(FragmentSize(spec.index, len(spec.params), spec.numel, blob_bytes, update))
    largest = max(named, key=lambda item: item[1].numel())
    if learners < 1:
        raise ValueError(f"learners must be at least 1, got {learners}")
    return Preview(config, tuple(sizes), (largest[0], largest[1].numel()), len(named), learners)
