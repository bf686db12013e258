"""Tensor codec: raw little-endian bytes with a typed spec, chunked streams with sha256, zero-copy decode.

Every service encodes and decodes tensors here and nowhere else. Nothing is pickled: a tensor is its dtype, its shape
and its row-major bytes. Large bundles travel as a header followed by data chunks of CHUNK_BYTES, so payload size is
not bounded by gRPC's per-message limit.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fairfl.rpc import CHUNK_BYTES
from fairfl.v1 import tensor_pb2

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise RuntimeError("fairfl.codec assumes a little-endian host; the wire format is little-endian")

DType = tensor_pb2.DType

TORCH_DTYPES: dict[int, torch.dtype] = {
    tensor_pb2.DTYPE_FLOAT32: torch.float32,
    tensor_pb2.DTYPE_FLOAT64: torch.float64,
    tensor_pb2.DTYPE_FLOAT16: torch.float16,
    tensor_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    tensor_pb2.DTYPE_INT8: torch.int8,
    tensor_pb2.DTYPE_UINT8: torch.uint8,
    tensor_pb2.DTYPE_INT16: torch.int16,
    tensor_pb2.DTYPE_INT32: torch.int32,
    tensor_pb2.DTYPE_INT64: torch.int64,
    tensor_pb2.DTYPE_BOOL: torch.bool,
}
WIRE_DTYPES: dict[torch.dtype, int] = {v: k for k, v in TORCH_DTYPES.items()}
ITEMSIZE: dict[int, int] = {k: torch.empty((), dtype=v).element_size() for k, v in TORCH_DTYPES.items()}

# Hard ceiling for one bundle; callers pass tighter limits where they know the expected size.
DEFAULT_MAX_BUNDLE_BYTES = 16 * 1024**3


class CodecError(ValueError):
    """A payload does not match its declared spec (size, dtype, shape, digest, order).

    `reason` is a fixed word for metrics (fairfl_requests_refused_total): integrity (sha256), non_finite, layout
    (names, dtypes, shapes, payload kinds against the model or task), size (declared or received byte counts) or
    malformed (anything else).
    """

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


def dtype_name(dtype: int) -> str:
    return tensor_pb2.DType.Name(dtype) if dtype in tensor_pb2.DType.values() else f"unknown dtype {dtype}"


def _as_torch(value: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(value, np.ndarray):  # ascontiguousarray turns 0-d into 1-d: restore the shape
        return torch.from_numpy(np.ascontiguousarray(value).reshape(value.shape))
    return value


def spec_of(name: str, tensor: torch.Tensor | np.ndarray) -> tensor_pb2.TensorSpec:
    t = _as_torch(tensor)
    if t.dtype not in WIRE_DTYPES:
        raise CodecError(f"tensor {name!r}: dtype {t.dtype} has no wire encoding")
    return tensor_pb2.TensorSpec(name=name, dtype=WIRE_DTYPES[t.dtype], shape=list(t.shape))


def spec_nbytes(spec: tensor_pb2.TensorSpec) -> int:
    """Byte size a spec declares; raises CodecError for unknown dtypes or negative dimensions."""
    if spec.dtype not in TORCH_DTYPES:
        raise CodecError(f"tensor {spec.name!r}: unsupported dtype {dtype_name(spec.dtype)}")
    numel = 1
    for dim in spec.shape:
        if dim < 0:
            raise CodecError(f"tensor {spec.name!r}: negative dimension in shape {list(spec.shape)}", "layout")
        numel *= dim
    return numel * ITEMSIZE[spec.dtype]


def tensor_bytes(tensor: torch.Tensor | np.ndarray) -> memoryview:
    """Raw row-major bytes of a tensor; no copy when it is already contiguous and on the CPU."""
    t = _as_torch(tensor).detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the same bits
        t = t.view(torch.int16)
    return memoryview(t.numpy().reshape(-1)).cast("B")  # 1-D first: memoryview cannot cast shapes with a 0


def tensor_to_proto(name: str, tensor: torch.Tensor | np.ndarray) -> tensor_pb2.Tensor:
    """A small tensor carried inline in a unary message."""
    return tensor_pb2.Tensor(spec=spec_of(name, tensor), data=bytes(tensor_bytes(tensor)))


def decode_tensor(spec: tensor_pb2.TensorSpec, buffer: bytes | bytearray | memoryview, offset: int = 0) -> torch.Tensor:
    """A tensor viewing `buffer` at `offset` (zero-copy for writable buffers)."""
    nbytes = spec_nbytes(spec)
    dtype = TORCH_DTYPES[spec.dtype]
    shape = tuple(spec.shape)
    if offset + nbytes > len(buffer):
        raise CodecError(f"tensor {spec.name!r}: needs {nbytes} bytes at offset {offset}, buffer has {len(buffer)}")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if isinstance(buffer, bytes):
        buffer = bytearray(buffer)  # torch.frombuffer wants a writable buffer; inline tensors are small
    if dtype == torch.bfloat16:
        raw = torch.frombuffer(buffer, dtype=torch.int16, count=nbytes // 2, offset=offset)
        return raw.view(torch.bfloat16).reshape(shape)
    return torch.frombuffer(buffer, dtype=dtype, count=nbytes // ITEMSIZE[spec.dtype], offset=offset).reshape(shape)


def tensor_from_proto(message: tensor_pb2.Tensor) -> torch.Tensor:
    if len(message.data) != spec_nbytes(message.spec):
        raise CodecError(
            f"tensor {message.spec.name!r}: {len(message.data)} bytes for shape {list(message.spec.shape)} "
            f"{dtype_name(message.spec.dtype)} (expected {spec_nbytes(message.spec)})"
        )
    return decode_tensor(message.spec, message.data)


def iter_byte_chunks(buffers: Iterable[memoryview], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Concatenate buffers and cut them into pieces of exactly chunk_bytes (the last may be shorter)."""
    pending: list[memoryview] = []
    pending_len = 0
    for buf in buffers:
        start = 0
        while start < len(buf):
            take = min(chunk_bytes - pending_len, len(buf) - start)
            pending.append(buf[start : start + take])
            pending_len += take
            start += take
            if pending_len == chunk_bytes:
                yield pending[0].tobytes() if len(pending) == 1 else b"".join(pending)
                pending, pending_len = [], 0
    if pending_len:
        yield b"".join(pending)


@dataclass(frozen=True)
class EncodedBundle:
    """Tensors ready to stream: their specs, their byte views, total size and content address."""

    specs: list[tensor_pb2.TensorSpec]
    buffers: list[memoryview]
    total_bytes: int
    sha256: str

    @property
    def header(self) -> tensor_pb2.BundleHeader:
        return tensor_pb2.BundleHeader(tensors=self.specs, total_bytes=self.total_bytes, sha256=self.sha256)

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tensor_pb2.Chunk]:
        yield tensor_pb2.Chunk(header=self.header)
        for piece in iter_byte_chunks(self.buffers, chunk_bytes):
            yield tensor_pb2.Chunk(data=piece)


def encode_bundle(tensors: Sequence[tuple[str, torch.Tensor | np.ndarray]]) -> EncodedBundle:
    specs = [spec_of(name, t) for name, t in tensors]
    buffers = [tensor_bytes(t) for _, t in tensors]
    digest = hashlib.sha256()
    for buf in buffers:
        digest.update(buf)
    return EncodedBundle(specs, buffers, sum(len(b) for b in buffers), digest.hexdigest())


class PayloadReceiver:
    """Collects streamed data chunks into one preallocated buffer and checks size and sha256 at the end.

    Chunks must be non-empty and at most `max_chunk_bytes` (senders cut at CHUNK_BYTES), so a stream cannot be
    stretched into millions of empty messages, and the buffer is allocated only after the declared size passed
    `max_bytes`. Order is covered by the digest: reordered chunks hash differently.
    """

    def __init__(
        self,
        total_bytes: int,
        sha256: str,
        max_bytes: int = DEFAULT_MAX_BUNDLE_BYTES,
        max_chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise CodecError("the header must carry the payload's sha256 as 64 lowercase hex digits")
        if total_bytes > max_bytes:
            raise CodecError(f"payload of {total_bytes} bytes exceeds the limit of {max_bytes} bytes", "size")
        if total_bytes < 0:  # int64 on the wire
            raise CodecError(f"payload of {total_bytes} bytes: a size cannot be negative", "size")
        self.max_chunk_bytes = max_chunk_bytes
        self.total_bytes = total_bytes
        self.expected_sha256 = sha256
        self.buffer = bytearray(total_bytes)
        self.received = 0
        self._digest = hashlib.sha256()

    def add(self, data: bytes) -> None:
        if not 0 < len(data) <= self.max_chunk_bytes:
            raise CodecError(f"data chunk of {len(data)} bytes: chunks carry 1..{self.max_chunk_bytes} bytes", "size")
        end = self.received + len(data)
        if end > self.total_bytes:
            raise CodecError(f"received {end} bytes but the header declared {self.total_bytes}", "size")
        self.buffer[self.received : end] = data
        self._digest.update(data)
        self.received = end

    def finish(self) -> bytearray:
        if self.received != self.total_bytes:
            raise CodecError(f"stream ended after {self.received} of {self.total_bytes} declared bytes", "size")
        if self._digest.hexdigest() != self.expected_sha256:
            raise CodecError("payload sha256 does not match the header: data was corrupted or reordered", "integrity")
        return self.buffer


def validate_specs(specs: Sequence[tensor_pb2.TensorSpec], total_bytes: int) -> None:
    declared = sum(spec_nbytes(s) for s in specs)
    if declared != total_bytes:
        raise CodecError(f"tensor specs declare {declared} bytes but the header says {total_bytes}", "size")


def decode_tensors(specs: Sequence[tensor_pb2.TensorSpec], buffer: bytearray) -> list[tuple[str, torch.Tensor]]:
    """Tensors viewing consecutive slices of `buffer`, in spec order."""
    out: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for spec in specs:
        out.append((spec.name, decode_tensor(spec, buffer, offset)))
        offset += spec_nbytes(spec)
    return out


def receive_bundle(
    chunks: Iterable[tensor_pb2.Chunk], max_bytes: int = DEFAULT_MAX_BUNDLE_BYTES
) -> tuple[tensor_pb2.BundleHeader, list[tuple[str, torch.Tensor]]]:
    """Assemble a header-then-data chunk stream into tensors, checking order, size and digest."""
    iterator = iter(chunks)
    first = next(iterator, None)
    if first is None or first.WhichOneof("part") != "header":
        raise CodecError("chunk stream must start with a header")
    header = first.header
    validate_specs(header.tensors, header.total_bytes)
    receiver = PayloadReceiver(header.total_bytes, header.sha256, max_bytes)
    for chunk in iterator:
        if chunk.WhichOneof("part") != "data":
            raise CodecError("a second header arrived inside a chunk stream")
        receiver.add(chunk.data)
    return header, decode_tensors(header.tensors, receiver.finish())
