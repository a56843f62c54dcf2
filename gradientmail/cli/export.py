"""``gradientmail export URL --out model.safetensors``: the run's newest model as one file.

Built on the read path (``gradientmail.reader``), as ``gradientmail.load`` is: for every
fragment, the θ of its newest committed round (or the manifest's Θ⁰ when no round has updated
it yet) is read, verified against its sha256 (and, in a signed run, its record under the run
key from ``GRADIENTMAIL_RUN_KEY``), decoded and cast back to each parameter's original dtype.
The file holds every parameter under its original name, so
``model.load_state_dict(safetensors.torch.load_file(path), strict=False)`` loads it (strict
loading fails only on names that are not parameters, such as buffers or tied aliases). Its
metadata ``gradientmail`` is JSON naming, per fragment, the version and round it holds. It is
written with the user's umask, like any file the user creates.
"""

import json
import os
from collections.abc import Sequence
from pathlib import Path

import anyio.to_thread
import safetensors.torch
from torch import Tensor

from gradientmail.errors import NoRun, UsageError
from gradientmail.protocol.signing import RunKey
from gradientmail.reader import RunReader, Source, open_mailbox

__all__ = ["export"]


def _save(named: dict[str, Tensor], sources: Sequence[Source], out: Path) -> None:
    metadata = {
        "gradientmail": json.dumps(
            [{"fragment": s.fragment, "version": s.version, "round": s.round} for s in sources]
        )
    }
    data = safetensors.torch.save(named, metadata=metadata)
    partial = out.with_name(out.name + ".partial")
    # Written by open() rather than safetensors' save_file, which makes the file 0600.
    with partial.open("wb") as file:
        file.write(data)
    os.replace(partial, out)


async def export(url: str, out: Path) -> list[Source]:
    """Write the newest committed model of the run at ``url`` to ``out`` (atomically: a
    partial file is renamed into place) and return where each fragment came from.

    Raises ``UsageError`` when there is no store or no run, or ``out`` cannot be written;
    ``RunMismatch`` for a signed run without its key; ``CorruptBlob`` / ``RecordError`` for
    damaged blobs.
    """
    async with open_mailbox(url, must_exist=True) as mailbox:
        reader = RunReader.of(mailbox, RunKey.from_env())
        try:
            manifest = await reader.manifest()
        except NoRun as exc:
            raise UsageError(f"{url}: {exc}, so nothing to export") from exc
        newest = await reader.newest(manifest)
    sources = newest.sources(manifest)
    try:
        await anyio.to_thread.run_sync(_save, newest.state_dict(manifest), sources, out)
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from exc
    return sources
