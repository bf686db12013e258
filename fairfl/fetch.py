"""Threaded range-fetch client: one content-addressed payload fetched as byte ranges on concurrent streams into one
buffer, its sha256 checked as the ranges complete. The streams themselves are opened by the caller (a gRPC call per
range), so this module needs no gRPC."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from fairfl.codec import (
    BACKGROUND_DIGEST_BYTES,
    DEFAULT_MAX_BUNDLE_BYTES,
    TRANSFER_BUFFERS,
    CodecError,
    PayloadReceiver,
    StreamDigest,
    check_sha256,
    check_size,
    validate_specs,
)
from fairfl.framing import CHUNK_BYTES
from fairfl.v1 import tensor_pb2

# Concurrent range fetches (fetch_ranges): blobs above one segment travel as segments of at least SEGMENT_BYTES (at
# most MAX_SEGMENTS of them) on FETCH_STREAMS streams at once.
FETCH_STREAMS = 4
SEGMENT_BYTES = 16 * 1024 * 1024
MAX_SEGMENTS = 256

RangeOpener = Callable[[int, int], Iterator[tensor_pb2.Chunk]]


def plan_segments(total_bytes: int, segment_bytes: int = SEGMENT_BYTES) -> list[tuple[int, int]]:
    """(offset, length) of the ranges a payload is fetched in: at least `segment_bytes` (whole chunks from a chunk
    up), at most MAX_SEGMENTS of them."""
    size = max(segment_bytes, math.ceil(total_bytes / MAX_SEGMENTS))
    if size >= CHUNK_BYTES:
        size = math.ceil(size / CHUNK_BYTES) * CHUNK_BYTES
    return [(start, min(size, total_bytes - start)) for start in range(0, total_bytes, size)]


class RangeReceiver:
    """One payload received as byte ranges on concurrent streams into one buffer.

    Each range's chunks arrive in order and must fill it exactly; the sha256 of the whole is fed front to back as the
    ranges complete (ranges are handed out in order, so the hashed prefix follows the received one closely), and
    `finish` compares it with the content address. A corrupted, reordered or truncated range fails like a stream."""

    def __init__(self, total_bytes: int, sha256: str, segments: Sequence[tuple[int, int]], max_bytes: int) -> None:
        check_sha256(sha256, "a blob reference")
        check_size(total_bytes, max_bytes)
        if sum(n for _, n in segments) != total_bytes:  # pragma: no cover - plan_segments covers the payload
            raise ValueError("segments do not cover the payload")
        self.total_bytes = total_bytes
        self.expected_sha256 = sha256
        self.segments = list(segments)
        self.buffer = TRANSFER_BUFFERS.take(total_bytes)
        self._view = memoryview(self.buffer)
        self._done = [False] * len(self.segments)
        self._hashed = 0  # segments fed to the digest
        self._lock = threading.Lock()
        self._digest = StreamDigest(background=total_bytes >= BACKGROUND_DIGEST_BYTES)

    def add(self, index: int, position: int, data: bytes | memoryview) -> int:
        """Write `data` at `position` of range `index` (the bytes received in it so far); the new position."""
        offset, length = self.segments[index]
        if not 0 < len(data) <= CHUNK_BYTES:
            raise CodecError(f"data chunk of {len(data)} bytes: chunks carry 1..{CHUNK_BYTES} bytes", "size")
        if position + len(data) > length:
            raise CodecError(
                f"range at {offset} received {position + len(data)} bytes, {length} were asked for", "size"
            )
        start = offset + position
        self.buffer[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)
        return position + len(data)

    def complete(self, index: int, position: int) -> None:
        offset, length = self.segments[index]
        if position != length:
            raise CodecError(f"range at {offset} ended after {position} of {length} bytes", "size")
        with self._lock:
            self._done[index] = True
            while self._hashed < len(self.segments) and self._done[self._hashed]:
                start, n = self.segments[self._hashed]
                self._digest.update(self._view[start : start + n])
                self._hashed += 1

    def finish(self) -> np.ndarray:
        if not all(self._done):
            raise CodecError("not every range of the payload arrived", "size")
        if self._digest.hexdigest() != self.expected_sha256:
            raise CodecError(
                "payload sha256 does not match the blob's address: data was corrupted or reordered", "integrity"
            )
        return self.buffer


def fetch_ranges(
    open_range: RangeOpener,
    total_bytes: int,
    sha256: str,
    check_header: Callable[[tensor_pb2.BundleHeader], None],
    max_bytes: int = DEFAULT_MAX_BUNDLE_BYTES,
    streams: int = FETCH_STREAMS,
    segment_bytes: int = SEGMENT_BYTES,
) -> tuple[tensor_pb2.BundleHeader, np.ndarray]:
    """Fetch the payload `sha256` of `total_bytes` as ranges on up to `streams` concurrent streams.

    `open_range(offset, length)` opens one stream: a header, then the data of that range (length 0: to the end).
    Every stream's header must describe the requested blob; `check_header` vets the first (layout, size). A blob of
    one segment, or one stream, is one plain request for the whole payload. Raises CodecError for anything malformed
    and whatever `open_range`'s streams raise (the other streams are cancelled)."""
    segments = plan_segments(total_bytes, segment_bytes)
    if len(segments) <= 1 or streams <= 1:
        chunks = open_range(0, 0)
        try:
            return _receive_whole(chunks, total_bytes, sha256, check_header, max_bytes)
        except BaseException:
            _cancel(chunks)
            raise

    receiver_ranges = RangeReceiver(total_bytes, sha256, segments, max_bytes)
    state = _FetchState()

    def worker() -> None:
        while not state.failed.is_set():
            index = state.next_index(len(segments))
            if index is None:
                return
            offset, length = segments[index]
            chunks = open_range(offset, length)
            state.track(chunks)
            try:
                position = -1  # before the header
                for chunk in chunks:
                    if state.failed.is_set():  # a sibling failed, maybe before this call was tracked: end it too
                        _cancel(chunks)
                        return
                    if position < 0:
                        state.header_seen(_range_header(chunk, total_bytes, sha256), check_header)
                        position = 0
                        continue
                    if chunk.WhichOneof("part") != "data":
                        raise CodecError("a second header arrived inside a chunk stream")
                    position = receiver_ranges.add(index, position, chunk.data)
                if position < 0:
                    raise CodecError(f"the stream of range at {offset} ended before its header")
                receiver_ranges.complete(index, position)
            finally:
                state.untrack(chunks)

    def run() -> None:
        try:
            worker()
        except BaseException as err:  # the first failure stops every stream and is raised to the caller
            state.fail(err)

    threads = [threading.Thread(target=run, name=f"fetch-{i}", daemon=True) for i in range(min(streams, len(segments)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if state.error is not None:
        raise state.error
    assert state.header is not None
    return state.header, receiver_ranges.finish()


def _receive_whole(
    chunks: Iterator[tensor_pb2.Chunk],
    total_bytes: int,
    sha256: str,
    check_header: Callable[[tensor_pb2.BundleHeader], None],
    max_bytes: int,
) -> tuple[tensor_pb2.BundleHeader, np.ndarray]:
    header, receiver = None, None
    for chunk in chunks:
        if header is None:
            header = _range_header(chunk, total_bytes, sha256)
            check_header(header)
            receiver = PayloadReceiver(total_bytes, sha256, max_bytes)
            continue
        if chunk.WhichOneof("part") != "data":
            raise CodecError("a second header arrived inside a chunk stream")
        assert receiver is not None
        receiver.add(chunk.data)
    if header is None or receiver is None:
        raise CodecError("the blob stream ended before its header")
    return header, receiver.finish()


def _cancel(call: object) -> None:
    """Cancel a gRPC response iterator (other iterables end on their own)."""
    cancel = getattr(call, "cancel", None)
    if callable(cancel):
        cancel()


def _range_header(chunk: tensor_pb2.Chunk, total_bytes: int, sha256: str) -> tensor_pb2.BundleHeader:
    if chunk.WhichOneof("part") != "header":
        raise CodecError("the blob stream did not start with a header")
    header = chunk.header
    if header.sha256 != sha256 or header.total_bytes != total_bytes:
        raise CodecError(
            f"the stream is not the requested blob: it describes {header.sha256[:16]!r} of {header.total_bytes} "
            f"bytes, {sha256[:16]!r} of {total_bytes} bytes was asked for"
        )
    validate_specs(header.tensors, header.total_bytes)
    return header


class _FetchState:
    """What fetch_ranges' streams share: the next range, the header, the first error and the open calls."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.failed = threading.Event()
        self.error: BaseException | None = None
        self.header: tensor_pb2.BundleHeader | None = None
        self._next = 0
        self._open: list[object] = []

    def next_index(self, count: int) -> int | None:
        with self.lock:
            if self._next >= count:
                return None
            self._next += 1
            return self._next - 1

    def header_seen(self, header: tensor_pb2.BundleHeader, check: Callable[[tensor_pb2.BundleHeader], None]) -> None:
        with self.lock:
            if self.header is None:
                check(header)
                self.header = header
            elif header != self.header:
                raise CodecError("the streams of one blob disagree on its header")

    def track(self, call: object) -> None:
        with self.lock:
            self._open.append(call)

    def untrack(self, call: object) -> None:
        with self.lock:
            self._open.remove(call)

    def fail(self, err: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = err
            self.failed.set()
            calls = list(self._open)
        for call in calls:
            _cancel(call)
