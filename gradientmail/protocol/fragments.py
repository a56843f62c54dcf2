"""How a model is split into fragments, how two splits are compared, and when each is due.

Splitting (``signature``) is deterministic: the same named parameters, fragment count and
pattern give the same ``FragmentSpec``s on every machine. Within a fragment, parameters keep
the model's order. Two patterns:

``contiguous``
    Consecutive parameters in module order, cut into ``F`` groups balanced by element count:
    the k-th cut (k = 1 … F−1) falls after the shortest prefix whose element count is closest
    to ``k/F`` of the model's, while leaving every group at least one parameter.
``strided``
    Parameters are grouped into blocks, and block ``i`` goes to fragment ``i mod F``, so each
    fragment holds every F-th block (Streaming DiLoCo's better pattern: a transformer's layers
    ``f, f+F, f+2F, …``). A parameter's block is its name up to and including the first
    all-digit component (``layers.3.attn.q.weight`` → ``layers.3``), or, for a name without
    one, its module (the name without its last component: ``embed.weight`` → ``embed``).
    Blocks are numbered in order of first appearance. A model with fewer blocks than
    fragments deals out single parameters instead.

The schedule: fragments are staggered by ``H // F`` local steps (``H = sync_every``), so that
on a steady learner one fragment is in flight at a time, and in round order: fragment ``f``
is due after every local step ``s > 0`` with ``s ≡ offset(f) (mod H)``, where
``offset(f) = (f + 1)·H // F mod H``. Fragment 0 goes first (after step ``H // F``), fragment
``F − 1`` last (after step ``H``), then the cycle repeats. Round ``r`` updates fragment
``r mod F``, so a learner's first snapshots land in rounds 0, 1, 2, … in that order; with
fragment 0 last instead, round 0 would be the last of its period to get a snapshot and every
syncer (rounds close in order) would wait on it, or close the rounds before it empty.

Pure: no I/O.
"""

import bisect
import itertools
import re
from collections.abc import Sequence

from torch import Tensor

from gradientmail.protocol.records import FragmentSpec, ParamSpec, Pattern, RunConfig

__all__ = ["block_of", "due", "mismatch", "offset", "signature"]

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


def signature(
    named: Sequence[tuple[str, Tensor]], fragments: int, pattern: Pattern
) -> tuple[FragmentSpec, ...]:
    """Split ``named`` (``model.named_parameters()`` order) into ``fragments`` fragments.

    Every fragment is non-empty. Raises ``ValueError`` for fewer parameter tensors than
    fragments (use fewer fragments), a repeated or empty name, a parameter that is not a
    floating-point tensor, a fragment count below 1 or an unknown pattern.
    """
    if not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"fragments must be a positive integer, got {fragments!r}")
    params = [_param(name, tensor) for name, tensor in named]
    seen: set[str] = set()
    for param in params:
        if param.name in seen:
            raise ValueError(f"parameter name {param.name!r} occurs twice")
        seen.add(param.name)
    if len(params) < fragments:
        raise ValueError(
            f"the model has {len(params)} parameter tensors, fewer than the {fragments} "
            f"fragments asked for; use at most {len(params)} fragments"
        )
    if pattern == "contiguous":
        groups = _contiguous(params, fragments)
    elif pattern == "strided":
        groups = _strided(params, fragments)
    else:
        raise ValueError(f"unknown fragment pattern {pattern!r}: use 'contiguous' or 'strided'")
    return tuple(
        FragmentSpec(index=index, params=tuple(params[i] for i in group))
        for index, group in enumerate(groups)
    )


def _describe(param: ParamSpec) -> str:
    return f"{param.name!r} (shape {list(param.shape)}, {param.dtype})"


def mismatch(run: Sequence[FragmentSpec], ours: Sequence[FragmentSpec]) -> str | None:
    """None if ``ours`` is the run's signature, else a sentence naming the first difference.

    Checked in order: the run's parameters in fragment order (one missing from this model, or
    of another shape or dtype), then parameters this model has that the run lacks, then the
    fragment count, then which parameters each fragment holds.
    """
    theirs = [param for spec in run for param in spec.params]
    mine = {param.name: param for spec in ours for param in spec.params}
    advice = "build the model exactly as the run's creator did, or start a new run"
    for param in theirs:
        other = mine.get(param.name)
        if other is None:
            return f"the run's parameter {_describe(param)} is missing from this model; {advice}"
        if other.shape != param.shape or other.dtype != param.dtype:
            return (
                f"parameter {param.name!r}: the run has shape {list(param.shape)}, "
                f"{param.dtype}; this model has shape {list(other.shape)}, {other.dtype}; {advice}"
            )
    known = {param.name for param in theirs}
    for spec in ours:
        for param in spec.params:
            if param.name not in known:
                return f"this model's parameter {_describe(param)} is not in the run; {advice}"
    if len(run) != len(ours):
        return (
            f"the run has {len(run)} fragments, this node split the model into {len(ours)}; "
            "join with the run's config"
        )
    for a, b in zip(run, ours, strict=True):
        names_a, names_b = [p.name for p in a.params], [p.name for p in b.params]
        if names_a != names_b:
            first = next(x or y for x, y in itertools.zip_longest(names_a, names_b) if x != y)
            return (
                f"fragment {a.index} holds {len(a.params)} parameters in the run and "
                f"{len(b.params)} here (first difference at {first!r}); join with the run's "
                "fragment pattern"
            )
    return None


def offset(fragment: int, config: RunConfig) -> int:
    """The local step, modulo ``sync_every``, at which ``fragment`` is due:
    ``(fragment + 1) · sync_every // fragments mod sync_every``."""
    if not 0 <= fragment < config.fragments:
        raise ValueError(f"fragment {fragment} is not in [0, {config.fragments})")
    return (fragment + 1) * config.sync_every // config.fragments % config.sync_every


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
