"""Raw dataset loading: Fashion-MNIST / MNIST (IDX files) and CIFAR-10 (python pickles).

Everything is returned as an :class:`ArrayDataset` of normalised float32 images and int64 labels. Loads are cached per
process because one client agent hosts many logical clients that all index into the same arrays; the cached arrays
are made read-only so no client can corrupt another's data.
"""

from __future__ import annotations

import functools
import gzip
import http.client
import io
import os
import pickle
import shutil
import struct
import tarfile
import tempfile
import urllib.request
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fairfl.data.plugin import DataRequest, Dataset
from fairfl.data.signature import DataSignature

ENV_DATA_DIR = "FAIRFL_DATA_DIR"
DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
SPLITS = ("train", "test")
DOWNLOAD_TIMEOUT_S = 30.0


class DatasetNotFoundError(FileNotFoundError):
    """The dataset files are not in any searched directory (and download was off or failed)."""


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """An in-memory labelled dataset: ``x`` float32 (N, *input_shape), ``y`` int64 (N,)."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        if self.x.dtype != np.float32:
            raise ValueError(f"ArrayDataset {self.name!r}: x must be float32, got {self.x.dtype}")
        if self.y.dtype != np.int64 or self.y.ndim != 1:
            raise ValueError(
                f"ArrayDataset {self.name!r}: y must be a 1-D int64 array, got {self.y.dtype} {self.y.shape}"
            )
        if self.x.ndim < 2 or len(self.x) != len(self.y):
            raise ValueError(f"ArrayDataset {self.name!r}: x {self.x.shape} and y {self.y.shape} disagree on N")
        if self.num_classes < 1:
            raise ValueError(f"ArrayDataset {self.name!r}: num_classes must be >= 1, got {self.num_classes}")
        if len(self.y) and (self.y.min() < 0 or self.y.max() >= self.num_classes):
            raise ValueError(f"ArrayDataset {self.name!r}: labels outside [0, {self.num_classes})")

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, indices: np.ndarray) -> ArrayDataset:
        """A copy restricted to ``indices`` (fancy indexing copies, so the result is writable)."""
        return ArrayDataset(self.x[indices], self.y[indices], self.num_classes, self.name)


@dataclass(frozen=True)
class _Spec:
    kind: str  # "idx" or "cifar"
    input_shape: tuple[int, ...]
    dir_names: tuple[str, ...]  # sub-directories of a search root that may hold the files
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    mirror: str
    debian_dir: Path | None = None


_IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_CIFAR_DIR = "cifar-10-batches-py"
_CIFAR_FILES = {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}
_CIFAR_ARCHIVE = "cifar-10-python.tar.gz"

# Normalisation constants are fixed (not recomputed per load) so every client and the server see identical inputs.
_SPECS: dict[str, _Spec] = {
    "fashion_mnist": _Spec(
        "idx",
        (1, 28, 28),
        ("fashion_mnist", "fashion-mnist", "FashionMNIST/raw"),
        10,
        (0.2860,),
        (0.3530,),
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        DEBIAN_FASHION_MNIST_DIR,
    ),
    "mnist": _Spec(
        "idx",
        (1, 28, 28),
        ("mnist", "MNIST/raw"),
        10,
        (0.1307,),
        (0.3081,),
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
    ),
    # True per-channel std of the CIFAR-10 train set (the often-quoted 0.2023/0.1994/0.2010 are not).
    "cifar10": _Spec(
        "cifar",
        (3, 32, 32),
        ("cifar10", "cifar-10"),
        10,
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
        "https://www.cs.toronto.edu/~kriz/",
    ),
}


# ---------------------------------------------------------------------------------------------------------------- IDX

# IDX type codes -> big-endian numpy dtypes.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _read_bytes(path: Path) -> bytes:
    """File contents, transparently gunzipped; a broken gzip stream is reported as a corrupt file."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                return fh.read()
        return path.read_bytes()
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"{path}: corrupt or truncated file ({exc})") from exc


def parse_idx(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """Parse an IDX blob: magic 0x0000, a type code, the number of dims, big-endian uint32 dims, then the payload."""
    if len(data) < 4:
        raise ValueError(f"{source}: too short for an IDX header ({len(data)} bytes)")
    zero, type_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or type_code not in _IDX_DTYPES or ndim == 0:
        raise ValueError(f"{source}: bad IDX magic number 0x{int.from_bytes(data[:4], 'big'):08x}")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise ValueError(f"{source}: truncated IDX header (need {header_len} bytes, have {len(data)})")
    dims = struct.unpack(f">{ndim}I", data[4:header_len])
    dtype = np.dtype(_IDX_DTYPES[type_code])
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    actual = len(data) - header_len
    if actual != expected:
        raise ValueError(f"{source}: IDX payload is {actual} bytes but dims {dims} need {expected} (truncated?)")
    return np.frombuffer(data, dtype=dtype, offset=header_len).reshape(dims)


def _find_file(directory: Path, stem: str) -> Path | None:
    for candidate in (directory / f"{stem}.gz", directory / stem):
        if candidate.is_file():
            return candidate
    return None


def _load_idx_split(directory: Path, name: str, split: str, spec: _Spec) -> ArrayDataset:
    image_stem, label_stem = _IDX_FILES[split]
    image_path, label_path = _find_file(directory, image_stem), _find_file(directory, label_stem)
    assert image_path is not None and label_path is not None  # guaranteed by _has_files
    images = parse_idx(_read_bytes(image_path), str(image_path))
    labels = parse_idx(_read_bytes(label_path), str(label_path))
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(f"{image_path}: expected a 3-D uint8 image array, got {images.dtype} {images.shape}")
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise ValueError(f"{label_path}: expected a 1-D uint8 label array, got {labels.dtype} {labels.shape}")
    if len(images) != len(labels):
        raise ValueError(f"{directory}: {len(images)} images but {len(labels)} labels for split {split!r}")
    if len(labels) and labels.max() >= spec.num_classes:
        raise ValueError(f"{label_path}: label {labels.max()} outside [0, {spec.num_classes})")
    x = _normalise(images[:, None, :, :], spec)
    return ArrayDataset(x, labels.astype(np.int64), spec.num_classes, name)


def _normalise(raw: np.ndarray, spec: _Spec) -> np.ndarray:
    """uint8 (N, C, H, W) -> float32 scaled to [0, 1] then standardised per channel; in place to bound peak memory."""
    x = raw.astype(np.float32)
    x *= np.float32(1.0 / 255.0)
    mean = np.asarray(spec.mean, dtype=np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(spec.std, dtype=np.float32).reshape(1, -1, 1, 1)
    x -= mean
    x /= std
    return x


# -------------------------------------------------------------------------------------------------------------- CIFAR


class ForbiddenGlobalError(pickle.UnpicklingError):
    """A pickle referenced a global outside the allow-list (it was refused, never resolved or called)."""


def _latin1_encode(obj: str, encoding: str = "utf-8") -> bytes:
    """Stand-in for ``_codecs.encode``: protocol-2 pickles written by Python 3 store bytes as latin-1 text."""
    if encoding.replace("-", "").lower() != "latin1":
        raise ForbiddenGlobalError(f"_codecs.encode with encoding {encoding!r} is not allowed")
    if not isinstance(obj, str):
        raise ForbiddenGlobalError("_codecs.encode on a non-string is not allowed")
    return obj.encode("latin-1")


def _allowed_globals() -> dict[tuple[str, str], Callable[..., Any] | type]:
    # The only globals a CIFAR batch needs: numpy's array reconstruction (module renamed in numpy 2) and, for files
    # re-written by Python 3 with protocol 2, a latin-1-only bytes constructor. Nothing here can run arbitrary code.
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _latin1_encode,
    }


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the allow-listed numpy globals; any other global is refused before it is called."""

    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file, encoding="bytes")
        self._source = source
        self._allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise ForbiddenGlobalError(f"{self._source}: refusing to load global {module}.{name}") from None


def load_restricted_pickle(path: Path) -> Any:
    """Unpickle ``path`` allowing only plain containers and numpy arrays."""
    with open(path, "rb") as fh:
        try:
            return _RestrictedUnpickler(fh, str(path)).load()
        except ForbiddenGlobalError as exc:
            if str(path) in str(exc):
                raise
            raise ForbiddenGlobalError(f"{path}: {exc}") from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
            raise ValueError(f"{path}: corrupt pickle ({exc})") from exc


def _get(batch: dict[Any, Any], key: str) -> Any:
    """Batches from the original Python 2 files have bytes keys; re-pickled ones may have str keys."""
    if key in batch:
        return batch[key]
    if key.encode() in batch:
        return batch[key.encode()]
    raise KeyError(key)


def _load_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    batch = load_restricted_pickle(path)
    if not isinstance(batch, dict):
        raise ValueError(f"{path}: expected a dict, got {type(batch).__name__}")
    try:
        data, labels = _get(batch, "data"), _get(batch, "labels")
    except KeyError as exc:
        raise ValueError(f"{path}: missing key {exc}") from None
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{path}: 'data' must be uint8 (N, 3072), got {data.dtype} {data.shape}")
    labels_arr = np.asarray(labels)
    if labels_arr.ndim != 1 or len(labels_arr) != len(data) or not np.issubdtype(labels_arr.dtype, np.integer):
        raise ValueError(f"{path}: 'labels' must be {len(data)} integers")
    if len(labels_arr) and (labels_arr.min() < 0 or labels_arr.max() >= 10):
        raise ValueError(f"{path}: labels outside [0, 10)")
    return data, labels_arr.astype(np.int64)


def _load_cifar_split(directory: Path, name: str, split: str, spec: _Spec) -> ArrayDataset:
    parts = [_load_cifar_batch(directory / f) for f in _CIFAR_FILES[split]]
    data = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
    labels = np.concatenate([p[1] for p in parts])
    # Rows are channel-major (1024 R, 1024 G, 1024 B), each channel row-major 32x32.
    x = _normalise(data.reshape(-1, 3, 32, 32), spec)
    return ArrayDataset(x, labels, spec.num_classes, name)


# ------------------------------------------------------------------------------------------------------------ search


def cache_dir(name: str) -> Path:
    return Path.home() / ".cache" / "fairfl" / name


def _search_dirs(name: str, root: str | None, env_dir: str | None) -> list[Path]:
    spec = _SPECS[name]
    bases = [Path(b).expanduser() for b in (root, env_dir) if b]
    dirs: list[Path] = []
    for base in bases:
        dirs.append(base)
        dirs.extend(base / sub for sub in spec.dir_names)
    if spec.debian_dir is not None:
        dirs.append(spec.debian_dir)
    dirs.append(cache_dir(name))
    if spec.kind == "cifar":  # the archive unpacks to cifar-10-batches-py/ under whichever directory was chosen
        dirs = [d for base in dirs for d in (base / _CIFAR_DIR, base)]
    return list(dict.fromkeys(dirs))  # de-duplicate, keep order


def _has_files(directory: Path, spec: _Spec, split: str) -> bool:
    if spec.kind == "idx":
        return all(_find_file(directory, stem) is not None for stem in _IDX_FILES[split])
    return all((directory / f).is_file() for f in _CIFAR_FILES[split])


def _not_found(name: str, split: str, searched: list[Path], download_error: str | None) -> DatasetNotFoundError:
    lines = [f"dataset {name!r} (split {split!r}) not found. Searched:"]
    lines += [f"  - {d}" for d in searched]
    lines.append(
        f"Fix: point the `data.root` config field (or the {ENV_DATA_DIR} environment variable) at a directory "
        "holding the files"
    )
    if name == "fashion_mnist":
        lines.append(f"  or install the Debian package dataset-fashion-mnist (provides {DEBIAN_FASHION_MNIST_DIR})")
    if download_error is None:
        lines.append(f"  or enable download (`data.download: true`), which fetches into {cache_dir(name)}.")
    else:
        lines.append(f"Download into {cache_dir(name)} failed: {download_error}")
    return DatasetNotFoundError("\n".join(lines))


def _locate(name: str, split: str, root: str | None, env_dir: str | None) -> Path:
    spec = _SPECS[name]
    searched = _search_dirs(name, root, env_dir)
    for directory in searched:
        if _has_files(directory, spec, split):
            return directory
    raise _not_found(name, split, searched, None)


@functools.lru_cache(maxsize=8)
def _load_cached(name: str, split: str, root: str | None, env_dir: str | None) -> ArrayDataset:
    # Exceptions are not cached, so a failed lookup is retried (e.g. after a download) on the next call.
    spec = _SPECS[name]
    directory = _locate(name, split, root, env_dir)
    loader = _load_idx_split if spec.kind == "idx" else _load_cifar_split
    ds = loader(directory, name, split, spec)
    ds.x.flags.writeable = False
    ds.y.flags.writeable = False
    return ds


def clear_cache() -> None:
    """Drop the in-process dataset cache (tests, or to free memory)."""
    _load_cached.cache_clear()


# ---------------------------------------------------------------------------------------------------------- download


def _fetch(url: str, dest: Path) -> None:
    """Download ``url`` to ``dest`` atomically (temp file + rename) so an interrupted download leaves nothing behind."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp:
            shutil.copyfileobj(resp, out)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _download(name: str) -> None:
    spec = _SPECS[name]
    target = cache_dir(name)
    if spec.kind == "idx":
        for stem in (s for pair in _IDX_FILES.values() for s in pair):
            if not (target / f"{stem}.gz").is_file():
                _fetch(spec.mirror + stem + ".gz", target / f"{stem}.gz")
        return
    archive = target / _CIFAR_ARCHIVE
    if not archive.is_file():
        _fetch(spec.mirror + _CIFAR_ARCHIVE, archive)
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(target, filter="data")  # the "data" filter refuses absolute paths, links out, devices


def load_dataset(name: str, split: str, root: str | None = None, download: bool = False) -> ArrayDataset:
    """Load ``split`` ('train' | 'test') of ``name`` ('fashion_mnist' | 'mnist' | 'cifar10').

    Searched in order: ``root`` (and its ``<name>`` sub-directories), ``$FAIRFL_DATA_DIR`` (likewise), the Debian
    package directory (Fashion-MNIST), then ``~/.cache/fairfl/<name>``. With ``download=True`` a miss fetches the files
    into the cache directory. Raises :class:`DatasetNotFoundError` when nothing is found, ValueError on corrupt files.
    The returned arrays are shared within the process and read-only.
    """
    if name not in _SPECS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(_SPECS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    env_dir = os.environ.get(ENV_DATA_DIR) or None
    try:
        return _load_cached(name, split, root, env_dir)
    except DatasetNotFoundError:
        if not download:
            raise
    try:
        _download(name)
    except (OSError, http.client.HTTPException, tarfile.TarError, EOFError, zlib.error) as exc:
        raise _not_found(name, split, _search_dirs(name, root, env_dir), f"{type(exc).__name__}: {exc}") from exc
    return _load_cached(name, split, root, env_dir)


# ----------------------------------------------------------------------------------------------------------- plug-ins


class FileDataset(Dataset):
    """A built-in public dataset read from its official files (registered as entry points of `fairfl.datasets`)."""

    def __init__(self, name: str) -> None:
        if name not in _SPECS:
            raise ValueError(f"no built-in dataset files for {name!r}")
        self.name = name

    def signature(self, params: Any) -> DataSignature:
        spec = _SPECS[self.name]
        return DataSignature(spec.input_shape, spec.num_classes)

    def load(self, split: str, params: Any, request: DataRequest) -> ArrayDataset:
        return load_dataset(self.name, split, root=request.root, download=request.download)

    def __repr__(self) -> str:
        return f"FileDataset({self.name!r})"


FASHION_MNIST = FileDataset("fashion_mnist")
MNIST = FileDataset("mnist")
CIFAR10 = FileDataset("cifar10")
