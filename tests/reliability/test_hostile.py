"""Hostile and broken input: each gets a clear error, or a rejection whose reason is in an
event, and the run goes on.

A writer without any right to the run (but with write access to the store) drops, into the
rounds ahead of a two-node run: a snapshot whose blob does not match its hash, one of the
wrong shapes, one holding NaN, one claiming far too many tokens, snapshots that are not
JSON, too big or of an unknown format, and keys outside the layout. The nodes reject the
first four by name in the round's record (``RoundCommitted``), skip the rest, and the run
reaches its target with every round committed once and every honest step accounted for.
Then the entry checks: a different model, a contradicting config, bad URLs, a missing
bucket, each a clear error naming what is wrong (and never a credential).
"""

import json

import anyio
import pytest
import torch
from reliability_helpers import (
    CONFIG,
    FAST,
    Recorder,
    Trainer,
    assert_steps_accounted,
    commits_by_round,
    history,
    tiny_model,
)
from torch import nn

import gradientmail
from gradientmail.errors import RunMismatch
from gradientmail.events import PollFailed, RecoveryFailed, RoundCommitted, RoundFailed
from gradientmail.mailbox import Mailbox, MemoryMailbox
from gradientmail.mailbox import open as open_mailbox
from gradientmail.protocol import keys, records
from gradientmail.protocol.codec import digest, encode_fragment
from gradientmail.protocol.records import (
    MAX_RECORD_BYTES,
    BlobRef,
    FragmentSpec,
    Manifest,
    ParamSpec,
    RunConfig,
    Snapshot,
)

pytestmark = pytest.mark.anyio

REJECTED = {"corrupt", "shape", "non-finite", "tokens"}
JUNK_KEYS = (
    "records/abc",
    "records/0000000001x",
    "blobs/not-a-hash",
    "leases/evil/notabeat",
    "create/junk",
    "init/0000/x",
    "rounds/junk/claims/0000",
    "rounds/0000000099/snapshots/bad id!",
    "rounds/0000000099/elsewhere/evil",
    "stray",
)


async def _put_blob(box: Mailbox, data: bytes) -> BlobRef:
    sha = digest(data)
    await box.put_if_absent(keys.blob(sha), data)
    return BlobRef(sha256=sha, size=len(data), encoding="fp32")


async def _hostile_snapshots(box: Mailbox, manifest: Manifest, round: int) -> None:
    """One snapshot of each hostile kind into ``round``, under learners named for it."""
    fragment = keys.fragment_of(round, manifest.config.fragments)
    spec = manifest.fragments[fragment]
    base = keys.version_of(round, manifest.config.fragments) - 1
    zeros = [torch.zeros(p.shape) for p in spec.params]
    nan = [torch.full(p.shape, float("nan")) for p in spec.params]
    wrong = FragmentSpec(
        index=spec.index,
        params=tuple(
            ParamSpec(name=p.name, shape=(*p.shape, 2), dtype=p.dtype) for p in spec.params
        ),
    )
    good = await _put_blob(box, encode_fragment(zeros, spec, "fp32", block_size=1))
    claimed = digest(b"what the snapshot claims")
    await box.put_if_absent(keys.blob(claimed), b"something else entirely")
    deltas = {
        "corrupt": BlobRef(sha256=claimed, size=24, encoding="fp32"),
        "shape": await _put_blob(
            box,
            encode_fragment(
                [torch.zeros(p.shape) for p in wrong.params], wrong, "fp32", block_size=1
            ),
        ),
        "non-finite": await _put_blob(box, encode_fragment(nan, spec, "fp32", block_size=1)),
        "tokens": good,
    }
    for kind, delta in deltas.items():
        snapshot = Snapshot(
            learner=f"evil-{kind}",
            round=round,
            fragment=fragment,
            base_version=base,
            steps=1,
            tokens=10**15 if kind == "tokens" else 16,
            delta=delta,
            norm=None,
        )
        await box.put_if_absent(keys.snapshot(round, snapshot.learner), records.encode(snapshot))
    unknown = json.loads(records.encode(snapshot))
    unknown["format"] = 99
    broken = {
        "evil-json": b"{this is not json",
        "evil-big": b'{"format":1,"pad":"' + b"x" * MAX_RECORD_BYTES + b'"}',
        "evil-format": json.dumps(unknown).encode(),
        "evil-shape-of-json": b"[1, 2, 3]",
    }
    for learner, data in broken.items():
        await box.put_if_absent(keys.snapshot(round, learner), data)


async def test_hostile_objects_are_rejected_and_the_run_goes_on() -> None:
    box = MemoryMailbox()
    for key in JUNK_KEYS:
        await box.put_if_absent(key, b"junk")
    sink = Recorder()
    finals = {}
    target = 12

    async def member(index: int, name: str) -> None:
        model = tiny_model(index)
        async with gradientmail.node(
            model, box, learner=name, config=CONFIG, options=FAST, sinks=[sink]
        ) as node:
            trainer = Trainer(model, index)
            with anyio.fail_after(90):
                while node.state.round < target:
                    trainer.step()
                    await node.step(tokens=16)
                    await anyio.sleep(0.002)
        finals[name] = node.state

    async def attacker() -> None:
        with anyio.fail_after(30):
            while (data := await box.get(keys.MANIFEST)) is None:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        manifest = records.decode(data, Manifest)
        for round in (3, 6):
            await _hostile_snapshots(box, manifest, round)

    async with anyio.create_task_group() as tg:
        tg.start_soon(attacker)
        for index, name in enumerate(("a", "b")):
            tg.start_soon(member, index, name)

    found = await history(box)
    assert len(found) > target
    assert commits_by_round(sink.events) == {r.round: 1 for r in found}
    reasons: dict[str, set[str]] = {}
    for event in sink.of(RoundCommitted):
        for rejection in event.record.rejected:  # type: ignore[attr-defined]
            reasons.setdefault(rejection.learner, set()).add(rejection.reason)
            assert rejection.detail, f"{rejection.learner}: a rejection without detail"
    for kind in REJECTED:
        assert reasons.get(f"evil-{kind}") == {kind}, reasons
    accepted = {p.learner for r in found for p in r.participants}
    assert accepted == {"a", "b"}
    for name, state in finals.items():
        assert_steps_accounted(name, state.steps, state.tokens, sink.events, found)


@pytest.mark.parametrize(
    ("what", "data"),
    [
        ("not JSON", b"{claim"),
        ("unknown format", b'{"format":99,"learner":"x"}'),
        ("wrong shape", b'{"format":1,"learner":7}'),
    ],
)
async def test_a_broken_claim_does_not_stall_its_round(what: str, data: bytes) -> None:
    box = MemoryMailbox()
    await box.put_if_absent(keys.round_claim(2, 0), data)
    sink = Recorder()
    model = tiny_model(0)
    async with gradientmail.node(
        model, box, learner="a", config=CONFIG, options=FAST, sinks=[sink]
    ) as node:
        trainer = Trainer(model, 0)
        with anyio.fail_after(30):
            while node.state.round < 4:
                trainer.step()
                await node.step(tokens=16)
                await anyio.sleep(0.002)
    found = await history(box)
    assert len(found) >= 5, what


class Wider(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 9)
        self.second = nn.Linear(9, 1)


async def _created_run() -> MemoryMailbox:
    box = MemoryMailbox()
    async with gradientmail.node(
        tiny_model(0), box, learner="creator", config=CONFIG, options=FAST
    ):
        pass
    return box


async def test_a_different_model_is_refused_by_name() -> None:
    box = await _created_run()
    with pytest.raises(RunMismatch, match=r"0\.weight|shape|parameter"):
        async with gradientmail.node(Wider(), box, learner="other", options=FAST):
            pass
    assert await box.get(keys.lease("other", 0, "learner")) is None


async def test_a_contradicting_config_is_refused_by_field() -> None:
    box = await _created_run()
    with pytest.raises(RunMismatch, match="sync_every"):
        async with gradientmail.node(
            tiny_model(1),
            box,
            learner="other",
            config=RunConfig(fragments=CONFIG.fragments, sync_every=CONFIG.sync_every * 2),
            options=FAST,
        ):
            pass


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("ftp://host/run", "ftp"),
        ("s3:///no-bucket", "bucket"),
        ("s3://bucket/run?nonsense=1", "nonsense"),
    ],
)
def test_a_bad_url_is_named(url: str, named: str) -> None:
    with pytest.raises(ValueError, match="accepted forms") as info:
        open_mailbox(url)
    assert named in str(info.value)


async def test_a_missing_bucket_is_named_and_no_credential_is_printed(
    moto_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "wJalrXUtnFEMI-very-secret-key-for-the-test"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    url = f"s3://no-such-bucket-here/run?endpoint_url={moto_server}&region=us-east-1"
    with pytest.raises(Exception) as info:  # noqa: PT011
        async with gradientmail.node(tiny_model(0), url, learner="a", config=CONFIG, options=FAST):
            pass
    text = "".join(str(e) for e in _chain(info.value)) + repr(info.value)
    assert "no-such-bucket-here" in text
    assert secret not in text


def _chain(error: BaseException) -> list[BaseException]:
    found = [error]
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
        found.append(error)
    return found


DEEP = b"[" * 1000 + b"]" * 1000
BROKEN_RECORDS = {
    "not JSON": b"{record",
    "over the size limit": b'{"format":1,"pad":"' + b"x" * MAX_RECORD_BYTES + b'"}',
    "an unknown format": b'{"format":99}',
    "the wrong shape": b'{"format":1,"round":"two"}',
    "nested 1,000 deep": DEEP,
    "nested inside a record": b'{"format":1,"round":' + DEEP + b"}",
}


@pytest.mark.parametrize("what", sorted(BROKEN_RECORDS))
async def test_a_broken_record_is_skipped_and_the_round_commits_at_its_successor(
    what: str,
) -> None:
    """A broken object planted at the key of the next round's record (create-once, so it
    cannot be replaced) does not stop the run: the node skips it (once: it is remembered),
    commits the round at the key's successor and goes on."""
    data = BROKEN_RECORDS[what]
    box = MemoryMailbox()
    sink = Recorder()
    model = tiny_model(0)

    async def vandal() -> None:
        with anyio.fail_after(30):
            while await box.get(keys.record(0)) is None:  # noqa: ASYNC110
                await anyio.sleep(0.005)
        await box.put_if_absent(keys.record(2), data)

    async with anyio.create_task_group() as tg:
        tg.start_soon(vandal)
        async with gradientmail.node(
            model, box, learner="a", config=CONFIG, options=FAST, sinks=[sink]
        ) as node:
            trainer = Trainer(model, 0)
            with anyio.fail_after(30):
                while node.state.round < 5:
                    trainer.step()
                    await node.step(tokens=16)
                    await anyio.sleep(0.002)
    found = await history(box)
    assert [r.round for r in found][:6] == list(range(6))
    assert await box.get(keys.record_slot(2, 1)) is not None, what
    assert not sink.of(RoundFailed) + sink.of(PollFailed) + sink.of(RecoveryFailed)


async def test_a_broken_manifest_is_skipped_for_its_successor() -> None:
    box = MemoryMailbox()
    await box.put_if_absent(keys.MANIFEST, b'{"format":1,"created_by":"x"}')
    await box.put_if_absent(keys.manifest_slot(1), DEEP)
    async with gradientmail.node(tiny_model(0), box, learner="a", options=FAST) as node:
        assert node.manifest.created_by == "a"
    assert await box.get(keys.manifest_slot(2)) is not None
    async with gradientmail.node(tiny_model(0), box, learner="b", options=FAST) as node:
        assert node.manifest.created_by == "a"
