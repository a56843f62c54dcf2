"""The typed store: verified blobs, strict records, counted requests, ambiguous writes."""

import os
from collections.abc import Sequence

import msgspec
import pytest

from gradientmail.errors import CorruptBlob, MailboxUnavailable
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.records import INDEX_CHUNK, BlobRef, LeaseBeat, Snapshot, chunk_index
from gradientmail.store import Store, sha256

pytestmark = pytest.mark.anyio


class LostReplies(MemoryMailbox):
    """Writes land, but the first ``lose`` replies to ``put_if_absent`` are lost."""

    def __init__(self, lose: int) -> None:
        super().__init__()
        self.lose = lose

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        created = await super().put_if_absent(key, data)
        if self.lose:
            self.lose -= 1
            raise MailboxUnavailable("reply lost")
        return created


class Fast:
    """A clock whose sleeps return at once, so retries cost no time."""

    def now(self) -> float:
        return 0.0

    async def sleep(self, seconds: float) -> None:
        return None


async def test_blobs_round_trip_verified_and_counted() -> None:
    store = Store(MemoryMailbox())
    ref = await store.put_blob(b"payload", "fp32")
    assert ref.sha256 == sha256(b"payload")
    assert ref.size == 7
    assert await store.get_blob(ref) == b"payload"
    stats = store.stats
    assert stats.bytes_up == 7
    assert stats.bytes_down == 7
    assert stats.requests["put"] == 1
    assert stats.requests["get"] == 1


async def test_a_damaged_blob_raises_and_a_gone_one_reads_none() -> None:
    box = MemoryMailbox()
    store = Store(box)
    ref = await store.put_blob(b"payload", "fp32")
    await box.delete([keys.blob(ref.sha256)])
    assert await store.get_blob(ref) is None
    await box.put_if_absent(keys.blob(ref.sha256), b"tampered")
    with pytest.raises(CorruptBlob):
        await store.get_blob(ref)


async def test_a_lost_reply_to_our_own_claim_counts_as_ours() -> None:
    store = Store(LostReplies(lose=1), clock=Fast())
    assert await store.claim_round(3, 0, "a")
    assert await store.round_claims(3) == [(0, "a")]


async def test_a_lost_reply_never_steals_someone_elses_claim() -> None:
    box = LostReplies(lose=0)
    assert await Store(box).claim_round(3, 0, "b")
    box.lose = 1
    assert not await Store(box, clock=Fast()).claim_round(3, 0, "a")


async def test_a_malformed_record_is_skipped_for_its_successor() -> None:
    box = MemoryMailbox()
    store = Store(box)
    await box.put_if_absent(keys.record(0), b"{not json")
    assert await store.record(0) is None
    assert keys.record(0) in store.ignored


async def test_listings_parse_the_layout() -> None:
    box = MemoryMailbox()
    store = Store(box)
    await store.beat("a", 1, "learner")
    await store.beat("a", 2, "learner")
    await store.beat("b", 7, "syncer")
    await box.put_if_absent("leases/odd-key", b"x")
    await box.put_if_absent("leases/a/000000000009.driver", b"x")
    assert await store.leases() == {"a": (2, "learner"), "b": (7, "syncer")}
    assert await store.own_beats("a") == [
        (1, "leases/a/000000000001.learner"),
        (2, "leases/a/000000000002.learner"),
    ]
    for round in (0, 1, 2):
        await box.put_if_absent(keys.record(round), b"{}")
    # Junk only: no round is committed.
    assert await store.record_rounds() == []


class CountedLists(MemoryMailbox):
    def __init__(self) -> None:
        super().__init__()
        self.lists: list[tuple[str, str]] = []

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        self.lists.append((prefix, after))
        return await super().list(prefix, after=after)


async def test_the_snapshots_of_several_rounds_come_from_one_listing() -> None:
    box = CountedLists()
    store = Store(box)
    ref = BlobRef(sha256="0" * 64, size=1, encoding="fp32")
    for round, learner in [(8, "a"), (9, "b"), (10, "c"), (10, "d"), (11, "e"), (12, "f")]:
        snapshot = Snapshot(
            learner=learner,
            round=round,
            fragment=0,
            base_version=0,
            steps=1,
            tokens=1,
            delta=ref,
            norm=None,
        )
        assert await store.put_snapshot(snapshot)
    # Junk in a later round counts for nothing; a claim there is no snapshot.
    await box.put_if_absent(keys.snapshot(10, "g"), b"not a snapshot")
    await store.claim_round(10, 0, "h")
    box.lists.clear()
    assert await store.learners_by_round(9, 11) == {9: ["b"], 10: ["c", "d"], 11: ["e"]}
    assert box.lists == [("rounds/00000000", "rounds/0000000009")]
    assert await store.learners_by_round(10, 10) == {10: ["c", "d"]}
    assert await store.learners_by_round(13, 15) == {}
    with pytest.raises(ValueError, match="after the last"):
        await store.learners_by_round(11, 10)


class PlainMailbox:
    """A mailbox with the four operations only (no ranged read), over a ``MemoryMailbox``."""

    def __init__(self) -> None:
        self.inner = MemoryMailbox()
        self.put_if_absent = self.inner.put_if_absent
        self.get = self.inner.get
        self.list = self.inner.list
        self.delete = self.inner.delete

    async def __aenter__(self) -> "PlainMailbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


RANGES = [(0, 10), (INDEX_CHUNK - 5, INDEX_CHUNK + 5), (3 * INDEX_CHUNK + 7, 3 * INDEX_CHUNK + 7)]


class Renewing(MemoryMailbox):
    """Node ``a`` beats (its next beat written, the one before deleted) right after each of
    the next ``renewals`` listings of the leases is taken, as a node renewing its lease
    between a reader's listing and its reads would."""

    def __init__(self, renewals: int) -> None:
        super().__init__()
        self.renewals = renewals
        self.beat = 0
        self.listings = 0

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        listed = await super().list(prefix, after=after)
        if prefix.startswith(keys.LEASES):
            self.listings += 1
            if self.renewals:
                self.renewals -= 1
                await self.renew()
        return listed

    async def renew(self) -> None:
        self.beat += 1
        data = msgspec.json.encode(LeaseBeat(learner="a"))
        await self.put_if_absent(keys.lease("a", self.beat, "learner"), data)
        await self.delete([keys.lease("a", self.beat - 1, "learner")])


@pytest.mark.parametrize("look", ["leases", "lease_beats", "own_beats"])
async def test_a_lease_renewed_while_it_is_read_is_still_held(look: str) -> None:
    box = Renewing(renewals=0)
    await box.renew()
    box.renewals = 1
    store = Store(box)
    seen = {
        "leases": store.leases,
        "lease_beats": store.lease_beats,
        "own_beats": lambda: store.own_beats("a"),
    }[look]
    assert (
        await seen()
        == {
            "leases": {"a": (2, "learner")},
            "lease_beats": {"a": {2: "learner"}},
            "own_beats": [(2, keys.lease("a", 2, "learner"))],
        }[look]
    )
    box.renewals = 100
    box.listings = 0
    await seen()
    assert box.listings <= 4


async def test_ranges_of_an_indexed_blob_are_read_chunk_by_chunk_and_checked() -> None:
    data = os.urandom(5 * INDEX_CHUNK + 123)
    store = Store(MemoryMailbox())
    ref = await store.put_blob(data, "fp32", indexed=True)
    assert isinstance(ref.index, str)
    assert await store.get(keys.blob(ref.index)) == chunk_index(data)
    before = store.stats.bytes_down
    wanted = [*RANGES, (len(data) - 1, len(data))]
    assert await store.blob_ranges(ref, wanted) == [data[a:b] for a, b in wanted]
    # The index, chunks 0 and 1 (one read), and chunk 5: never the chunks between.
    read = store.stats.bytes_down - before
    assert read == len(chunk_index(data)) + 2 * INDEX_CHUNK + 123
    with pytest.raises(ValueError, match="outside blob"):
        await store.blob_ranges(ref, [(0, len(data) + 1)])


async def test_a_damaged_chunk_or_index_is_corrupt_and_a_missing_one_is_gone() -> None:
    data = os.urandom(3 * INDEX_CHUNK)
    ref = await Store(MemoryMailbox()).put_blob(data, "fp32", indexed=True)
    assert isinstance(ref.index, str)
    damaged = bytearray(data)
    damaged[INDEX_CHUNK + 1] ^= 1
    mailbox = MemoryMailbox()
    await mailbox.put_if_absent(keys.blob(ref.sha256), bytes(damaged))
    await mailbox.put_if_absent(keys.blob(ref.index), chunk_index(data))
    store = Store(mailbox)
    assert await store.blob_ranges(ref, [(0, 10)]) == [data[:10]]
    with pytest.raises(CorruptBlob, match=f"bytes \\[{INDEX_CHUNK}, {2 * INDEX_CHUNK}\\)"):
        await store.blob_ranges(ref, [(INDEX_CHUNK, INDEX_CHUNK + 1)])
    forged = MemoryMailbox()
    await forged.put_if_absent(keys.blob(ref.sha256), data)
    await forged.put_if_absent(keys.blob(ref.index), chunk_index(bytes(damaged)))
    with pytest.raises(CorruptBlob, match="index"):
        await Store(forged).blob_ranges(ref, [(0, 10)])
    gone = MemoryMailbox()
    await gone.put_if_absent(keys.blob(ref.index), chunk_index(data))
    assert await Store(gone).blob_ranges(ref, [(0, 10)]) is None
    assert await Store(MemoryMailbox()).blob_ranges(ref, [(0, 10)]) is None


async def test_a_blob_without_an_index_or_a_mailbox_without_ranges_is_read_whole() -> None:
    data = os.urandom(2 * INDEX_CHUNK)
    store = Store(MemoryMailbox())
    plain = await store.put_blob(data, "fp32")
    assert plain.index is msgspec.UNSET
    assert await store.blob_ranges(plain, RANGES[:2]) == [data[a:b] for a, b in RANGES[:2]]
    mailbox = PlainMailbox()
    store = Store(mailbox)  # type: ignore[arg-type]
    ref = await store.put_blob(data, "fp32", indexed=True)
    assert await store.blob_ranges(ref, RANGES[:2]) == [data[a:b] for a, b in RANGES[:2]]
    assert await store.get_range(keys.blob(ref.sha256), 5, 9) == data[5:9]
