"""Every decoder of bytes from the store, fed random, mutated and hostile bytes (JSON nested
deeper than the interpreter's recursion limit, huge and non-finite numbers), either decodes
or raises its own error (``RecordError`` and its ``CodecError``) and nothing else, not even
``RecursionError``; key parsers return None for anything outside the layout, out-of-range
numbers included."""

import contextlib
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradientmail.errors import RecordError
from gradientmail.protocol import keys, records
from gradientmail.protocol.codec import CodecError, decode_fragment, encode_fragment
from gradientmail.protocol.records import (
    BlobRef,
    CreateClaim,
    FragmentSpec,
    InitMarker,
    LeaseBeat,
    Manifest,
    ParamSpec,
    Participant,
    Rejection,
    RoundClaim,
    RoundRecord,
    RunConfig,
    Snapshot,
)
from gradientmail.protocol.signing import RunKey

torch.set_num_threads(1)

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

REF = BlobRef(sha256="ab" * 32, size=12, encoding="fp32")
SPEC = FragmentSpec(
    index=1,
    params=(
        ParamSpec(name="w", shape=(3, 4), dtype="float32"),
        ParamSpec(name="b", shape=(5,), dtype="float32"),
    ),
)
VALID: dict[type[Any], bytes] = {
    Manifest: records.encode(
        Manifest(created_by="a", config=RunConfig(fragments=2), fragments=(SPEC,), theta0=(REF,))
    ),
    CreateClaim: records.encode(CreateClaim(learner="a")),
    InitMarker: records.encode(InitMarker(learner="a", fragment=1, blob=REF)),
    LeaseBeat: records.encode(LeaseBeat(learner="a")),
    Snapshot: records.encode(
        Snapshot(
            learner="a",
            round=3,
            fragment=1,
            base_version=1,
            steps=4,
            tokens=40,
            delta=REF,
            norm=0.5,
        )
    ),
    RoundClaim: records.encode(RoundClaim(learner="b")),
    RoundRecord: records.encode(
        RoundRecord(
            round=3,
            fragment=1,
            version=2,
            committed_by="b",
            participants=(
                Participant(learner="a", weight=1.0, steps=4, tokens=40, base_version=1),
            ),
            rejected=(Rejection(learner="c", reason="corrupt", steps=1, tokens=1),),
            quorum_seconds=0.1,
            grace_seconds=0.0,
            cosine=None,
            theta=REF,
            outer=REF,
            update=REF,
        )
    ),
}
KINDS = list(VALID)
TENSORS = [torch.linspace(-2, 2, 12).reshape(3, 4), torch.linspace(0, 1, 5)]
BLOBS = {
    encoding: encode_fragment(TENSORS, SPEC, encoding, block_size=4)  # type: ignore[arg-type]
    for encoding in ("fp32", "bf16", "int8", "int4")
}
PARSERS = [
    keys.parse_blob,
    keys.parse_claim,
    keys.parse_create_claim,
    keys.parse_init_marker,
    keys.parse_lease,
    keys.parse_record,
    keys.parse_snapshot,
]
RUN_KEY = RunKey("fuzzing key, long enough")


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` with a few bytes flipped, inserted, deleted or the tail cut."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        where = draw(st.integers(0, len(data) - 1))
        match draw(st.sampled_from(["flip", "insert", "delete", "cut", "splice"])):
            case "flip":
                data[where] ^= 1 << draw(st.integers(0, 7))
            case "insert":
                data[where:where] = draw(st.binary(min_size=1, max_size=8))
            case "delete":
                del data[where : where + draw(st.integers(1, 8))]
            case "cut":
                del data[where:]
            case "splice":
                data[where:where] = draw(
                    st.sampled_from([b'"', b"{", b"}", b"-1", b"1e999", b"null"])
                )
    return bytes(data)


@st.composite
def hostile(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` with a deeply nested JSON value (up to 5,000 levels, ~10 KB) or an absurd
    number put in place of one of its values, or such a value alone."""
    depth = draw(st.integers(100, 5000))
    opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
    nest = opener * depth + b"1" + closer * depth
    number = draw(st.sampled_from([b"1e999", b"-1e999", b"9" * 400, b"-0", b"NaN", b"1e-999"]))
    value = draw(st.sampled_from([nest, number]))
    if draw(st.booleans()):
        return value
    colon = valid.find(b":", draw(st.integers(0, max(len(valid) - 1, 0))))
    if colon < 0:
        return value
    end = colon + 1
    while end < len(valid) and valid[end : end + 1] not in (b",", b"}"):
        end += 1
    return valid[: colon + 1] + value + valid[end:]


def _decode_record(data: bytes, kind: type[Any]) -> None:
    with contextlib.suppress(RecordError):
        records.decode(data, kind)
    with contextlib.suppress(RecordError):
        RUN_KEY.check(keys.MANIFEST, data)


def _decode_blob(data: bytes) -> None:
    try:
        tensors = decode_fragment(data, SPEC)
    except CodecError:
        return
    assert [tuple(t.shape) for t in tensors] == [(3, 4), (5,)]
    assert all(t.dtype == torch.float32 for t in tensors)


@FUZZ
@given(st.sampled_from(KINDS), st.binary(max_size=512))
def test_records_decode_random_bytes(kind: type[Any], data: bytes) -> None:
    _decode_record(data, kind)


@FUZZ
@given(st.sampled_from(KINDS), st.data())
def test_records_decode_mutated_encodings(kind: type[Any], data: st.DataObject) -> None:
    _decode_record(data.draw(mutated(VALID[kind])), kind)


@FUZZ
@given(st.sampled_from(KINDS), st.data())
def test_records_decode_hostile_values(kind: type[Any], data: st.DataObject) -> None:
    _decode_record(data.draw(hostile(VALID[kind])), kind)


def test_records_decode_json_nested_beyond_the_recursion_limit() -> None:
    """JSON nested past the recursion limit raises ``RecordError``, not ``RecursionError``.
    Whether 1,000 levels reach the limit depends on the stack in use (hypothesis raises the
    limit), so 100,000 levels (200 KB) are fed too, which reach it under any limit."""
    for depth in (1000, 100_000):
        deep = b"[" * depth + b"]" * depth
        for nest in (deep, b'{"format":1,"learner":' + deep + b"}"):
            for kind in KINDS:
                with pytest.raises(RecordError):
                    records.decode(nest, kind)
            with pytest.raises(RecordError):
                RUN_KEY.check(keys.record(1), nest)
    with pytest.raises(RecordError, match="nested too deep"):
        RUN_KEY.check(keys.record(1), b"[" * 100_000 + b"]" * 100_000)


@FUZZ
@given(st.sampled_from(sorted(BLOBS)), st.data())
def test_codec_decodes_blobs_with_a_hostile_header(encoding: str, data: st.DataObject) -> None:
    blob = BLOBS[encoding]
    size = int.from_bytes(blob[:8], "little")
    header = data.draw(hostile(blob[8 : 8 + size]))[: 1 << 16]
    _decode_blob(len(header).to_bytes(8, "little") + header + blob[8 + size :])


@FUZZ
@given(st.sampled_from(KINDS), st.sampled_from(KINDS))
def test_a_record_of_one_kind_read_as_another(written: type[Any], read: type[Any]) -> None:
    _decode_record(VALID[written], read)


@FUZZ
@given(st.binary(max_size=512))
def test_codec_decodes_random_bytes(data: bytes) -> None:
    _decode_blob(data)


@FUZZ
@given(st.sampled_from(sorted(BLOBS)), st.data())
def test_codec_decodes_mutated_blobs(encoding: str, data: st.DataObject) -> None:
    _decode_blob(data.draw(mutated(BLOBS[encoding])))


@FUZZ
@given(st.sampled_from(sorted(BLOBS)), st.data())
def test_codec_decodes_blobs_with_a_mutated_header(encoding: str, data: st.DataObject) -> None:
    blob = BLOBS[encoding]
    size = int.from_bytes(blob[:8], "little")
    header = data.draw(mutated(blob[8 : 8 + size]))
    _decode_blob(len(header).to_bytes(8, "little") + header + blob[8 + size :])


@FUZZ
@given(st.sampled_from(PARSERS), st.text(max_size=80))
def test_key_parsers_return_none_or_a_parse(parse: Any, key: str) -> None:
    parse(key)


@FUZZ
@given(
    st.sampled_from(PARSERS),
    st.sampled_from(
        [
            keys.blob("0" * 64),
            keys.round_claim(7, 2),
            keys.create_claim(3),
            keys.init_marker(2, 1),
            keys.lease("a", 9, "learner"),
            keys.record(12),
            keys.snapshot(4, "bob"),
        ]
    ),
    st.data(),
)
def test_key_parsers_on_mutated_keys(parse: Any, key: str, data: st.DataObject) -> None:
    mangled = data.draw(mutated(key.encode())).decode("utf-8", "replace")
    parse(mangled)


def test_valid_bytes_decode() -> None:
    for kind, data in VALID.items():
        records.decode(data, kind)
    for blob in BLOBS.values():
        assert len(decode_fragment(blob, SPEC)) == 2
