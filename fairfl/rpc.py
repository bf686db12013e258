"""Wire limits and the gRPC settings every FairFL server and channel shares: message and chunk sizes, deadlines,
keepalive, and the allocator tuning for streaming buffers.

The rest of the gRPC layer is split by concept: transport security and caller identity (fairfl.rpc_security), the
access guard (fairfl.rpc_guard), refusals (fairfl.rpc_refusals), server construction (fairfl.rpc_server), channels
(fairfl.rpc_channel) and the RPC metrics interceptor (fairfl.rpc_metrics).
"""

from __future__ import annotations

from fairfl.framing import CHUNK_BYTES as CHUNK_BYTES  # a wire-format constant, defined with the framing

# Big payloads are streamed in chunks, so gRPC's default per-message limit (4 MiB) is kept: no single message (a chunk,
# a header with its signature vectors) may exceed it. Chunks stay below it. The servers' access guard enforces it
# (RESOURCE_EXHAUSTED, counted as `size`); gRPC core itself refuses only messages over CORE_MESSAGE_BYTES, before any
# handler or counter sees them, so that is what one call can make a server buffer.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
CORE_MESSAGE_BYTES = 2 * MAX_MESSAGE_BYTES

# Blobs (models) up to this size may travel inline in a poll reply, at most this much per reply (< MAX_MESSAGE_BYTES).
INLINE_BLOB_BYTES = 2 * 1024 * 1024

# Deadlines (seconds) for calls whose duration does not depend on payload size.
SHORT_DEADLINE = 10.0

# Deadline for one streamed transfer; generous because models may be large.
TRANSFER_DEADLINE = 600.0

KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

# glibc malloc: a freed chunk-sized block (2-4 MiB: message buffers, serialised protos) is returned to the kernel and
# the next one faults its pages in again, which on a small VM costs more than moving the bytes (~1 s per GiB
# streamed). Buffers up to 32 MiB (glibc's ceiling for this setting) come from the heap, and the heap keeps up to
# 128 MiB of freed memory before giving it back.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_TRIM_THRESHOLD = 128 * 1024 * 1024
MALLOC_MMAP_THRESHOLD = 32 * 1024 * 1024
_allocator_tuned = False


def tune_allocator() -> None:
    """Keep streaming buffers' memory in the process (see MALLOC_*); once per process, a no-op off glibc."""
    global _allocator_tuned
    if _allocator_tuned:
        return
    _allocator_tuned = True
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator's defaults stand
        return
    mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)
    mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
