"""One node in its own process, that may SIGKILL itself at a chosen point.

    python kill_worker.py URL LEARNER SEED UNTIL BACKEND OUT_DIR ROLE KILL [GATE]

ROLE: ``learner`` (trains and closes rounds), ``learner-only`` (trains; no syncer) or
``syncer`` (no model; runs until the file ``OUT_DIR/stop`` exists).
UNTIL: train until the node has seen this round's record; ``+N``: N rounds after the newest
one when it joined.
KILL: ``none``; ``counted:N`` (after N local steps, once a round record that counts this
learner has reached it: the life that dies has work in the run); ``claim`` (right after its
first claim on a round lands); ``blob`` (right after the first blob it writes once it holds
a claim); ``record`` (when it is about to write its first round record); ``init:N`` (right
after its N-th Θ⁰ marker lands). The kill is a real ``SIGKILL`` of this process, from inside the
mailbox call at that point, so nothing after it runs: no flush, no lease release.
GATE: a file whose name (in OUT_DIR) the node waits for once its imports are done, so that
a test can start a process ahead of the moment it needs the node (start-up costs seconds).

On a clean exit it writes ``OUT_DIR/LEARNER.json``: its steps, tokens, versions, drops, the
rounds it committed, claimed and took over, and when it joined.
"""

import json
import os
import signal
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import anyio
from reliability_helpers import CONFIG, FAST, Recorder, Trainer, tiny_model

import gradientmail
from gradientmail.events import (
    FragmentAligned,
    Joined,
    Recovered,
    RoundClaimed,
    RoundCommitted,
    StepsDropped,
    TookOverCreation,
    TookOverRound,
)
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox import open as open_mailbox
from gradientmail.protocol import keys


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def counted(sink: Recorder) -> bool:
    """Whether a round record that took this learner's snapshot has been applied."""
    return any(isinstance(e, FragmentAligned) and e.lag_steps is not None for e in sink.events)


class KillingMailbox:
    """Forwards to ``inner`` and SIGKILLs the process at the point ``kill`` names."""

    def __init__(self, inner: Mailbox, kill: str) -> None:
        self._inner = inner
        self._kill = kill
        self._claimed = False
        self._markers = 0

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        if self._kill == "record" and keys.parse_record(key) is not None:
            die()
        created = await self._inner.put_if_absent(key, data)
        if created and keys.parse_claim(key) is not None:
            self._claimed = True
            if self._kill == "claim":
                die()
        if self._kill == "blob" and self._claimed and keys.parse_blob(key) is not None:
            die()
        if self._kill.startswith("init:") and created and keys.parse_init_marker(key):
            self._markers += 1
            if self._markers == int(self._kill.split(":")[1]):
                die()
        return created

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        return await self._inner.get(key, max_bytes=max_bytes)

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        return await self._inner.list(prefix, after=after)

    async def delete(self, keys_: Iterable[str]) -> None:
        await self._inner.delete(keys_)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


async def main(
    url: str, learner: str, seed: int, until: str, out: Path, role: str, kill: str
) -> None:
    sink = Recorder()
    times: list[tuple[float, Any]] = []
    model = None if role == "syncer" else tiny_model(seed)
    options = replace(FAST, syncer=role != "learner-only")
    started = time.monotonic()
    async with open_mailbox(url) as inner:
        box = KillingMailbox(inner, kill)
        async with gradientmail.node(
            model,
            box,
            learner=learner,
            config=CONFIG,
            options=options,
            sinks=[sink, lambda event: times.append((time.monotonic(), event))],
        ) as node:
            joined = node.state.round
            entered = time.monotonic()
            if model is None:
                # The stop file is written by another process: nothing to wait on but time.
                # A syncer stops once it has rebuilt its state at least once.
                while not (out / "stop").exists() or not sink.of(Recovered):  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            else:
                target = joined + int(until[1:]) if until.startswith("+") else int(until)
                limit = int(kill.split(":")[1]) if kill.startswith("counted:") else None
                trainer = Trainer(model, seed)
                with anyio.fail_after(120):
                    while node.state.round < target:
                        trainer.step()
                        await node.step(tokens=16)
                        if limit is not None and node.state.steps >= limit and counted(sink):
                            die()
                        await anyio.sleep(0.002)
    state = node.state
    events: list[Any] = sink.events
    took_over = [e for e in events if isinstance(e, TookOverRound)]
    report = {
        "steps": state.steps,
        "tokens": state.tokens,
        "versions": list(state.versions),
        "joined": joined,
        "drops": [
            {"fragment": e.fragment, "steps": e.steps, "tokens": e.tokens}
            for e in events
            if isinstance(e, StepsDropped)
        ],
        "committed": [e.record.round for e in events if isinstance(e, RoundCommitted)],
        "claimed": [e.round for e in events if isinstance(e, RoundClaimed)],
        "took_over": [{"round": e.round, "cause": e.cause} for e in took_over],
        "took_over_after": [at - entered for at, e in times if isinstance(e, TookOverRound)],
        "took_over_creation": any(isinstance(e, TookOverCreation) for e in events),
        "recovered": [e.round for e in events if isinstance(e, Recovered)],
        "created_by": next(e.created_by for e in events if isinstance(e, Joined)),
        "seconds": time.monotonic() - started,
    }
    (out / f"{learner}.json").write_text(json.dumps(report))


def wait_for(gate: Path, limit: float = 200.0) -> None:
    """Wait until ``gate`` exists (another process writes it: nothing to wait on but time)."""
    deadline = time.monotonic() + limit
    while not gate.exists():
        if time.monotonic() > deadline:
            sys.exit(f"{gate} did not appear within {limit} s")
        time.sleep(0.02)


if __name__ == "__main__":
    url, learner, seed, until, backend, out, role, kill, *gate = sys.argv[1:]
    if gate:
        wait_for(Path(out) / gate[0])
    anyio.run(main, url, learner, int(seed), until, Path(out), role, kill, backend=backend)
