"""A site's own data (fairfl.data.site, fairfl.data.lazy): every SPEC format round-trips real data (Fashion-MNIST,
scikit-learn's digits and wine) written here into tmp_path, splits are deterministic per seed, lazy `.npy` rows are
read without mapping the file, and every bad SPEC is one SiteDataError naming the path and the option."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from sklearn.datasets import load_digits, load_wine

from fairfl.api import SiteDataError, open_site
from fairfl.data import DATASETS, DataRequest, load_dataset, parse_idx, run_signature
from fairfl.data.datasets import DEBIAN_FASHION_MNIST_DIR, FASHION_MNIST
from fairfl.data.lazy import LazyRows, gather_rows, is_lazy, iter_row_chunks, materialize
from fairfl.data.plugin import DataProvider, Dataset, dataset_params
from fairfl.data.site import SITE, parse_spec
from fairfl.data.synthetic import SYNTHETIC
from fairfl.plugins import PluginError
from fairfl.schema import ConfigError

FMNIST = DEBIAN_FASHION_MNIST_DIR
needs_fmnist = pytest.mark.skipif(
    not (FMNIST / "train-images-idx3-ubyte.gz").is_file(),
    reason=f"Fashion-MNIST files absent from {FMNIST} (Debian package dataset-fashion-mnist)",
)


@pytest.fixture(scope="module")
def fmnist() -> tuple[np.ndarray, np.ndarray]:
    """The first 300 Fashion-MNIST test images as loaded by fairfl (normalised float32 (N,1,28,28)) and labels."""
    ds = load_dataset("fashion_mnist", "test")
    return np.array(ds.x[:300]), np.array(ds.y[:300])


@pytest.fixture(scope="module")
def fmnist_pixels() -> tuple[np.ndarray, np.ndarray]:
    """The first 120 raw Fashion-MNIST test images, uint8 (N, 28, 28), and their labels."""
    images = parse_idx(gzip.decompress((FMNIST / "t10k-images-idx3-ubyte.gz").read_bytes()))
    labels = parse_idx(gzip.decompress((FMNIST / "t10k-labels-idx1-ubyte.gz").read_bytes()))
    return np.array(images[:120]), np.array(labels[:120]).astype(np.int64)


def digits() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    return x, y.astype(np.int64)


def feature_table(x: np.ndarray, y: np.ndarray, names: list[str], **extra: np.ndarray) -> pa.Table:
    return pa.table({**{n: x[:, i] for i, n in enumerate(names)}, "label": y, **extra})


# ------------------------------------------------------------------------------------------------------------ lazy


def save_npy(path: Path, array: np.ndarray) -> np.memmap:
    np.save(path, array)
    return np.load(path, mmap_mode="r")


def test_gather_rows_equals_in_memory_indexing(tmp_path: Path) -> None:
    a = np.random.default_rng(0).standard_normal((500, 3, 4)).astype(np.float32)
    m = save_npy(tmp_path / "a.npy", a)
    assert is_lazy(m) and not is_lazy(a) and not is_lazy(m[np.array([1, 2])])
    idx = np.array([5, 3, 4, 499, -1, 3, 0, 1, 2, 250])  # unsorted, repeated, negative
    got = gather_rows(m, idx)
    assert type(got) is np.ndarray and got.flags.writeable and np.array_equal(got, a[idx])
    assert np.array_equal(gather_rows(m, np.arange(100, 200)), a[100:200])
    assert gather_rows(m, np.array([], dtype=np.int64)).shape == (0, 3, 4)
    # views of the mapping: a row slice, a reshape, a strided and a column view (the last two fall back to numpy)
    assert np.array_equal(gather_rows(m[100:300], np.array([0, 199, 5])), a[100:300][[0, 199, 5]])
    assert np.array_equal(gather_rows(m.reshape(500, 12), idx), a.reshape(500, 12)[idx])
    assert np.array_equal(gather_rows(m[::3], np.array([4, 1])), a[::3][[4, 1]])
    assert np.array_equal(gather_rows(m[:, 1], idx), a[:, 1][idx])
    assert np.array_equal(gather_rows(a, idx), a[idx])
    with pytest.raises(IndexError):
        gather_rows(m, np.array([500]))
    with pytest.raises(IndexError):
        gather_rows(m, np.array([-501]))


def test_iter_row_chunks_and_lazy_rows(tmp_path: Path) -> None:
    a = np.arange(700 * 5, dtype=np.float32).reshape(700, 5)
    m = save_npy(tmp_path / "a.npy", a)
    chunks = list(iter_row_chunks(m, 128))
    assert [len(c) for c in chunks] == [128] * 5 + [60]
    assert np.array_equal(np.concatenate(chunks), a)
    assert all(np.shares_memory(c, a) for c in iter_row_chunks(a, 300))  # in memory: views, no copies
    rows = np.array([9, 8, 7, 1, 650])
    lazy = LazyRows(m, rows)
    assert is_lazy(lazy) and lazy.shape == (5, 5) and len(lazy) == 5 and lazy.dtype == np.float32
    assert np.array_equal(lazy[[4, 0]], a[[650, 9]])
    assert np.array_equal(lazy[1:3], a[[8, 7]])
    assert np.array_equal(lazy[-1], a[650])
    assert np.array_equal(lazy[:, 2], a[rows, 2])
    assert np.array_equal(np.asarray(lazy), a[rows])
    assert np.array_equal(np.concatenate(list(iter_row_chunks(lazy, 2))), a[rows])
    assert np.array_equal(gather_rows(lazy, np.array([3, 3])), a[[1, 1]])


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 64),
    width=st.integers(1, 7),
    picks=st.lists(st.integers(0, 10_000), max_size=40),
)
def test_gather_rows_matches_indexing_property(
    tmp_path_factory: pytest.TempPathFactory, rows: int, width: int, picks: list[int]
) -> None:
    a = np.random.default_rng(rows * 31 + width).standard_normal((rows, width)).astype(np.float32)
    m = save_npy(tmp_path_factory.mktemp("prop") / "a.npy", a)
    idx = np.asarray([p % (2 * rows) - rows for p in picks], dtype=np.int64)  # negatives too
    assert np.array_equal(gather_rows(m, idx), a[idx])
    assert np.array_equal(gather_rows(LazyRows(m, np.arange(rows)[::-1]), idx), a[::-1][idx])


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux /proc")
def test_gather_rows_does_not_map_the_file(tmp_path: Path) -> None:
    """Reading every row of a 200 MB .npy through gather_rows / iter_row_chunks leaves RSS where it was; reading it
    through the mapping would add the file's size."""
    n, width = 200_000, 256  # 200_000 x 256 float32 = 204.8 MB
    path = tmp_path / "big.npy"
    block = np.random.default_rng(0).standard_normal((10_000, width)).astype(np.float32)
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": "<f4", "fortran_order": False, "shape": (n, width)})
        for _ in range(n // len(block)):
            fh.write(block.tobytes())
    m = np.load(path, mmap_mode="r")
    before = rss_bytes()
    total = 0.0
    for chunk in iter_row_chunks(m, 8192):
        total += float(chunk[:, 0].sum())
    rng = np.random.default_rng(1)
    for _ in range(20):
        batch = gather_rows(m, rng.integers(0, n, 512))
        assert batch.shape == (512, width)
    assert np.array_equal(gather_rows(m, np.array([0, 10_000, n - 1])), block[[0, 0, -1]])
    grown = rss_bytes() - before
    assert grown < 40e6, f"RSS grew by {grown / 1e6:.0f} MB reading a {path.stat().st_size / 1e6:.0f} MB file"
    assert total == pytest.approx(float(block[:, 0].sum()) * (n // len(block)), rel=1e-3)
    # the measure can see a mapping: summing through the memmap maps the pages
    mapped = float(np.asarray(m[: n // 2]).sum())
    assert rss_bytes() - before > 80e6 and np.isfinite(mapped)


# -------------------------------------------------------------------------------------------------- Fashion-MNIST


@needs_fmnist
def test_npz_files_round_trip(tmp_path: Path, fmnist: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = fmnist
    site = tmp_path / "site"
    site.mkdir()
    np.savez(site / "client1.npz", x=x[:100], y=y[:100])
    np.savez(site / "client2.npz", x_train=x[100:180], y_train=y[100:180], x_test=x[180:200], y_test=y[180:200])
    np.savez(site / "client10.npz", x=x[200:].reshape(100, 784).astype(np.float64), y=y[200:].astype(np.int32))
    data = open_site(f"{site},shape=1x28x28,test_fraction=0.25", [42, 7, 9])
    assert data.signature.input_shape == (1, 28, 28) and data.signature.num_classes == 10
    assert data.signature.feature_names is None
    # natural order: client1, client2, client10 -> ids 7, 9, 42
    assert [Path(c.source).name for c in (data.clients[7], data.clients[9], data.clients[42])] == [
        "client1.npz",
        "client2.npz",
        "client10.npz",
    ]
    assert data.counts() == {7: (75, 25), 9: (80, 20), 42: (75, 25)}
    c9 = data.clients[9]
    assert np.array_equal(c9.train.x, x[100:180]) and np.array_equal(c9.test.y, y[180:200])
    for cid, k, lo in ((7, 0, 0), (42, 2, 200)):  # k: the position in the site's order seeds the split
        mask = test_mask(100, 0.25, 0, k)
        c = data.clients[cid]
        assert np.array_equal(c.train.x, x[lo : lo + 100][~mask]) and np.array_equal(c.test.x, x[lo : lo + 100][mask])
        assert np.array_equal(c.train.y, y[lo : lo + 100][~mask]) and np.array_equal(c.test.y, y[lo : lo + 100][mask])
        assert c.train.x.dtype == np.float32 and c.train.y.dtype == np.int64 and not is_lazy(c.train.x)


@needs_fmnist
def test_npy_pairs_are_lazy_and_round_trip(tmp_path: Path, fmnist: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = fmnist
    site = tmp_path / "site"
    (site / "a" / "train").mkdir(parents=True)
    (site / "a" / "test").mkdir()
    (site / "b").mkdir()
    np.save(site / "a" / "train" / "x.npy", x[:150])
    np.save(site / "a" / "train" / "y.npy", y[:150])
    np.save(site / "a" / "test" / "x.npy", x[150:200])
    np.save(site / "a" / "test" / "y.npy", y[150:200])
    np.save(site / "b" / "x.npy", x[200:])
    np.save(site / "b" / "y.npy", y[200:])
    data = open_site(str(site), [0, 1])
    a, b = data.clients[0], data.clients[1]
    assert isinstance(a.train.x, np.memmap) and is_lazy(a.train.x) and is_lazy(a.test.x)
    assert np.array_equal(gather_rows(a.train.x, np.arange(150)), x[:150])
    assert np.array_equal(materialize(a.test.x), x[150:200]) and np.array_equal(a.test.y, y[150:200])
    assert isinstance(b.train.x, LazyRows) and is_lazy(b.test.x)
    assert data.counts()[1] == (80, 20)
    rows = np.sort(np.concatenate([b.train.x.rows, b.test.x.rows]))
    assert np.array_equal(rows, np.arange(100))  # disjoint and complete
    assert np.array_equal(materialize(b.train.x), x[200:][b.train.x.rows])
    assert np.array_equal(b.test.y, y[200:][b.test.x.rows])
    assert np.array_equal(b.train.subset(np.array([3, 0])).x, x[200:][b.train.x.rows[[3, 0]]])


@needs_fmnist
def test_image_folders_decode_grayscale(tmp_path: Path, fmnist_pixels: tuple[np.ndarray, np.ndarray]) -> None:
    pixels, labels = fmnist_pixels
    site = tmp_path / "site"
    for k, (lo, hi) in enumerate(((0, 60), (60, 120))):
        for split, (a, b) in (("train", (lo, lo + 45)), ("test", (lo + 45, hi))):
            for i in range(a, b):
                folder = site / f"client{k}" / split / str(labels[i])
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(pixels[i], mode="L").save(folder / f"{i:04d}.png")
    data = open_site(str(site), [0, 1])
    # integer class folders are the labels; num_classes from the largest one seen
    assert data.signature.input_shape == (1, 28, 28)
    assert data.signature.num_classes == int(labels.max()) + 1
    train = data.clients[1].train
    files = sorted_files(site / "client1" / "train")
    idx = np.array([int(Path(p).stem) for p in files])
    expected = pixels[idx].astype(np.float32)[:, None] * np.float32(1 / 255)
    assert np.array_equal(train.x, expected) and np.array_equal(train.y, labels[idx])
    assert len(train) == 45 and train.x.min() >= 0 and train.x.max() <= 1


def sorted_files(split_dir: Path) -> list[Path]:
    """The images of an image folder in open_site's order: class folders, then files, each in natural order."""
    from fairfl.data.site_formats import natural_key

    folders = sorted(split_dir.iterdir(), key=lambda p: natural_key(p.name))
    return [f for d in folders for f in sorted(d.iterdir(), key=lambda p: natural_key(p.name))]


@needs_fmnist
def test_image_folders_rgb_named_classes_and_size_errors(
    tmp_path: Path, fmnist_pixels: tuple[np.ndarray, np.ndarray]
) -> None:
    pixels, labels = fmnist_pixels
    names = ["tshirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]
    site = tmp_path / "rgb"
    for i in range(40):
        folder = site / names[labels[i]]
        folder.mkdir(parents=True, exist_ok=True)
        g = pixels[i]
        rgb = np.stack([g, 255 - g, g // 2], axis=-1)
        Image.fromarray(rgb, mode="RGB").save(folder / f"{i}.png")
    data = open_site(f"{site},test_fraction=0", [5])
    sig = data.signature
    present = sorted({names[v] for v in labels[:40]})
    assert sig.input_shape == (3, 28, 28) and sig.num_classes == len(present)  # sorted folder names -> 0..K-1
    c = data.clients[5]
    assert len(c.test) == 0 and len(c.train) == 40
    first = sorted_files(site)[0]
    i = int(first.stem)
    assert np.array_equal(c.train.x[0, 1], (255 - pixels[i]).astype(np.float32) * np.float32(1 / 255))
    assert c.train.y[0] == present.index(first.parent.name)
    # classes= fixes the order across sites
    fixed = open_site(f"{site},classes={'|'.join(names)}", [0])
    assert fixed.signature.num_classes == 10
    ds = fixed.clients[0]
    assert set(np.concatenate([ds.train.y, ds.test.y]).tolist()) == set(labels[:40].tolist())
    # a differently sized image is named
    odd = site / names[labels[0]] / "odd.png"
    Image.fromarray(np.zeros((20, 28), dtype=np.uint8), mode="L").save(odd)
    with pytest.raises(SiteDataError, match=r"odd\.png: 28x20 pixels.*same size"):
        open_site(str(site), [0])


# ----------------------------------------------------------------------------------------------------------- tables


def test_csv_directory_round_trips_digits(tmp_path: Path) -> None:
    x, y = digits()
    names = [f"px{i}" for i in range(64)]
    site = tmp_path / "csv"
    site.mkdir()
    for k in range(3):
        rows = slice(k * 300, (k + 1) * 300)
        pacsv.write_csv(feature_table(x[rows], y[rows], names), site / f"site{k}.csv")
    data = open_site(f"{site},seed=3", [0, 1, 2])
    assert data.signature.input_shape == (64,) and data.signature.feature_names == tuple(names)
    assert data.signature.num_classes == 10
    c, mask = data.clients[2], test_mask(300, 0.2, 3, 2)
    assert np.array_equal(c.train.x, x[600:900][~mask].astype(np.float32))
    assert np.array_equal(c.test.x, x[600:900][mask].astype(np.float32)) and np.array_equal(c.test.y, y[600:900][mask])


def test_mask_helper_matches_documented_rng() -> None:
    # the split documented in fairfl.data.site: SeedSequence(seed, spawn_key=(k,)), permutation, first n_test rows
    m = test_mask(10, 0.3, 0, 0)
    assert m.sum() == 3


def test_mask(n: int, fraction: float, seed: int, k: int) -> np.ndarray:
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(k,)))
    mask = np.zeros(n, dtype=bool)
    mask[rng.permutation(n)[: min(max(round(n * fraction), 1), n - 1)]] = True
    return mask


test_mask.__test__ = False  # type: ignore[attr-defined]


def test_parquet_one_file_with_client_column_row_groups(tmp_path: Path) -> None:
    wine = load_wine()
    x, y = wine.data, wine.target.astype(np.int64)
    names = [n.replace("/", "_") for n in wine.feature_names]
    hospital = np.array([f"hospital{i % 3 + 1}" if i % 7 else "hospital10" for i in range(len(y))])
    table = pa.table({"hospital": hospital, "class": y, **{n: x[:, i] for i, n in enumerate(names)}})
    path = tmp_path / "wine.parquet"
    pq.write_table(table, path, row_group_size=40)  # several row groups
    assert pq.ParquetFile(path).num_row_groups > 1
    data = open_site(f"{path},label=class,client_column=hospital,test_fraction=0.1", [3, 1, 2, 4])
    assert data.signature.feature_names == tuple(names) and data.signature.input_shape == (13,)
    # natural order of the values: hospital1, hospital2, hospital3, hospital10 -> ids 1, 2, 3, 4
    for cid, value in zip((1, 2, 3, 4), ("hospital1", "hospital2", "hospital3", "hospital10"), strict=True):
        rows = np.flatnonzero(hospital == value)
        c = data.clients[cid]
        assert c.source.endswith(f"[hospital={value}]")
        assert len(c.train) + len(c.test) == len(rows)
        pooled = np.concatenate([c.train.x, c.test.x])
        want = x[rows].astype(np.float32)
        assert np.array_equal(np.sort(pooled, axis=0), np.sort(want, axis=0))
        assert np.array_equal(np.sort(np.concatenate([c.train.y, c.test.y])), np.sort(y[rows]))


def test_tables_with_different_column_order_and_string_labels(tmp_path: Path) -> None:
    x, y = digits()
    names = [f"f{i}" for i in range(64)]
    site = tmp_path / "mixed"
    site.mkdir()
    pq.write_table(feature_table(x[:200], y[:200], names), site / "a.parquet")
    reordered = pa.table({**{n: x[200:400, i] for i, n in reversed(list(enumerate(names)))}, "label": y[200:400]})
    pacsv.write_csv(reordered, site / "b.csv")
    data = open_site(f"{site},test_fraction=0", [0, 1])
    assert np.array_equal(data.clients[1].train.x, x[200:400].astype(np.float32))  # back in the first table's order
    # string labels need classes=
    words = np.array(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"])
    pacsv.write_csv(feature_table(x[:50], words[y[:50]], names), tmp_path / "words.csv")
    with pytest.raises(SiteDataError, match=r"words\.csv: labels \(column 'label'\) are strings.*classes="):
        open_site(str(tmp_path / "words.csv"), [0])
    data = open_site(f"{tmp_path / 'words.csv'},classes={'|'.join(words)},test_fraction=0", [0])
    assert np.array_equal(data.clients[0].train.y, y[:50]) and data.signature.num_classes == 10


def test_fewer_classes_than_the_run_is_normal(tmp_path: Path) -> None:
    x, y = digits()
    keep = y < 3
    pq.write_table(feature_table(x[keep], y[keep], [f"f{i}" for i in range(64)]), tmp_path / "t.parquet")
    assert open_site(str(tmp_path / "t.parquet"), [0]).signature.num_classes == 3
    data = open_site(f"{tmp_path / 't.parquet'},num_classes=10", [0])
    assert data.signature.num_classes == 10 and data.clients[0].train.num_classes == 10
    with pytest.raises(SiteDataError, match=r"t\.parquet: label 2 is not below num_classes=2"):
        open_site(f"{tmp_path / 't.parquet'},num_classes=2", [0])


# ----------------------------------------------------------------------------------------------------------- splits


def test_splits_are_deterministic_per_seed(tmp_path: Path) -> None:
    x, y = digits()
    site = tmp_path / "npz"
    site.mkdir()
    for k in range(2):
        np.savez(site / f"c{k}.npz", x=x[k * 500 : (k + 1) * 500], y=y[k * 500 : (k + 1) * 500])

    def test_rows(spec: str) -> list[np.ndarray]:
        data = open_site(spec, [0, 1])
        return [data.clients[c].test.x for c in (0, 1)]

    a, b = test_rows(f"{site},seed=5"), test_rows(f"{site},seed=5")
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    c = test_rows(f"{site},seed=6")
    assert not np.array_equal(a[0], c[0])
    assert not np.array_equal(test_mask(500, 0.2, 5, 0), test_mask(500, 0.2, 5, 1))  # each client its own draw
    assert np.array_equal(a[0], x[:500][test_mask(500, 0.2, 5, 0)].astype(np.float32))
    data = open_site(f"{site},seed=5,test_fraction=0.3", [0, 1])
    mask = test_mask(500, 0.3, 5, 1)
    assert np.array_equal(data.clients[1].test.x, x[500:1000][mask].astype(np.float32))
    assert np.array_equal(data.clients[1].train.y, y[500:1000][~mask])


# -------------------------------------------------------------------------------------------------------- providers


def test_a_data_provider_by_reference() -> None:
    data = open_site("fairfl.data.synthetic:SYNTHETIC,alpha=0.5,beta=0.25,seed=4", [10, 11, 12])
    expected = SYNTHETIC.clients(SYNTHETIC.Params(alpha=0.5, beta=0.25), DataRequest(num_clients=3, seed=4))
    assert data.signature == SYNTHETIC.signature(None)
    for k, cid in enumerate((10, 11, 12)):
        assert np.array_equal(data.clients[cid].train.x, expected.client_train(k).x)
        assert np.array_equal(data.clients[cid].test.y, expected.client_test(k).y)
    with pytest.raises(SiteDataError, match=r"--data fairfl\.data\.synthetic:SYNTHETIC params\.alpha"):
        open_site("fairfl.data.synthetic:SYNTHETIC,alpha=x", [0])
    with pytest.raises(SiteDataError, match=r"unknown parameter 'gamma'"):
        open_site("fairfl.data.synthetic:SYNTHETIC,gamma=1", [0])
    with pytest.raises(SiteDataError, match=r"central Dataset, not a DataProvider"):
        open_site("fairfl.data.datasets:FASHION_MNIST", [0])
    with pytest.raises(SiteDataError, match=r"fairfl\.data\.nowhere"):
        open_site("fairfl.data.nowhere:THING", [0])
    with pytest.raises(SiteDataError, match=r"the data is at the sites"):
        open_site("fairfl.data.site:SITE,input_shape=[4],num_classes=2", [0])


# ---------------------------------------------------------------------------------------------------------- plug-in


def test_site_plugin_declares_the_signature_and_builds_nothing() -> None:
    assert DATASETS.load("site", "data.dataset") is SITE
    assert SITE.at_sites is True and isinstance(SITE, DataProvider)
    assert FASHION_MNIST.at_sites is False and SYNTHETIC.at_sites is False and Dataset.at_sites is False
    params = dataset_params(
        SITE, {"input_shape": [13], "num_classes": 3, "feature_names": [f"f{i}" for i in range(13)]}
    )
    sig = SITE.signature(params)
    assert sig.input_shape == (13,) and sig.num_classes == 3 and sig.feature_names[-1] == "f12"
    with pytest.raises(PluginError, match=r"fairfl serve agent --data SPEC"):
        SITE.clients(params, DataRequest(num_clients=2))
    with pytest.raises(ConfigError, match=r"data\.params\.input_shape"):
        dataset_params(SITE, {"num_classes": 3})
    with pytest.raises(ConfigError, match=r"data\.params\.num_classes"):
        dataset_params(SITE, {"input_shape": [4]})
    with pytest.raises(ConfigError, match=r"data\.params\.feature_names: 2 names for 4 features"):
        dataset_params(SITE, {"input_shape": [4], "num_classes": 2, "feature_names": ["a", "b"]})


def test_run_signature_of_a_site_run_opens_nothing() -> None:
    from fairfl.config import experiment_from_dict

    config = experiment_from_dict(
        {"data": {"dataset": "site", "num_clients": 20, "params": {"input_shape": [1, 28, 28], "num_classes": 10}}}
    )
    assert run_signature(config).input_shape == (1, 28, 28)


# ------------------------------------------------------------------------------------------------------- bad specs


def test_bad_specs_name_the_path_and_the_option(tmp_path: Path) -> None:
    x, y = digits()
    names = [f"f{i}" for i in range(64)]
    good = tmp_path / "good.csv"
    pacsv.write_csv(feature_table(x[:60], y[:60], names), good)
    text = pa.table({"f0": x[:5, 0], "colour": ["red"] * 5, "label": y[:5]})
    pacsv.write_csv(text, tmp_path / "text.csv")
    nulls = pa.table({"f0": pa.array([1.0, None, 2.0]), "label": [0, 1, 1]})
    pq.write_table(nulls, tmp_path / "nulls.parquet")
    np.savez(tmp_path / "keys.npz", a=x[:5], b=y[:5])
    np.savez(tmp_path / "neg.npz", x=x[:5], y=np.array([0, 1, -1, 0, 1]))
    np.savez(tmp_path / "frac.npz", x=x[:5], y=np.array([0, 1.5, 1, 0, 1]))
    (tmp_path / "half").mkdir()
    np.save(tmp_path / "half" / "x.npy", x[:5].astype(np.float32))
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "empty").mkdir()
    two = tmp_path / "two"
    two.mkdir()
    for k in range(2):
        pacsv.write_csv(feature_table(x[:20], y[:20], names), two / f"c{k}.csv")
    cases = {
        f"{tmp_path}/missing.csv": r"missing\.csv: no such file or directory",
        f"{good},label=target": r"good\.csv: no label column 'target'.*label=COLUMN",
        f"{good},test_fraction=1": r"good\.csv: option test_fraction=1: expected a number in \[0, 1\)",
        f"{good},test_fraction=abc": r"option test_fraction=abc",
        f"{good},seed=-1": r"option seed=-1: expected an integer >= 0",
        f"{good},num_classes=1": r"option num_classes=1: expected an integer >= 2",
        f"{good},shape=8x0": r"option shape=8x0",
        f"{good},shape=3x3": r"good\.csv: option shape=3x3 has 9 values per sample but the data has 64",
        f"{good},classes=a": r"option classes=a: expected two or more distinct names",
        f"{good},colour=red": r"unknown option colour=; valid options: label, client_column",
        f"{good},label=label,label=x": r"option label= given twice",
        f"{good},oops": r"'oops' is not an option key=value",
        f"{good},client_column=site": r"good\.csv: client_column=site: no such column",
        f"{good},classes=a|b": r"good\.csv: label '0' is not one of classes=a\|b",
        str(tmp_path / "text.csv"): r"text\.csv: feature column 'colour' is string, not numeric",
        str(tmp_path / "nulls.parquet"): r"nulls\.parquet: feature column 'f0' has 1 missing values",
        str(tmp_path / "keys.npz"): r"keys\.npz: expected keys x, y or x_train.*found a, b",
        str(tmp_path / "neg.npz"): r"neg\.npz: label -1 is negative",
        str(tmp_path / "frac.npz"): r"frac\.npz: label 1\.5 is not an integer",
        str(tmp_path / "half"): r"half: has x\.npy but no y\.npy",
        str(tmp_path / "notes.txt"): r"notes\.txt: not a site data file",
        str(tmp_path / "empty"): r"empty: empty directory",
        str(two): r"two: holds 2 client\(s\) \(.*c0\.csv.*\) but the agent hosts 1 \(ids 0\)",
        f"{two},client_column=site": r"two: option client_column= needs PATH to be one table or \.npz file",
        f"{good},client_column=f5": r"good\.csv: holds 16 client\(s\) \(f5=0, f5=1, .*\) but the agent hosts 1",
        "": r"--data: empty",
    }
    for spec, pattern in cases.items():
        with pytest.raises(SiteDataError, match=pattern):
            open_site(spec, [0])
    with pytest.raises(SiteDataError, match=r"client ids repeat"):
        open_site(str(good), [1, 1])
    assert parse_spec(f"{good},shape=1X8x8").options.shape == (1, 8, 8)


# ------------------------------------------------------------------------------------------------------ lazy tables


def same_clients(lazy_spec: str, memory_spec: str, ids: list[int]) -> dict[int, object]:
    """Open a site both ways; every client's arrays are bit-identical, the lazy one's features on disk."""
    lazy, memory = open_site(lazy_spec, ids), open_site(memory_spec, ids)
    assert lazy.signature == memory.signature and lazy.counts() == memory.counts()
    for cid in ids:
        for split in ("train", "test"):
            a, b = getattr(lazy.clients[cid], split), getattr(memory.clients[cid], split)
            assert is_lazy(a.x) and not is_lazy(b.x) and a.x.shape == b.x.shape
            got = materialize(a.x)
            assert got.dtype == b.x.dtype == np.float32 and got.tobytes() == b.x.tobytes()
            assert a.y.dtype == b.y.dtype == np.int64 and np.array_equal(a.y, b.y)
    return lazy.clients


def test_lazy_tables_equal_the_in_memory_path(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    x, y = digits()
    names = [f"px{i}" for i in range(64)]
    site = tmp_path / "digits"
    site.mkdir()
    pq.write_table(feature_table(x[:700], y[:700], names), site / "a.parquet", row_group_size=64)
    pacsv.write_csv(feature_table(x[700:1200], y[700:1200], names), site / "b.csv")
    split = site / "c"  # a given split, its test table's columns in another order (re-streamed in the site's order)
    split.mkdir()
    pq.write_table(feature_table(x[1200:1500], y[1200:1500], names), split / "train.parquet", row_group_size=100)
    reordered = pa.table({**{n: x[1500:, i] for i, n in reversed(list(enumerate(names)))}, "label": y[1500:]})
    pq.write_table(reordered, split / "test.parquet")
    clients = same_clients(
        f"{site},seed=4,shape=1x8x8,lazy=true,cache={cache}", f"{site},seed=4,shape=1x8x8", [0, 1, 2]
    )
    assert isinstance(clients[0].train.x, LazyRows) and clients[2].train.x.shape == (300, 1, 8, 8)
    # one file holding every client, string labels, several row groups
    wine = load_wine()
    wx, wy = wine.data, wine.target.astype(np.int64)
    words = np.array(["barolo", "grignolino", "barbera"])
    hospital = np.array([f"h{i % 3 + 1}" if i % 7 else "h10" for i in range(len(wy))])
    table = pa.table({"hospital": hospital, "class": words[wy], **{f"w{i}": wx[:, i] for i in range(13)}})
    pq.write_table(table, tmp_path / "wine.parquet", row_group_size=25)
    pacsv.write_csv(table, tmp_path / "wine.csv")
    for name in ("wine.parquet", "wine.csv"):
        spec = f"{tmp_path / name},label=class,client_column=hospital,classes={'|'.join(words)},test_fraction=0.3"
        same_clients(f"{spec},lazy=true,cache={cache}", f"{spec},lazy=false", [5, 6, 7, 8])
    # auto: small tables stay in memory, tables over LAZY_TABLE_BYTES are streamed
    assert not is_lazy(open_site(f"{site / 'b.csv'},cache={cache}", [0]).clients[0].train.x)


@needs_fmnist
def test_lazy_parquet_of_fashion_mnist_pixels(tmp_path: Path, fmnist: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = fmnist
    names = [f"p{i}" for i in range(784)]
    path = tmp_path / "records.parquet"
    ward = np.array([f"ward{i % 4}" for i in range(len(y))])
    pq.write_table(feature_table(x.reshape(len(x), 784), y, names, ward=ward), path, row_group_size=70)
    spec = f"{path},client_column=ward,shape=1x28x28"
    clients = same_clients(f"{spec},lazy=true,cache={tmp_path / 'cache'}", spec, [0, 1, 2, 3])
    rows = np.flatnonzero(ward == "ward1")
    pooled = np.concatenate([materialize(clients[1].train.x), materialize(clients[1].test.x)])
    assert np.array_equal(
        np.sort(pooled.reshape(len(rows), -1), axis=0), np.sort(x[rows].reshape(len(rows), -1), axis=0)
    )


def cache_files(cache: Path) -> dict[str, int]:
    return {str(p.relative_to(cache)): p.stat().st_mtime_ns for p in sorted(cache.rglob("*")) if p.is_file()}


def test_lazy_cache_is_reused_and_follows_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fairfl.data.site as site_module

    x, y = digits()
    names = [f"f{i}" for i in range(64)]
    path = tmp_path / "t.parquet"
    pq.write_table(feature_table(x[:400], y[:400], names), path, row_group_size=50)
    cache = tmp_path / "from-env"
    monkeypatch.setenv("FAIRFL_CACHE_DIR", str(cache))
    monkeypatch.setattr(site_module, "LAZY_TABLE_BYTES", 0)  # auto: every table is "large"
    first = open_site(str(path), [0]).clients[0]
    written = cache_files(cache)
    assert is_lazy(first.train.x) and sorted(Path(n).name for n in written) == ["meta.json", "x.npy", "y.npy"]
    again = open_site(f"{path},seed=1", [0]).clients[0]  # the split seed does not change the cache
    assert cache_files(cache) == written  # reused: nothing rewritten
    assert len(again.train) == len(first.train) and not np.array_equal(again.test.y, first.test.y)
    # the source changes: a new cache, the new values
    pq.write_table(feature_table(x[400:800], y[400:800], names), path, row_group_size=50)
    stat = path.stat()
    import os

    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    changed = open_site(f"{path},test_fraction=0", [0]).clients[0]
    assert np.array_equal(materialize(changed.train.x), x[400:800].astype(np.float32))
    assert len({Path(n).parent for n in cache_files(cache)}) == 2
    assert not any(p.name.startswith(".") for p in cache.iterdir())  # no temporary directory left behind
    with pytest.raises(SiteDataError, match=r"option lazy=maybe: expected auto, true or false"):
        open_site(f"{path},lazy=maybe", [0])
    with pytest.raises(SiteDataError, match=r"option cache= needs a directory"):
        open_site(f"{path},cache=", [0])


def test_lazy_streaming_names_the_file_and_column_of_a_bad_value(tmp_path: Path) -> None:
    x, y = digits()
    names = [f"f{i}" for i in range(64)]
    cache = tmp_path / "cache"
    bad = x[:300].copy()
    bad[250, 5] = np.nan
    pq.write_table(feature_table(bad, y[:300], names), tmp_path / "nan.parquet", row_group_size=100)
    big = x[:300].copy()
    big[10, 7] = 1e39  # finite as float64, infinite as float32
    pacsv.write_csv(feature_table(big, y[:300], names), tmp_path / "inf.csv")
    nulls = pa.table({"f0": pa.array([1.0, 2.0, None]), "label": [0, 1, 1]})
    pq.write_table(nulls, tmp_path / "nulls.parquet", row_group_size=2)
    pacsv.write_csv(pa.table({"f0": [1, 2], "colour": ["red", "blue"], "label": [0, 1]}), tmp_path / "text.csv")
    cases = {
        "nan.parquet": r"nan\.parquet: feature column 'f5' has NaN or infinite values \(row 250: nan",
        "inf.csv": r"inf\.csv: feature column 'f7' has NaN or infinite values \(row 10: inf",
        "nulls.parquet": r"nulls\.parquet: feature column 'f0' has 1 missing values \(rows \d+\.\.2\)",
        "text.csv": r"text\.csv: feature column 'colour' is string, not numeric",
    }
    for name, pattern in cases.items():
        with pytest.raises(SiteDataError, match=pattern):
            open_site(f"{tmp_path / name},lazy=true,cache={cache}", [0])
    assert not cache.exists() or not list(cache.iterdir())  # no cache, half or whole, for a bad table


def _has_vm_hwm() -> bool:
    status = Path("/proc/self/status")
    return status.is_file() and "VmHWM:" in status.read_text()


_PEAK_OF_OPEN = """
import json, sys
from pathlib import Path
import numpy, pyarrow.parquet, PIL.Image  # imported before the baseline: the growth is the open's alone
import fairfl.data.site as site

def hwm():
    lines = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) * 1024 for line in lines if line.startswith("VmHWM:"))

if sys.argv[3]:
    site.LAZY_TABLE_BYTES = int(sys.argv[3])
before = hwm()
opened = site.open_site(sys.argv[1], json.loads(sys.argv[2]))
print(json.dumps({"growth": hwm() - before, "lazy": [site.is_lazy(c.train.x) for c in opened.clients.values()]}))
"""


def peak_growth_of_open(spec: str, ids: list[int], lazy_bytes: int | None = None) -> tuple[int, list[bool]]:
    """How much opening the site raises the peak RSS of a fresh process (after its imports), and which clients' train
    features are lazy. A fresh process: in a long test process, freed heap stays resident and a new allocation may
    not raise the RSS at all."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _PEAK_OF_OPEN, spec, json.dumps(ids), "" if lazy_bytes is None else str(lazy_bytes)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reply = json.loads(done.stdout.strip().splitlines()[-1])
    return int(reply["growth"]), list(reply["lazy"])


@pytest.mark.skipif(not _has_vm_hwm(), reason="needs Linux /proc/<pid>/status (VmHWM, the peak RSS)")
def test_lazy_parquet_streams_in_bounded_memory(tmp_path: Path) -> None:
    """Streaming a 150 MB Parquet file (10 row groups) into its cache raises the peak RSS by far less than the
    file's decoded features; reading it into memory (the control) raises it by more than their size."""
    rows, width, group = 150_000, 250, 15_000  # float32: 150 MB decoded
    decoded = rows * width * 4
    block = np.random.default_rng(0).standard_normal((group, width)).astype(np.float32)
    names = [f"f{i}" for i in range(width)]
    schema = pa.schema([*(pa.field(n, pa.float32()) for n in names), pa.field("label", pa.int64())])
    path = tmp_path / "big.parquet"
    with pq.ParquetWriter(path, schema, compression="none", use_dictionary=False) as writer:
        for k in range(rows // group):
            part = block + np.float32(k)
            columns = {**{n: part[:, i] for i, n in enumerate(names)}, "label": (np.arange(group) + k) % 10}
            writer.write_table(pa.table(columns, schema=schema))
    del part, columns
    assert path.stat().st_size > 0.9 * decoded and pq.ParquetFile(path).num_row_groups == 10

    spec = f"{path},lazy=true,cache={tmp_path / 'cache'},test_fraction=0.1"
    lazy_growth, lazy = peak_growth_of_open(spec, [0])  # writes the cache
    assert lazy == [True]
    data = open_site(spec, [0])
    train = data.clients[0].train
    assert is_lazy(train.x) and len(train) == 135_000
    picked = train.x.rows[[0, 70_000, -1]]
    expected = block[picked % group] + (picked // group).astype(np.float32)[:, None]
    assert np.array_equal(train.x[[0, 70_000, -1]], expected)
    del data, train

    memory_growth, lazy = peak_growth_of_open(f"{path},lazy=false,test_fraction=0.1", [0])
    assert lazy == [False]
    assert memory_growth > decoded, f"the control grew by only {memory_growth / 1e6:.0f} MB"
    print(f"peak RSS growth: streamed {lazy_growth / 1e6:.0f} MB, in memory {memory_growth / 1e6:.0f} MB")
    # Less than the features themselves (the reader holds a row group or two and its memory pool's reserve), and a
    # small part of what reading the table into memory takes (a fresh process measured 85 MB against 407 MB).
    assert lazy_growth < min(decoded, 0.35 * memory_growth), (
        f"streaming grew the peak RSS by {lazy_growth / 1e6:.0f} MB for {decoded / 1e6:.0f} MB of features "
        f"(in memory: {memory_growth / 1e6:.0f} MB)"
    )


def test_lazy_csv_integers_then_decimals_across_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fairfl.data.site_formats as formats

    monkeypatch.setattr(formats, "_BLOCK_BYTES", 4096)  # many blocks: the first holds integers only
    x, y = digits()
    values = x[:1000].copy()
    values[900:, 3] += 0.5
    pacsv.write_csv(feature_table(values, y[:1000], [f"f{i}" for i in range(64)]), tmp_path / "t.csv")
    spec = f"{tmp_path / 't.csv'},seed=2"
    same_clients(f"{spec},lazy=true,cache={tmp_path / 'cache'}", spec, [0])


# ------------------------------------------------------------------------------------------------------ lazy images


@pytest.fixture(scope="module")
def fmnist_300() -> tuple[np.ndarray, np.ndarray]:
    """The first 300 raw Fashion-MNIST training images, uint8 (N, 28, 28), and their labels."""
    images = parse_idx(gzip.decompress((FMNIST / "train-images-idx3-ubyte.gz").read_bytes()))
    labels = parse_idx(gzip.decompress((FMNIST / "train-labels-idx1-ubyte.gz").read_bytes()))
    return np.array(images[:300]), np.array(labels[:300]).astype(np.int64)


def write_images(folder: Path, pixels: np.ndarray, classes: list[str], start: int = 0) -> None:
    """One PNG per image in `folder/<class>/<index>.png` (grayscale for (H, W), RGB for (H, W, 3))."""
    for i, (image, name) in enumerate(zip(pixels, classes, strict=True)):
        (folder / name).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image, mode="L" if image.ndim == 2 else "RGB").save(folder / name / f"{start + i}.png")


def rgb_pixels(n: int, size: int, seed: int) -> np.ndarray:
    """`n` smooth RGB images (compress well, decode fast), uint8 (n, size, size, 3)."""
    rng = np.random.default_rng(seed)
    ramp = np.add.outer(np.arange(size), np.arange(size)).astype(np.int64)
    shift = rng.integers(0, 256, (n, 1, 1, 3))
    return ((ramp[None, :, :, None] * (1 + np.arange(3)) + shift) % 256).astype(np.uint8)


@needs_fmnist
def test_lazy_image_folders_equal_the_in_memory_path(tmp_path: Path, fmnist_300: tuple[np.ndarray, np.ndarray]) -> None:
    pixels, labels = fmnist_300
    cache = tmp_path / "cache"
    site = tmp_path / "gray"
    write_images(site / "c0" / "train", pixels[:120], [str(v) for v in labels[:120]])  # a given split
    write_images(site / "c0" / "test", pixels[120:160], [str(v) for v in labels[120:160]], 120)
    write_images(site / "c1", pixels[160:], [str(v) for v in labels[160:]], 160)  # split at random
    clients = same_clients(f"{site},seed=3,lazy=true,cache={cache}", f"{site},seed=3,lazy=false", [4, 9])
    assert isinstance(clients[9].train.x, LazyRows) and clients[0 + 4].train.x.shape == (120, 1, 28, 28)
    assert len(clients[9].train) + len(clients[9].test) == 140
    assert len(list(cache.iterdir())) == 3  # c0/train, c0/test, c1
    # RGB: one grayscale image among RGB ones makes the whole site 3 channels; named classes, classes= order
    rgb = tmp_path / "rgb"
    colour = rgb_pixels(30, 28, 0)
    names = ["bird", "cat", "dog"]
    write_images(rgb / "a", colour[:15], [names[i % 3] for i in range(15)])
    write_images(rgb / "b", colour[15:], [names[i % 2] for i in range(15, 30)], 15)
    write_images(rgb / "b", pixels[:1], ["dog"], 99)
    for extra in ("", ",classes=dog|cat|bird", ",test_fraction=0"):
        spec = f"{rgb},seed=1{extra}"
        got = same_clients(f"{spec},lazy=true,cache={cache}", spec, [0, 1])
        assert got[1].train.x.shape[1:] == (3, 28, 28)


@pytest.mark.skipif(not _has_vm_hwm(), reason="needs Linux /proc/<pid>/status (VmHWM, the peak RSS)")
def test_lazy_image_cache_reuse_invalidation_errors_and_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import fairfl.data.site as site_module

    folder = tmp_path / "photos"
    count, size = 80, 256  # float32 (80, 3, 256, 256): 63 MB decoded
    decoded = count * 3 * size * size * 4
    colour = rgb_pixels(count, size, 1)
    write_images(folder, colour, [f"k{i % 4}" for i in range(count)])
    cache = tmp_path / "cache"
    monkeypatch.setenv("FAIRFL_CACHE_DIR", str(cache))

    spec = f"{folder},test_fraction=0.25,cache={cache}"
    memory_growth, lazy = peak_growth_of_open(spec, [0], lazy_bytes=decoded)  # auto: "small", read into memory
    assert lazy == [False]
    lazy_growth, lazy = peak_growth_of_open(spec, [0], lazy_bytes=decoded - 1)  # auto: "large", into the cache
    assert lazy == [True]
    monkeypatch.setattr(site_module, "LAZY_TABLE_BYTES", decoded)
    memory = open_site(spec, [0])
    assert not is_lazy(memory.clients[0].train.x)
    monkeypatch.setattr(site_module, "LAZY_TABLE_BYTES", decoded - 1)
    data = open_site(spec, [0])  # the cache the fresh process wrote
    first = data.clients[0]
    assert is_lazy(first.train.x) and len(first.train) == 60
    del data
    written = cache_files(cache)
    assert sorted(Path(n).name for n in written) == ["meta.json", "x.npy", "y.npy"]
    print(f"peak RSS growth: cached {lazy_growth / 1e6:.0f} MB, in memory {memory_growth / 1e6:.0f} MB")
    assert memory_growth > decoded, f"the control grew by only {memory_growth / 1e6:.0f} MB"
    assert lazy_growth < 0.4 * decoded, f"decoding into the cache grew the peak RSS by {lazy_growth / 1e6:.0f} MB"
    rows = first.train.x.rows[[0, 30, -1]]
    assert np.array_equal(first.train.x[[0, 30, -1]], memory.clients[0].train.x[[0, 30, -1]])
    assert np.array_equal(first.train.x[[0]], colour[rows[:1]].transpose(0, 3, 1, 2) * np.float32(1 / 255))
    del memory

    again = open_site(f"{folder},test_fraction=0.25,seed=5,lazy=true", [0]).clients[0]  # the seed: same cache
    assert cache_files(cache) == written and not np.array_equal(again.test.y, first.test.y)
    # an image changes: a new cache with the new values
    changed = folder / "k1" / "1.png"
    Image.fromarray(255 - colour[1], mode="RGB").save(changed)
    stat = changed.stat()
    os.utime(changed, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    new = open_site(f"{folder},test_fraction=0,lazy=true", [0]).clients[0]  # k1/1.png: after k0's 20 images
    assert np.array_equal(new.train.x[[20]][0], (255 - colour[1]).transpose(2, 0, 1) * np.float32(1 / 255))
    assert len({Path(n).parent for n in cache_files(cache)}) == 2
    # a corrupt image (its header intact) and a decompression bomb: named, and no cache left behind
    bad = tmp_path / "bad"
    write_images(bad, colour[:6, :32, :32], ["a", "b"] * 3)
    data_bytes = (bad / "a" / "2.png").read_bytes()
    (bad / "a" / "2.png").write_bytes(data_bytes[: len(data_bytes) // 2])
    empty = tmp_path / "empty-cache"
    with pytest.raises(SiteDataError, match=r"bad/a/2\.png: cannot decode the image"):
        open_site(f"{bad},lazy=true,cache={empty}", [0])
    assert not empty.exists() or not list(empty.iterdir())
    (bad / "a" / "2.png").write_bytes(data_bytes)
    from PIL import Image as PILImage

    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 200)  # 32x32 > 2x200: a bomb
    with pytest.raises(SiteDataError, match=r"bad/a/0\.png: .*decompression bomb"):
        open_site(f"{bad},lazy=true,cache={empty}", [0])
    assert not empty.exists() or not list(empty.iterdir())
