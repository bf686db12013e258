"""A client's samples that stay on disk, seen by the local-training loop as it sees samples on the device.

A site's large `.npy` arrays open as read-only memory maps (fairfl.data.site; a client's split of one file is a
fairfl.data.lazy.LazyRows over it). Reading them through the map would leave every touched page resident and counted
in the agent's RSS, so `DiskRows` reads rows with fairfl.data.lazy.gather_rows (pread into a fresh buffer) and moves
only those rows to the device: a training batch per step, an evaluation pass chunk by chunk. The loop, the built-in
pieces and DP-SGD index it as they index a device tensor (`rows[idx]`, `rows[a:b]`, `len(rows)`), so an on-disk
client trains with the same code as an in-memory one. (A user procedure sees it as `LocalState.x_train`: indexing
works, whole-tensor operations do not.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from fairfl.data.lazy import gather_rows, is_lazy, iter_row_chunks
from fairfl.params import to_device

__all__ = ["DiskRows", "row_chunks", "rows_on_device"]


class DiskRows:
    """One client's on-disk samples `x` (fairfl.data.lazy.is_lazy: an np.memmap, or a LazyRows over one): indexing
    returns the rows on `device`, read on demand."""

    def __init__(self, x: Any, device: torch.device) -> None:
        self.x = x
        self.device = device

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, key: torch.Tensor | np.ndarray | slice) -> torch.Tensor:
        """The rows `key` selects (an index tensor on any device, an index array or a slice), in its order."""
        if isinstance(key, slice):
            idx = np.arange(*key.indices(len(self.x)), dtype=np.int64)
        elif isinstance(key, torch.Tensor):
            idx = key.detach().to("cpu", torch.int64).numpy()
        else:
            idx = np.asarray(key, dtype=np.int64)
        return self._moved(gather_rows(self.x, idx))

    def chunks(self, size: int) -> Iterator[torch.Tensor]:
        """Every row in order, `size` rows at a time, each chunk on the device (a sequential pass: evaluation)."""
        for block in iter_row_chunks(self.x, size):
            yield self._moved(block)

    def _moved(self, rows: np.ndarray) -> torch.Tensor:
        if not rows.flags.writeable:  # torch.from_numpy warns on (and must not write into) read-only buffers
            rows = rows.copy()
        return to_device(torch.from_numpy(rows), self.device)


def rows_on_device(x: Any, device: torch.device) -> torch.Tensor | DiskRows:
    """A client's samples as the loop reads them: a device tensor for in-memory `x`, DiskRows for on-disk `x`."""
    if is_lazy(x):
        return DiskRows(x, device)
    if not x.flags.writeable:
        x = x.copy()
    return torch.from_numpy(x).to(device)


def row_chunks(x: torch.Tensor | DiskRows, size: int) -> Iterator[torch.Tensor]:
    """`x`'s rows in order, `size` at a time: slices of a device tensor, or chunks read from disk."""
    if isinstance(x, DiskRows):
        yield from x.chunks(size)
        return
    for start in range(0, len(x), size):
        yield x[start : start + size]
