"""A site's own data: what an agent started with `fairfl serve agent --data SPEC` serves to the run.

`open_site(spec, client_ids)` reads the site's files into one `SiteClient` (train and test `ArrayDataset`) per client
the agent hosts, and the site's `DataSignature`. The `site` dataset plug-in (`SITE`) is what a run names to be served
from the sites: it declares the signature the run expects and builds nothing itself (`at_sites = True`).

SPEC is comma-separated: the first item is a PATH, or `package.module:attr` naming a DataProvider (the other items
are then its parameters, YAML values, except `seed=`); the other items are options `key=value`:

    label=COLUMN          the label column of a table (default `label`)
    client_column=NAME    PATH is one table (or .npz key) holding every client: its distinct values, in natural
                          sorted order, map to the agent's client ids in ascending order
    test_fraction=F       the test share of a client without a given split (default 0.2; 0 = no test data)
    seed=N                the seed of those splits (default 0)
    shape=AxBxC           reshape each sample (table rows, .npz/.npy rows) to this shape
    num_classes=K         the class count (default: the class folders of an image site, else max label + 1)
    classes=A|B|C         the class names in class order: string labels (or folder names) map to their position
    lazy=auto|true|false  read CSV and Parquet tables and image folders lazily: stream or decode each once, a
                          batch at a time, into a float32 feature cache served from disk like `.npy` (auto, the
                          default: tables over 256 MiB, image folders whose decoded float32 pixels, from the sizes
                          in the headers, exceed 256 MiB)
    cache=DIR             where those caches live (default $FAIRFL_CACHE_DIR, else ~/.cache/fairfl/sites)

PATH is one client's entry, or a directory holding one entry per client (natural sorted order, hidden names
skipped, mapped onto the agent's client ids in ascending order; the counts must match). An entry is a file
`NAME.npz` (keys `x`,`y` or `x_train`,`y_train`,`x_test`,`y_test`), `NAME.csv` or `NAME.parquet`, or a directory
holding `x.npy`+`y.npy`, `train.EXT`+`test.EXT` (EXT one of npz, csv, parquet), `train/`+`test/` (each `x.npy`+
`y.npy` or an image folder), or an image folder `<class>/<image>`.

Labels are integers >= 0 (integral floats are accepted); string labels need `classes=`. Image class folders named by
integers are those labels; otherwise their names in sorted order (over the whole site) are 0..K-1, which is only the
run's order if every site has the same folders: give `classes=` when they differ. Images are decoded with Pillow to
float32 in [0, 1], shape (C, H, W): C = 1 when every image of the site is grayscale, else 3 (RGB); every image must
have the same size. Tables: every column but the label (and the client column) is a numeric feature, named by its
column; every table of a site must have the same feature columns (their order is the first table's).

A client without a given split is split at random: `test_fraction` of its rows (rounded; at least one row each
way when it has two or more and test_fraction > 0) become its test set, drawn with
`np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(k,)))` where k is the client's position in the
site's order (not its client id), so the same files and seed always give the same split; both sets keep file order.

x is float32 and y int64. `.npy` features that are float32 in C order stay on disk (an `np.memmap`, or a
`fairfl.data.lazy.LazyRows` of one when split at random or by client column): read them with fairfl.data.lazy. So do
lazily read tables: the first open streams the table (Parquet a row group or less at a time, CSV a block at a time) into
`DIR/<name>-<hash>/x.npy` plus its labels, with the checks of the in-memory path (and NaN/infinite values named by
column); later opens reuse it while the file's size and mtime and the options label=, client_column= stay the same. A
CSV streamed this way takes each column's type from its first block (integers widened to float64), so a column with text
further down fails there. Lazily read image folders stay on disk too: the first open decodes the folder's images in file
order, up to 1,024 at a time, into `DIR/<folder>-<hash>/x.npy` (float32, (N, C, H, W)) plus their labels; later opens
reuse it while the folder's images (relative paths, sizes, mtimes), the channel count and the labels (classes=, the
class folders) stay the same. Both paths give the same arrays, and a bad table or image leaves no cache behind.
Everything else is read into memory when the site is opened. Every problem is a `SiteDataError`: one line naming the
path and the option.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import yaml

from fairfl.data.datasets import ArrayDataset
from fairfl.data.federated import FederatedData
from fairfl.data.lazy import LazyRows, is_lazy
from fairfl.data.plugin import DataProvider, DataRequest, Dataset, dataset_signature_of, resolve_dataset
from fairfl.data.signature import DataSignature
from fairfl.data.site_formats import (
    IMAGE_SUFFIXES,
    LAZY_TABLE_BYTES,
    TABLE_SUFFIXES,
    ImageScan,
    LazyTable,
    Part,
    SiteDataError,
    cache_images,
    decode_images,
    natural_key,
    read_npy_pair,
    read_npz,
    read_table,
    scan_image_folder,
    stream_table,
)
from fairfl.plugins import NoParams, PluginError, parse_params
from fairfl.schema import ConfigError

__all__ = ["SITE", "SiteClient", "SiteData", "SiteDataError", "SiteOptions", "SiteParams", "SiteSource", "open_site"]

OPTIONS = ("label", "client_column", "test_fraction", "seed", "shape", "num_classes", "classes", "lazy", "cache")
LAZY = ("auto", "true", "false")
_SPLIT_SUFFIXES = (".npz", *TABLE_SUFFIXES)
_PROVIDER = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass(frozen=True)
class SiteClient:
    """One client's data at a site: its train and test sets (x may be lazy: fairfl.data.lazy)."""

    train: ArrayDataset
    test: ArrayDataset
    source: str = ""  # the file or folder it came from (for logs)


@dataclass(frozen=True)
class SiteData:
    """A site's data: the signature it offers and each hosted client's data, by client id."""

    spec: str
    signature: DataSignature
    clients: dict[int, SiteClient]

    def counts(self) -> dict[int, tuple[int, int]]:
        """(train, test) sample counts by client id."""
        return {cid: (len(c.train), len(c.test)) for cid, c in self.clients.items()}


@dataclass(frozen=True)
class SiteOptions:
    """The `key=value` options of a SPEC (see the module docstring)."""

    label: str = "label"
    client_column: str | None = None
    test_fraction: float = 0.2
    seed: int = 0
    shape: tuple[int, ...] | None = None
    num_classes: int | None = None
    classes: tuple[str, ...] | None = None
    lazy: str = "auto"  # one of LAZY
    cache: str | None = None


@dataclass(frozen=True)
class SiteSource:
    """A parsed SPEC: a PATH with options, or a DataProvider reference with its parameters."""

    target: str
    options: SiteOptions = field(default_factory=SiteOptions)
    provider_params: dict[str, Any] | None = None  # set when target is package.module:attr


# ------------------------------------------------------------------------------------------------------- the spec


def _split_items(spec: str) -> list[str]:
    """Comma-separated items; commas inside [], {} or quotes (a provider's YAML values) do not split."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(spec):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    items.append(spec[start:])
    return [item.strip() for item in items]


def parse_spec(spec: str) -> SiteSource:
    """SPEC parsed and checked (options' values and names); nothing is opened. SiteDataError on a bad SPEC."""
    if not isinstance(spec, str) or not spec.strip():
        raise SiteDataError("--data: empty; give a PATH or package.module:attr, then options key=value")
    items = _split_items(spec)
    target, rest = items[0], items[1:]
    if not target:
        raise SiteDataError(f"--data {spec!r}: the first item must be a PATH or package.module:attr")
    pairs: dict[str, str] = {}
    for item in rest:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SiteDataError(f"--data {target}: {item!r} is not an option key=value")
        if key in pairs:
            raise SiteDataError(f"--data {target}: option {key}= given twice")
        pairs[key] = value.strip()
    if _is_provider(target):
        seed = _int_option(target, "seed", pairs.pop("seed"), 0) if "seed" in pairs else 0
        params = {}
        for key, value in pairs.items():
            try:
                params[key] = yaml.safe_load(value) if value else ""
            except yaml.YAMLError:
                params[key] = value
        return SiteSource(target, SiteOptions(seed=seed), params)
    unknown = sorted(set(pairs) - set(OPTIONS))
    if unknown:
        raise SiteDataError(f"--data {target}: unknown option {unknown[0]}=; valid options: {', '.join(OPTIONS)}")
    return SiteSource(target, _options(target, pairs))


def _is_provider(target: str) -> bool:
    return bool(_PROVIDER.fullmatch(target)) and not Path(target).expanduser().exists()


def _options(target: str, pairs: dict[str, str]) -> SiteOptions:
    opts: dict[str, Any] = {}
    for key in ("label", "client_column"):
        if key in pairs:
            if not pairs[key]:
                raise SiteDataError(f"--data {target}: option {key}= needs a column name")
            opts[key] = pairs[key]
    if "lazy" in pairs:
        if pairs["lazy"].lower() not in LAZY:
            raise SiteDataError(f"--data {target}: option lazy={pairs['lazy']}: expected auto, true or false")
        opts["lazy"] = pairs["lazy"].lower()
    if "cache" in pairs:
        if not pairs["cache"]:
            raise SiteDataError(f"--data {target}: option cache= needs a directory")
        opts["cache"] = pairs["cache"]
    if "test_fraction" in pairs:
        raw = pairs["test_fraction"]
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not 0.0 <= value < 1.0:
            raise SiteDataError(f"--data {target}: option test_fraction={raw}: expected a number in [0, 1)")
        opts["test_fraction"] = value
    if "seed" in pairs:
        opts["seed"] = _int_option(target, "seed", pairs["seed"], 0)
    if "num_classes" in pairs:
        opts["num_classes"] = _int_option(target, "num_classes", pairs["num_classes"], 2)
    if "shape" in pairs:
        raw = pairs["shape"]
        dims = raw.lower().split("x")
        if not all(d.strip().isdigit() and int(d) > 0 for d in dims):
            raise SiteDataError(
                f"--data {target}: option shape={raw}: expected positive sizes joined by x, e.g. shape=1x28x28"
            )
        opts["shape"] = tuple(int(d) for d in dims)
    if "classes" in pairs:
        names = tuple(n.strip() for n in pairs["classes"].split("|"))
        if len(names) < 2 or any(not n for n in names) or len(set(names)) != len(names):
            raise SiteDataError(
                f"--data {target}: option classes={pairs['classes']}: expected two or more distinct names joined "
                "by |, in class order, e.g. classes=cat|dog|bird"
            )
        opts["classes"] = names
    options = SiteOptions(**opts)
    if options.classes is not None and options.num_classes is not None and options.num_classes < len(options.classes):
        raise SiteDataError(
            f"--data {target}: option num_classes={options.num_classes} is less than the {len(options.classes)} "
            "names of classes="
        )
    return options


def _int_option(target: str, key: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise SiteDataError(f"--data {target}: option {key}={raw}: expected an integer >= {minimum}")
    return value


# ---------------------------------------------------------------------------------------------------------- opening


def open_site(spec: str, client_ids: list[int]) -> SiteData:
    """The site's data for the agent's `client_ids` (see the module docstring); SiteDataError on any problem."""
    ids = sorted(int(c) for c in client_ids)
    if not ids:
        raise SiteDataError("--data: the agent hosts no clients")
    if len(set(ids)) != len(ids):
        raise SiteDataError(f"--data: client ids repeat: {client_ids}")
    source = parse_spec(spec)
    if source.provider_params is not None:
        return _open_provider(spec, source, ids)
    root = Path(source.target).expanduser()
    if not root.exists():
        raise SiteDataError(f"--data {source.target}: no such file or directory")
    opts = source.options
    entries = _entries(root, source.target, opts, ids)
    parts = [p for _, train, test in entries for p in (train, test) if p is not None]
    num_classes = _labels(parts, source.target, opts)
    _decode(parts, opts)
    feature_names = _features(parts, opts)
    input_shape = tuple(parts[0].x.shape[1:])
    for part in parts:
        if tuple(part.x.shape[1:]) != input_shape:
            raise SiteDataError(
                f"{part.source}: samples of shape {list(part.x.shape[1:])}, but {parts[0].source} has "
                f"{list(input_shape)}; every client of a site must have the same input shape"
            )
    try:
        signature = DataSignature(input_shape, num_classes, feature_names)
    except ValueError as err:
        raise SiteDataError(f"--data {source.target}: {err}") from None
    clients: dict[int, SiteClient] = {}
    for k, (cid, (name, train, test)) in enumerate(zip(ids, entries, strict=True)):
        if len(train) == 0:
            raise SiteDataError(f"{name}: no training samples")
        if test is None:
            train, test = _split(train, opts.test_fraction, opts.seed, k)
        clients[cid] = SiteClient(_dataset(train, num_classes), _dataset(test, num_classes), name)
    return SiteData(spec, signature, clients)


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids)) if len(ids) <= 6 else f"{ids[0]}..{ids[-1]}"


_Entry = tuple[str, Part, Part | None]


def _entries(root: Path, target: str, opts: SiteOptions, ids: list[int]) -> list[_Entry]:
    """(name, train, test or None) per client, in the site's order; the count checked against `ids` before any
    data file is read where the layout tells it (one entry per client)."""
    if root.is_file() or _is_client_dir(root):
        train, test = _read_entry(root, opts)
        entries = [(str(root), train, test)] if opts.client_column is None else _by_owner(root, train, test, opts)
        _check_count(target, [name for name, _, _ in entries], ids, opts)
        return entries
    if opts.client_column is not None:
        raise SiteDataError(
            f"--data {target}: option client_column= needs PATH to be one table or .npz file holding every client"
        )
    if not root.is_dir():  # a device, a socket, or a file whose suffix is no data format
        raise SiteDataError(
            f"--data {target}: {root} is neither a directory nor a data file (.npz, .npy pair directory, .csv, "
            ".parquet or an image folder)"
        )
    children = [p for p in sorted(root.iterdir(), key=lambda p: natural_key(p.name)) if not p.name.startswith(".")]
    if not children:
        raise SiteDataError(f"--data {target}: empty directory; expected one entry per client")
    _check_count(target, [str(c) for c in children], ids, opts)
    entries: list[_Entry] = []
    for child in children:
        if child.is_dir() and not _is_client_dir(child):
            raise SiteDataError(
                f"{child}: not a client's data: expected x.npy+y.npy, train/+test/, train.EXT+test.EXT or an image "
                "folder <class>/<image>"
            )
        train, test = _read_entry(child, opts)
        entries.append((str(child), train, test))
    return entries


def _check_count(target: str, names: list[str], ids: list[int], opts: SiteOptions) -> None:
    if len(names) == len(ids):
        return
    shown = ", ".join(Path(n).name if opts.client_column is None else n[n.rfind("[") + 1 : -1] for n in names[:5])
    raise SiteDataError(
        f"--data {target}: holds {len(names)} client(s) ({shown}{', ...' if len(names) > 5 else ''}) but the agent "
        f"hosts {len(ids)} (ids {_ids(ids)}); give one entry per client"
        + ("" if opts.client_column else ", or client_column= for one file holding every client")
    )


def _is_client_dir(path: Path) -> bool:
    if not path.is_dir():
        return False
    if (path / "x.npy").is_file() or (path / "y.npy").is_file():
        return True
    if (path / "train").is_dir() and (path / "test").is_dir():
        return True
    if any((path / f"train{s}").is_file() for s in _SPLIT_SUFFIXES):
        return True
    return _looks_like_image_folder(path)


def _looks_like_image_folder(path: Path) -> bool:
    """Every visible child is a folder, and the first file found in them is an image."""
    children = [p for p in path.iterdir() if not p.name.startswith(".")]
    if not children or not all(c.is_dir() for c in children):
        return False
    for child in children:
        for item in child.iterdir():
            if not item.name.startswith("."):
                return item.is_file() and item.suffix.lower() in IMAGE_SUFFIXES
    return True  # class folders, all empty


def _read_entry(path: Path, opts: SiteOptions) -> tuple[Part, Part | None]:
    if path.is_file():
        return _read_file(path, opts)
    if (path / "x.npy").is_file() or (path / "y.npy").is_file():
        _need(path, ("x.npy", "y.npy"))
        return read_npy_pair(path), None
    if (path / "train").is_dir() and (path / "test").is_dir():
        return _read_split_dir(path / "train"), _read_split_dir(path / "test")
    for suffix in _SPLIT_SUFFIXES:
        if (path / f"train{suffix}").is_file():
            _need(path, (f"train{suffix}", f"test{suffix}"))
            train, given = _read_file(path / f"train{suffix}", opts)
            test, given_test = _read_file(path / f"test{suffix}", opts)
            if given is not None or given_test is not None:
                raise SiteDataError(f"{path}: train{suffix} and test{suffix} must each hold keys x, y")
            return train, test
    scan = scan_image_folder(path)
    return Part(str(path), None, scan.names, images=scan), None


def _need(path: Path, names: tuple[str, ...]) -> None:
    for name in names:
        if not (path / name).is_file():
            raise SiteDataError(f"{path}: has {' / '.join(n for n in names if n != name)} but no {name}")


def _read_split_dir(path: Path) -> Part:
    if (path / "x.npy").is_file() or (path / "y.npy").is_file():
        _need(path, ("x.npy", "y.npy"))
        return read_npy_pair(path)
    scan = scan_image_folder(path)
    return Part(str(path), None, scan.names, images=scan)


def _read_file(path: Path, opts: SiteOptions) -> tuple[Part, Part | None]:
    suffix = path.suffix.lower()
    if suffix == ".npz":
        return read_npz(path, opts.client_column)
    if suffix in TABLE_SUFFIXES:
        if opts.lazy == "true" or (opts.lazy == "auto" and path.stat().st_size > LAZY_TABLE_BYTES):
            return stream_table(LazyTable(path, opts.label, opts.client_column, _cache_dir(opts))), None
        return read_table(path, opts.label, opts.client_column), None
    raise SiteDataError(f"{path}: not a site data file (expected .npz, .csv or .parquet, or a directory)")


def _cache_dir(opts: SiteOptions) -> Path:
    return Path(opts.cache or os.environ.get("FAIRFL_CACHE_DIR") or "~/.cache/fairfl/sites").expanduser()


def _by_owner(root: Path, train: Part, test: Part | None, opts: SiteOptions) -> list[_Entry]:
    """One file holding every client: rows grouped by the client column, values in natural sorted order."""
    if train.owners is None:
        raise SiteDataError(f"{root}: option client_column= applies to one table or .npz file holding every client")
    parts = [train] if test is None else [train, test]
    values = np.unique(np.concatenate([np.asarray(p.owners).astype(str) for p in parts]))
    order = sorted(values.tolist(), key=natural_key)
    entries = []
    split = [_owner_rows(p, order) for p in parts]
    for i, value in enumerate(order):
        name = f"{root} [{opts.client_column}={value}]"
        tr = _take(train, split[0][i], name)
        te = None if test is None else _take(test, split[1][i], name)
        entries.append((name, tr, te))
    return entries


def _owner_rows(part: Part, order: list[str]) -> list[np.ndarray]:
    """Row indices of each client value (in `order`), each in file order."""
    position = {value: i for i, value in enumerate(order)}
    uniq, inverse = np.unique(np.asarray(part.owners).astype(str), return_inverse=True)
    codes = np.asarray([position[v] for v in uniq.tolist()], dtype=np.int64)[inverse.reshape(-1)]
    by = np.argsort(codes, kind="stable")
    bounds = np.searchsorted(codes[by], np.arange(len(order) + 1))
    return [by[bounds[i] : bounds[i + 1]] for i in range(len(order))]


def _take(part: Part, rows: np.ndarray, name: str) -> Part:
    x = _select(part.x, rows)
    return Part(name, x, part.y[rows], part.feature_names, lazy_ok=part.lazy_ok, lazy_table=part.lazy_table)


def _select(x: Any, rows: np.ndarray) -> Any:
    """Rows of `x`: in memory a copy, on disk a LazyRows (of the memmap under `x` when it is one already)."""
    if isinstance(x, LazyRows):
        return LazyRows(x.base, x.rows[rows])
    return LazyRows(x, rows) if is_lazy(x) else x[rows]


# ----------------------------------------------------------------------------------------------------------- labels


def _labels(parts: list[Part], target: str, opts: SiteOptions) -> int:
    """Each part's labels as int64 class indices (in place); the site's class count."""
    candidates: list[int] = []
    image_names = sorted({n for p in parts if p.images is not None for n in p.images.class_names})
    mapping: dict[str, int] | None = None
    if opts.classes is not None:
        mapping = {name: i for i, name in enumerate(opts.classes)}
        candidates.append(len(opts.classes))
    elif image_names:
        if all(n.isdigit() for n in image_names):
            candidates.append(max(int(n) for n in image_names) + 1)
        else:
            mapping = {name: i for i, name in enumerate(image_names)}
            candidates.append(len(image_names))
    for part in parts:
        if part.images is not None or opts.classes is not None:
            part.y = _map_labels(part, mapping, opts)
        else:
            part.y = _integer_labels(part, opts)
        if len(part.y):
            candidates.append(int(part.y.max()) + 1)
    inferred = max(candidates, default=0)
    if opts.num_classes is not None:
        for part in parts:
            if len(part.y) and part.y.max() >= opts.num_classes:
                raise SiteDataError(
                    f"{part.source}: label {int(part.y.max())} is not below num_classes={opts.num_classes}"
                )
        return opts.num_classes
    if inferred < 2:
        raise SiteDataError(
            f"--data {target}: the labels only reach {inferred - 1}; give num_classes=K (the run's class count)"
        )
    return inferred


def _map_labels(part: Part, mapping: dict[str, int] | None, opts: SiteOptions) -> np.ndarray:
    raw = part.y
    if mapping is None:  # image folders named by integers
        return raw.astype(np.int64)
    if np.issubdtype(raw.dtype, np.floating):
        raw = _integral(part, raw).astype(np.int64)
    keys = raw.astype(str)
    uniq, inverse = np.unique(keys, return_inverse=True)
    codes = np.empty(len(uniq), dtype=np.int64)
    for i, key in enumerate(uniq.tolist()):  # per distinct label value, not per sample
        if key not in mapping:
            where = "class folder" if part.images is not None else "label"
            hint = f"classes={'|'.join(opts.classes)}" if opts.classes else "the site's class folders"
            raise SiteDataError(f"{part.source}: {where} {key!r} is not one of {hint}")
        codes[i] = mapping[key]
    return codes[inverse.reshape(-1)]


def _integer_labels(part: Part, opts: SiteOptions) -> np.ndarray:
    y = part.y
    if y.dtype.kind in "USO":
        label = f" (column {opts.label!r})" if part.feature_names is not None else ""
        sample = ", ".join(repr(v) for v in np.unique(y)[:3].tolist())
        raise SiteDataError(
            f"{part.source}: labels{label} are strings ({sample}, ...); give classes=A|B|C (the names in class "
            "order) or store class indices 0..K-1"
        )
    if y.dtype == np.bool_:
        return y.astype(np.int64)
    if np.issubdtype(y.dtype, np.floating):
        y = _integral(part, y)
    elif not np.issubdtype(y.dtype, np.integer):
        raise SiteDataError(f"{part.source}: labels must be integers, got dtype {y.dtype}")
    if len(y) and y.min() < 0:
        raise SiteDataError(f"{part.source}: label {int(y.min())} is negative; labels are class indices 0..K-1")
    return y.astype(np.int64)


def _integral(part: Part, y: np.ndarray) -> np.ndarray:
    bad = ~np.isfinite(y) | (y != np.round(y))
    if bad.any():
        raise SiteDataError(
            f"{part.source}: label {y[np.flatnonzero(bad)[0]].item()!r} is not an integer; labels are class "
            "indices 0..K-1"
        )
    return y


# --------------------------------------------------------------------------------------------------------- features


def _decode(parts: list[Part], opts: SiteOptions) -> None:
    """Decode image parts, all with one channel count: 1 if every image of the site is grayscale, else 3; into
    memory, or (lazy=true, or lazy=auto for a folder whose decoded float32 exceeds LAZY_TABLE_BYTES) into a cache
    served from disk (cache_images), with the same values."""
    scans = [p.images for p in parts if p.images is not None]
    if not scans:
        return
    channels = 1 if all(s.gray for s in scans) else 3
    sized = [s for s in scans if s.size is not None]
    for scan in sized[1:]:
        if scan.size != sized[0].size:
            raise SiteDataError(
                f"{scan.files[0]}: {scan.size[0]}x{scan.size[1]} pixels, but {sized[0].files[0]} is "
                f"{sized[0].size[0]}x{sized[0].size[1]}; every image of a site must have the same size (resize them)"
            )
    size = sized[0].size if sized else None
    for part in parts:
        if part.images is None:
            continue
        if part.images.size is None:
            if size is None:
                raise SiteDataError(f"{part.source}: no images in its class folders")
            part.x = np.empty((0, channels, size[1], size[0]), dtype=np.float32)
        elif opts.lazy == "true" or (opts.lazy == "auto" and _large_images(part.images, channels)):
            part.x = cache_images(part.images, channels, part.y, _cache_dir(opts), opts.classes)
            part.lazy_ok = True
        else:
            part.x = decode_images(part.images, channels)


def _large_images(scan: ImageScan, channels: int) -> bool:
    """Whether the scanned images decode to more float32 bytes than LAZY_TABLE_BYTES (sizes from the headers)."""
    assert scan.size is not None
    return len(scan.files) * scan.size[0] * scan.size[1] * channels * 4 > LAZY_TABLE_BYTES


def _features(parts: list[Part], opts: SiteOptions) -> tuple[str, ...] | None:
    """Features as float32 in one column order and shape (in place); the feature names when every part is a table."""
    tables = [p for p in parts if p.feature_names is not None]
    names = tables[0].feature_names if tables else None
    for part in tables[1:]:
        if part.feature_names == names:
            continue
        assert names is not None and part.feature_names is not None
        missing = [n for n in names if n not in part.feature_names]
        extra = [n for n in part.feature_names if n not in names]
        if missing or extra:
            what = "; ".join(
                [f"missing {', '.join(missing)}"] * bool(missing) + [f"extra {', '.join(extra)}"] * bool(extra)
            )
            raise SiteDataError(
                f"{part.source}: feature columns differ from {tables[0].source} ({what}); every table of a site "
                "needs the same feature columns"
            )
        if part.lazy_table is not None:  # on disk: a cache with the columns in this order (streamed once)
            base = stream_table(part.lazy_table, names).x
            part.x = LazyRows(base, part.x.rows) if isinstance(part.x, LazyRows) else base
        else:
            position = {n: i for i, n in enumerate(part.feature_names)}
            part.x = part.x[:, [position[n] for n in names]]
        part.feature_names = names
    for part in parts:
        x = part.x
        if not (part.lazy_ok and is_lazy(x)):
            x = np.asarray(x)
            if x.dtype != np.float32:
                x = x.astype(np.float32)
            if x.size and not np.isfinite(x).all():
                bad = int((~np.isfinite(x)).sum())
                raise SiteDataError(f"{part.source}: {bad} feature values are NaN or infinite")
        if opts.shape is not None:
            per_row = math.prod(x.shape[1:])
            if per_row != math.prod(opts.shape):
                raise SiteDataError(
                    f"{part.source}: option shape={'x'.join(map(str, opts.shape))} has {math.prod(opts.shape)} "
                    f"values per sample but the data has {per_row}"
                )
            if isinstance(x, LazyRows):
                x = LazyRows(x.base.reshape((len(x.base), *opts.shape)), x.rows)
            else:
                x = x.reshape((len(x), *opts.shape))
        part.x = x
    return names if names is not None and len(tables) == len(parts) else None


# ------------------------------------------------------------------------------------------------------------ split


def _split(part: Part, fraction: float, seed: int, k: int) -> tuple[Part, Part]:
    """A random `fraction` of `part`'s rows as test, the rest train, both in file order (module docstring)."""
    n = len(part)
    n_test = round(n * fraction)
    if fraction > 0 and n >= 2:
        n_test = min(max(n_test, 1), n - 1)
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(k,)))
    is_test = np.zeros(n, dtype=bool)
    is_test[rng.permutation(n)[:n_test]] = True
    test_rows, train_rows = np.flatnonzero(is_test), np.flatnonzero(~is_test)
    return _rows(part, train_rows), _rows(part, test_rows)


def _rows(part: Part, rows: np.ndarray) -> Part:
    return Part(part.source, _select(part.x, rows), part.y[rows], part.feature_names)


def _dataset(part: Part, num_classes: int) -> ArrayDataset:
    try:
        return ArrayDataset(part.x, np.ascontiguousarray(part.y, dtype=np.int64), num_classes, f"site:{part.source}")
    except ValueError as err:
        raise SiteDataError(f"{part.source}: {err}") from None


# -------------------------------------------------------------------------------------------------------- providers


def _open_provider(spec: str, source: SiteSource, ids: list[int]) -> SiteData:
    target = source.target
    try:
        plugin = resolve_dataset(target, "--data")
    except ConfigError as err:
        raise SiteDataError(str(err)) from None
    if isinstance(plugin, Dataset) or not isinstance(plugin, DataProvider):
        raise SiteDataError(
            f"--data {target}: is a central Dataset, not a DataProvider; a site serves a DataProvider's clients or "
            "its own files"
        )
    try:
        params = parse_params(
            getattr(plugin, "Params", NoParams), source.provider_params or {}, f"--data {target} params"
        )
        signature = dataset_signature_of(plugin, params, f"--data {target}")
        data = plugin.clients(params, DataRequest(num_clients=len(ids), seed=source.options.seed))
    except ConfigError as err:
        raise SiteDataError(str(err)) from None
    except Exception as err:  # a user's plug-in: one line saying which and why
        raise SiteDataError(f"--data {target}: clients() failed: {type(err).__name__}: {err}") from None
    if not isinstance(data, FederatedData) or data.num_clients != len(ids):
        got = data.num_clients if isinstance(data, FederatedData) else type(data).__name__
        raise SiteDataError(f"--data {target}: clients() returned {got} clients for the agent's {len(ids)}")
    clients: dict[int, SiteClient] = {}
    for k, cid in enumerate(ids):
        train, test = data.client_train(k), data.client_test(k)
        for split, ds in (("train", train), ("test", test)):
            if ds.input_shape != signature.input_shape or ds.num_classes > signature.num_classes:
                raise SiteDataError(
                    f"--data {target}: client {k} {split} data has shape {list(ds.input_shape)} and "
                    f"{ds.num_classes} classes, but the signature declares {list(signature.input_shape)} and "
                    f"{signature.num_classes}"
                )
        clients[cid] = SiteClient(train, test, f"{target} client {k}")
    return SiteData(spec, signature, clients)


# --------------------------------------------------------------------------------------------------------- plug-in


@dataclass(frozen=True)
class SiteParams:
    """`data.params` of `site`: the signature every site must offer (the model is built from it)."""

    input_shape: tuple[int, ...] = ()
    num_classes: int = 0
    feature_names: tuple[str, ...] | None = None

    def validate(self, path: str) -> None:
        if not self.input_shape or any(d < 1 for d in self.input_shape):
            raise ConfigError(
                f"{path}.input_shape: the shape of one sample, e.g. [1, 28, 28] or [64]; got {list(self.input_shape)}"
            )
        if self.num_classes < 2:
            raise ConfigError(f"{path}.num_classes: the run's class count (>= 2), got {self.num_classes}")
        if self.feature_names is not None and len(self.feature_names) != math.prod(self.input_shape):
            raise ConfigError(
                f"{path}.feature_names: {len(self.feature_names)} names for {math.prod(self.input_shape)} features"
            )


class Site(DataProvider):
    """The data is at the sites: each agent serves its own (`fairfl serve agent --data SPEC`); see open_site."""

    Params = SiteParams
    at_sites: ClassVar[bool] = True

    def signature(self, params: Any) -> DataSignature:
        return DataSignature(params.input_shape, params.num_classes, params.feature_names)

    def clients(self, params: Any, request: DataRequest) -> FederatedData:
        raise PluginError(
            "data.dataset 'site': the data is at the sites; agents serve it with `fairfl serve agent --data SPEC`; "
            "the in-process transport has no sites"
        )

    def __repr__(self) -> str:
        return "Site()"


SITE = Site()
