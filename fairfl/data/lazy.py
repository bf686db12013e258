"""Rows of arrays that stay on disk: read with `os.pread`, never mapped, so a site's data does not count in RSS.

A site's `.npy` features are opened as a read-only `np.memmap` (fairfl.data.site). Touching a memmap's pages maps
them into the process and they count in its resident memory until the mapping goes away, so a client that trains
over a 20 GB file through `x[idx]` ends up "using" 20 GB. Here rows are read with `os.pread` into ordinary arrays
instead: the kernel's page cache still serves them, but the process holds only the rows it asked for.

Two kinds of array are lazy (`is_lazy`):

- an `np.memmap` (the whole file, or a row slice or reshape of it), and
- a `LazyRows`: a chosen set of rows of such a memmap (a client's random train/test split of one `x.npy`). It has
  `dtype`, `shape`, `ndim`, `len()` and gathers on `[...]` indexing, so code that only indexes still works.

Everything else is in memory and `gather_rows(x, idx)` is plain `x[idx]`.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["LazyRows", "gather_rows", "is_lazy", "iter_row_chunks", "materialize"]


class LazyRows:
    """Rows `rows` (in that order) of an on-disk array `base`, read on demand; read-only.

    `base` is an `np.memmap` whose leading axis is the sample axis; `rows` is a 1-D array of row indices into it.
    Indexing (`lazy[idx]`, `lazy[a:b]`, `lazy[i]`) returns an ordinary in-memory array read with `os.pread`.
    """

    __slots__ = ("base", "rows")

    def __init__(self, base: np.memmap, rows: np.ndarray) -> None:
        if not isinstance(base, np.memmap) or base.ndim < 1:
            raise TypeError(f"LazyRows: base must be an np.memmap with a row axis, got {type(base).__name__}")
        rows = np.asarray(rows)
        if rows.ndim != 1 or (rows.size and not np.issubdtype(rows.dtype, np.integer)):
            raise TypeError(f"LazyRows: rows must be a 1-D integer array, got {rows.dtype} {rows.shape}")
        rows = rows.astype(np.int64, copy=True)
        if rows.size and (rows.min() < 0 or rows.max() >= len(base)):
            raise IndexError(f"LazyRows: row indices outside [0, {len(base)})")
        rows.flags.writeable = False
        self.base = base
        self.rows = rows

    @property
    def dtype(self) -> np.dtype:
        return self.base.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.rows), *self.base.shape[1:])

    @property
    def ndim(self) -> int:
        return self.base.ndim

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: Any) -> np.ndarray:
        head, rest = (key[0], key[1:]) if isinstance(key, tuple) and key else (key, ())
        if isinstance(head, int | np.integer):
            row = gather_rows(self.base, self.rows[[int(head)]])[0]
            return row[rest] if rest else row
        out = gather_rows(self.base, self.rows[head])
        return out[(slice(None), *rest)] if rest else out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = gather_rows(self.base, self.rows)
        return out if dtype is None else out.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"LazyRows({len(self.rows)} of {len(self.base)} rows of {_filename(self.base)!r}, {self.dtype})"


def is_lazy(x: Any) -> bool:
    """Whether `x`'s rows are read from disk on demand (an `np.memmap` backed by a file mapping, or `LazyRows`)."""
    return isinstance(x, LazyRows) or (isinstance(x, np.memmap) and _root(x) is not None)


def materialize(x: Any) -> np.ndarray:
    """`x` as an in-memory array (all rows read with `os.pread` when lazy; in-memory arrays returned as they are)."""
    if isinstance(x, LazyRows):
        return gather_rows(x.base, x.rows)
    if is_lazy(x):
        return _read_range(x, 0, len(x))
    return x


def gather_rows(x: Any, idx: np.ndarray) -> np.ndarray:
    """Rows `idx` of `x` (leading axis), in the order asked and with repeats, as a new in-memory array.

    In-memory arrays: `x[idx]`. Lazy arrays: the distinct rows are sorted, contiguous runs coalesced into one
    `os.pread` each, and the result put back in `idx`'s order; no page of the file is mapped. Negative indices
    count from the end as in numpy; out-of-range ones raise IndexError.
    """
    if isinstance(x, LazyRows):
        return gather_rows(x.base, x.rows[np.asarray(idx)])
    if not is_lazy(x):
        return x[idx]
    idx = np.asarray(idx)
    if idx.dtype == np.bool_:
        idx = np.flatnonzero(idx)
    if idx.ndim != 1:
        raise IndexError(f"gather_rows: idx must be 1-D, got shape {idx.shape}")
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        raise IndexError(f"gather_rows: idx must be integers, got {idx.dtype}")
    n = len(x)
    idx = idx.astype(np.int64, copy=False)
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"gather_rows: index outside [-{n}, {n}) for an array of {n} rows")
    idx = np.where(idx < 0, idx + n, idx)
    layout = _layout(x)
    if layout is None:  # rows not contiguous on disk (a column slice, a strided view): numpy's own copy
        return np.array(x[idx])
    if idx.size == 0:
        return np.empty((0, *x.shape[1:]), dtype=x.dtype)
    uniq, inverse = np.unique(idx, return_inverse=True)
    # Runs of consecutive row numbers: each is one read.
    breaks = np.flatnonzero(np.diff(uniq) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [len(uniq)]))
    out = np.empty((len(uniq), *x.shape[1:]), dtype=x.dtype)
    filename, offset, row_bytes = layout
    buf = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(b"")
    fd = os.open(filename, os.O_RDONLY)
    try:
        for lo, hi in zip(starts.tolist(), stops.tolist(), strict=True):
            _pread_into(fd, buf[lo * row_bytes : hi * row_bytes], offset + int(uniq[lo]) * row_bytes, filename)
    finally:
        os.close(fd)
    if len(uniq) == len(idx) and np.array_equal(uniq, idx):
        return out  # already sorted and distinct: no reordering copy
    return out[inverse.reshape(-1)]


def iter_row_chunks(x: Any, size: int) -> Iterator[np.ndarray]:
    """`x`'s rows in order, `size` at a time (the last chunk may be shorter), for sequential passes (evaluation).

    In-memory arrays yield views `x[a:b]`; lazy ones yield in-memory copies read with one `os.pread` per chunk
    (`LazyRows`: per contiguous run), so at most one chunk of the file is held at a time.
    """
    if size < 1:
        raise ValueError(f"iter_row_chunks: size must be >= 1, got {size}")
    n = len(x)
    for start in range(0, n, size):
        stop = min(start + size, n)
        if isinstance(x, LazyRows):
            yield gather_rows(x.base, x.rows[start:stop])
        elif is_lazy(x):
            yield _read_range(x, start, stop)
        else:
            yield x[start:stop]


# ------------------------------------------------------------------------------------------------------ internals


def _root(x: np.ndarray) -> np.ndarray | None:
    """The array created directly over the file mapping that `x` views, or None if `x` is not file-backed."""
    a: Any = x
    while isinstance(a, np.ndarray):
        if isinstance(a.base, mmap.mmap):
            return a if isinstance(a, np.memmap) else None
        a = a.base
    return None


def _filename(x: np.ndarray) -> str:
    root = _root(x)
    name = getattr(root, "filename", None)
    return str(name) if name else "<memmap>"


def _layout(x: np.ndarray) -> tuple[str, int, int] | None:
    """(file, byte offset of row 0, bytes per row) when `x`'s rows lie back to back in its file, else None."""
    root = _root(x)
    if root is None or not getattr(root, "filename", None):
        return None
    itemsize = x.dtype.itemsize
    row_bytes = math.prod(x.shape[1:]) * itemsize
    # Each row C-contiguous and rows adjacent: strides are exactly the C strides of the shape.
    expected = []
    step = itemsize
    for dim in reversed(x.shape):
        expected.append(step)
        step *= dim
    if any(dim > 1 and s != e for dim, s, e in zip(x.shape, x.strides, reversed(expected), strict=True)):
        return None
    if row_bytes == 0:
        return None
    delta = x.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    return str(root.filename), int(root.offset) + delta, row_bytes


def _read_range(x: np.ndarray, start: int, stop: int) -> np.ndarray:
    layout = _layout(x)
    if layout is None:
        return np.array(x[start:stop])
    filename, offset, row_bytes = layout
    out = np.empty((stop - start, *x.shape[1:]), dtype=x.dtype)
    if out.size:
        fd = os.open(filename, os.O_RDONLY)
        try:
            _pread_into(fd, memoryview(out.reshape(-1).view(np.uint8)), offset + start * row_bytes, filename)
        finally:
            os.close(fd)
    return out


def _pread_into(fd: int, dst: memoryview, offset: int, filename: str) -> None:
    """Fill `dst` from `fd` at `offset` (looping over short reads); EOFError when the file is shorter."""
    got, want = 0, len(dst)
    while got < want:
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [dst[got:]], offset + got)
        else:  # pragma: no cover - platforms without preadv
            chunk = os.pread(fd, want - got, offset + got)
            n = len(chunk)
            dst[got : got + n] = chunk
        if n == 0:
            raise EOFError(f"{filename}: file ends before byte {offset + want} (truncated since it was opened?)")
        got += n
