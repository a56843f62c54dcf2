"""``gradientmail export URL --out model.safetensors``: the run's newest model as one file.

For every fragment, the θ of its newest committed round (or the manifest's Θ⁰ when no round
has updated it yet) is read, verified against its sha256, decoded and cast back to each
parameter's original dtype. The file holds every parameter under its original name, so
``model.load_state_dict(safetensors.torch.load_file(path), strict=False)`` loads it (strict
loading fails only on names that are not parameters, such as buffers or tied aliases). Its
metadata ``gradientmail`` is JSON naming, per fragment, the version and round it holds.

A θ blob can be collected between listing the records and reading it, once a newer round of
its fragment commits; the export then lists again and takes the newer one.
"""

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
import safetensors.torch
import torch
from torch import Tensor

from gradientmail.cli._common import open_store
from gradientmail.cli._errors import CliError
from gradientmail.errors import CorruptBlob, RecordError
from gradientmail.mailbox import Mailbox, retrying
from gradientmail.protocol import keys
from gradientmail.protocol.codec import decode_fragment, verify
from gradientmail.protocol.records import BlobRef, FragmentSpec, Manifest, RoundRecord, decode

__all__ = ["Exported", "export", "newest_model"]

_READ_ATTEMPTS = 4
_RELIST_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class Exported:
    """Where fragment ``fragment``'s tensors came from: ``version`` committed by ``round``
    (None for Θ⁰), ``tensors`` tensors of ``parameters`` elements."""

    fragment: int
    version: int
    round: int | None
    tensors: int
    parameters: int


async def _get(mailbox: Mailbox, key: str) -> bytes | None:
    return await retrying(lambda: mailbox.get(key), attempts=_READ_ATTEMPTS)


async def _manifest(mailbox: Mailbox, url: str) -> Manifest:
    data = await _get(mailbox, keys.MANIFEST)
    if data is None:
        raise CliError(f"{url}: no run here (no manifest), so nothing to export")
    try:
        return decode(data, Manifest)
    except RecordError as exc:
        raise CliError(f"{url}: the run's manifest is unreadable: {exc}") from exc


async def _newest_records(mailbox: Mailbox, fragments: int) -> dict[int, int]:
    """fragment -> its newest committed round, from the listing of ``records/``."""
    listed = await retrying(lambda: mailbox.list(keys.RECORDS), attempts=_READ_ATTEMPTS)
    newest: dict[int, int] = {}
    for key in listed:
        round = keys.parse_record(key)
        if round is not None:
            fragment = keys.fragment_of(round, fragments)
            newest[fragment] = max(round, newest.get(fragment, -1))
    return newest


def _decoded(data: bytes, ref: BlobRef, spec: FragmentSpec) -> list[Tensor]:
    tensors = decode_fragment(verify(data, ref.sha256), spec)
    return [t.to(getattr(torch, p.dtype)) for t, p in zip(tensors, spec.params, strict=True)]


async def _fragment(
    mailbox: Mailbox, manifest: Manifest, spec: FragmentSpec, url: str, *, initial: bool
) -> tuple[list[Tensor], Exported]:
    for _ in range(_RELIST_ATTEMPTS):
        round = (
            None
            if initial
            else (await _newest_records(mailbox, len(manifest.fragments))).get(spec.index)
        )
        version, ref = 0, manifest.theta0[spec.index]
        if round is not None:
            data = await _get(mailbox, keys.record(round))
            if data is None:
                raise CliError(f"{url}: record {round} is listed but cannot be read")
            try:
                record = decode(data, RoundRecord)
            except RecordError as exc:
                raise CliError(f"{url}: record {round} is unreadable: {exc}") from exc
            version, ref = record.version, record.theta
        blob = await _get(mailbox, keys.blob(ref.sha256))
        if blob is None:
            continue
        try:
            tensors = await anyio.to_thread.run_sync(_decoded, blob, ref, spec)
        except (CorruptBlob, RecordError) as exc:
            raise CliError(
                f"{url}: θ of fragment {spec.index} (version {version}) is damaged: {exc}"
            ) from exc
        return tensors, Exported(
            spec.index, version, round, tensors=len(spec.params), parameters=spec.numel
        )
    raise CliError(
        f"{url}: the θ blob of fragment {spec.index} kept disappearing while reading "
        f"({_RELIST_ATTEMPTS} tries); the store may be missing blobs its records reference"
    )


async def newest_model(
    mailbox: Mailbox, url: str, *, initial: bool = False
) -> tuple[dict[str, Tensor], list[Exported]]:
    """Every parameter of the run's newest committed model (with ``initial``, of Θ⁰) by
    name, and where each fragment came from. ``CliError`` when there is no run or its
    objects are unusable."""
    manifest = await _manifest(mailbox, url)
    named: dict[str, Tensor] = {}
    sources: list[Exported] = []
    for spec in manifest.fragments:
        tensors, source = await _fragment(mailbox, manifest, spec, url, initial=initial)
        named.update((p.name, t) for p, t in zip(spec.params, tensors, strict=True))
        sources.append(source)
    return named, sources


def _save(named: dict[str, Tensor], sources: Sequence[Exported], out: Path) -> None:
    metadata = {
        "gradientmail": json.dumps(
            [{"fragment": s.fragment, "version": s.version, "round": s.round} for s in sources]
        )
    }
    partial = out.with_name(out.name + ".partial")
    safetensors.torch.save_file(named, str(partial), metadata=metadata)
    os.replace(partial, out)


async def export(url: str, out: Path) -> list[Exported]:
    """Write the newest committed model of the run at ``url`` to ``out`` (atomically: a
    partial file is renamed into place) and return where each fragment came from.

    Raises ``CliError`` when there is no store or no run, or ``out`` cannot be written.
    """
    async with open_store(url, must_exist=True) as mailbox:
        named, sources = await newest_model(mailbox, url)
    try:
        await anyio.to_thread.run_sync(_save, named, sources, out)
    except OSError as exc:
        raise CliError(f"cannot write {out}: {exc.strerror or exc}") from exc
    return sources
