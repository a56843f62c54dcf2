"""What the demo's processes agree on: the settings, where each file lives, and the progress
a learner reports.

The runner writes the settings of a session to ``<workdir>/session.json``; every learner
process reads them and builds the same corpus, model shape, run config and node timings from
them (``corpus``, ``model_config``, ``run_config``, ``node_options``). A learner reports its
progress by replacing ``<workdir>/progress/<learner>.json`` (``write_progress``), which the
runner reads (``read_progress``); its events go to ``<workdir>/events/<learner>.jsonl``.
"""

import os
from pathlib import Path
from typing import Literal

import msgspec

from gradientmail._node import NodeOptions
from gradientmail.demo.data import Corpus, synthetic, text_file
from gradientmail.demo.model import GPTConfig
from gradientmail.protocol.records import Encoding, RunConfig

__all__ = [
    "DemoSettings",
    "Phase",
    "Progress",
    "corpus",
    "events_path",
    "learner_name",
    "log_path",
    "model_config",
    "node_options",
    "progress_path",
    "read_progress",
    "run_config",
    "session_path",
    "write_progress",
]

Phase = Literal["starting", "training", "closing", "done", "interrupted", "failed"]
EVAL_BATCHES = 4
EVAL_BATCH_SIZE = 32


class DemoSettings(msgspec.Struct, frozen=True, kw_only=True):
    """One session of the demo (see ``gradientmail demo --help`` for each field).

    ``store`` is the run's mailbox URL; ``workdir`` the local directory for events,
    progress, logs, the evaluation history and the plot; ``session`` counts the sessions run
    on this workdir (0 for the first), so a resumed session draws fresh training batches.
    """

    store: str
    workdir: str
    learners: int = 3
    steps: int = 200
    batch_size: int = 16
    context: int = 64
    fragments: int = RunConfig().fragments
    sync_every: int = RunConfig().sync_every
    encoding: Encoding = "fp32"
    lr: float = 3e-3
    data: str | None = None
    model: Literal["tiny", "small", "medium"] = "small"
    seed: int = 0
    backend: Literal["asyncio", "trio"] = "asyncio"
    eval_every: float = 5.0
    live: bool = True
    session: int = 0


class Progress(msgspec.Struct, frozen=True, kw_only=True):
    """What a learner process reports: its phase, local steps and tokens this session, the
    loss of its last batch (averaged over recent steps), its throughput, the node's state
    (``NodeState`` fields) and, when failed, the error."""

    learner: str
    pid: int
    session: int
    phase: Phase
    step: int = 0
    steps: int = 0
    tokens: int = 0
    loss: float | None = None
    tokens_per_second: float = 0.0
    state: dict[str, object] | None = None
    error: str | None = None


def learner_name(index: int) -> str:
    return f"learner-{index}"


def session_path(workdir: str | Path) -> Path:
    return Path(workdir) / "session.json"


def events_path(workdir: str | Path, learner: str) -> Path:
    return Path(workdir) / "events" / f"{learner}.jsonl"


def progress_path(workdir: str | Path, learner: str) -> Path:
    return Path(workdir) / "progress" / f"{learner}.json"


def log_path(workdir: str | Path, learner: str) -> Path:
    return Path(workdir) / "logs" / f"{learner}.log"


def write_progress(workdir: str | Path, progress: Progress) -> None:
    """Replace the learner's progress file atomically (a reader sees the old or the new)."""
    path = progress_path(workdir, progress.learner)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(msgspec.json.encode(progress))
    os.replace(partial, path)


def read_progress(workdir: str | Path, learner: str) -> Progress | None:
    """The learner's last progress, or None when it has not written any (or it is garbled)."""
    try:
        return msgspec.json.decode(progress_path(workdir, learner).read_bytes(), type=Progress)
    except (OSError, msgspec.DecodeError):
        return None


def corpus(settings: DemoSettings) -> Corpus:
    """The synthetic language (seeded by ``settings.seed``), or the bytes of ``data``."""
    if settings.data is not None:
        return text_file(settings.data, shards=settings.learners, seed=settings.seed)
    return synthetic(length=settings.context, seed=settings.seed)


def model_config(settings: DemoSettings, vocab_size: int) -> GPTConfig:
    size = {"tiny": GPTConfig.tiny, "small": GPTConfig.small, "medium": GPTConfig.medium}
    return size[settings.model](vocab_size=vocab_size, context=settings.context)


def run_config(settings: DemoSettings) -> RunConfig:
    """The run's config: fragments, schedule and encodings from the settings (``topk``:
    ``RunConfig.sparse()``), the rest ``RunConfig``'s measured defaults (docs/protocol.md,
    "Recommended settings")."""
    if settings.encoding == "topk":
        return RunConfig.sparse(fragments=settings.fragments, sync_every=settings.sync_every)
    return RunConfig(
        fragments=settings.fragments,
        sync_every=settings.sync_every,
        delta_encoding=settings.encoding,
        update_encoding=settings.encoding,
    )


def node_options() -> NodeOptions:
    """Timings for processes on one machine: fast polls, a lease that lapses in 5 s."""
    return NodeOptions(
        poll_interval=0.2,
        lease_every=1.0,
        lease_timeout=5.0,
        claim_timeout=10.0,
        creation_timeout=10.0,
        close_timeout=20.0,
    )
