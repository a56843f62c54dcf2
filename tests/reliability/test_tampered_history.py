"""A committed round record overwritten in the store, as an attacker who can overwrite objects
(a bucket without object lock or versioning) would do it: the bytes of the record's file in a
real ``LocalMailbox`` directory replaced with junk, or with another well-formed record of the
round naming another update. A node that joins or restarts then must not commit a second
record of the round (a fork) and stops with ``StoreTampered`` naming the key; ``status`` says
which key it is."""

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch
from msgspec.structs import replace
from reliability_helpers import CONFIG, FAST, Trainer, tiny_model

import gradientmail
from gradientmail import StoreTampered
from gradientmail.mailbox import LocalMailbox
from gradientmail.mailbox.local import key_path
from gradientmail.protocol import keys, records
from gradientmail.protocol.signing import RunKey
from gradientmail.store import Store

pytestmark = pytest.mark.anyio

SECRET = "the run secret, long enough"


async def train(node: gradientmail.Node, model: torch.nn.Module, until_round: int) -> None:
    trainer = Trainer(model, seed=1)
    with anyio.fail_after(60):
        while node.state.round < until_round:
            trainer.step()
            await node.step(tokens=16)
            await anyio.sleep(0.002)


async def committed_run(directory: Path, run_key: str | None) -> int:
    """A run of one learner in ``directory`` with at least six rounds committed and the
    round after the newest claimed; the newest committed round."""
    model = tiny_model()
    key = None if run_key is None else RunKey(run_key)
    async with LocalMailbox(directory) as box:
        async with gradientmail.node(
            model, box, learner="a", config=CONFIG, options=FAST, run_key=run_key
        ) as node:
            await train(node, model, until_round=6)
        store = Store(box, run_key=key)
        await store.manifest()
        with anyio.fail_after(30):
            while True:
                newest = (await store.record_rounds())[-1]
                if await store.round_claims(newest + 1):
                    return newest
                # The node closed between a commit and its claim on the next round.
                await store.claim_round(newest + 1, 0, "a")


def overwrite(directory: Path, key: str, data: bytes) -> None:
    (directory / "objects").joinpath(*key_path(key)).write_bytes(data)


async def forged(directory: Path, round: int) -> bytes:
    """A well-formed record of ``round`` naming the update of another round of its fragment,
    chained onto the round before as the original is."""
    async with LocalMailbox(directory) as box:
        store = Store(box)
        await store.manifest()
        original = await store.record(round)
        other = await store.record(round - CONFIG.fragments)
    assert original is not None
    assert other is not None
    assert other.update != original.update
    return records.encode(replace(original, update=other.update, committed_by="mallory"))


def tampered(error: BaseException) -> StoreTampered:
    """The ``StoreTampered`` that ``error`` is or carries (as a cause or in a group)."""
    pending: list[BaseException] = [error]
    while pending:
        exc = pending.pop()
        if isinstance(exc, StoreTampered):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        pending.extend(e for e in (exc.__cause__, exc.__context__) if e is not None)
    raise AssertionError(f"no StoreTampered in {error!r}") from error


async def listed_records(directory: Path) -> dict[str, bytes]:
    async with LocalMailbox(directory) as box:
        return {key: await box.get(key) or b"" for key in await box.list(keys.RECORDS)}


async def joiner_fails(directory: Path, learner: str, run_key: str | None) -> StoreTampered:
    model = tiny_model(seed=3)
    try:
        async with (
            LocalMailbox(directory) as box,
            gradientmail.node(
                model, box, learner=learner, config=CONFIG, options=FAST, run_key=run_key
            ) as node,
        ):
            trainer = Trainer(model, seed=2)
            with anyio.fail_after(60):
                while True:
                    trainer.step()
                    await node.step(tokens=16)
                    await anyio.sleep(0.002)
    except Exception as exc:
        return tampered(exc)
    raise AssertionError("the node went on over a tampered history")


@pytest.mark.parametrize(
    ("victim", "kind", "run_key"),
    [
        ("before-newest", "junk", None),
        ("before-newest", "junk", SECRET),
        ("before-newest", "forged", None),
        ("newest", "junk", SECRET),
        ("newest", "junk", None),
    ],
)
@pytest.mark.parametrize("learner", ["a", "b"])
async def test_an_overwritten_record_stops_a_node_instead_of_forking(
    tmp_path: Path, victim: str, kind: str, run_key: str | None, learner: str
) -> None:
    newest = await committed_run(tmp_path, run_key)
    round = newest - 1 if victim == "before-newest" else newest
    key = keys.record(round)
    overwrite(tmp_path, key, b"overwritten" if kind == "junk" else await forged(tmp_path, round))
    before = await listed_records(tmp_path)
    error = await joiner_fails(tmp_path, learner, run_key)
    assert error.key == key, error
    assert key in str(error)
    assert await listed_records(tmp_path) == before, "a second record was committed"


async def test_status_names_the_overwritten_key(tmp_path: Path) -> None:
    newest = await committed_run(tmp_path, None)
    key = keys.record(newest - 2)
    overwrite(tmp_path, key, await forged(tmp_path, newest - 2))
    result = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-m", "gradientmail", "status", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "200"},
            check=False,
        )
    )
    assert result.returncode == 1, result
    assert f"{key} is not the record" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
