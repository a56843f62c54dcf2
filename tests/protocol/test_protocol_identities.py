"""Learner identities as pure decisions: who speaks for whom, admissions, revocations."""

import contextlib
import pickle
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.errors import RecordError, RunMismatch
from gradientmail.protocol import keys
from gradientmail.protocol.identities import (
    Admission,
    AdmissionKey,
    Identities,
    LearnerKey,
    Revocation,
    Signing,
    check_public_key,
    identity_key,
    listed,
    parse_identity_key,
)
from gradientmail.protocol.records import (
    BlobRef,
    LeaseBeat,
    Manifest,
    RunConfig,
    Snapshot,
    encode,
)
from gradientmail.protocol.signing import RunKey

RUN = "0123456789abcdef0123456789abcdef"
RUN_KEY = RunKey("a run key of sixteen bytes or more")
A, B = LearnerKey.generate(), LearnerKey.generate()
OPERATOR = AdmissionKey.generate()
SNAPSHOT = Snapshot(
    learner="a",
    round=3,
    fragment=1,
    base_version=1,
    steps=4,
    tokens=64,
    delta=BlobRef(sha256="0" * 64, size=8, encoding="fp32"),
    norm=None,
)
KEY = keys.snapshot(3, "a")
IDS = Identities(
    {"a": frozenset([A.public]), "b": frozenset([B.public])}, authority=OPERATOR.public
)


def _check(ids: Identities, data: bytes, key: str = KEY, run: str = RUN) -> str | None:
    return ids.check(key, "a", data, run)


def test_a_learners_own_signature_verifies_and_anothers_does_not() -> None:
    assert _check(IDS, encode(A.sign(KEY, SNAPSHOT, RUN))) is None
    assert _check(IDS, encode(B.sign(KEY, SNAPSHOT, RUN))) == "bad-signature"
    assert _check(IDS, encode(RUN_KEY.sign(KEY, SNAPSHOT, RUN))) == "bad-signature"
    assert _check(IDS, encode(SNAPSHOT)) == "unsigned"


def test_a_signature_binds_the_key_the_run_and_the_content() -> None:
    data = encode(A.sign(KEY, SNAPSHOT, RUN))
    assert _check(IDS, data, key=keys.snapshot(4, "a")) == "bad-signature"
    assert _check(IDS, data, run="f" * 32) == "bad-signature"
    tampered = data.replace(b'"tokens":64', b'"tokens":65')
    assert tampered != data
    assert _check(IDS, tampered) == "bad-signature"


@pytest.mark.parametrize("signature", ["", "ed25519:", "ed25519:zz", "ed25519:" + "00" * 64, "x"])
def test_malformed_signatures_are_bad(signature: str) -> None:
    forged = msgspec.structs.replace(SNAPSHOT, signature=signature)
    assert _check(IDS, encode(forged)) == "bad-signature"


def test_a_learner_without_an_admitted_key_is_not_admitted() -> None:
    data = encode(A.sign(KEY, SNAPSHOT, RUN))
    assert _check(Identities(), data) == "not-admitted"
    assert _check(Identities({"b": frozenset([A.public])}), data) == "not-admitted"


def test_a_revoked_key_is_named_and_a_new_key_speaks_for_its_learner() -> None:
    old = encode(A.sign(KEY, SNAPSHOT, RUN))
    revoked = IDS.revoke(A.public)
    assert _check(revoked, old) == "revoked"
    assert not revoked.speaks_for(A.public, "a")
    fresh = LearnerKey.generate()
    renewed = revoked.admit("a", fresh.public)
    assert _check(renewed, old) == "revoked"
    assert _check(renewed, encode(fresh.sign(KEY, SNAPSHOT, RUN))) is None
    assert renewed.speaks_for(fresh.public, "a")
    assert not renewed.speaks_for(fresh.public, "b")


def test_the_check_raises_only_record_error_for_bytes_that_are_no_object() -> None:
    for data in (b"", b"[1]", b"\xff", b"{" * 10):
        with pytest.raises(RecordError):
            _check(IDS, data)


def _signed(
    obj: Admission | Revocation, key: str, signer: AdmissionKey | LearnerKey = OPERATOR
) -> bytes:
    return encode(signer.sign(key, obj, RUN))


def test_admissions_and_revocations_count_only_under_the_admission_key() -> None:
    c = LearnerKey.generate()
    key = identity_key(Admission, c.public)
    admission = Admission(learner="c", public_key=c.public)
    assert IDS.fold(key, _signed(admission, key), RUN).speaks_for(c.public, "c")
    for data, why in (
        (encode(admission), "unsigned"),
        (encode(RUN_KEY.sign(key, admission, RUN)), "bad-signature"),
        (_signed(admission, key, AdmissionKey.generate()), "bad-signature"),
        (_signed(admission, key, A), "bad-signature"),
        (encode(OPERATOR.sign(key, admission, "another run")), "bad-signature"),
        (_signed(admission, identity_key(Admission, c.public)), "bad-signature"),
        (_signed(Admission(learner="c", public_key=A.public), key), "another public key"),
        (_signed(Admission(learner="no/slash", public_key=c.public), key), "no/slash"),
    ):
        with pytest.raises(RecordError, match=why):
            IDS.fold(key, data, RUN)
    with pytest.raises(RecordError, match="names no admission key"):
        replace(IDS, authority=None).fold(key, _signed(admission, key), RUN)
    key = identity_key(Revocation, A.public)
    found = IDS.fold(key, _signed(Revocation(public_key=A.public), key), RUN)
    assert found.revoked == {A.public}
    assert found.authority == OPERATOR.public
    with pytest.raises(RecordError):
        IDS.fold(keys.MANIFEST, b"{}", RUN)


def test_identity_keys_parse_and_junk_keys_do_not() -> None:
    assert parse_identity_key(identity_key(Admission, A.public)) is Admission
    assert parse_identity_key(identity_key(Revocation, A.public, "ab")) is Revocation
    for junk in (
        "identities/admit/x/1",
        f"identities/other/{A.public}/1",
        f"identities/admit/{A.public}/",
        f"identities/admit/{A.public}",
        f"identities/admit/{A.public.upper()}/1",
    ):
        assert parse_identity_key(junk) is None
    with pytest.raises(ValueError, match="64 lowercase hex"):
        check_public_key("abc")


def _manifest(learners: dict[str, str] | None = None) -> Manifest:
    manifest = Manifest(created_by="a", config=RunConfig(), fragments=(), theta0=())
    return manifest if learners is None else msgspec.structs.replace(manifest, learners=learners)


def test_signing_signs_snapshots_and_beats_with_the_learner_key_and_the_rest_with_the_run_key() -> (
    None
):
    signing = Signing(RUN_KEY, A).learn(listed(_manifest(), A, OPERATOR.public))
    assert signing.identities == Identities({"a": frozenset([A.public])}, authority=OPERATOR.public)
    beat_key = keys.lease("a", 0, "learner")
    for key, obj in ((KEY, SNAPSHOT), (beat_key, LeaseBeat(learner="a"))):
        data = encode(signing.sign(key, obj, RUN))
        assert data.count(b"ed25519:") == 1
        assert signing.check(key, data, RUN) is None
    record_key = keys.round_claim(3, 0)
    data = encode(signing.sign(record_key, LeaseBeat(learner="a"), RUN))
    assert RUN_KEY.check(record_key, data, RUN) is None
    assert signing.check(record_key, data, RUN) is None
    assert Signing().check(KEY, b"not even json", RUN) is None


def test_who_may_join_is_decided_from_the_manifest_and_the_admissions() -> None:
    ours = OPERATOR.public
    with pytest.raises(RunMismatch, match="no learner identities"):
        Signing(RUN_KEY, A).learn(_manifest())
    with pytest.raises(RunMismatch, match="no run key"):
        Signing(None, None).learn(_manifest({"a": A.public}))
    reader = Signing(RUN_KEY).learn(_manifest({"a": A.public}))
    with pytest.raises(RunMismatch, match="no learner key"):
        reader.check_member("a", ours)
    with pytest.raises(RunMismatch, match="names no admission key"):
        Signing(RUN_KEY, A).learn(_manifest({"a": A.public})).check_member("a", ours)
    joined = Signing(RUN_KEY, B).learn(listed(_manifest(), A, ours))
    with pytest.raises(RunMismatch, match=f"admission key is {ours}"):
        joined.check_member("a", AdmissionKey.generate().public)
    with pytest.raises(RunMismatch, match="not admitted"):
        joined.check_member("b", ours)
    assert joined.identities is not None
    joined = Signing(RUN_KEY, B, joined.identities.admit("b", B.public))
    joined.check_member("b", ours)
    with pytest.raises(RunMismatch, match="not admitted"):
        joined.check_member("a", ours)
    assert joined.identities is not None
    revoked = Signing(RUN_KEY, B, joined.identities.revoke(B.public))
    with pytest.raises(RunMismatch, match="revoked"):
        revoked.check_member("b", ours)
    Signing(RUN_KEY).learn(_manifest()).check_member("anyone", None)
    with pytest.raises(ValueError, match="admission key"):
        listed(_manifest(), A, None)


def test_folding_remembers_what_it_saw_and_when() -> None:
    signing = Signing(RUN_KEY, A).learn(listed(_manifest(), A, OPERATOR.public))
    assert signing.due(0.0)
    key = identity_key(Admission, B.public)
    folded, why = signing.fold(
        key, _signed(Admission(learner="b", public_key=B.public), key), RUN, 5.0
    )
    assert why is None
    assert folded.seen == {key}
    assert not folded.due(5.5)
    assert folded.due(6.0)
    junk, why = folded.fold("identities/admit/x/1", b"junk", RUN, 7.0)
    assert why is not None
    assert junk.identities == folded.identities
    assert "identities/admit/x/1" in junk.seen
    assert not Signing(RUN_KEY).due(0.0)


def test_a_learner_key_keeps_its_secret(tmp_path: Path) -> None:
    path = tmp_path / "a.pem"
    path.write_bytes(A.pem())
    assert LearnerKey.load(path) == A
    assert LearnerKey.from_pem(A.pem()).public == A.public
    assert A.pem().decode() not in repr(A)
    assert repr(A) == f"LearnerKey(public={A.public!r})"
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(A)
    path.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n")
    with pytest.raises(ValueError, match=str(path)):
        LearnerKey.load(path)


def test_an_admission_key_signs_only_as_an_admission_key(tmp_path: Path) -> None:
    path = tmp_path / "operator.pem"
    path.write_bytes(OPERATOR.pem())
    assert AdmissionKey.load(path) == OPERATOR
    assert repr(OPERATOR) == f"AdmissionKey(public={OPERATOR.public!r})"
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(OPERATOR)
    with pytest.raises(ValueError, match="cannot read an admission key"):
        AdmissionKey.load(tmp_path / "missing.pem")
    # The same private key as a learner key signs under another label: no admission.
    as_learner = LearnerKey.from_pem(OPERATOR.pem())
    assert as_learner.public == OPERATOR.public
    assert as_learner != OPERATOR
    c = LearnerKey.generate()
    key = identity_key(Admission, c.public)
    with pytest.raises(RecordError, match="bad-signature"):
        IDS.fold(key, _signed(Admission(learner="c", public_key=c.public), key, as_learner), RUN)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=80),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "signature": _JSON | st.just("ed25519:" + "00" * 64),
        "learner": _JSON,
        "public_key": _JSON | st.just(A.public),
    },
)


@given(
    data=st.binary(max_size=512) | _JSON.map(msgspec.json.encode) | _FIELDS.map(msgspec.json.encode)
)
@settings(max_examples=300, deadline=None)
def test_hostile_bytes_raise_only_record_error(data: bytes) -> None:
    key = identity_key(Admission, A.public, "ab")
    for judge in (
        lambda: IDS.check(KEY, "a", data, RUN),
        lambda: IDS.fold(key, data, RUN),
        lambda: Signing(RUN_KEY, A, IDS).check(KEY, data, RUN),
    ):
        with contextlib.suppress(RecordError):
            judge()
