"""The fast transfer path (issue #9): byte ranges fetched on concurrent streams, digests computed while bytes move (and
in a trailer), hand-framed data chunks, reused receive buffers, the one-sum finiteness check, lossy float16/bfloat16
updates, and the blob store's byte budget. Each piece must refuse exactly what the plain path refuses."""

from __future__ import annotations

import hashlib
import itertools
import math
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from aggregator_service.blobs import MIN_KEPT, BlobStore
from fairfl import codec, fetch, framing
from fairfl.config import ConfigError, experiment_from_dict
from fairfl.framing import CHUNK_BYTES
from fairfl.params import PAYLOAD_DTYPES, ParamLayout
from fairfl.protocol import TRAIN, UPDATE, ClientResult, ResultAssembler, encode_result, parse_result_chunk
from fairfl.v1 import federation_pb2, tensor_pb2

torch.set_num_threads(1)
F16, BF16, F32 = tensor_pb2.DTYPE_FLOAT16, tensor_pb2.DTYPE_BFLOAT16, tensor_pb2.DTYPE_FLOAT32


# -- all_finite --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_all_finite_finds_one_bad_value_anywhere(dtype: torch.dtype, bad: float) -> None:
    n = 3 * (1 << 20) + 5  # several of the half-precision blocks, and a ragged last one
    values = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert codec.all_finite(values)
    for index in (0, n // 2, n - 1):
        spoiled = values.clone()
        spoiled[index] = bad
        assert not codec.all_finite(spoiled), (dtype, bad, index)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_is_exact_when_the_sum_overflows(dtype: torch.dtype) -> None:
    """Finite values whose sum overflows the dtype are finite: the check settles it element-wise."""
    big = torch.full((4096,), torch.finfo(dtype).max, dtype=dtype)
    assert math.isinf(float(big.sum()))
    assert codec.all_finite(big)
    big[7] = math.nan
    assert not codec.all_finite(big)


def test_all_finite_of_empty_and_integer_tensors() -> None:
    assert codec.all_finite(torch.empty(0))
    assert codec.all_finite(torch.arange(10))


# -- StreamDigest ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("background", [False, True])
def test_stream_digest_is_sha256_of_the_pieces_in_order(background: bool) -> None:
    rng = np.random.default_rng(2)
    pieces = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in (0, 1, 4096, 3_000_000, 17, 65_536)]
    digest = codec.StreamDigest(background=background)
    for piece in pieces:
        digest.update(memoryview(piece))
    assert digest.hexdigest() == hashlib.sha256(b"".join(pieces)).hexdigest()


def test_stream_digests_share_the_workers_without_mixing() -> None:
    rng = np.random.default_rng(3)
    payloads = [rng.integers(0, 256, 2_000_000, dtype=np.uint8).tobytes() for _ in range(6)]
    digests = [codec.StreamDigest(background=True) for _ in payloads]
    for start in range(0, 2_000_000, 250_000):  # interleaved, as concurrent streams feed them
        for digest, payload in zip(digests, payloads, strict=True):
            digest.update(payload[start : start + 250_000])
    assert [d.hexdigest() for d in digests] == [hashlib.sha256(p).hexdigest() for p in payloads]


# -- BufferPool --------------------------------------------------------------------------------------------------------


def test_pool_hands_a_buffer_out_again_only_when_nothing_reaches_it() -> None:
    pool = codec.BufferPool(max_buffers=2, min_bytes=64)
    first = pool.take(1000)
    first[:] = 7
    holders = {
        "tensor": lambda a: torch.frombuffer(a, dtype=torch.float32, count=10, offset=4),
        "numpy view": lambda a: a[100:200].view(np.int16),
        "memoryview": lambda a: memoryview(a)[3:9],
        "from_numpy": lambda a: torch.from_numpy(a)[5:],
    }
    for name, hold in holders.items():
        held = hold(first)
        address = first.ctypes.data
        del first
        other = pool.take(1000)
        assert other.ctypes.data != address, f"reused while a {name} still reaches it"
        del other
        first = next(p.array for p in pool._buffers if p.array.ctypes.data == address)
        del held
    address, before = first.ctypes.data, pool.reused
    del first
    reused = pool.take(1000)
    assert reused.ctypes.data == address and pool.reused == before + 1
    assert (reused == 7).all()  # not cleared: callers overwrite every byte


def test_pool_keeps_at_most_max_buffers_and_small_sizes_are_plain() -> None:
    pool = codec.BufferPool(max_buffers=2, min_bytes=64)
    small = pool.take(10)
    assert len(small) == 10 and pool._buffers == []
    held = [pool.take(100), pool.take(100), pool.take(100)]  # the third: all pooled ones in use, so a plain one
    assert len(pool._buffers) == 2
    del held
    pool.take(300)  # an idle buffer of another size makes room, the oldest first
    assert sorted(len(p.array) for p in pool._buffers) == [100, 300]


# -- hand-framed data chunks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, 2_097_151, CHUNK_BYTES])
def test_framed_data_is_the_protobuf_encoding(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    views = [memoryview(data)[: size // 3], memoryview(data)[size // 3 :]]
    framed = framing.framed_data(views)
    assert framed.data == tensor_pb2.Chunk(data=data).SerializeToString()
    assert framed.data == federation_pb2.ResultChunk(data=data).SerializeToString()
    assert framed.ByteSize() == len(framed.data) and framing.serialize(framed) == framed.data
    parsed = framing.chunk_parser(tensor_pb2.Chunk)(framed.data)
    assert isinstance(parsed, framing.DataChunk) and parsed.WhichOneof("part") == "data"
    assert bytes(parsed.data) == data and parsed.ByteSize() == len(framed.data)


def test_parser_leaves_everything_but_a_lone_data_field_to_protobuf() -> None:
    header = tensor_pb2.Chunk(header=tensor_pb2.BundleHeader(total_bytes=3, sha256="a" * 64)).SerializeToString()
    data = tensor_pb2.Chunk(data=b"xyz").SerializeToString()
    trailer = federation_pb2.ResultChunk(trailer=federation_pb2.ResultTrailer(sha256="b" * 64)).SerializeToString()
    for raw in (header, data + header, data + b"\x00", data[:-1], b"\x12\xff\xff", b"", trailer):
        assert framing.data_view(raw) is None, raw
    parse = framing.chunk_parser(tensor_pb2.Chunk)
    assert parse(header).header.total_bytes == 3
    assert parse(data + header).WhichOneof("part") == "header"  # protobuf semantics: the last oneof field wins
    assert parse_result_chunk(trailer).trailer.sha256 == "b" * 64
    assert parse_result_chunk(data).data.tobytes() == b"xyz"


# -- bundles as byte ranges --------------------------------------------------------------------------------------------


def _bundle(sizes: tuple[int, ...] = (1000, 3, 700_000, 9)) -> codec.EncodedBundle:
    gen = torch.Generator().manual_seed(4)
    return codec.encode_bundle([(f"t{i}", torch.randn(n, generator=gen)) for i, n in enumerate(sizes)])


def _payload(bundle: codec.EncodedBundle) -> bytes:
    return b"".join(bytes(b) for b in bundle.buffers)


@pytest.mark.parametrize("framed", [False, True])
@pytest.mark.parametrize(("offset", "length"), [(0, None), (0, 4000), (3999, 13), (4001, 2_000_000), (2_804_048, 0)])
def test_bundle_range_is_the_slice_of_the_payload(offset: int, length: int | None, framed: bool) -> None:
    bundle = _bundle()
    chunks = list(bundle.chunks(65_536, offset, length, framed=framed))
    assert chunks[0].header.sha256 == bundle.sha256
    raws = [c.SerializeToString() for c in chunks[1:]]
    data = b"".join(tensor_pb2.Chunk.FromString(r).data for r in raws)
    end = bundle.total_bytes if length is None else offset + length
    assert data == _payload(bundle)[offset:end]
    assert all(0 < len(tensor_pb2.Chunk.FromString(r).data) <= 65_536 for r in raws)


@pytest.mark.parametrize(("offset", "length"), [(-1, 5), (0, -1), (2_804_049, 0), (10, 2_804_040)])
def test_bundle_range_outside_the_payload_is_refused(offset: int, length: int) -> None:
    with pytest.raises(codec.CodecError, match="outside the payload") as refused:
        list(_bundle().chunks(offset=offset, length=length))
    assert refused.value.reason == "size"


def test_segments_are_whole_chunks_covering_the_payload() -> None:
    for total in (1, CHUNK_BYTES, 3 * fetch.SEGMENT_BYTES + 5, 64 * 1024**3):
        segments = fetch.plan_segments(total)
        assert segments[0][0] == 0 and sum(n for _, n in segments) == total
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(segments))
        assert all(n % CHUNK_BYTES == 0 for _, n in segments[:-1]) and len(segments) <= fetch.MAX_SEGMENTS


class _Server:
    """Serves a bundle's ranges the way FetchBlob does; `tamper` rewrites one range's stream."""

    def __init__(self, bundle: codec.EncodedBundle, tamper=None) -> None:
        self.bundle = bundle
        self.tamper = tamper
        self.calls: list[tuple[int, int]] = []
        self.cancelled = 0
        self.lock = threading.Lock()

    def open(self, offset: int, length: int) -> Iterator[tensor_pb2.Chunk]:
        with self.lock:
            self.calls.append((offset, length))
        chunks = list(self.bundle.chunks(4096, offset, length or self.bundle.total_bytes - offset))
        if self.tamper is not None:
            chunks = self.tamper(offset, chunks)
        return _Call(chunks, self)


class _Call:
    def __init__(self, chunks: list[tensor_pb2.Chunk], server: _Server) -> None:
        self.chunks = iter(chunks)
        self.server = server

    def __iter__(self) -> _Call:
        return self

    def __next__(self) -> tensor_pb2.Chunk:
        return next(self.chunks)

    def cancel(self) -> None:
        with self.server.lock:
            self.server.cancelled += 1


def _fetch(server: _Server, streams: int = 3, check=lambda header: None) -> tuple[tensor_pb2.BundleHeader, np.ndarray]:
    b = server.bundle
    return fetch.fetch_ranges(server.open, b.total_bytes, b.sha256, check, streams=streams, segment_bytes=65_536)


@pytest.mark.parametrize("streams", [1, 2, 5])
def test_fetch_ranges_reassembles_the_payload(streams: int) -> None:
    bundle = _bundle()
    server = _Server(bundle)
    header, buffer = _fetch(server, streams)
    assert bytes(buffer) == _payload(bundle) and header.sha256 == bundle.sha256
    ranges = sorted(server.calls)
    if streams == 1:
        assert ranges == [(0, 0)]  # one plain request for the whole payload
    else:
        assert len(ranges) > 1 and sum(n for _, n in ranges) == bundle.total_bytes
    tensors = codec.decode_tensors(header.tensors, buffer)
    assert torch.equal(tensors[2][1], torch.frombuffer(bytearray(bundle.buffers[2]), dtype=torch.float32))


def _data_chunk(data: bytes) -> tensor_pb2.Chunk:
    return tensor_pb2.Chunk(data=data)


def _flip(offset: int, chunks: list[tensor_pb2.Chunk]) -> list[tensor_pb2.Chunk]:
    if offset == 65_536 * 2:
        data = bytearray(chunks[3].data)
        data[5] ^= 1
        chunks[3] = _data_chunk(bytes(data))
    return chunks


def _swap(offset: int, chunks: list[tensor_pb2.Chunk]) -> list[tensor_pb2.Chunk]:
    return [chunks[0], chunks[2], chunks[1], *chunks[3:]] if offset == 65_536 else chunks


def _truncate(offset: int, chunks: list[tensor_pb2.Chunk]) -> list[tensor_pb2.Chunk]:
    return chunks[:-1] if offset == 65_536 * 4 else chunks


def _extend(offset: int, chunks: list[tensor_pb2.Chunk]) -> list[tensor_pb2.Chunk]:
    return [*chunks, _data_chunk(b"\x00")] if offset == 0 else chunks


def _second_header(offset: int, chunks: list[tensor_pb2.Chunk]) -> list[tensor_pb2.Chunk]:
    return [*chunks[:2], chunks[0], *chunks[2:]] if offset == 65_536 else chunks


def _other_blob(offset: int, chunks: list[tensor_pb2.Chunk]) -> list[tensor_pb2.Chunk]:
    if offset == 65_536 * 3:
        header = tensor_pb2.Chunk()
        header.CopyFrom(chunks[0])
        header.header.sha256 = "0" * 64
        return [header, *chunks[1:]]
    return chunks


def _no_header(offset: int, chunks: list[tensor_pb2.Chunk]) -> list[tensor_pb2.Chunk]:
    return chunks[1:] if offset == 65_536 else chunks


def _empty_chunk(offset: int, chunks: list[tensor_pb2.Chunk]) -> list[tensor_pb2.Chunk]:
    return [chunks[0], _data_chunk(b""), *chunks[1:]] if offset == 0 else chunks


BAD_RANGES = [
    (_flip, "integrity", "sha256"),
    (_swap, "integrity", "sha256"),
    (_truncate, "size", "ended after"),
    (_extend, "size", "were asked for"),
    (_second_header, "malformed", "second header"),
    (_other_blob, "malformed", "not the requested blob"),
    (_no_header, "malformed", "did not start with a header"),
    (_empty_chunk, "size", "chunks carry"),
]


@pytest.mark.parametrize(("tamper", "reason", "match"), BAD_RANGES)
def test_fetch_ranges_refuses_a_bad_range(tamper, reason: str, match: str) -> None:
    with pytest.raises(codec.CodecError, match=match) as refused:
        _fetch(_Server(_bundle(), tamper), streams=3)
    assert refused.value.reason == reason


@pytest.mark.parametrize(
    ("tamper", "reason", "match"),
    [(_flip, "integrity", "sha256"), (_swap, "integrity", "sha256"), (_truncate, "size", "ended after 2")],
)
def test_one_stream_fetch_refuses_a_bad_stream(tamper, reason: str, match: str) -> None:
    """The single-request path (small blobs, one stream) checks the same: here the whole payload is range 0."""

    def whole(offset: int, chunks: list[tensor_pb2.Chunk]) -> list[tensor_pb2.Chunk]:
        return tamper({_flip: 65_536 * 2, _swap: 65_536, _truncate: 65_536 * 4}[tamper], chunks)

    server = _Server(_bundle(), whole)
    with pytest.raises(codec.CodecError, match=match) as refused:
        _fetch(server, streams=1)
    assert refused.value.reason == reason
    assert server.calls == [(0, 0)] and server.cancelled == 1  # the call is not left open


def test_fetch_ranges_checks_the_header_and_cancels_the_other_streams() -> None:
    bundle = _bundle()

    def refuse(header: tensor_pb2.BundleHeader) -> None:
        raise codec.CodecError("tensor 't0': dtype DTYPE_FLOAT32, expected DTYPE_FLOAT16", "layout")

    with pytest.raises(codec.CodecError, match="expected DTYPE_FLOAT16"):
        _fetch(_Server(bundle), 3, refuse)

    class Broken(_Server):
        def open(self, offset: int, length: int) -> Iterator[tensor_pb2.Chunk]:
            if offset == 65_536 * 5:
                raise ConnectionError("the stream broke")
            return super().open(offset, length)

    broken = Broken(bundle)
    with pytest.raises(ConnectionError, match="the stream broke"):
        _fetch(broken, 4)
    assert len(broken.calls) < len(fetch.plan_segments(bundle.total_bytes, 65_536))  # the others stopped early


def test_fetch_ranges_refuses_a_blob_over_the_limit() -> None:
    bundle = _bundle()
    with pytest.raises(codec.CodecError, match="exceeds the limit") as refused:
        fetch.fetch_ranges(
            _Server(bundle).open, bundle.total_bytes, bundle.sha256, lambda h: None, max_bytes=1000, streams=3
        )
    assert refused.value.reason == "size"


# -- sha256 in a trailer -----------------------------------------------------------------------------------------------


def _receiver(data: bytes, trailer: bool = True) -> codec.PayloadReceiver:
    sha = "" if trailer else hashlib.sha256(data).hexdigest()
    return codec.PayloadReceiver(len(data), sha, sha256_in_trailer=trailer)


def test_trailer_digest_is_checked_like_a_header_digest() -> None:
    data = bytes(range(256)) * 100
    receiver = _receiver(data)
    receiver.add(data[:10_000])
    receiver.add(memoryview(data)[10_000:])
    receiver.set_trailer(hashlib.sha256(data).hexdigest())
    assert bytes(receiver.finish()) == data
    wrong = _receiver(data)
    wrong.add(data)
    wrong.set_trailer(hashlib.sha256(data[::-1]).hexdigest())
    with pytest.raises(codec.CodecError, match="sha256") as refused:
        wrong.finish()
    assert refused.value.reason == "integrity"


def test_trailer_misuse_is_refused() -> None:
    data = b"abcdefgh"
    digest = hashlib.sha256(data).hexdigest()
    with pytest.raises(codec.CodecError, match="send one of them"):
        codec.PayloadReceiver(8, digest, sha256_in_trailer=True)
    missing = _receiver(data)
    missing.add(data)
    with pytest.raises(codec.CodecError, match="without the sha256 trailer"):
        missing.finish()
    unannounced = _receiver(data, trailer=False)
    with pytest.raises(codec.CodecError, match="did not announce"):
        unannounced.set_trailer(digest)
    twice = _receiver(data)
    twice.add(data)
    twice.set_trailer(digest)
    with pytest.raises(codec.CodecError, match="second sha256 trailer"):
        twice.set_trailer(digest)
    late = _receiver(data)
    late.add(data[:4])
    late.set_trailer(digest)
    with pytest.raises(codec.CodecError, match="after the sha256 trailer"):
        late.add(data[4:])
    with pytest.raises(codec.CodecError, match="64 lowercase hex"):
        _receiver(data).set_trailer(digest.upper())


# -- results: trailer, framing, lossy dtypes ---------------------------------------------------------------------------


@pytest.fixture
def layout() -> ParamLayout:
    return ParamLayout(("w", "b"), ((300, 7), (7,)))


def _result(layout: ParamLayout, values: torch.Tensor | None = None) -> ClientResult:
    if values is None:
        values = torch.randn(layout.numel, generator=torch.Generator().manual_seed(5)) * 1e-2
    return ClientResult("t1", "r", 1, 0, TRAIN, 10, loss_before=1.0, loss_after=0.5, payloads={UPDATE: values})


def _assemble(parts: list, layout: ParamLayout) -> ClientResult:
    raws = [framing.serialize(p) for p in parts]
    first = parse_result_chunk(raws[0])
    assembler = ResultAssembler(first.header, layout)
    for raw in raws[1:]:
        chunk = parse_result_chunk(raw)
        assembler.add(chunk.trailer if chunk.WhichOneof("part") == "trailer" else chunk.data)
    return assembler.finish()


@pytest.mark.parametrize("framed", [False, True])
@pytest.mark.parametrize("trailer", [False, True])
def test_result_roundtrips_with_trailer_and_framing(layout: ParamLayout, trailer: bool, framed: bool) -> None:
    result = _result(layout)
    parts = list(encode_result(result, layout, chunk_bytes=1000, sha256_in_trailer=trailer, framed=framed))
    header = parts[0].header
    assert header.sha256_in_trailer == trailer and (header.sha256 == "") == trailer
    assert (parse_result_chunk(framing.serialize(parts[-1])).WhichOneof("part") == "trailer") == trailer
    plain = [c.SerializeToString() for c in encode_result(result, layout, chunk_bytes=1000)]
    data = [framing.serialize(p) for p in parts[1 : len(parts) - trailer]]
    assert data == plain[1:]  # the data chunks are the same bytes whichever way they were made
    got = _assemble(parts, layout)
    assert torch.equal(got.payloads[UPDATE], result.payloads[UPDATE])


@pytest.mark.parametrize(("name", "unit_roundoff"), [("float16", 2.0**-11), ("bfloat16", 2.0**-8)])
def test_lossy_update_roundtrip_error_is_within_the_dtype_rounding(
    layout: ParamLayout, name: str, unit_roundoff: float
) -> None:
    wire = layout.with_payload_dtype(name)
    values = torch.randn(layout.numel, generator=torch.Generator().manual_seed(6)) * 1e-2
    values[:3] = torch.tensor([0.0, 1e-9, -300.0])  # zero, a value below the normal range, a large one
    parts = list(encode_result(_result(layout, values), wire, chunk_bytes=512, sha256_in_trailer=True, framed=True))
    assert all(spec.dtype == PAYLOAD_DTYPES[name] for spec in parts[0].header.payloads[0].tensors)
    assert parts[0].header.total_bytes == layout.numel * 2 == wire.payload_nbytes
    got = _assemble(parts, wire).payloads[UPDATE]
    assert got.dtype == torch.float32 and got.shape == values.shape
    tiny = torch.finfo(codec.TORCH_DTYPES[PAYLOAD_DTYPES[name]]).tiny  # absolute error below the normal range
    assert ((got - values).abs() <= unit_roundoff * values.abs() + tiny).all()
    assert torch.equal(got, values.to(codec.TORCH_DTYPES[PAYLOAD_DTYPES[name]]).float())  # exactly the rounded values
    assert not torch.equal(got, values)


@pytest.mark.parametrize(
    ("sent", "expected"), [("float16", "float32"), ("float32", "float16"), ("bfloat16", "float16")]
)
def test_a_result_in_another_dtype_than_the_run_is_refused(layout: ParamLayout, sent: str, expected: str) -> None:
    parts = list(encode_result(_result(layout), layout.with_payload_dtype(sent)))
    header = parts[0].header
    with pytest.raises(codec.CodecError, match=f"expected DTYPE_{expected.upper()}") as refused:
        ResultAssembler(header, layout.with_payload_dtype(expected))
    assert refused.value.reason == "layout"


def test_float16_overflow_is_refused_by_the_sender(layout: ParamLayout) -> None:
    values = torch.zeros(layout.numel)
    values[42] = 1e6  # finite in float32, beyond float16's 65504
    with pytest.raises(codec.CodecError, match=r"overflows DTYPE_FLOAT16.*1e\+06.*bfloat16 or float32") as refused:
        next(encode_result(_result(layout, values), layout.with_payload_dtype("float16")))
    assert refused.value.reason == "non_finite"
    assert next(encode_result(_result(layout, values), layout.with_payload_dtype("bfloat16"))).header.total_bytes
    values[42] = math.nan
    with pytest.raises(codec.CodecError, match="UPDATE contains NaN"):
        next(encode_result(_result(layout, values), layout.with_payload_dtype("bfloat16")))


def test_non_finite_half_payload_is_refused_by_the_receiver(layout: ParamLayout) -> None:
    wire = layout.with_payload_dtype("float16")
    parts = list(encode_result(_result(layout), wire, chunk_bytes=100_000))
    data = bytearray(parts[1].data)
    data[10:12] = np.array([np.inf], dtype=np.float16).tobytes()
    header = federation_pb2.ResultHeader()
    header.CopyFrom(parts[0].header)
    header.sha256 = hashlib.sha256(bytes(data)).hexdigest()  # a correct digest: only the value check can tell
    assembler = ResultAssembler(header, wire)
    assembler.add(bytes(data))
    with pytest.raises(codec.CodecError, match="NaN or infinite") as refused:
        assembler.finish()
    assert refused.value.reason == "non_finite"


def test_update_dtype_is_validated_at_load() -> None:
    assert experiment_from_dict({"transport": {"update_dtype": "bfloat16"}}).transport.update_dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"^transport\.update_dtype: 'int8' is not one of"):
        experiment_from_dict({"transport": {"update_dtype": "int8"}})
    with pytest.raises(ConfigError, match=r"^transport\.compression: unknown field"):
        experiment_from_dict({"transport": {"compression": "fp16"}})
    with pytest.raises(ValueError, match="not one of float32, float16, bfloat16"):
        ParamLayout(("w",), ((2,),)).with_payload_dtype("float8")


# -- blob store byte budget --------------------------------------------------------------------------------------------


def test_blob_store_keeps_the_newest_within_its_byte_budget() -> None:
    layout = ParamLayout(("w",), ((1000,),))  # 4000 bytes a blob
    store = BlobStore(capacity=8, max_bytes=10_000)
    refs = [store.put(layout, torch.full((1000,), float(i))) for i in range(5)]
    assert [store.get(r.sha256) is not None for r in refs] == [False, False, False, True, True]
    huge = BlobStore(capacity=8, max_bytes=1)  # over budget: the newest MIN_KEPT stay anyway
    refs = [huge.put(layout, torch.full((1000,), float(i))) for i in range(4)]
    assert sum(huge.get(r.sha256) is not None for r in refs) == MIN_KEPT
    assert huge.get(refs[-1].sha256) is not None
