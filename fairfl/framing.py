"""Chunked payload streams on the wire: the chunk size, cutting a payload into chunks, and data chunks framed and
parsed by hand without protobuf's copies.

A payload (a tensor bundle) travels as a header message followed by data chunks of at most CHUNK_BYTES, so its size is
not bounded by gRPC's per-message limit. This module knows only bytes and protobuf framing: no tensors (fairfl.codec)
and no gRPC settings (fairfl.rpc, which reads CHUNK_BYTES from here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from google.protobuf.message import Message

# Below gRPC's default 4 MiB per-message limit (fairfl.rpc.MAX_MESSAGE_BYTES), with room for the message around it.
CHUNK_BYTES = 2 * 1024 * 1024


def iter_chunk_views(buffers: Iterable[memoryview], chunk_bytes: int = CHUNK_BYTES) -> Iterator[list[memoryview]]:
    """Concatenate buffers and cut them into pieces of exactly chunk_bytes (the last may be shorter), each piece as
    the views of the buffers it spans (no copy)."""
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
                yield pending
                pending, pending_len = [], 0
    if pending_len:
        yield pending


def iter_byte_chunks(buffers: Iterable[memoryview], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Concatenate buffers and cut them into pieces of exactly chunk_bytes (the last may be shorter)."""
    for views in iter_chunk_views(buffers, chunk_bytes):
        yield views[0].tobytes() if len(views) == 1 else b"".join(views)


# -- data chunks framed without protobuf's copies ----------------------------------------------------------------------
# A Chunk or ResultChunk holding only `data` (field 2, length-delimited) is its tag, the length as a varint and the
# bytes. Built by hand, a chunk is one copy of the tensor memory instead of three (cut, into the message, serialised);
# parsed by hand, its bytes are a view of the received message instead of two copies. Anything else goes through
# protobuf, so what is accepted is exactly what protobuf would parse.

_HEADER_TAG = 0x0A  # field 1, wire type 2 (length-delimited)
_DATA_TAG = 0x12  # field 2, wire type 2


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class Framed:
    """A message serialised already, for the passthrough `serialize`; it answers ByteSize() like a protobuf message
    (the gRPC metrics count it)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def ByteSize(self) -> int:
        return len(self.data)

    def SerializeToString(self) -> bytes:
        return self.data


def serialize(message: Framed | Message) -> bytes:
    """gRPC serializer for streams that mix Framed chunks and protobuf messages."""
    return message.SerializeToString()


def framed_data(views: Sequence[memoryview | bytes]) -> Framed:
    """The serialised Chunk / ResultChunk whose `data` is the views' concatenation."""
    size = sum(len(v) for v in views)
    return Framed(b"".join([bytes((_DATA_TAG,)), _varint(size), *views]))


class DataChunk:
    """A received Chunk / ResultChunk that holds only `data`, a read-only view of the received bytes."""

    __slots__ = ("_size", "data")

    def __init__(self, data: memoryview, size: int) -> None:
        self.data = data
        self._size = size

    def WhichOneof(self, group: str) -> str:
        return "data"

    def ByteSize(self) -> int:
        return self._size


def _read_varint(raw: bytes, at: int) -> tuple[int, int] | None:
    """(value, offset after it) of the varint at `at`, or None if it runs past the end or past 10 bytes."""
    value, shift = 0, 0
    for position in range(at, min(len(raw), at + 10)):
        byte = raw[position]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position + 1
        shift += 7
    return None


def data_view(raw: bytes) -> memoryview | None:
    """The bytes of `raw` if it is exactly one `data` field (tag, varint length, bytes), as a view; else None."""
    if len(raw) < 2 or raw[0] != _DATA_TAG:
        return None
    size = _read_varint(raw, 1)
    return memoryview(raw)[size[1] :] if size is not None and size[1] + size[0] == len(raw) else None


def header_data_parts(header: bytes, views: Sequence[memoryview | bytes]) -> list[memoryview | bytes]:
    """The serialised message {1: header (a serialised message), 2: the views' concatenation}, as pieces to join."""
    size = sum(len(v) for v in views)
    return [bytes((_HEADER_TAG,)), _varint(len(header)), header, bytes((_DATA_TAG,)), _varint(size), *views]


def length_delimited_parts(field: int, parts: Sequence[memoryview | bytes]) -> list[memoryview | bytes]:
    """Field `field` (wire type 2) holding the pieces' concatenation, as pieces to join: its key, length, the pieces."""
    return [_varint(field << 3 | 2), _varint(sum(len(p) for p in parts)), *parts]


def framed_header_data(header: bytes, views: Sequence[memoryview | bytes]) -> Framed:
    """The serialised message {1: header (a serialised message), 2: the views' concatenation} (ResultUpload), built
    with one copy of the views."""
    return Framed(b"".join(header_data_parts(header, views)))


def split_header_data(raw: bytes) -> tuple[memoryview, memoryview] | None:
    """Views of field 1's and field 2's bytes when `raw` is exactly those two length-delimited fields in that order
    (as framed_header_data and protobuf write them); None for any other encoding (parse that with protobuf)."""
    if len(raw) < 4 or raw[0] != _HEADER_TAG:
        return None
    header_size = _read_varint(raw, 1)
    if header_size is None:
        return None
    header_end = header_size[1] + header_size[0]
    if header_end >= len(raw) or raw[header_end] != _DATA_TAG:
        return None
    data_size = _read_varint(raw, header_end + 1)
    if data_size is None or data_size[1] + data_size[0] != len(raw):
        return None
    view = memoryview(raw)
    return view[header_size[1] : header_end], view[data_size[1] :]


def chunk_parser(message: type[Message]) -> Callable[[bytes], Message | DataChunk]:
    """A gRPC deserializer for `message` (Chunk, ResultChunk) that reads data chunks without copying them."""

    def parse(raw: bytes) -> Message | DataChunk:
        view = data_view(raw)
        return message.FromString(raw) if view is None else DataChunk(view, len(raw))

    return parse


def byte_range(buffers: Sequence[memoryview], offset: int, length: int) -> list[memoryview]:
    """The bytes [offset, offset + length) of the buffers' concatenation, as views of them."""
    out: list[memoryview] = []
    start = 0
    for buf in buffers:
        end = start + len(buf)
        lo, hi = max(offset, start), min(offset + length, end)
        if lo < hi:
            out.append(buf[lo - start : hi - start])
        start = end
    return out
