"""Records and keys: lossless round trips, strict decoding and the key layout."""

import json
from typing import Any, get_args

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gradientmail.errors import RecordError
from gradientmail.protocol import keys, records
from gradientmail.protocol.records import (
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    MAX_RECORD_BYTES,
    BlobRef,
    CreateClaim,
    FragmentSpec,
    InitMarker,
    LeaseBeat,
    Manifest,
    ParamSpec,
    Participant,
    Rejection,
    RejectReason,
    RoundClaim,
    RoundRecord,
    RoundRecordDraft,
    RunConfig,
    Snapshot,
)

CHECKS = settings(max_examples=40, deadline=None)

learners = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
counts = st.integers(0, 2**40)
ints = st.integers(-(2**40), 2**40)
floats = st.floats(allow_nan=False, allow_infinity=False)
sha256s = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)
encodings = st.sampled_from(["fp32", "bf16", "int8", "int4"])
reasons = st.sampled_from(get_args(RejectReason))
refs = st.builds(BlobRef, sha256=sha256s, size=counts, encoding=encodings)
params = st.builds(
    ParamSpec,
    name=st.text(min_size=1, max_size=20),
    shape=st.lists(st.integers(0, 4096), max_size=4).map(tuple),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
)
specs = st.builds(
    FragmentSpec, index=st.integers(0, 99), params=st.lists(params, max_size=4).map(tuple)
)


@st.composite
def configs(draw: st.DrawFn) -> RunConfig:
    fragments = draw(st.integers(1, 16))
    return RunConfig(
        fragments=fragments,
        sync_every=draw(st.integers(fragments, 1000)),
        pattern=draw(st.sampled_from(["contiguous", "strided"])),
        delta_encoding=draw(encodings),
        update_encoding=draw(encodings),
        block_size=draw(st.integers(1, 4096)),
        outer_lr=draw(st.floats(1e-6, 10)),
        outer_momentum=draw(st.floats(0, 1)),
        weighting=draw(st.sampled_from(["tokens", "steps", "equal"])),
        max_staleness=draw(st.integers(0, 10)),
        outlier_factor=draw(st.floats(1, 100)),
        quorum_min=draw(st.integers(1, 10)),
        quorum_fraction=draw(st.floats(0, 1)),
        grace=draw(st.floats(0, 60)),
        merge=draw(st.sampled_from(["keep-progress", "alpha"])),
        alpha=draw(st.floats(0, 1)),
        robust=draw(st.booleans()),
    )


participants = st.builds(
    Participant,
    learner=learners,
    weight=st.floats(0, 1),
    steps=counts,
    tokens=counts,
    base_version=counts,
    arrived=st.just(msgspec.UNSET) | st.floats(0, 1e9),
)
rejections = st.builds(
    Rejection, learner=learners, reason=reasons, steps=ints, tokens=ints, detail=st.text()
)
drafts = st.builds(
    RoundRecordDraft,
    round=counts,
    fragment=counts,
    version=counts,
    committed_by=learners,
    participants=st.lists(participants, max_size=4).map(tuple),
    rejected=st.lists(rejections, max_size=4).map(tuple),
    quorum_seconds=floats,
    grace_seconds=floats,
    cosine=st.none() | st.floats(-1, 1),
)
objects = st.one_of(
    st.builds(
        Manifest,
        created_by=learners,
        config=configs(),
        fragments=st.lists(specs, max_size=3).map(tuple),
        theta0=st.lists(refs, max_size=3).map(tuple),
    ),
    st.builds(CreateClaim, learner=learners),
    st.builds(InitMarker, learner=learners, fragment=counts, blob=refs),
    st.builds(LeaseBeat, learner=learners),
    st.builds(
        Snapshot,
        learner=learners,
        round=counts,
        fragment=counts,
        base_version=counts,
        steps=ints,
        tokens=ints,
        delta=refs,
        norm=st.none() | floats,
    ),
    st.builds(RoundClaim, learner=learners),
    drafts,
    st.builds(
        lambda draft, theta, outer, update: RoundRecord.committed(
            draft, theta=theta, outer=outer, update=update
        ),
        drafts,
        refs,
        refs,
        refs,
    ),
)


@CHECKS
@given(objects)
def test_every_record_round_trips(obj: Any) -> None:
    data = records.encode(obj)
    assert records.decode(data, type(obj)) == obj
    assert records.encode(records.decode(data, type(obj))) == data
    assert json.loads(data)["format"] == FORMAT_VERSION


@CHECKS
@given(objects, st.dictionaries(st.from_regex(r"x_[a-z]{1,8}", fullmatch=True), st.integers()))
def test_unknown_fields_are_ignored(obj: Any, extra: dict[str, int]) -> None:
    fields = json.loads(records.encode(obj))
    fields.update(extra)
    assert records.decode(json.dumps(fields).encode(), type(obj)) == obj


def test_unknown_nested_fields_are_ignored() -> None:
    ref = BlobRef(sha256="a" * 64, size=3, encoding="fp32")
    marker = InitMarker(learner="a", fragment=0, blob=ref)
    fields = json.loads(records.encode(marker))
    fields["blob"]["signature"] = "later"
    assert records.decode(json.dumps(fields).encode(), InitMarker) == marker


def test_encoding_is_canonical() -> None:
    claim = CreateClaim(learner="a")
    assert records.encode(claim) == b'{"format":1,"learner":"a"}'


REF = {"sha256": "a" * 64, "size": 3, "encoding": "fp32"}
SNAPSHOT = {
    "format": 1,
    "learner": "a",
    "round": 4,
    "fragment": 0,
    "base_version": 1,
    "steps": 2,
    "tokens": 9,
    "delta": REF,
    "norm": 1.5,
}


def test_the_reference_snapshot_decodes() -> None:
    assert records.decode(json.dumps(SNAPSHOT).encode(), Snapshot).tokens == 9


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"round": "4"}, "Expected `int`, got `str`"),
        ({"round": 4.0}, "Expected `int`"),
        ({"round": True}, "Expected `int`, got `bool`"),
        ({"round": -1}, r"Expected `int` >= 0 - at `\$.round`"),
        ({"steps": None}, "Expected `int`, got `null`"),
        ({"delta": {**REF, "sha256": "A" * 64}}, r"\$.delta.sha256"),
        ({"delta": {**REF, "size": -3}}, r"\$.delta.size"),
        ({"delta": "blobs/abc"}, "Expected `object`"),
        ({"norm": "big"}, "Expected `float | null`"),
        ({"format": 2}, "format 2 is not one this gradientmail knows"),
        ({"format": None}, "format None"),
        ({"format": "1"}, "format '1'"),
    ],
)
def test_decoding_is_strict(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(RecordError, match=match):
        records.decode(json.dumps({**SNAPSHOT, **changes}).encode(), Snapshot)


@pytest.mark.parametrize("arrived", [-0.5, 2e9, "1e999", '"1.5"', "null"])
def test_a_participant_arrival_that_is_no_duration_is_refused(arrived: Any) -> None:
    """A hostile record cannot hand learners a negative, absurd or infinite arrival (the
    learner turns it into a shift of its schedule)."""
    good = RoundRecordDraft(
        round=0,
        fragment=0,
        version=1,
        committed_by="s",
        participants=(
            Participant(learner="a", weight=1.0, steps=1, tokens=1, base_version=0, arrived=1.5),
        ),
        quorum_seconds=0.0,
        grace_seconds=0.0,
        cosine=None,
    )
    data = records.encode(good)
    assert records.decode(data, RoundRecordDraft) == good
    bad = data.replace(b'"arrived":1.5', f'"arrived":{arrived}'.encode())
    with pytest.raises(RecordError, match="arrived"):
        records.decode(bad, RoundRecordDraft)


def test_missing_fields_and_format_are_named() -> None:
    with pytest.raises(RecordError, match="missing required field `learner`"):
        records.decode(
            json.dumps({k: v for k, v in SNAPSHOT.items() if k != "learner"}).encode(), Snapshot
        )
    with pytest.raises(RecordError, match="format None"):
        records.decode(
            json.dumps({k: v for k, v in SNAPSHOT.items() if k != "format"}).encode(), Snapshot
        )


@pytest.mark.parametrize("data", [b"", b"not json", b"[1, 2]", b"42", b"\xff\xfe", b'{"format": 1'])
def test_non_objects_are_rejected(data: bytes) -> None:
    with pytest.raises(RecordError, match="Snapshot"):
        records.decode(data, Snapshot)


def test_size_limits() -> None:
    big = records.encode(CreateClaim(learner="a" * MAX_RECORD_BYTES))
    with pytest.raises(RecordError, match=f"over the {MAX_RECORD_BYTES}-byte limit"):
        records.decode(big, CreateClaim)
    # The manifest may be larger (it lists the whole model), up to its own limit.
    spec = FragmentSpec(
        index=0,
        params=tuple(
            ParamSpec(name=f"layer.{i}.weight", shape=(1024, 1024), dtype="float32")
            for i in range(40_000)
        ),
    )
    manifest = Manifest(created_by="a", config=RunConfig(), fragments=(spec,), theta0=())
    data = records.encode(manifest)
    assert MAX_RECORD_BYTES < len(data) < MAX_MANIFEST_BYTES
    assert records.decode(data, Manifest) == manifest
    with pytest.raises(RecordError, match="over the"):
        records.decode(data + b" " * MAX_MANIFEST_BYTES, Manifest)


def test_invalid_config_in_a_manifest_is_a_record_error() -> None:
    fields = json.loads(
        records.encode(Manifest(created_by="a", config=RunConfig(), fragments=(), theta0=()))
    )
    fields["config"]["sync_every"] = 2
    with pytest.raises(RecordError, match="sync_every"):
        records.decode(json.dumps(fields).encode(), Manifest)


def test_a_manifest_without_robust_decodes_to_the_plain_aggregation() -> None:
    fields = json.loads(
        records.encode(Manifest(created_by="a", config=RunConfig(), fragments=(), theta0=()))
    )
    assert fields["config"].pop("robust") is False
    assert records.decode(json.dumps(fields).encode(), Manifest).config.robust is False
    fields["config"]["robust"] = "yes"
    with pytest.raises(RecordError, match="robust"):
        records.decode(json.dumps(fields).encode(), Manifest)


def test_committed_record_from_a_record() -> None:
    ref = BlobRef(sha256="b" * 64, size=1, encoding="fp32")
    draft = RoundRecordDraft(
        round=3,
        fragment=1,
        version=2,
        committed_by="a",
        participants=(),
        quorum_seconds=0.0,
        grace_seconds=0.0,
        cosine=None,
    )
    record = RoundRecord.committed(draft, theta=ref, outer=ref, update=ref)
    other = BlobRef(sha256="c" * 64, size=1, encoding="int8")
    again = RoundRecord.committed(record, theta=other, outer=other, update=other)
    assert again.update == other
    assert again.round == 3


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"fragments": 0}, "fragments must be a positive"),
        ({"fragments": 10_000, "sync_every": 20_000}, "at most 9999"),
        ({"fragments": 4, "sync_every": 3}, "at least fragments"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"outer_lr": 0.0}, "outer_lr"),
        ({"outer_momentum": 1.5}, "outer_momentum"),
        ({"outlier_factor": 0.5}, "outlier_factor"),
        ({"grace": float("inf")}, "grace"),
        ({"alpha": float("nan")}, "alpha"),
        ({"topk_feedback": 1.5}, "topk_feedback must be finite and in \\[0.0, 1.0\\]"),
        ({"overlap": -1}, "overlap must be None \\(never wait\\) or a number of steps, 0"),
        ({"robust": 1}, "robust must be True or False"),
    ],
)
def test_run_config_checks_its_ranges(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RunConfig(**changes)


@pytest.mark.parametrize(
    ("sync_every", "overlap", "applied_after"),
    [(50, 2, 2), (50, 50, 50), (50, 51, 50), (1, 2, 1), (4, None, None)],
)
def test_a_version_is_applied_by_its_fragments_next_snapshot_at_the_latest(
    sync_every: int, overlap: int | None, applied_after: int | None
) -> None:
    config = RunConfig(fragments=1, sync_every=sync_every, overlap=overlap)
    assert config.applied_after == applied_after


# -- keys -------------------------------------------------------------------------------------


def test_key_layout() -> None:
    assert keys.create_claim(3) == "create/0003"
    assert keys.init_marker(1, 12) == "init/0001/0012"
    assert keys.lease("node-1", 42, "learner") == "leases/node-1/000000000042.learner"
    assert keys.lease("node-1", 42, "syncer") == "leases/node-1/000000000042.syncer"
    assert keys.lease("node-1", 42, "closing") == "leases/node-1/000000000042.closing"
    assert [keys.trains(r) for r in ("learner", "closing", "syncer")] == [True, True, False]
    assert keys.snapshot(7, "a.b") == "rounds/0000000007/snapshots/a.b"
    assert keys.round_claim(7, 2) == "rounds/0000000007/claims/0002"
    assert keys.record(12) == "records/0000000012"
    assert keys.blob("f" * 64) == "blobs/" + "f" * 64


@CHECKS
@given(counts.filter(lambda n: n < 10**10), st.integers(0, 9999), learners)
@example(round=10**10 - 1, small=0, learner="a")
def test_keys_parse_back(round: int, small: int, learner: str) -> None:
    assert keys.parse_create_claim(keys.create_claim(small)) == small
    assert keys.parse_init_marker(keys.init_marker(small, small)) == (small, small)
    for role in ("learner", "closing", "syncer"):
        assert keys.parse_lease(keys.lease(learner, round, role)) == (learner, round, role)
    assert keys.parse_snapshot(keys.snapshot(round, learner)) == (round, learner)
    assert keys.parse_claim(keys.round_claim(round, small)) == (round, small)
    assert keys.parse_record(keys.record(round)) == round
    assert round + 1 == 10**10 or keys.record(round) < keys.record(round + 1)


@pytest.mark.parametrize(
    "key",
    [
        "records/12",
        "records/-000000001",
        "records/١٢٣٤٥٦٧٨٩٠",
        "records/0000000012/x",
        "rounds/0000000001/snapshots/-bad",
        "rounds/0000000001/claims/01",
        "leases/a/12",
        "leases/a/000000000012",
        "leases/a/000000000012.driver",
        "init/0001",
        "create/abcd",
        "blobs/XYZ",
        "manifest",
    ],
)
def test_keys_outside_the_layout_parse_as_none(key: str) -> None:
    parsed = [
        keys.parse_record(key),
        keys.parse_snapshot(key),
        keys.parse_claim(key),
        keys.parse_lease(key),
        keys.parse_init_marker(key),
        keys.parse_create_claim(key),
        keys.parse_blob(key),
    ]
    assert parsed == [None] * len(parsed)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: keys.record(-1), "round"),
        (lambda: keys.record(10**10), "round"),
        (lambda: keys.create_claim(10_000), "attempt"),
        (lambda: keys.round_claim(1, -2), "claim number"),
        (lambda: keys.lease("a", True, "learner"), "beat"),
        (lambda: keys.lease("a", 1, "driver"), "role"),
        (lambda: keys.snapshot(1, "a/b"), "invalid learner"),
        (lambda: keys.snapshot(1, ""), "invalid learner"),
        (lambda: keys.blob("abc"), "invalid blob digest"),
        (lambda: keys.round_of(0, 0, 4), "version 0"),
        (lambda: keys.round_of(4, 1, 4), "fragment 4"),
        (lambda: keys.fragment_of(-1, 4), "round -1"),
        (lambda: keys.version_of(3, 0), "0 fragments"),
    ],
)
def test_key_builders_reject_bad_input(build: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


@CHECKS
@given(st.integers(1, 50), st.integers(0, 5000))
def test_round_numbering_is_a_bijection(fragments: int, round: int) -> None:
    fragment, version = keys.fragment_of(round, fragments), keys.version_of(round, fragments)
    assert version >= 1
    assert keys.round_of(fragment, version, fragments) == round


def test_msgspec_is_the_json_codec() -> None:
    # Records are readable by any JSON tool: plain objects, no msgspec-specific framing.
    claim = json.loads(records.encode(RoundClaim(learner="z")))
    assert claim == {"format": 1, "learner": "z"}
    assert msgspec.json.decode(records.encode(RoundClaim(learner="z"))) == claim
