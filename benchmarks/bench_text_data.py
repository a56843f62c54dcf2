"""The real-text benchmark's corpus: the running interpreter's standard library source.

Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, ``site-packages`` and
``dist-packages`` excluded, read as bytes in sorted order of its POSIX path relative to that
directory. A file is held out for validation when the sha256 of that relative path, as an
integer, is 0 mod ``VALIDATION_MODULUS`` (about 1 in 20 files): the split is a property of
the path alone. Training bytes are the concatenation of the other files (a newline after
each), cut into ``shards`` contiguous shards; ``train(shard, …)`` yields windows at random
offsets of one shard from a generator seeded by ``(seed, shard, stream)``; ``evaluation``
gives evenly spaced windows of the validation bytes, the same for every caller.

The corpus depends on the interpreter's version: ``description`` names it with the byte
counts and a digest of the file list, and the result file records it.
"""

import functools
import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

VALIDATION_MODULUS = 20
_EXCLUDED = ("site-packages", "dist-packages")


def is_validation(relative: str) -> bool:
    """Whether the file at ``relative`` (POSIX path under the stdlib) is held out."""
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % VALIDATION_MODULUS == 0


@functools.cache
def _read(root: str) -> tuple[bytes, bytes, int, int, str]:
    base = Path(root)
    files = sorted(
        (path.relative_to(base).as_posix(), path)
        for path in base.rglob("*.py")
        if not set(path.relative_to(base).parts) & set(_EXCLUDED) and path.is_file()
    )
    if not files:
        raise RuntimeError(f"no *.py files under {root}: is this a full Python install?")
    train, held = bytearray(), bytearray()
    listing = hashlib.sha256()
    held_files = 0
    for relative, path in files:
        listing.update(relative.encode() + b"\0")
        text = path.read_bytes() + b"\n"
        if is_validation(relative):
            held += text
            held_files += 1
        else:
            train += text
    return bytes(train), bytes(held), len(files), held_files, listing.hexdigest()[:16]


class StdlibCorpus:
    """The byte-level corpus described in the module docstring."""

    def __init__(self, root: str, *, shards: int, seed: int) -> None:
        train, held, files, held_files, listing = _read(root)
        self.train_bytes = torch.frombuffer(bytearray(train), dtype=torch.uint8)
        self.eval_bytes = torch.frombuffer(bytearray(held), dtype=torch.uint8)
        self.shards = shards
        self.seed = seed
        self.description = (
            f"{root}: {files} *.py files, {files - held_files} for training "
            f"({len(train):,} bytes), {held_files} held out ({len(held):,} bytes); "
            f"file list sha256 {listing}"
        )

    def _windows(self, tokens: Tensor, starts: Tensor, length: int) -> Tensor:
        return tokens[starts[:, None] + torch.arange(length + 1)].to(torch.int64)

    def train(
        self, shard: int, *, batch_size: int, length: int, stream: int = 0
    ) -> Iterator[Tensor]:
        """Endless ``[batch_size, length + 1]`` windows of shard ``shard``."""
        size = len(self.train_bytes) // self.shards
        part = self.train_bytes[shard * size : (shard + 1) * size]
        generator = torch.Generator().manual_seed(
            int.from_bytes(hashlib.sha256(f"{self.seed}/{shard}/{stream}".encode()).digest()[:8])
        )
        while True:
            starts = torch.randint(0, len(part) - length - 1, (batch_size,), generator=generator)
            yield self._windows(part, starts, length)

    def evaluation(self, batches: int, batch_size: int, *, length: int) -> list[Tensor]:
        """``batches`` batches of ``batch_size`` evenly spaced validation windows."""
        room = len(self.eval_bytes) - length - 1
        starts = torch.linspace(0, room - 1, batches * batch_size).to(torch.int64)
        return [
            self._windows(self.eval_bytes, starts[i : i + batch_size], length)
            for i in range(0, len(starts), batch_size)
        ]


def stdlib_corpus(*, shards: int, seed: int) -> StdlibCorpus:
    """The corpus of this interpreter's standard library."""
    return StdlibCorpus(sysconfig.get_paths()["stdlib"], shards=shards, seed=seed)
