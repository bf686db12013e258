"""Tensor codec: every wire dtype, empty/0-d/non-contiguous/>64 MiB tensors through the chunked path, and every way a
stream can be malformed (missing or repeated header, truncation, extra bytes, corruption, reordering, bad specs)."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from fairfl import codec, framing
from fairfl.framing import CHUNK_BYTES
from fairfl.v1 import tensor_pb2

GRPC_DEFAULT_MAX_MESSAGE = 4 * 1024 * 1024

# Same-width integer dtype used to compare tensors bit for bit (NaN payloads, -0.0 and subnormals included).
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.bool: torch.uint8,
}


def assert_same(actual: torch.Tensor, expected: torch.Tensor | np.ndarray) -> None:
    """Same dtype, same shape, same bits."""
    if isinstance(expected, np.ndarray):
        expected = torch.from_numpy(np.ascontiguousarray(expected))
    assert actual.dtype == expected.dtype
    assert tuple(actual.shape) == tuple(expected.shape)
    bits = _BITS.get(expected.dtype)
    a, e = actual.contiguous(), expected.contiguous()
    if bits is not None:
        a, e = a.view(bits), e.view(bits)
    assert torch.equal(a, e)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random values covering the dtype's whole range; floats include inf, -inf, NaN, -0.0 and a subnormal."""
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=gen, dtype=torch.float64) * 1e3).to(dtype)
        flat = t.view(-1)
        specials = [math.inf, -math.inf, math.nan, -0.0, torch.finfo(dtype).tiny / 2, torch.finfo(dtype).max]
        for i, value in enumerate(specials[: flat.numel()]):
            flat[i] = value
        return t
    info = torch.iinfo(dtype)
    t = torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)
    if t.numel() >= 2:
        t.view(-1)[0], t.view(-1)[1] = info.min, info.max
    return t


def roundtrip(
    tensors: list[tuple[str, torch.Tensor | np.ndarray]], chunk_bytes: int = CHUNK_BYTES
) -> list[tuple[str, torch.Tensor]]:
    bundle = codec.encode_bundle(tensors)
    chunks = list(bundle.chunks(chunk_bytes))
    header, decoded = codec.receive_bundle(chunks)
    assert header == bundle.header
    assert [name for name, _ in decoded] == [name for name, _ in tensors]
    return decoded


def small_stream(chunk_bytes: int = 16) -> tuple[codec.EncodedBundle, list[tensor_pb2.Chunk]]:
    """A bundle of mixed tensors (83 bytes) cut into several small data chunks with distinct contents."""
    gen = torch.Generator().manual_seed(7)
    bundle = codec.encode_bundle(
        [
            ("w", random_tensor(torch.float32, (3, 4), gen)),
            ("b", random_tensor(torch.int8, (3,), gen)),
            ("m", random_tensor(torch.int64, (2, 2), gen)),
        ]
    )
    chunks = list(bundle.chunks(chunk_bytes))
    assert len(chunks) >= 4
    return bundle, chunks


# --- round trips ----------------------------------------------------------------------------------------------------


def test_dtype_tables_cover_every_wire_dtype() -> None:
    wire = [v for v in tensor_pb2.DType.values() if v != tensor_pb2.DTYPE_UNSPECIFIED]
    assert sorted(codec.TORCH_DTYPES) == sorted(wire)
    assert {codec.WIRE_DTYPES[t]: t for t in codec.WIRE_DTYPES} == codec.TORCH_DTYPES
    for wire_dtype, torch_dtype in codec.TORCH_DTYPES.items():
        assert codec.ITEMSIZE[wire_dtype] == torch.empty((), dtype=torch_dtype).element_size()


@pytest.mark.parametrize("dtype", list(codec.TORCH_DTYPES.values()), ids=str)
def test_every_dtype_roundtrips_bit_exact(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    tensors = [
        ("matrix", random_tensor(dtype, (37, 29), gen)),
        ("vector", random_tensor(dtype, (1001,), gen)),
        ("cube", random_tensor(dtype, (3, 5, 7), gen)),
    ]
    # A small chunk size forces tensors to straddle chunk boundaries.
    decoded = roundtrip(tensors, chunk_bytes=997)
    for (_, original), (_, got) in zip(tensors, decoded, strict=True):
        assert_same(got, original)
        if not original.is_floating_point():
            assert torch.equal(got, original)


@pytest.mark.parametrize("dtype", list(codec.TORCH_DTYPES.values()), ids=str)
def test_every_dtype_wire_bytes_are_little_endian_row_major(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    t = random_tensor(dtype, (4, 3), gen)
    raw = bytes(codec.tensor_bytes(t))
    assert len(raw) == t.numel() * t.element_size()
    # Independent reference: element by element, row-major, little-endian.
    width = t.element_size()
    as_int = t.contiguous().view(_BITS.get(dtype, dtype)).reshape(-1).tolist()
    expected = b"".join(
        int(v).to_bytes(width, "little", signed=dtype != torch.uint8 and dtype != torch.bool) for v in as_int
    )
    assert raw == expected


def test_mixed_dtypes_in_one_bundle_at_unaligned_offsets() -> None:
    gen = torch.Generator().manual_seed(3)
    tensors = [
        (f"t{i}_{str(dtype).removeprefix('torch.')}", random_tensor(dtype, shape, gen))
        for i, (dtype, shape) in enumerate(
            [
                (torch.int8, (3,)),  # the next tensor starts at an odd offset
                (torch.float64, (5, 2)),
                (torch.bool, (7,)),
                (torch.bfloat16, (3, 3)),
                (torch.uint8, (1,)),
                (torch.float32, (11,)),
                (torch.int16, (2, 3)),
                (torch.float16, (5,)),
                (torch.int64, (4,)),
                (torch.int32, (3,)),
            ]
        )
    ]
    for chunk_bytes in (1, 5, 64, CHUNK_BYTES):
        decoded = roundtrip(tensors, chunk_bytes=chunk_bytes)
        for (_, original), (_, got) in zip(tensors, decoded, strict=True):
            assert_same(got, original)


def _check_empty_roundtrip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    empty = torch.empty(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(4)
    neighbour = random_tensor(dtype, (6,), gen)
    decoded = roundtrip([("empty", empty), ("neighbour", neighbour), ("empty_again", empty)])
    assert_same(decoded[0][1], empty)
    assert_same(decoded[1][1], neighbour)
    assert_same(decoded[2][1], empty)
    proto = codec.tensor_to_proto("empty", empty)
    assert proto.data == b""
    assert_same(codec.tensor_from_proto(proto), empty)


@pytest.mark.parametrize("dtype", list(codec.TORCH_DTYPES.values()), ids=str)
def test_empty_vectors_roundtrip(dtype: torch.dtype) -> None:
    _check_empty_roundtrip(dtype, (0,))


@pytest.mark.parametrize("shape", [(3, 0, 2), (0, 4)], ids=str)
def test_empty_tensors_with_several_dims_roundtrip(shape: tuple[int, ...]) -> None:
    # Fails today: tensor_bytes does memoryview(ndarray).cast("B"), which CPython refuses for a multi-dimensional view
    # with a zero in its shape ("cannot cast view with zeros in shape or strides") -> TypeError, for every dtype.
    for dtype in codec.TORCH_DTYPES.values():
        _check_empty_roundtrip(dtype, shape)
    _, (got,) = zip(*roundtrip([("np", np.zeros(shape, dtype=np.float32))]), strict=True)
    assert tuple(got.shape) == shape


def test_bundle_of_only_empty_tensors_is_a_lone_header() -> None:
    bundle = codec.encode_bundle([("a", torch.empty(0)), ("b", torch.empty((0,), dtype=torch.int64))])
    chunks = list(bundle.chunks())
    assert len(chunks) == 1
    assert chunks[0].WhichOneof("part") == "header"
    assert bundle.total_bytes == 0
    assert bundle.sha256 == hashlib.sha256(b"").hexdigest()
    _, decoded = codec.receive_bundle(chunks)
    assert [(n, tuple(t.shape)) for n, t in decoded] == [("a", (0,)), ("b", (0,))]


@pytest.mark.parametrize("dtype", list(codec.TORCH_DTYPES.values()), ids=str)
def test_zero_dim_scalars_roundtrip(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    scalar = random_tensor(dtype, (), gen)
    assert scalar.dim() == 0
    decoded = roundtrip([("s", scalar), ("v", random_tensor(dtype, (3,), gen))])
    assert_same(decoded[0][1], scalar)
    assert decoded[0][1].dim() == 0
    assert_same(codec.tensor_from_proto(codec.tensor_to_proto("s", scalar)), scalar)


def test_zero_dim_numpy_arrays_keep_their_shape() -> None:
    # Fails today: _as_torch uses np.ascontiguousarray, which returns an array with ndim >= 1, so a 0-d array is
    # declared and decoded with shape [1] instead of [].
    for dtype in (np.float32, np.float64, np.int64, np.uint8, np.bool_):
        scalar = np.array(3, dtype=dtype)
        expected = torch.from_numpy(scalar.copy())
        assert codec.spec_of("s", scalar).shape == [], dtype
        ((_, got),) = roundtrip([("s", scalar)])
        assert_same(got, expected)
        assert_same(codec.tensor_from_proto(codec.tensor_to_proto("s", scalar)), expected)


def _non_contiguous_cases(dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(6)
    base = random_tensor(dtype, (6, 8), gen)
    yield "transposed", base.t()
    yield "strided_slice", base[::2, 1::3]
    yield "column", base[:, 5]
    yield "expanded", base[2:3, :].expand(4, 8)
    yield "permuted_3d", random_tensor(dtype, (2, 3, 4), gen).permute(2, 0, 1)
    yield "stepped_flat", base.reshape(-1)[3::5]


@pytest.mark.parametrize("dtype", list(codec.TORCH_DTYPES.values()), ids=str)
def test_non_contiguous_tensors_roundtrip_to_their_values(dtype: torch.dtype) -> None:
    cases = list(_non_contiguous_cases(dtype))
    assert all(not t.is_contiguous() for _, t in cases)
    decoded = roundtrip(cases, chunk_bytes=33)
    for (_, original), (_, got) in zip(cases, decoded, strict=True):
        assert got.is_contiguous()
        assert_same(got, original)
    for name, original in cases:
        assert_same(codec.tensor_from_proto(codec.tensor_to_proto(name, original)), original)


def test_numpy_inputs_roundtrip_including_non_contiguous() -> None:
    rng = np.random.default_rng(8)
    arrays: list[tuple[str, np.ndarray]] = [
        ("f32", rng.standard_normal((4, 5)).astype(np.float32)),
        ("f64_T", rng.standard_normal((3, 7)).T),
        ("f16", rng.standard_normal(9).astype(np.float16)),
        ("i8_rev", rng.integers(-128, 127, 11, dtype=np.int8)[::-1]),
        ("u8", rng.integers(0, 255, (2, 2), dtype=np.uint8)),
        ("i16", rng.integers(-(2**15), 2**15 - 1, 6, dtype=np.int16)),
        ("i32_step", rng.integers(-(2**31), 2**31 - 1, 20, dtype=np.int32)[1::3]),
        ("i64", rng.integers(-(2**63), 2**63 - 1, 5, dtype=np.int64)),
        ("bool", rng.random((3, 3)) < 0.5),
    ]
    decoded = roundtrip(arrays, chunk_bytes=10)
    for (_, original), (_, got) in zip(arrays, decoded, strict=True):
        assert_same(got, original)
        np.testing.assert_array_equal(got.numpy(), original)


def test_tensor_requiring_grad_is_encoded_detached() -> None:
    weight = torch.nn.Parameter(torch.randn(3, 4))
    ((_, got),) = roundtrip([("weight", weight)])
    assert not got.requires_grad
    assert torch.equal(got, weight.detach())


def test_header_describes_the_payload() -> None:
    gen = torch.Generator().manual_seed(9)
    a, b = random_tensor(torch.float32, (2, 3), gen), random_tensor(torch.int16, (5,), gen)
    bundle = codec.encode_bundle([("a", a), ("b", b)])
    header = bundle.header
    assert [(s.name, s.dtype, list(s.shape)) for s in header.tensors] == [
        ("a", tensor_pb2.DTYPE_FLOAT32, [2, 3]),
        ("b", tensor_pb2.DTYPE_INT16, [5]),
    ]
    payload = a.numpy().tobytes() + b.numpy().tobytes()
    assert header.total_bytes == len(payload) == 24 + 10
    assert header.sha256 == hashlib.sha256(payload).hexdigest()
    data = b"".join(c.data for c in list(bundle.chunks(7))[1:])
    assert data == payload


def test_tensor_larger_than_64_mib_streams_in_grpc_sized_chunks() -> None:
    gen = torch.Generator().manual_seed(10)
    big = torch.randn(17_000_000, generator=gen)  # 68 MB > 64 MiB
    assert big.numel() * 4 > 64 * 1024**2
    tensors: list[tuple[str, torch.Tensor]] = [
        ("before", random_tensor(torch.int8, (13,), gen)),
        ("big", big),
        ("bias", random_tensor(torch.float64, (7,), gen)),
        ("mask", random_tensor(torch.bool, (3, 5), gen)),
    ]
    bundle = codec.encode_bundle(tensors)
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    assert bundle.total_bytes == total

    chunks = list(bundle.chunks())
    assert len(chunks) == math.ceil(total / CHUNK_BYTES) + 1
    assert chunks[0].WhichOneof("part") == "header"
    data_chunks = chunks[1:]
    assert all(c.WhichOneof("part") == "data" for c in data_chunks)
    assert CHUNK_BYTES <= GRPC_DEFAULT_MAX_MESSAGE
    for chunk in data_chunks[:-1]:
        assert len(chunk.data) == CHUNK_BYTES
    assert 0 < len(data_chunks[-1].data) <= CHUNK_BYTES
    assert sum(len(c.data) for c in data_chunks) == total
    # Whole serialized messages, header included, stay under gRPC's default receive limit.
    assert max(c.ByteSize() for c in chunks) <= GRPC_DEFAULT_MAX_MESSAGE

    header, decoded = codec.receive_bundle(iter(chunks), max_bytes=total)
    assert header.total_bytes == total
    for (name, original), (got_name, got) in zip(tensors, decoded, strict=True):
        assert got_name == name
        assert_same(got, original)


# --- iter_byte_chunks -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "chunk_bytes"),
    [
        ([3, 0, 10, 1, 7], 4),
        ([8, 8], 4),  # exact multiple: no empty trailing piece
        ([4], 4),
        ([1, 1, 1, 1, 1], 2),
        ([0, 0], 4),
        ([], 4),
        ([5], 100),
        ([100], 7),
    ],
)
def test_iter_byte_chunks_cuts_exact_pieces_across_buffers(sizes: list[int], chunk_bytes: int) -> None:
    rng = random.Random(sum(sizes) * 31 + chunk_bytes)
    raw = [bytes(rng.getrandbits(8) for _ in range(n)) for n in sizes]
    pieces = list(framing.iter_byte_chunks([memoryview(r) for r in raw], chunk_bytes))
    joined = b"".join(raw)
    assert b"".join(pieces) == joined
    assert all(isinstance(p, bytes) for p in pieces)
    assert len(pieces) == math.ceil(len(joined) / chunk_bytes)
    assert all(len(p) == chunk_bytes for p in pieces[:-1])
    if pieces:
        assert 0 < len(pieces[-1]) <= chunk_bytes


def test_iter_byte_chunks_random_layouts() -> None:
    rng = random.Random(11)
    for _ in range(200):
        sizes = [rng.choice([0, 1, 2, 3, 7, 16, 31, 64]) for _ in range(rng.randint(0, 8))]
        chunk_bytes = rng.randint(1, 40)
        raw = [rng.randbytes(n) for n in sizes]
        pieces = list(framing.iter_byte_chunks([memoryview(r) for r in raw], chunk_bytes))
        joined = b"".join(raw)
        assert b"".join(pieces) == joined
        assert all(len(p) == chunk_bytes for p in pieces[:-1])
        assert all(0 < len(p) <= chunk_bytes for p in pieces)
        assert len(pieces) == math.ceil(len(joined) / chunk_bytes)


def test_iter_byte_chunks_default_size_is_chunk_bytes() -> None:
    buffers = [memoryview(bytes(CHUNK_BYTES - 1)), memoryview(bytes(3)), memoryview(bytes(CHUNK_BYTES))]
    pieces = list(framing.iter_byte_chunks(buffers))
    assert [len(p) for p in pieces] == [CHUNK_BYTES, CHUNK_BYTES, 2]


# --- malformed streams ----------------------------------------------------------------------------------------------


def test_stream_without_header_is_refused() -> None:
    _, chunks = small_stream()
    with pytest.raises(codec.CodecError, match="header"):
        codec.receive_bundle(chunks[1:])


def test_empty_stream_is_refused() -> None:
    with pytest.raises(codec.CodecError, match="header"):
        codec.receive_bundle([])


def test_second_header_mid_stream_is_refused() -> None:
    _, chunks = small_stream()
    chunks.insert(2, chunks[0])
    with pytest.raises(codec.CodecError, match="second header"):
        codec.receive_bundle(chunks)


def test_chunk_with_no_part_is_refused() -> None:
    _, chunks = small_stream()
    chunks.insert(2, tensor_pb2.Chunk())
    with pytest.raises(codec.CodecError):
        codec.receive_bundle(chunks)


def test_truncated_stream_is_refused() -> None:
    _, chunks = small_stream()
    with pytest.raises(codec.CodecError, match="ended after"):
        codec.receive_bundle(chunks[:-1])
    with pytest.raises(codec.CodecError, match="ended after"):
        codec.receive_bundle(chunks[:1])


def test_extra_bytes_are_refused() -> None:
    _, chunks = small_stream()
    with pytest.raises(codec.CodecError, match="declared"):
        codec.receive_bundle([*chunks, tensor_pb2.Chunk(data=b"\x00")])
    # Extra bytes inside the last chunk, too.
    last = tensor_pb2.Chunk(data=chunks[-1].data + b"x")
    with pytest.raises(codec.CodecError):
        codec.receive_bundle([*chunks[:-1], last])


def test_corrupted_byte_fails_the_digest() -> None:
    _, chunks = small_stream()
    for index in range(1, len(chunks)):
        data = bytearray(chunks[index].data)
        data[len(data) // 2] ^= 0x01
        tampered = [*chunks[:index], tensor_pb2.Chunk(data=bytes(data)), *chunks[index + 1 :]]
        with pytest.raises(codec.CodecError, match="sha256"):
            codec.receive_bundle(tampered)


def test_reordered_chunks_fail_the_digest() -> None:
    _, chunks = small_stream()
    assert chunks[1].data != chunks[2].data
    swapped = [chunks[0], chunks[2], chunks[1], *chunks[3:]]
    with pytest.raises(codec.CodecError, match="sha256"):
        codec.receive_bundle(swapped)


def test_spec_sizes_must_match_total_bytes() -> None:
    bundle, chunks = small_stream()
    for delta in (-1, 1):
        header = tensor_pb2.BundleHeader()
        header.CopyFrom(bundle.header)
        header.total_bytes = bundle.total_bytes + delta
        with pytest.raises(codec.CodecError, match="declare"):
            codec.receive_bundle([tensor_pb2.Chunk(header=header), *chunks[1:]])
    # A spec whose shape grew: same total_bytes, but the specs now declare more.
    header = tensor_pb2.BundleHeader()
    header.CopyFrom(bundle.header)
    header.tensors[0].shape[0] += 1
    with pytest.raises(codec.CodecError, match="declare"):
        codec.receive_bundle([tensor_pb2.Chunk(header=header), *chunks[1:]])


def test_max_bytes_is_enforced() -> None:
    bundle, chunks = small_stream()
    with pytest.raises(codec.CodecError, match="exceeds the limit"):
        codec.receive_bundle(chunks, max_bytes=bundle.total_bytes - 1)
    _, decoded = codec.receive_bundle(chunks, max_bytes=bundle.total_bytes)
    assert len(decoded) == 3
    with pytest.raises(codec.CodecError, match="exceeds the limit"):
        codec.PayloadReceiver(10, "0" * 64, max_bytes=9)


@pytest.mark.parametrize("dtype", [tensor_pb2.DTYPE_UNSPECIFIED, 99])
def test_unknown_dtype_is_refused(dtype: int) -> None:
    bundle, chunks = small_stream()
    header = tensor_pb2.BundleHeader()
    header.CopyFrom(bundle.header)
    header.tensors[1].dtype = dtype  # type: ignore[assignment]
    with pytest.raises(codec.CodecError, match="unsupported dtype"):
        codec.receive_bundle([tensor_pb2.Chunk(header=header), *chunks[1:]])
    spec = tensor_pb2.TensorSpec(name="x", dtype=dtype, shape=[2])  # type: ignore[arg-type]
    with pytest.raises(codec.CodecError, match="unsupported dtype"):
        codec.tensor_from_proto(tensor_pb2.Tensor(spec=spec, data=b"\x00" * 8))


def test_negative_dimension_is_refused() -> None:
    bundle, chunks = small_stream()
    header = tensor_pb2.BundleHeader()
    header.CopyFrom(bundle.header)
    # (-3, -4) multiplies to the original element count: only the sign check can catch it.
    header.tensors[0].shape[:] = [-3, -4]
    with pytest.raises(codec.CodecError, match="negative dimension"):
        codec.receive_bundle([tensor_pb2.Chunk(header=header), *chunks[1:]])
    spec = tensor_pb2.TensorSpec(name="x", dtype=tensor_pb2.DTYPE_INT8, shape=[-1])
    with pytest.raises(codec.CodecError, match="negative dimension"):
        codec.spec_nbytes(spec)


def test_unencodable_dtype_is_refused_at_encode() -> None:
    with pytest.raises(codec.CodecError, match="no wire encoding"):
        codec.encode_bundle([("z", torch.zeros(3, dtype=torch.complex64))])
    with pytest.raises(codec.CodecError, match="no wire encoding"):
        codec.tensor_to_proto("z", torch.zeros(3, dtype=torch.complex64))


def test_missing_or_malformed_digest_is_refused() -> None:
    """Integrity is not optional: a header without a proper sha256 is refused before any data is read."""
    bundle, chunks = small_stream()
    for digest in ("", "abc", "Z" * 64):
        header = tensor_pb2.BundleHeader()
        header.CopyFrom(bundle.header)
        header.sha256 = digest
        with pytest.raises(codec.CodecError, match="sha256"):
            codec.receive_bundle([tensor_pb2.Chunk(header=header), *chunks[1:]])


# --- inline tensors and zero-copy decode ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(codec.TORCH_DTYPES.values()), ids=str)
def test_inline_tensor_roundtrip(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(12)
    original = random_tensor(dtype, (4, 3), gen)
    message = codec.tensor_to_proto("inline", original)
    assert message.spec.name == "inline"
    assert message.spec.dtype == codec.WIRE_DTYPES[dtype]
    assert list(message.spec.shape) == [4, 3]
    assert message.data == bytes(codec.tensor_bytes(original))
    reparsed = tensor_pb2.Tensor.FromString(message.SerializeToString())
    assert_same(codec.tensor_from_proto(reparsed), original)


@pytest.mark.parametrize("delta", [-1, 1, -12])
def test_inline_tensor_with_wrong_data_length_is_refused(delta: int) -> None:
    message = codec.tensor_to_proto("inline", torch.arange(12, dtype=torch.float32).reshape(3, 4))
    message.data = message.data[:delta] if delta < 0 else message.data + b"\x00" * delta
    with pytest.raises(codec.CodecError, match="expected 48"):
        codec.tensor_from_proto(message)


def test_decode_tensor_shares_a_bytearray_buffer() -> None:
    values = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float32)
    buffer = bytearray(b"\xff" * 4 + values.numpy().tobytes())
    spec = codec.spec_of("v", values)
    decoded = codec.decode_tensor(spec, buffer, offset=4)
    assert torch.equal(decoded, values)
    buffer[4:8] = np.float32(42.0).tobytes()  # modify the buffer: the tensor sees it
    assert decoded[0].item() == 42.0
    decoded[2] = -7.0  # and the other way round
    assert np.frombuffer(bytes(buffer[12:16]), dtype=np.float32)[0] == -7.0


def test_decode_tensor_bfloat16_shares_a_bytearray_buffer() -> None:
    values = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    buffer = bytearray(codec.tensor_bytes(values))
    decoded = codec.decode_tensor(codec.spec_of("v", values), buffer)
    buffer[0:2] = bytes(codec.tensor_bytes(torch.tensor([8.0], dtype=torch.bfloat16)))
    assert decoded.dtype == torch.bfloat16
    assert decoded.tolist() == [8.0, 2.0]


def test_received_bundle_tensors_view_one_buffer() -> None:
    _, chunks = small_stream()
    _, decoded = codec.receive_bundle(chunks)
    tensors = dict(decoded)
    # Consecutive views of one allocation, in spec order: no per-tensor copies.
    base = tensors["w"].data_ptr()
    assert tensors["b"].data_ptr() == base + 48
    assert tensors["m"].data_ptr() == base + 48 + 3


def test_decode_tensor_refuses_short_buffer() -> None:
    spec = tensor_pb2.TensorSpec(name="v", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[4])
    with pytest.raises(codec.CodecError, match="needs 16 bytes"):
        codec.decode_tensor(spec, bytearray(15))
    with pytest.raises(codec.CodecError, match="needs 16 bytes"):
        codec.decode_tensor(spec, bytearray(16), offset=1)


def test_tensor_bytes_is_zero_copy_for_contiguous_cpu_tensors() -> None:
    t = torch.zeros(4, dtype=torch.float32)
    view = codec.tensor_bytes(t)
    t[0] = 1.0
    assert bytes(view[:4]) == np.float32(1.0).tobytes()


@pytest.mark.parametrize("offset", range(4))
def test_a_borrowed_tensor_is_aligned_whatever_the_framing_offset(offset: int) -> None:
    raw = bytes(range(64))
    tensor = codec.borrowed_tensor(np.frombuffer(raw, dtype=np.uint8), torch.float32, 8, offset)
    assert tensor.data_ptr() % 4 == 0
    assert torch.equal(tensor, torch.frombuffer(bytearray(raw[offset : offset + 32]), dtype=torch.float32))
