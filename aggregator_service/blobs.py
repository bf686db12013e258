"""Content-addressed store of encoded bundles (global models, fair gradients) that clients fetch by sha256."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from fairfl.codec import EncodedBundle
from fairfl.params import ParamLayout
from fairfl.v1 import tensor_pb2

# The newest blobs always kept, whatever their size: a round's model and its fair gradient (FedEBA+) are in use at once.
MIN_KEPT = 2


class BlobStore:
    """Keeps the most recent `capacity` bundles, and beyond the newest MIN_KEPT only while they hold at most
    `max_bytes` together (a 1 GiB model would otherwise keep 8 GiB of past rounds); a model is encoded once per
    round and streamed to every client."""

    def __init__(self, capacity: int = 8, max_bytes: int = 2 * 1024**3) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._blobs: OrderedDict[str, tuple[EncodedBundle, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, layout: ParamLayout, flat: torch.Tensor) -> tensor_pb2.BlobRef:
        flat = flat.detach().to(torch.float32).contiguous().clone()  # the store owns an immutable copy
        bundle = layout.encode(flat)
        with self._lock:
            self._blobs[bundle.sha256] = (bundle, flat)
            self._blobs.move_to_end(bundle.sha256)
            held = sum(b.total_bytes for b, _ in self._blobs.values())
            while len(self._blobs) > MIN_KEPT and (len(self._blobs) > self.capacity or held > self.max_bytes):
                _, (oldest, _) = self._blobs.popitem(last=False)
                held -= oldest.total_bytes
        return tensor_pb2.BlobRef(sha256=bundle.sha256, total_bytes=bundle.total_bytes)

    def get(self, sha256: str) -> tuple[EncodedBundle, torch.Tensor] | None:
        with self._lock:
            return self._blobs.get(sha256)

    def newest(self, count: int | None = None) -> list[tuple[str, torch.Tensor]]:
        """The newest `count` blobs' (sha256, flat float32 tensor), oldest first; None: every blob held."""
        with self._lock:
            kept = list(self._blobs.items())[-count:] if count is not None else list(self._blobs.items())
        return [(sha256, flat) for sha256, (_, flat) in kept]

    def clear(self) -> None:
        with self._lock:
            self._blobs.clear()
