"""A snapshot's delta in parts (``records.SnapshotPart``): each part a blob of some rows of
every parameter, read back as one fragment (``codec.open_parts``) that the aggregation and the
reader treat as one blob, whatever the split; parts that do not hold every row once, in
order, are refused with a reason that names them; a whole snapshot encodes as it always did.

``CHUNK_ELEMENTS`` is shrunk so that pieces cross part boundaries inside parameters."""

import msgspec
import pytest
import torch

import gradientmail.protocol.pieces as pieces
from gradientmail.errors import CodecError, RecordError
from gradientmail.protocol.aggregation import Candidate, aggregate
from gradientmail.protocol.codec import (
    decode_fragment,
    encode_fragment,
    open_delta,
    open_fragment,
    open_parts,
    rows_of,
    tensors_of,
)
from gradientmail.protocol.layout import (
    HEAD_BYTES,
    blob_layout,
    check_parts,
    decode_rows,
    part_spec,
    row_spans,
)
from gradientmail.protocol.records import (
    MAX_PARTS,
    BlobRef,
    FragmentSpec,
    ParamSpec,
    RunConfig,
    Snapshot,
    SnapshotPart,
    decode,
    encode,
)
from gradientmail.protocol.sparse import Sparsity

SPEC = FragmentSpec(
    index=0,
    params=(
        ParamSpec(name="w", shape=(33, 5), dtype="float32"),
        ParamSpec(name="b", shape=(1,), dtype="float32"),
        ParamSpec(name="scalar", shape=(), dtype="float32"),
        ParamSpec(name="v", shape=(40,), dtype="float32"),
    ),
)
REF = BlobRef(sha256="0" * 64, size=1, encoding="fp32")


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pieces, "CHUNK_ELEMENTS", 16)


def tensors(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) for p in SPEC.params]


def shards(world: int) -> list[list[tuple[int, int]]]:
    """Each rank's rows as FSDP2 cuts them (``torch.chunk`` of the first dimension: ceil
    rows per rank, later ranks possibly empty); a 0-dimensional parameter is on rank 0."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for param in SPEC.params:
        rows = param.shape[0] if param.shape else 1
        size = -(-rows // world)
        for rank in range(world):
            start = min(rank * size, rows)
            out[rank].append((start, min(start + size, rows)))
    return out


def cut(values: list[torch.Tensor], rows: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [
        v[start:end] if v.dim() else (v if end > start else v.reshape(1)[:0])
        for v, (start, end) in zip(values, rows, strict=True)
    ]


def parted(
    values: list[torch.Tensor], world: int, encoding: str
) -> tuple[list[bytes], list[list[tuple[int, int]]]]:
    split = shards(world)
    datas = [
        encode_fragment(cut(values, rows), part_spec(SPEC, rows), encoding, block_size=8)
        for rows in split
    ]
    return datas, split


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_parts_read_back_as_the_whole_fragment_in_fp32(world: int) -> None:
    values = tensors(0)
    datas, split = parted(values, world, "fp32")
    decoded = tensors_of(open_parts(datas, SPEC, split))
    whole = decode_fragment(encode_fragment(values, SPEC, "fp32", block_size=8), SPEC)
    for got, want, v in zip(decoded, whole, values, strict=True):
        assert got.shape == v.shape
        assert torch.equal(got, want)


@pytest.mark.parametrize("encoding", ["bf16", "int8", "int4"])
def test_lossy_parts_are_within_their_encodings_error(encoding: str) -> None:
    values = tensors(1)
    datas, split = parted(values, 2, encoding)
    decoded = tensors_of(open_parts(datas, SPEC, split))
    bound = {"bf16": 2**-8, "int8": 1 / 127, "int4": 1 / 7}[encoding]
    for got, want in zip(decoded, values, strict=True):
        scale = want.abs().max() if want.numel() else torch.tensor(0.0)
        assert torch.allclose(got, want, atol=float(scale) * bound + 1e-6)


def test_topk_parts_read_back_as_each_parts_selection() -> None:
    """A ``topk`` delta in parts (each rank selects within its own rows) reads as one
    fragment: each part's rows decode as that part's blob decodes them."""
    values = tensors(4)
    sparsity = Sparsity(8, 2, 0.25)
    for world in (1, 2, 3):
        split = shards(world)
        datas = [
            encode_fragment(
                cut(values, rows), part_spec(SPEC, rows), "topk", block_size=1, sparsity=sparsity
            )
            for rows in split
        ]
        decoded = tensors_of(open_parts(datas, SPEC, split))
        for data, rows in zip(datas, split, strict=True):
            own = decode_fragment(data, part_spec(SPEC, rows))
            assert all(torch.equal(a, b) for a, b in zip(cut(decoded, rows), own, strict=True))


@pytest.mark.parametrize("encoding", ["int8", "topk"])
def test_rows_of_a_whole_blob_are_the_rows_of_its_decoding(encoding: str) -> None:
    values = tensors(5)
    data = encode_fragment(
        values,
        SPEC,
        encoding,
        block_size=8,
        sparsity=Sparsity(8, 2, 0.25),  # type: ignore[arg-type]
    )
    whole = decode_fragment(data, SPEC)
    for world in (1, 2, 3):
        for rows in shards(world):
            got = rows_of(data, SPEC, rows)
            assert all(torch.equal(a, b) for a, b in zip(got, cut(whole, rows), strict=True))


def test_the_aggregation_of_parts_equals_that_of_the_same_tensors() -> None:
    config = RunConfig(fragments=1, sync_every=10)
    values = [tensors(2), tensors(3)]
    blobs = []
    for value, world in zip(values, (2, 3), strict=True):
        datas, split = parted(value, world, "fp32")
        blobs.append(open_parts(datas, SPEC, split))

    def snapshot(learner: str) -> Snapshot:
        return Snapshot(
            learner=learner,
            round=0,
            fragment=0,
            base_version=0,
            steps=10,
            tokens=100,
            delta=REF,
            norm=None,
        )

    a = aggregate(0, [Candidate(snapshot(f"l{i}"), b) for i, b in enumerate(blobs)], SPEC, config)
    b = aggregate(0, [Candidate(snapshot(f"l{i}"), v) for i, v in enumerate(values)], SPEC, config)
    assert a.participants == b.participants
    assert a.mean is not None
    assert b.mean is not None
    for x, y in zip(a.mean, b.mean, strict=True):
        assert torch.equal(x, y)
    assert a.cosine == b.cosine


@pytest.mark.parametrize(
    ("parts", "named"),
    [
        ([[(0, 17), (0, 1), (0, 1), (0, 20)], [(18, 33), (1, 1), (1, 1), (20, 40)]], "start at"),
        ([[(0, 17), (0, 1), (0, 1), (0, 20)], [(16, 33), (1, 1), (1, 1), (20, 40)]], "start at"),
        ([[(0, 17), (0, 1), (0, 1), (0, 20)], [(17, 30), (1, 1), (1, 1), (20, 40)]], "has 33"),
        ([[(0, 33), (0, 1), (0, 1), (0, 41)]], "has 40"),
        ([[(0, 33), (0, 1), (0, 1)]], "3 parameters"),
        ([[(0, 33), (0, 1), (1, 0), (0, 40)]], "start at"),
    ],
)
def test_parts_that_do_not_hold_every_row_once_in_order_are_refused(
    parts: list[list[tuple[int, int]]], named: str
) -> None:
    problem = check_parts(SPEC, parts)
    assert problem is not None
    assert named in problem
    with pytest.raises(CodecError, match=named) as raised:
        open_parts([b""] * len(parts), SPEC, parts)
    assert raised.value.reason == "shape"


def test_a_part_blob_of_other_rows_names_the_part() -> None:
    values = tensors(4)
    datas, split = parted(values, 2, "fp32")
    with pytest.raises(CodecError, match="part 1") as raised:
        open_parts([datas[0], datas[0]], SPEC, split)
    assert raised.value.reason == "shape"
    with pytest.raises(CodecError, match="part 0"):
        open_parts([b"junk", datas[1]], SPEC, split)


def test_a_snapshot_names_one_blob_or_parts_exactly_one() -> None:
    fields = {
        "learner": "a",
        "round": 0,
        "fragment": 0,
        "base_version": 0,
        "steps": 1,
        "tokens": 1,
        "norm": 1.0,
    }
    part = SnapshotPart(delta=REF, rows=((0, 33), (0, 1), (0, 1), (0, 40)))
    with pytest.raises(ValueError, match="exactly one"):
        Snapshot(**fields)
    with pytest.raises(ValueError, match="exactly one"):
        Snapshot(**fields, delta=REF, parts=(part,))
    with pytest.raises(ValueError, match=f"1 to {MAX_PARTS}"):
        Snapshot(**fields, parts=())
    parted_snapshot = Snapshot(**fields, parts=(part, part))
    assert parted_snapshot.blobs == (REF, REF)
    assert decode(encode(parted_snapshot), Snapshot) == parted_snapshot
    forged = msgspec.json.decode(encode(parted_snapshot))
    forged["delta"] = msgspec.to_builtins(REF)
    with pytest.raises(RecordError, match="exactly one"):
        decode(msgspec.json.encode(forged), Snapshot)
    forged["parts"] = [msgspec.to_builtins(part)] * (MAX_PARTS + 1)
    del forged["delta"]
    with pytest.raises(RecordError, match=f"1 to {MAX_PARTS}"):
        decode(msgspec.json.encode(forged), Snapshot)


def test_a_whole_snapshot_encodes_as_before_parts_existed() -> None:
    snapshot = Snapshot(
        learner="a", round=3, fragment=1, base_version=0, steps=2, tokens=5, delta=REF, norm=0.5
    )
    assert encode(snapshot) == (
        b'{"format":1,"learner":"a","round":3,"fragment":1,"base_version":0,"steps":2,'
        b'"tokens":5,"delta":{"sha256":"' + b"0" * 64 + b'","size":1,"encoding":"fp32"},'
        b'"norm":0.5}'
    )
    assert snapshot.blobs == (REF,)


def test_open_delta_reads_a_whole_snapshot_or_its_parts() -> None:
    values = tensors(5)
    whole = encode_fragment(values, SPEC, "fp32", block_size=8)
    base = {"learner": "a", "round": 0, "fragment": 0, "base_version": 0, "steps": 1}
    one = Snapshot(**base, tokens=1, delta=REF, norm=None)
    assert isinstance(open_delta([whole], one, SPEC), type(open_fragment(whole, SPEC)))
    datas, split = parted(values, 2, "fp32")
    parts = tuple(SnapshotPart(delta=REF, rows=tuple(rows)) for rows in split)
    many = Snapshot(**base, tokens=1, parts=parts, norm=None)
    for got, want in zip(tensors_of(open_delta(datas, many, SPEC)), values, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_ranks_rows_decode_from_their_byte_ranges_alone(encoding: str, world: int) -> None:
    values = tensors(6)
    data = encode_fragment(values, SPEC, encoding, block_size=8)
    whole = decode_fragment(data, SPEC)
    layout = blob_layout(data[:HEAD_BYTES], len(data), SPEC)
    for rows in shards(world):
        spans = row_spans(layout, rows)
        got = decode_rows(layout, rows, [data[a:b] for a, b in spans])
        for tensor, want in zip(got, cut(whole, rows), strict=True):
            assert tensor.shape == want.shape
            assert torch.equal(tensor, want)


def test_a_rank_reads_about_its_share_of_a_blob() -> None:
    spec = FragmentSpec(
        index=0,
        params=(
            ParamSpec(name="w", shape=(256, 64), dtype="float32"),
            ParamSpec(name="b", shape=(64,), dtype="float32"),
        ),
    )
    gen = torch.Generator().manual_seed(7)
    data = encode_fragment(
        [torch.randn(p.shape, generator=gen) for p in spec.params], spec, "int8", block_size=64
    )
    layout = blob_layout(data[:HEAD_BYTES], len(data), spec)
    for rank in range(4):
        rows = [(rank * 64, rank * 64 + 64), (rank * 16, rank * 16 + 16)]
        read = sum(b - a for a, b in row_spans(layout, rows))
        assert read <= len(data) / 4


def test_bytes_that_fail_the_checks_are_refused() -> None:
    values = tensors(8)
    data = encode_fragment(values, SPEC, "int8", block_size=8)
    layout = blob_layout(data, len(data), SPEC)
    rows = shards(2)[1]
    spans = row_spans(layout, rows)
    fetched = [bytearray(data[a:b]) for a, b in spans]
    fetched[0][0] = 0x80  # -128: below -127
    with pytest.raises(CodecError, match="below -127"):
        decode_rows(layout, rows, [bytes(f) for f in fetched])
    other = FragmentSpec(index=0, params=SPEC.params[:2])
    with pytest.raises(CodecError, match="another model"):
        blob_layout(data, len(data), other)
    with pytest.raises(CodecError, match="tensors take"):
        blob_layout(data, len(data) + 4, SPEC)
