"""Readers of a site's data files (fairfl.data.site): each turns one file or folder into a `Part`.

A `Part` is one set of samples as found on disk: features (numeric, any dtype; an `np.memmap` for float32 `.npy`
files, and for tables streamed into such a cache by `stream_table`: these stay on disk), raw labels (numbers, or
strings/folder names that fairfl.data.site maps to class indices) and, for tables, the feature column names. Images
are scanned first (`ImageScan`: file names, sizes and modes from the headers) and decoded later, once the whole
site's channel count is known: into memory (`decode_images`) or, batch by batch, into a cache like a table's
(`cache_images`). Both caches are written by one helper (`_cached_rows`: a directory named by a key, written under
a temporary name and renamed into place whole).

Every problem is a `SiteDataError`: one line naming the file (and the column or key) and what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "IMAGE_SUFFIXES",
    "LAZY_TABLE_BYTES",
    "TABLE_SUFFIXES",
    "ImageScan",
    "LazyTable",
    "Part",
    "SiteDataError",
    "cache_images",
    "decode_images",
    "natural_key",
    "read_npy_pair",
    "read_npz",
    "read_table",
    "scan_image_folder",
    "stream_table",
]

TABLE_SUFFIXES = (".csv", ".parquet", ".pq")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm", ".pbm")
LAZY_TABLE_BYTES = 256 * 2**20  # lazy=auto streams tables larger than this into a cache (stream_table)
_BLOCK_BYTES = 4 * 2**20  # a streamed batch: about this many bytes of float32 features (CSV: of text)
_IMAGE_BATCH = 1024  # a decoded batch of images: at most this many, and about `_BLOCK_BYTES` (one image at least)
_HEADER_BYTES = 128  # the fixed .npy header of a cache, rewritten in place with the row count
_CACHE_VERSION = 1
_GRAY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"})


class SiteDataError(ValueError):
    """A site's data cannot be served: one line naming the path (and the option) and what to do."""


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key putting `client2` before `client10`: digit runs compare as numbers, the rest case-insensitively."""
    return tuple((0, int(tok), "") if tok.isdigit() else (1, 0, tok.lower()) for tok in re.split(r"(\d+)", name) if tok)


def _visible(path: Path) -> list[Path]:
    """A directory's entries without hidden ones, in natural order."""
    return sorted((p for p in path.iterdir() if not p.name.startswith(".")), key=lambda p: natural_key(p.name))


@dataclass(eq=False)
class ImageScan:
    """An image folder `<class>/<image>` read as far as its headers: decoded by `decode_images`."""

    root: Path
    files: list[Path]
    names: np.ndarray  # class folder name of each file (str)
    class_names: tuple[str, ...]  # every class folder, empty ones included
    size: tuple[int, int] | None  # (width, height) shared by every image; None when there are none
    gray: bool  # every image is single-channel


@dataclass(eq=False)
class Part:
    """One set of samples as found on disk (see the module docstring)."""

    source: str
    x: Any  # (N, ...) numeric array, an np.memmap (float32 .npy), or None for images not yet decoded
    y: np.ndarray  # (N,) raw labels
    feature_names: tuple[str, ...] | None = None
    images: ImageScan | None = None
    owners: np.ndarray | None = None  # client_column= values, one per row (a file holding every client)
    lazy_ok: bool = field(default=False)
    lazy_table: LazyTable | None = None  # a table served from its cache (stream_table): how to stream it again

    def __len__(self) -> int:
        return len(self.y)


# ----------------------------------------------------------------------------------------------------------- numpy


def read_npz(path: Path, client_key: str | None = None) -> tuple[Part, Part | None]:
    """`.npz` with `x`,`y` (one set, to be split) or `x_train`,`y_train`,`x_test`,`y_test` (given split).

    With `client_key`, the array of that name holds each row's client (only with `x`,`y`).
    """
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as err:  # truncated or not a zip at all
        raise SiteDataError(f"{path}: not a readable .npz file ({type(err).__name__}: {err})") from None
    keys = sorted(arrays)
    if {"x_train", "y_train", "x_test", "y_test"} <= set(arrays):
        if client_key is not None:
            raise SiteDataError(
                f"{path}: client_column={client_key} needs keys x, y and {client_key}; this file has a given "
                "train/test split (x_train, y_train, x_test, y_test)"
            )
        train = _npz_part(path, arrays["x_train"], arrays["y_train"], "x_train", "y_train")
        test = _npz_part(path, arrays["x_test"], arrays["y_test"], "x_test", "y_test")
        return train, test
    if {"x", "y"} <= set(arrays):
        part = _npz_part(path, arrays["x"], arrays["y"], "x", "y")
        if client_key is not None:
            if client_key not in arrays:
                raise SiteDataError(f"{path}: client_column={client_key}: no such key (keys: {', '.join(keys)})")
            owners = arrays[client_key]
            if owners.shape != (len(part),):
                raise SiteDataError(
                    f"{path}: client_column={client_key}: key {client_key!r} has shape {owners.shape}, "
                    f"expected ({len(part)},) (one client per row)"
                )
            part.owners = owners
        return part, None
    raise SiteDataError(
        f"{path}: expected keys x, y or x_train, y_train, x_test, y_test; found {', '.join(keys) or 'none'}"
    )


def _npz_part(path: Path, x: np.ndarray, y: np.ndarray, xkey: str, ykey: str) -> Part:
    if x.ndim < 2:
        raise SiteDataError(f"{path}: {xkey} has shape {x.shape}; expected (samples, features...) ")
    if y.ndim != 1 or len(y) != len(x):
        raise SiteDataError(f"{path}: {ykey} has shape {y.shape}; expected ({len(x)},), one label per row of {xkey}")
    _check_numeric(x, f"{path}: {xkey}")
    return Part(str(path), x, y)


def read_npy_pair(directory: Path) -> Part:
    """`x.npy` + `y.npy`: x memory-mapped read-only (lazy when float32, C order); y read into memory."""
    xpath, ypath = directory / "x.npy", directory / "y.npy"
    try:
        x = np.load(xpath, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise SiteDataError(f"{xpath}: not a readable .npy file ({type(err).__name__}: {err})") from None
    try:
        y = np.load(ypath, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise SiteDataError(f"{ypath}: not a readable .npy file ({type(err).__name__}: {err})") from None
    if x.ndim < 2:
        raise SiteDataError(f"{xpath}: shape {x.shape}; expected (samples, features...)")
    if y.ndim != 1 or len(y) != len(x):
        raise SiteDataError(f"{ypath}: shape {y.shape}; expected ({len(x)},), one label per row of {xpath.name}")
    _check_numeric(x, str(xpath))
    native = x.dtype == np.float32 and x.dtype.isnative and x.flags.c_contiguous
    if not native:  # converted to float32 in memory: a memmap of another dtype cannot be served lazily
        x = np.load(xpath, allow_pickle=False)
    return Part(str(xpath), x, y, lazy_ok=native)


def _check_numeric(x: np.ndarray, where: str) -> None:
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise SiteDataError(f"{where}: features must be numbers, got dtype {x.dtype}")


# ----------------------------------------------------------------------------------------------------------- tables


def read_table(path: Path, label: str, client_column: str | None = None) -> Part:
    """A CSV or Parquet table read into memory: the `label` column, every other column (but `client_column`) a
    numeric feature.

    Parquet files are read one row group at a time into the float32 feature matrix; CSV files whole (pyarrow).
    """
    import pyarrow as pa

    schema, num_rows, batches = _open_table(path, streaming=False)
    features = _feature_columns(path, schema, label, client_column)
    assert num_rows is not None
    x = np.empty((num_rows, len(features)), dtype=np.float32)
    ys: list[np.ndarray] = []
    owners: list[np.ndarray] = []
    row = 0
    try:
        for batch in batches:
            n = batch.num_rows
            y, owner = _convert_batch(batch, path, features, label, client_column, row, x[row : row + n])
            ys.append(y)
            if owner is not None:
                owners.append(owner)
            row += n
    except pa.ArrowException as err:
        raise SiteDataError(f"{path}: cannot read the table ({err})") from None
    if row != num_rows:
        raise SiteDataError(f"{path}: read {row} rows, its metadata says {num_rows}")
    part = Part(str(path), x, _concat(ys), feature_names=tuple(features))
    if client_column is not None:
        part.owners = _concat(owners)
    return part


def _open_table(path: Path, streaming: bool, forced: dict[str, Any] | None = None) -> tuple[Any, int | None, Any]:
    """(schema, row count or None, batches): Parquet by row groups (streaming: batches of about `_BLOCK_BYTES` of
    features); CSV whole, or streaming in blocks with `forced` column types (the row count is then unknown)."""
    import pyarrow as pa

    try:
        if path.suffix.lower() == ".csv":
            import pyarrow.csv as pacsv

            if not streaming:
                table = pacsv.read_csv(path)
                return table.schema, table.num_rows, iter([table])
            reader = pacsv.open_csv(
                path,
                read_options=pacsv.ReadOptions(block_size=_BLOCK_BYTES),
                convert_options=pacsv.ConvertOptions(column_types=forced or {}),
            )
            return reader.schema, None, reader
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path, pre_buffer=not streaming)  # pre-buffering would hold the whole file's bytes
        schema, num_rows = pf.schema_arrow, pf.metadata.num_rows
        if streaming:
            rows = max(1, _BLOCK_BYTES // (4 * max(1, len(schema.names))))
            return schema, num_rows, pf.iter_batches(batch_size=rows)
        return schema, num_rows, (pf.read_row_group(i) for i in range(pf.num_row_groups))
    except (OSError, pa.ArrowException) as err:
        raise SiteDataError(f"{path}: not a readable {path.suffix.lstrip('.')} table ({err})") from None


def _feature_columns(path: Path, schema: Any, label: str, client_column: str | None) -> list[str]:
    """The feature column names (every column but the label and the client column), each checked numeric."""
    import pyarrow as pa

    names = list(schema.names)
    if label not in names:
        raise SiteDataError(f"{path}: no label column {label!r} (columns: {_some(names)}); name it with label=COLUMN")
    if client_column is not None and client_column not in names:
        raise SiteDataError(f"{path}: client_column={client_column}: no such column (columns: {_some(names)})")
    features = [n for n in names if n not in (label, client_column)]
    if not features:
        raise SiteDataError(f"{path}: no feature columns besides the label column {label!r}")
    for name in features:
        kind = schema.field(name).type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
            raise SiteDataError(
                f"{path}: feature column {name!r} is {kind}, not numeric; convert it to numbers or drop it "
                f"(every column but label={label}{'' if client_column is None else f', client_column={client_column}'}"
                " is a feature)"
            )
    return features


def _convert_batch(
    batch: Any, path: Path, features: list[str], label: str, client_column: str | None, row: int, out: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None]:
    """Write `batch`'s features into `out` (float32, one column at a time: vectorised, no per-row work); its raw
    labels and client values. `row` is the batch's first row in the file (for messages)."""
    n = batch.num_rows
    for j, name in enumerate(features):
        column = batch.column(name)
        if column.null_count:
            raise SiteDataError(
                f"{path}: feature column {name!r} has {column.null_count} missing values "
                f"(rows {row}..{row + n - 1}); fill or drop them"
            )
        with np.errstate(over="ignore"):  # a float64 beyond float32's range: inf, reported as such
            out[:, j] = column.to_numpy(zero_copy_only=False)
    y = _column_values(batch.column(label), path, f"label column {label!r}")
    owners = None
    if client_column is not None:
        owners = _column_values(batch.column(client_column), path, f"client_column {client_column!r}")
    return y, owners


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)


def _some(names: list[str], limit: int = 12) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _column_values(column: Any, path: Path, what: str) -> np.ndarray:
    if column.null_count:
        raise SiteDataError(f"{path}: {what} has {column.null_count} missing values")
    values = column.to_numpy(zero_copy_only=False)
    if values.dtype == object:  # strings: a fixed-width unicode array sorts and compares vectorised
        values = values.astype(str)
    return values


# ----------------------------------------------------------------------------------------------- tables, streamed


@dataclass(frozen=True)
class LazyTable:
    """A CSV or Parquet table served from a float32 `.npy` feature cache in `cache_dir` (see `stream_table`)."""

    path: Path
    label: str
    client_column: str | None
    cache_dir: Path


def stream_table(table: LazyTable, columns: tuple[str, ...] | None = None) -> Part:
    """`table` as a Part whose features stay on disk: a read-only `np.memmap` of its float32 `.npy` cache.

    The cache is made once by streaming the table (Parquet in batches of at most a row group, CSV in blocks), so at
    most one batch of it is in memory, and checked as `read_table` checks it, plus NaN/infinite values per column.
    It lives in `cache_dir/<stem>-<path hash>-<key>/` (x.npy float32, y.npy the raw labels, owners.npy the client
    column's values, meta.json), where the key covers the file's absolute path, size and mtime, the label and
    client columns and `columns` (the feature order; default the file's): a changed file gets a new cache (the old
    one is left for an agent still serving it; delete it by hand). It is written in a temporary directory renamed
    into place whole, so an agent killed meanwhile leaves no half cache (only a `.<name>.tmp-*` directory).
    """
    path = table.path
    stat = _stat(path)
    key = {"version": _CACHE_VERSION, "source": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    key["label"] = table.label
    key.update({"client_column": table.client_column, "columns": None if columns is None else list(columns)})

    def fill(tmp: Path) -> dict[str, Any]:
        features, y, owners = _stream_into(table, columns, tmp / "x.npy")
        after = _stat(path)
        if (after.st_size, after.st_mtime_ns) != (stat.st_size, stat.st_mtime_ns):
            raise SiteDataError(f"{path}: changed while it was being read; open the site again")
        np.save(tmp / "y.npy", y, allow_pickle=False)
        if owners is not None:
            np.save(tmp / "owners.npy", owners, allow_pickle=False)
        return {"features": features}

    return _cached_rows(table.cache_dir, path, key, lambda final: _load_cache(final, table), fill)


def _stat(path: Path) -> os.stat_result:
    try:
        return path.stat()
    except OSError as err:
        raise SiteDataError(f"{path}: cannot read it ({err})") from None


def _cached_rows(
    cache_dir: Path,
    path: Path,
    key: dict[str, Any],
    load: Callable[[Path], Any],
    fill: Callable[[Path], dict[str, Any]],
) -> Any:
    """What `load` makes of the cache of `path` under `key` in `cache_dir`, written first by `fill` if absent.

    The cache is the directory `cache_dir/<stem>-<path hash>-<key hash>`; `load(directory)` returns None when it
    is absent or unreadable. `fill(tmp)` writes the cache's files into a fresh temporary directory in `cache_dir`
    (raising SiteDataError on bad data) and returns what `meta.json` adds to `key`; that directory is then renamed
    into place whole, so a failure or a killed agent leaves no cache (at most a `.<name>.tmp-*` directory).
    """
    source = str(path.resolve())
    prefix = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', path.stem)[:40]}-{_digest(source)[:12]}"
    final = cache_dir / f"{prefix}-{_digest(json.dumps(key, sort_keys=True))[:16]}"
    cached = load(final)
    if cached is not None:
        return cached
    advice = "give cache=DIR (a writable directory with room for the features as float32)"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    except OSError as err:
        raise SiteDataError(f"{path}: cannot create its lazy cache in {cache_dir} ({err}); {advice}") from None
    try:
        extra = fill(tmp)
        (tmp / "meta.json").write_text(json.dumps({**key, **extra}))
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():  # else another agent finished the same cache first: use theirs
                raise
    except OSError as err:
        raise SiteDataError(f"{path}: cannot write its lazy cache in {cache_dir} ({err}); {advice}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed into place
    cached = load(final)
    if cached is None:
        raise SiteDataError(f"{path}: its lazy cache {final} cannot be read back; delete it and open the site again")
    return cached


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _stream_into(
    table: LazyTable, columns: tuple[str, ...] | None, target: Path
) -> tuple[list[str], np.ndarray, np.ndarray | None]:
    """Stream `table` into the float32 `.npy` file `target` (a header, then each batch's rows appended; the header
    rewritten with the row count at the end); the feature names, raw labels and client values."""
    import pyarrow as pa

    path, label, client_column = table.path, table.label, table.client_column
    schema, num_rows, batches = _open_table(path, streaming=True)
    if path.suffix.lower() == ".csv":
        # A streaming CSV reader fixes each column's type from its first block: integer features and labels are
        # read as float64 (the same values) so that a later block holding decimals still parses.
        forced = {
            f.name: pa.float64()
            for f in schema
            if f.name != client_column and (pa.types.is_integer(f.type) or pa.types.is_null(f.type))
        }
        batches.close()
        schema, num_rows, batches = _open_table(path, streaming=True, forced=forced)
    features = _feature_columns(path, schema, label, client_column)
    if columns is not None:
        assert sorted(columns) == sorted(features), (columns, features)
        features = list(columns)
    ys: list[np.ndarray] = []
    owners: list[np.ndarray] = []
    row = 0
    with open(target, "wb") as fh:
        fh.write(_npy_header((0, len(features))))
        try:
            for batch in batches:
                block = np.empty((batch.num_rows, len(features)), dtype="<f4")
                y, owner = _convert_batch(batch, path, features, label, client_column, row, block)
                bad = ~np.isfinite(block)
                if bad.any():
                    i, j = np.argwhere(bad)[0]
                    raise SiteDataError(
                        f"{path}: feature column {features[j]!r} has NaN or infinite values (row {row + i}: "
                        f"{block[i, j]}, as float32); fill or drop them"
                    )
                fh.write(memoryview(block).cast("B"))
                ys.append(y)
                if owner is not None:
                    owners.append(owner)
                row += len(block)
        except pa.ArrowException as err:
            raise SiteDataError(f"{path}: cannot read the table ({err})") from None
        if num_rows is not None and row != num_rows:
            raise SiteDataError(f"{path}: read {row} rows, its metadata says {num_rows}")
        fh.seek(0)
        fh.write(_npy_header((row, len(features))))
    return features, _concat(ys), (_concat(owners) if client_column is not None else None)


def _npy_header(shape: tuple[int, ...]) -> bytes:
    """A `.npy` (version 1.0) header for float32 of `shape`, always `_HEADER_BYTES` long so that it can be
    rewritten in place once the row count is known."""
    text = repr({"descr": "<f4", "fortran_order": False, "shape": tuple(shape)}).encode("latin1")
    room = _HEADER_BYTES - 10  # after the magic string (8 bytes) and the header length (2)
    if len(text) + 1 > room:
        raise SiteDataError(f"an array of shape {list(shape)} is too large for the lazy cache")
    return np.lib.format.magic(1, 0) + struct.pack("<H", room) + text.ljust(room - 1) + b"\n"


def _load_cache(final: Path, table: LazyTable) -> Part | None:
    """The cache in `final` as a Part, or None when it is absent or unreadable (then it is written anew)."""
    try:
        meta = json.loads((final / "meta.json").read_text())
        features = tuple(meta["features"])
        y = np.load(final / "y.npy", allow_pickle=False)
        owners = None if table.client_column is None else np.load(final / "owners.npy", allow_pickle=False)
        if len(y):
            x = np.load(final / "x.npy", mmap_mode="r", allow_pickle=False)
        else:  # an empty file cannot be mapped
            x = np.empty((0, len(features)), dtype=np.float32)
    except (OSError, ValueError, KeyError, TypeError, EOFError):
        return None
    if x.dtype != np.float32 or x.shape != (len(y), len(features)) or (owners is not None and len(owners) != len(y)):
        return None
    return Part(str(table.path), x, y, features, owners=owners, lazy_ok=True, lazy_table=table)


# ----------------------------------------------------------------------------------------------------------- images


def scan_image_folder(root: Path) -> ImageScan:
    """`root/<class>/<image>`: every image's class (its folder's name), size and mode, from the headers only."""
    from PIL import Image, UnidentifiedImageError

    class_dirs = [p for p in _visible(root) if p.is_dir()]
    strays = [p for p in _visible(root) if not p.is_dir()]
    if strays:
        raise SiteDataError(f"{strays[0]}: an image folder holds only class folders <class>/<image>")
    if not class_dirs:
        raise SiteDataError(f"{root}: no class folders (expected {root}/<class>/<image>)")
    files: list[Path] = []
    names: list[str] = []
    size: tuple[int, int] | None = None
    first: Path | None = None
    gray = True
    for class_dir in class_dirs:
        for image in _visible(class_dir):
            if image.is_dir() or image.suffix.lower() not in IMAGE_SUFFIXES:
                raise SiteDataError(
                    f"{image}: not an image file (expected {', '.join(IMAGE_SUFFIXES)}) in class folder {class_dir}"
                )
            try:
                with Image.open(image) as im:
                    mode, image_size = im.mode, im.size
            except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as err:
                raise SiteDataError(f"{image}: not a readable image ({err})") from None
            if size is None:
                size, first = image_size, image
            elif image_size != size:
                raise SiteDataError(
                    f"{image}: {image_size[0]}x{image_size[1]} pixels, but {first} is {size[0]}x{size[1]}; "
                    "every image of a site must have the same size (resize them)"
                )
            gray = gray and mode in _GRAY_MODES
            files.append(image)
            names.append(class_dir.name)
    return ImageScan(root, files, np.asarray(names, dtype=str), tuple(p.name for p in class_dirs), size, gray)


def decode_images(scan: ImageScan, channels: int) -> np.ndarray:
    """The scanned images as float32 (N, channels, H, W) in [0, 1] (Pillow; 'L' for 1 channel, 'RGB' for 3)."""
    x = np.empty(_image_shape(scan, channels), dtype=np.float32)
    row = 0
    for block in _decoded_batches(scan, channels):
        x[row : row + len(block)] = block
        row += len(block)
    return x


def cache_images(scan: ImageScan, channels: int, labels: np.ndarray, cache_dir: Path, classes: Any = None) -> Any:
    """The scanned images as `decode_images` gives them, but on disk: a read-only `np.memmap` of a float32 cache.

    The images are decoded once, in file order, a batch at a time (so at most one batch is in memory), into
    `cache_dir/<folder>-<hash>-<key>/` (x.npy float32 (N, channels, H, W), y.npy the class indices `labels`,
    meta.json), written like a table's cache (`_cached_rows`). The key covers the folder's absolute path, each
    image's relative path, size and mtime, the channel count and what decides the labels (`classes`, the
    `labels` themselves): a changed image gives a new cache.
    """
    root = scan.root
    shape = _image_shape(scan, channels)
    stats = _image_stats(scan)
    files = json.dumps(
        [[str(f.relative_to(root)), size, mtime] for f, (size, mtime) in zip(scan.files, stats, strict=True)]
    )
    labels = np.ascontiguousarray(labels, dtype=np.int64)
    key = {"version": _CACHE_VERSION, "format": "images", "source": str(root.resolve()), "files": _digest(files)}
    key.update({"count": len(scan.files), "shape": list(shape), "classes": None if classes is None else list(classes)})
    key["labels"] = hashlib.sha256(labels.tobytes()).hexdigest()

    def fill(tmp: Path) -> dict[str, Any]:
        with open(tmp / "x.npy", "wb") as fh:
            fh.write(_npy_header(shape))
            for block in _decoded_batches(scan, channels):
                fh.write(memoryview(np.ascontiguousarray(block, dtype="<f4")).cast("B"))
        for path, before in zip(scan.files, stats, strict=True):
            if _image_stat(path) != before:
                raise SiteDataError(f"{path}: changed while it was being read; open the site again")
        np.save(tmp / "y.npy", labels, allow_pickle=False)
        return {}

    def load(final: Path) -> Any:
        try:
            y = np.load(final / "y.npy", allow_pickle=False)
            x = np.load(final / "x.npy", mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError):
            return None
        if x.dtype != np.float32 or x.shape != shape or not np.array_equal(y, labels):
            return None
        return x

    return _cached_rows(cache_dir, root, key, load, fill)


def _image_shape(scan: ImageScan, channels: int) -> tuple[int, int, int, int]:
    if scan.size is None:
        raise SiteDataError(f"{scan.root}: no images in its class folders")
    width, height = scan.size
    return (len(scan.files), channels, height, width)


def _image_stat(path: Path) -> tuple[int, int]:
    stat = _stat(path)
    return stat.st_size, stat.st_mtime_ns


def _image_stats(scan: ImageScan) -> list[tuple[int, int]]:
    return [_image_stat(path) for path in scan.files]


def _decoded_batches(scan: ImageScan, channels: int) -> Iterator[np.ndarray]:
    """The scanned images decoded in file order, float32 (B, channels, H, W) in [0, 1], B bounded by
    `_IMAGE_BATCH` and `_BLOCK_BYTES`."""
    from PIL import Image

    _, _, height, width = _image_shape(scan, channels)
    mode = "L" if channels == 1 else "RGB"
    batch = max(1, min(_IMAGE_BATCH, _BLOCK_BYTES // (4 * channels * height * width)))
    for start in range(0, len(scan.files), batch):
        files = scan.files[start : start + batch]
        raw = np.empty((len(files), height, width, channels), dtype=np.uint8)
        for i, path in enumerate(files):  # one decode per file: inherent
            try:
                with Image.open(path) as im:
                    pixels = np.asarray(im.convert(mode), dtype=np.uint8)
            except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
                raise SiteDataError(f"{path}: cannot decode the image ({type(err).__name__}: {err})") from None
            if pixels.shape[:2] != (height, width):
                raise SiteDataError(
                    f"{path}: decoded to {pixels.shape[1]}x{pixels.shape[0]}, expected {width}x{height}"
                )
            raw[i] = pixels.reshape(height, width, channels)
        x = raw.transpose(0, 3, 1, 2).astype(np.float32)
        x *= np.float32(1.0 / 255.0)
        yield x
