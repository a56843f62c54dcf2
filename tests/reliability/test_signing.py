"""Signed runs, the pure part: signatures verify, any change is caught, the key never shows."""

import contextlib
import json
import pickle

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.errors import RecordError, RunMismatch
from gradientmail.protocol import keys, records
from gradientmail.protocol.records import (
    BlobRef,
    CreateClaim,
    FragmentSpec,
    InitMarker,
    Manifest,
    ParamSpec,
    Participant,
    Rejection,
    RoundClaim,
    RoundRecord,
    RunConfig,
    Snapshot,
)
from gradientmail.protocol.signing import (
    ENV_VAR,
    RunKey,
    SignatureError,
    check_manifest,
)

SECRET = "correct horse battery staple 42"
KEY = RunKey(SECRET)
REF = BlobRef(sha256="ab" * 32, size=12, encoding="fp32")
SPEC = FragmentSpec(index=0, params=(ParamSpec(name="w", shape=(3, 4), dtype="float32"),))
MANIFEST = Manifest(created_by="a", config=RunConfig(fragments=1), fragments=(SPEC,), theta0=(REF,))
SNAPSHOT = Snapshot(
    learner="a",
    round=3,
    fragment=0,
    base_version=3,
    steps=8,
    tokens=800,
    delta=REF,
    norm=1.5,
)
RECORD = RoundRecord(
    round=3,
    fragment=0,
    version=4,
    committed_by="b",
    participants=(Participant(learner="a", weight=1.0, steps=8, tokens=800, base_version=3),),
    rejected=(Rejection(learner="c", reason="tokens", steps=1, tokens=10**9),),
    quorum_seconds=0.25,
    grace_seconds=0.0,
    cosine=None,
    theta=REF,
    outer=REF,
    update=REF,
)
OBJECTS = [
    (keys.MANIFEST, MANIFEST),
    (keys.create_claim(0), CreateClaim(learner="a")),
    (keys.init_marker(0, 0), InitMarker(learner="a", fragment=0, blob=REF)),
    (keys.snapshot(3, "a"), SNAPSHOT),
    (keys.round_claim(3, 0), RoundClaim(learner="b")),
    (keys.record(3), RECORD),
]
IDS = [type(obj).__name__ for _, obj in OBJECTS]


@pytest.mark.parametrize(("key", "obj"), OBJECTS, ids=IDS)
def test_signed_objects_verify_and_decode(key: str, obj: records._Object) -> None:
    signed = KEY.sign(key, obj)
    data = records.encode(signed)
    assert KEY.check(key, data) is None
    KEY.verify(key, data)
    decoded = records.decode(data, type(obj))
    assert decoded == signed
    assert isinstance(decoded.signature, str)
    assert msgspec.structs.replace(decoded, signature=msgspec.UNSET, **_no_key_id(obj)) == obj


def _no_key_id(obj: object) -> dict[str, object]:
    return {"key_id": msgspec.UNSET} if isinstance(obj, Manifest) else {}


@pytest.mark.parametrize(("key", "obj"), OBJECTS, ids=IDS)
def test_unsigned_objects_are_reported_unsigned(key: str, obj: records._Object) -> None:
    data = records.encode(obj)
    assert KEY.check(key, data) == "unsigned"
    with pytest.raises(SignatureError, match="unsigned") as info:
        KEY.verify(key, data)
    assert info.value.reason == "unsigned"
    assert isinstance(info.value, RecordError)


def test_unsigned_encoding_is_unchanged() -> None:
    assert records.encode(CreateClaim(learner="a")) == b'{"format":1,"learner":"a"}'
    assert "key_id" not in json.loads(records.encode(MANIFEST))


@pytest.mark.parametrize(("key", "obj"), OBJECTS, ids=IDS)
def test_another_key_or_another_place_fails(key: str, obj: records._Object) -> None:
    data = records.encode(KEY.sign(key, obj))
    assert RunKey(SECRET + "!").check(key, data) == "bad-signature"
    assert KEY.check(key + "0", data) == "bad-signature"


def test_a_claim_cannot_be_replayed_on_another_round_or_as_a_creation_claim() -> None:
    data = records.encode(KEY.sign(keys.round_claim(5, 0), RoundClaim(learner="b")))
    assert KEY.check(keys.round_claim(5, 0), data) is None
    assert KEY.check(keys.round_claim(6, 0), data) == "bad-signature"
    assert KEY.check(keys.round_claim(5, 1), data) == "bad-signature"
    assert KEY.check(keys.create_claim(0), data) == "bad-signature"


def _leaves(
    value: object, path: tuple[object, ...] = ()
) -> list[tuple[tuple[object, ...], object]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(value, list):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, (*path, i))]
    return [(path, value)]


def _set(value: object, path: tuple[object, ...], new: object) -> None:
    for step in path[:-1]:
        value = value[step]  # type: ignore[index]
    value[path[-1]] = new  # type: ignore[index]


def _changed(leaf: object) -> object:
    if isinstance(leaf, bool):
        return not leaf
    if isinstance(leaf, int):
        return leaf + 1
    if isinstance(leaf, float):
        return leaf * 2 + 1
    if isinstance(leaf, str):
        return leaf[:-1] + ("0" if leaf[-1:] != "0" else "1")
    return 0


@pytest.mark.parametrize(("key", "obj"), OBJECTS, ids=IDS)
def test_changing_any_field_breaks_the_signature(key: str, obj: records._Object) -> None:
    data = records.encode(KEY.sign(key, obj))
    value = json.loads(data)
    leaves = [leaf for leaf in _leaves(value) if leaf[0] != ("signature",)]
    assert leaves
    for path, leaf in leaves:
        tampered = json.loads(data)
        _set(tampered, path, _changed(leaf))
        assert KEY.check(key, json.dumps(tampered).encode()) == "bad-signature", path
    extra = {**value, "x_new": 1}
    assert KEY.check(key, json.dumps(extra).encode()) == "bad-signature"


def test_a_blob_is_covered_through_its_hash() -> None:
    key = keys.snapshot(3, "a")
    data = records.encode(KEY.sign(key, SNAPSHOT))
    other = msgspec.structs.replace(
        SNAPSHOT, delta=BlobRef(sha256="cd" * 32, size=12, encoding="fp32")
    )
    swapped = json.loads(data)
    swapped["delta"] = json.loads(records.encode(other))["delta"]
    assert KEY.check(key, json.dumps(swapped).encode()) == "bad-signature"


def test_whitespace_and_key_order_do_not_matter() -> None:
    key = keys.record(3)
    data = records.encode(KEY.sign(key, RECORD))
    value = json.loads(data)
    reordered = json.dumps(dict(reversed(list(value.items()))), indent=2).encode()
    assert KEY.check(key, reordered) is None


@pytest.mark.parametrize(
    "data", [b"", b"[]", b"42", b"null", b'"signature"', b"\xff", b'{"signature": 7}']
)
def test_check_on_garbage_is_a_record_error_or_a_problem(data: bytes) -> None:
    with contextlib.suppress(RecordError):
        assert KEY.check("records/0000000001", data) in ("unsigned", "bad-signature")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256))
def test_check_never_raises_anything_but_record_error(data: bytes) -> None:
    with contextlib.suppress(RecordError):
        KEY.check("manifest", data)


def test_the_key_never_shows() -> None:
    secret = "s3cr3t-run-key-" + "x" * 20
    run_key = RunKey(secret)
    shown = [repr(run_key), str(run_key), f"{run_key}", repr([run_key])]
    signed = run_key.sign(keys.MANIFEST, MANIFEST)
    shown += [repr(signed), records.encode(signed).decode()]
    for key, obj in OBJECTS:
        shown.append(records.encode(run_key.sign(key, obj)).decode())
    for text in shown:
        assert secret not in text
        assert secret.encode().hex() not in text
    assert run_key.key_id in repr(run_key)
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(run_key)


def test_a_short_key_is_refused_without_showing_it() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes") as info:
        RunKey("tooshort")
    assert "tooshort" not in str(info.value)
    with pytest.raises(TypeError):
        RunKey(42)  # type: ignore[arg-type]


def test_key_id_is_stable_and_distinguishes_keys() -> None:
    assert RunKey(SECRET).key_id == KEY.key_id
    assert RunKey(SECRET) == KEY
    assert RunKey(SECRET.encode()) == KEY
    assert RunKey(SECRET + "!").key_id != KEY.key_id
    assert RunKey(SECRET + "!") != KEY
    assert len(KEY.key_id) == 16


def test_from_env() -> None:
    assert RunKey.from_env({}) is None
    assert RunKey.from_env({ENV_VAR: ""}) is None
    assert RunKey.from_env({ENV_VAR: SECRET}) == KEY
    with pytest.raises(ValueError, match=ENV_VAR):
        RunKey.from_env({ENV_VAR: "short"})


def test_check_manifest() -> None:
    signed = KEY.sign(keys.MANIFEST, MANIFEST)
    assert signed.key_id == KEY.key_id
    check_manifest(MANIFEST, None)
    check_manifest(signed, KEY)
    with pytest.raises(RunMismatch, match=f"signed \\(key id {KEY.key_id}\\).*{ENV_VAR}"):
        check_manifest(signed, None)
    with pytest.raises(RunMismatch, match="not signed"):
        check_manifest(MANIFEST, KEY)
    other = RunKey(SECRET + "!")
    with pytest.raises(RunMismatch, match="another key") as info:
        check_manifest(signed, other)
    assert SECRET not in str(info.value)
