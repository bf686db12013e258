"""Tensor codec: raw little-endian bytes with a typed spec, bundles of tensors, a received payload checked against
its size and sha256, zero-copy decode.

Every service encodes and decodes tensors here and nowhere else. Nothing is pickled: a tensor is its dtype, its shape
and its row-major bytes. Large bundles travel as a header followed by data chunks of CHUNK_BYTES (the chunk framing is
fairfl.framing; fetching one payload as ranges on concurrent streams is fairfl.fetch).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import sys
import threading
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from fairfl.framing import CHUNK_BYTES, Framed, byte_range, framed_data, iter_byte_chunks, iter_chunk_views
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
# Payloads at least this big are hashed on a helper thread while the next bytes move (see StreamDigest); below it a
# hand-off costs more than it saves.
BACKGROUND_DIGEST_BYTES = 8 * 1024 * 1024
DIGEST_STEP_BYTES = 8 * 1024 * 1024  # received bytes handed to the hashing thread at a time


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
        array = np.ascontiguousarray(value).reshape(value.shape)
        if not array.flags.writeable:  # e.g. np.frombuffer over bytes: torch would warn, and must never write it
            array = array.copy()
        return torch.from_numpy(array)
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


Buffer = bytes | bytearray | memoryview | np.ndarray


def decode_tensor(spec: tensor_pb2.TensorSpec, buffer: Buffer, offset: int = 0) -> torch.Tensor:
    """A tensor viewing `buffer` at `offset` (zero-copy for writable buffers: received payloads are uint8 arrays)."""
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


_FINITE_BLOCK = 1 << 20  # half-precision values summed in float32 this many at a time


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite, exactly, at the cost of one sum in the common case.

    A sum is finite only if every term is (inf and NaN propagate; inf - inf is NaN), so a finite sum proves it; a
    non-finite one may also be an overflow of finite values, which the exact element-wise check settles.
    torch.isfinite(...).all() alone is ~20x slower than a sum on a CPU. Half-precision values are summed in float32 a
    block at a time (sum(dtype=float32) of the whole would first copy it to float32); float16 blocks cannot overflow
    there, bfloat16 ones can (its range is float32's), which only sends them to the exact check."""
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return True
    flat = tensor.reshape(-1)
    if flat.dtype in (torch.float16, torch.bfloat16):
        sums = [flat[i : i + _FINITE_BLOCK].sum(dtype=torch.float32) for i in range(0, flat.numel(), _FINITE_BLOCK)]
        total = float(torch.stack(sums).sum())
    else:
        total = float(flat.sum())
    return math.isfinite(total) or bool(torch.isfinite(flat).all())


# -- hashing while the bytes move --------------------------------------------------------------------------------------

_digest_pool: ThreadPoolExecutor | None = None
_digest_pool_lock = threading.Lock()


def _digest_workers() -> ThreadPoolExecutor:
    global _digest_pool
    with _digest_pool_lock:
        if _digest_pool is None:
            _digest_pool = ThreadPoolExecutor(
                max_workers=max(2, min(8, (os.cpu_count() or 2) // 2)), thread_name_prefix="sha256"
            )
        return _digest_pool


class StreamDigest:
    """sha256 of byte pieces fed in order. With `background`, the pieces are hashed on a shared worker thread
    (hashlib releases the GIL), so hashing a received chunk overlaps receiving the next one instead of following it;
    `hexdigest` waits for what is still queued. A digest abandoned half way (a refused stream) only drains what it was
    given: it holds no thread of its own."""

    _BATCH = 8  # pieces hashed per turn on a worker, so concurrent streams share the workers

    def __init__(self, background: bool = False) -> None:
        self._sha = hashlib.sha256()
        self.background = background
        self._pending: deque[memoryview | bytes] = deque()
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None

    def update(self, piece: memoryview | bytes) -> None:
        """Feed the next piece; it must stay unchanged until hashed (pieces of a received buffer do)."""
        if not self.background:
            self._sha.update(piece)
            return
        with self._lock:
            self._pending.append(piece)
            if not self._idle.is_set():
                return  # a worker is draining this digest and will take the piece
            self._idle.clear()
        _digest_workers().submit(self._drain)

    def _drain(self) -> None:
        for _ in range(self._BATCH):
            with self._lock:
                if not self._pending:
                    self._idle.set()
                    return
                piece = self._pending.popleft()
            try:
                self._sha.update(piece)
            except BaseException as err:  # pragma: no cover - hashlib does not fail on buffers
                self._error = err
        _digest_workers().submit(self._drain)  # more to do: queue behind the other streams' turns

    def hexdigest(self) -> str:
        self._idle.wait()
        if self._error is not None:  # pragma: no cover
            raise self._error
        return self._sha.hexdigest()


# -- receive buffers ---------------------------------------------------------------------------------------------------


class _Pooled:
    __slots__ = ("array", "unused_refs")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.unused_refs = 0


class BufferPool:
    """Large uint8 buffers handed out again once nothing uses them.

    First touching fresh memory costs more than the bytes it receives on some hosts (page faults, ~1 s per GiB on a
    small VM), and a 1 GiB model or update arrives every round. A buffer is free again when its reference count is
    back to what it was when only the pool held it: anything that can still reach its memory (a numpy view, a tensor
    made by torch.frombuffer or from_numpy, a memoryview) holds a reference to it. The pool tracks at most
    `max_buffers` (in use or idle; beyond that, plain allocations), so it keeps at most that many alive when idle;
    sizes below `min_bytes` are plain allocations."""

    def __init__(self, max_buffers: int = 2, min_bytes: int = 32 * 1024 * 1024) -> None:
        self.max_buffers = max_buffers
        self.min_bytes = min_bytes
        self._buffers: list[_Pooled] = []  # oldest first
        self._lock = threading.Lock()
        self.reused = 0

    @staticmethod
    def _refs(pooled: _Pooled) -> int:
        return sys.getrefcount(pooled.array)  # the same expression measures the unused count and checks against it

    def take(self, nbytes: int) -> np.ndarray:
        """An uninitialised uint8 array of `nbytes`."""
        if nbytes < self.min_bytes:
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            idle = [i for i, pooled in enumerate(self._buffers) if self._refs(pooled) <= pooled.unused_refs]
            match = next((i for i in idle if len(self._buffers[i].array) == nbytes), None)
            if match is not None:
                pooled = self._buffers.pop(match)
                self._buffers.append(pooled)
                self.reused += 1
                return pooled.array
            surplus = len(self._buffers) - self.max_buffers + 1  # idle buffers of other sizes make room, oldest first
            for i in sorted(idle[: max(surplus, 0)], reverse=True):
                del self._buffers[i]
            if len(self._buffers) >= self.max_buffers:  # all in use: not pooled
                return np.empty(nbytes, dtype=np.uint8)
            pooled = _Pooled(np.empty(nbytes, dtype=np.uint8))
            pooled.unused_refs = self._refs(pooled)
            self._buffers.append(pooled)
            return pooled.array

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()


TRANSFER_BUFFERS = BufferPool()


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

    def chunks(
        self, chunk_bytes: int = CHUNK_BYTES, offset: int = 0, length: int | None = None, framed: bool = False
    ) -> Iterator[tensor_pb2.Chunk | Framed]:
        """The header, then the payload's bytes [offset, offset + length) (default: all of it) in chunks; with
        `framed`, the data chunks come serialised already (for the `serialize` serializer)."""
        if length is None:
            length = self.total_bytes - offset
        if offset < 0 or length < 0 or offset + length > self.total_bytes:
            raise CodecError(f"range {offset}+{length} is outside the payload of {self.total_bytes} bytes", "size")
        yield tensor_pb2.Chunk(header=self.header)
        buffers = (
            self.buffers if (offset, length) == (0, self.total_bytes) else byte_range(self.buffers, offset, length)
        )
        if framed:
            for views in iter_chunk_views(buffers, chunk_bytes):
                yield framed_data(views)
            return
        for piece in iter_byte_chunks(buffers, chunk_bytes):
            yield tensor_pb2.Chunk(data=piece)


def encode_bundle(tensors: Sequence[tuple[str, torch.Tensor | np.ndarray]]) -> EncodedBundle:
    specs = [spec_of(name, t) for name, t in tensors]
    buffers = [tensor_bytes(t) for _, t in tensors]
    digest = hashlib.sha256()
    for buf in buffers:
        digest.update(buf)
    return EncodedBundle(specs, buffers, sum(len(b) for b in buffers), digest.hexdigest())


def check_sha256(sha256: str, where: str = "the header") -> None:
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise CodecError(f"{where} must carry the payload's sha256 as 64 lowercase hex digits")


def check_size(total_bytes: int, max_bytes: int) -> None:
    if total_bytes > max_bytes:
        raise CodecError(f"payload of {total_bytes} bytes exceeds the limit of {max_bytes} bytes", "size")
    if total_bytes < 0:  # int64 on the wire
        raise CodecError(f"payload of {total_bytes} bytes: a size cannot be negative", "size")


class PayloadReceiver:
    """Collects streamed data chunks into one preallocated buffer and checks size and sha256 at the end.

    Chunks must be non-empty and at most `max_chunk_bytes` (senders cut at CHUNK_BYTES), so a stream cannot be
    stretched into millions of empty messages, and the buffer is allocated only after the declared size passed
    `max_bytes`. Order is covered by the digest: reordered chunks hash differently. Large payloads are hashed while
    they arrive (StreamDigest). With `sha256_in_trailer` the digest comes after the data (`set_trailer`) and `sha256`
    must be empty; with `sha256_optional` an empty `sha256` means no digest is computed or checked (a payload that
    came in one message over mutual TLS, which authenticates every byte of it). `finish` returns the payload as a uint8
    array (tensors view it without a copy). With `borrow`, a payload that arrives as one piece of an immutable `bytes`
    object (an UploadResult's data: a view of the received message) is not copied at all: the array is a read-only
    view of it, kept alive by what views it; for receivers whose tensors are only read (the aggregator's results).
    """

    def __init__(
        self,
        total_bytes: int,
        sha256: str,
        max_bytes: int = DEFAULT_MAX_BUNDLE_BYTES,
        max_chunk_bytes: int = CHUNK_BYTES,
        sha256_in_trailer: bool = False,
        sha256_optional: bool = False,
        borrow: bool = False,
    ) -> None:
        if sha256_in_trailer:
            if sha256:
                raise CodecError("the header announces a sha256 trailer and also carries a sha256: send one of them")
        elif sha256 or not sha256_optional:
            check_sha256(sha256)
        self.verify = bool(sha256) or sha256_in_trailer
        check_size(total_bytes, max_bytes)
        self.max_chunk_bytes = max_chunk_bytes
        self.total_bytes = total_bytes
        self.expected_sha256 = sha256
        self.sha256_in_trailer = sha256_in_trailer
        self.trailer_received = False
        self.borrow = borrow
        self._buffer: np.ndarray | None = None  # taken at the first chunk, unless that chunk is the whole payload
        self.received = 0
        self._hashed = 0  # bytes handed to the digest
        self._digest = StreamDigest(background=total_bytes >= BACKGROUND_DIGEST_BYTES)

    def add(self, data: bytes | memoryview | bytearray, owned: bool = False) -> None:
        """The next chunk. `owned`: the caller hands its memory over (nothing else holds or changes it), so with
        `borrow` it is viewed like an immutable message rather than copied."""
        if self.trailer_received:
            raise CodecError("data arrived after the sha256 trailer")
        if not 0 < len(data) <= self.max_chunk_bytes:
            raise CodecError(f"data chunk of {len(data)} bytes: chunks carry 1..{self.max_chunk_bytes} bytes", "size")
        end = self.received + len(data)
        if end > self.total_bytes:
            raise CodecError(f"received {end} bytes but the header declared {self.total_bytes}", "size")
        if self._buffer is None and self.borrow and end == self.total_bytes and (owned or _immutable(data)):
            self._buffer = np.frombuffer(data, dtype=np.uint8)  # the whole payload at once: a view, no copy
        else:
            self.buffer[self.received : end] = np.frombuffer(data, dtype=np.uint8)
        self.received = end
        # Hand over a few chunks at once: fewer GIL hand-offs.
        if self.verify and end - self._hashed >= DIGEST_STEP_BYTES:
            self._digest.update(memoryview(self.buffer)[self._hashed : end])
            self._hashed = end

    @property
    def buffer(self) -> np.ndarray:
        """The payload's bytes (those received so far): a receive buffer, or a view of a borrowed message."""
        if self._buffer is None:
            self._buffer = TRANSFER_BUFFERS.take(self.total_bytes)
        return self._buffer

    def set_trailer(self, sha256: str) -> None:
        if not self.sha256_in_trailer:
            raise CodecError("a sha256 trailer arrived but the header did not announce one")
        if self.trailer_received:
            raise CodecError("a second sha256 trailer arrived")
        check_sha256(sha256, "the trailer")
        self.expected_sha256 = sha256
        self.trailer_received = True

    def finish(self) -> np.ndarray:
        if self.received != self.total_bytes:
            raise CodecError(f"stream ended after {self.received} of {self.total_bytes} declared bytes", "size")
        if self.sha256_in_trailer and not self.trailer_received:
            raise CodecError("stream ended without the sha256 trailer its header announced")
        if not self.verify:
            return self.buffer
        self._digest.update(memoryview(self.buffer)[self._hashed : self.received])
        self._hashed = self.received
        if self._digest.hexdigest() != self.expected_sha256:
            raise CodecError(
                "payload sha256 does not match the declared one: data was corrupted or reordered", "integrity"
            )
        return self.buffer


def _immutable(data: bytes | memoryview) -> bool:
    """Whether `data` is (a view of) a `bytes` object, whose memory nothing can change while it is referenced."""
    return isinstance(data.obj if isinstance(data, memoryview) else data, bytes)


def borrowed_tensor(buffer: np.ndarray, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    """torch.frombuffer of a buffer that may be read-only (PayloadReceiver's `borrow`): such a tensor must only be
    read, which its callers guarantee (torch warns once about it, silenced for this module below). Where the values
    do not start at a multiple of their size in memory (a message's framing decides), a copy: kernels expect
    aligned elements."""
    tensor = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
    return tensor if tensor.data_ptr() % dtype.itemsize == 0 else tensor.clone()


# torch warns (once per process) that a tensor over read-only memory could be written; borrowed_tensor's are only read.
warnings.filterwarnings(
    "ignore", message="The given buffer is not writable", category=UserWarning, module=re.escape(__name__)
)


def validate_specs(specs: Sequence[tensor_pb2.TensorSpec], total_bytes: int) -> None:
    declared = sum(spec_nbytes(s) for s in specs)
    if declared != total_bytes:
        raise CodecError(f"tensor specs declare {declared} bytes but the header says {total_bytes}", "size")


def decode_tensors(specs: Sequence[tensor_pb2.TensorSpec], buffer: Buffer) -> list[tuple[str, torch.Tensor]]:
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
