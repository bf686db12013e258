"""Tests for fairfl.data: loaders (on tiny hand-written files), partitioners, Synthetic(α, β), build_federated."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import urllib.error
from pathlib import Path

import numpy as np
import pytest

from fairfl.data import (
    ArrayDataset,
    DatasetNotFoundError,
    FederatedData,
    build_federated,
    clear_cache,
    load_dataset,
    parse_idx,
    partition,
    partition_dirichlet,
    partition_iid,
    partition_shards,
    synthetic_leaf,
)
from fairfl.data import datasets as ds_mod

DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
IDX_STEMS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the real ~/.cache or a developer's FAIRFL_DATA_DIR, and each starts with an empty cache."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FAIRFL_DATA_DIR", raising=False)
    clear_cache()
    yield
    clear_cache()


# ------------------------------------------------------------------------------------------------------------ helpers


def idx_bytes(arr: np.ndarray, type_code: int = 0x08) -> bytes:
    header = struct.pack(">HBB", 0, type_code, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def write_idx_dataset(
    directory: Path, n_train: int = 40, n_test: int = 20, gz: bool = True, seed: int = 0
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Write a tiny MNIST-format dataset (labels cycle 0..9) and return the raw arrays per split."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    raw = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        for stem, arr in zip(IDX_STEMS[split], (images, labels), strict=True):
            data = idx_bytes(arr)
            if gz:
                (directory / f"{stem}.gz").write_bytes(gzip.compress(data))
            else:
                (directory / stem).write_bytes(data)
        raw[split] = (images, labels)
    return raw


def write_cifar(directory: Path, per_batch: int = 6, str_keys: bool = False) -> dict[str, tuple[np.ndarray, list]]:
    """A fake cifar-10-batches-py written like the real files (dicts with numpy arrays, pickle protocol 2)."""
    rng = np.random.default_rng(1)
    batch_dir = directory / "cifar-10-batches-py"
    batch_dir.mkdir(parents=True)
    raw: dict[str, tuple[np.ndarray, list]] = {}
    for fname in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, per_batch)]
        key = (lambda k: k) if str_keys else (lambda k: k.encode())
        batch = {key("data"): data, key("labels"): labels, key("batch_label"): b"fake"}
        (batch_dir / fname).write_bytes(pickle.dumps(batch, protocol=2))
        raw[fname] = (data, labels)
    return raw


def label_entropy(labels: np.ndarray, num_classes: int = 10) -> float:
    p = np.bincount(labels, minlength=num_classes) / len(labels)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def assert_disjoint_cover(parts: list[np.ndarray], n: int, cover: bool = True) -> None:
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "indices must be sorted and unique"
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx), "clients overlap"
    if cover:
        np.testing.assert_array_equal(np.sort(allidx), np.arange(n))


# --------------------------------------------------------------------------------------------------------- IDX loader


@pytest.mark.parametrize("gz", [True, False])
def test_idx_round_trip(tmp_path: Path, gz: bool) -> None:
    raw = write_idx_dataset(tmp_path / "fashion_mnist", gz=gz)
    for split in ("train", "test"):
        ds = load_dataset("fashion_mnist", split, root=str(tmp_path))
        images, labels = raw[split]
        assert ds.x.shape == (len(labels), 1, 28, 28) and ds.input_shape == (1, 28, 28)
        assert ds.x.dtype == np.float32 and ds.y.dtype == np.int64
        assert ds.num_classes == 10 and ds.name == "fashion_mnist"
        np.testing.assert_array_equal(ds.y, labels)
        expected = (images[:, None].astype(np.float32) / 255.0 - 0.2860) / 0.3530
        np.testing.assert_allclose(ds.x, expected, rtol=1e-5, atol=1e-6)


def test_idx_search_dash_name_and_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = write_idx_dataset(tmp_path / "data" / "fashion-mnist", gz=False)
    monkeypatch.setenv("FAIRFL_DATA_DIR", str(tmp_path / "data"))
    ds = load_dataset("fashion_mnist", "test")
    np.testing.assert_array_equal(ds.y, raw["test"][1])


def test_load_is_cached_and_read_only(tmp_path: Path) -> None:
    write_idx_dataset(tmp_path)
    a = load_dataset("mnist", "train", root=str(tmp_path))
    assert load_dataset("mnist", "train", root=str(tmp_path)) is a
    with pytest.raises(ValueError):
        a.x[0, 0, 0, 0] = 1.0  # shared by every logical client, so it must not be writable


def test_mnist_uses_its_own_normalisation(tmp_path: Path) -> None:
    raw = write_idx_dataset(tmp_path / "mnist", n_train=30, n_test=10, gz=True)
    ds = load_dataset("mnist", "test", root=str(tmp_path))
    images, labels = raw["test"]
    np.testing.assert_array_equal(ds.y, labels)
    np.testing.assert_allclose(ds.x[:, 0], (images / 255.0 - 0.1307) / 0.3081, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda b: b"\x00\x00\x07\x03" + b[4:], id="bad-type-code"),
        pytest.param(lambda b: b"\x01" + b[1:], id="bad-magic"),
        pytest.param(lambda b: b[:-5], id="truncated-payload"),
        pytest.param(lambda b: b[:10], id="truncated-header"),
    ],
)
def test_corrupt_idx_raises_value_error(tmp_path: Path, mutate) -> None:
    write_idx_dataset(tmp_path, gz=False)
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(mutate(path.read_bytes()))
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte"):
        load_dataset("mnist", "test", root=str(tmp_path))


def test_truncated_gzip_raises_value_error(tmp_path: Path) -> None:
    write_idx_dataset(tmp_path, gz=True)
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(ValueError, match="t10k-labels"):
        load_dataset("mnist", "test", root=str(tmp_path))


def test_parse_idx_other_dtypes() -> None:
    arr = np.arange(6, dtype=">i4").reshape(2, 3)
    blob = struct.pack(">HBB", 0, 0x0C, 2) + struct.pack(">2I", 2, 3) + arr.tobytes()
    np.testing.assert_array_equal(parse_idx(blob), arr)


def test_missing_dataset_message_names_searched_dirs_and_fixes(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("mnist", "train", root=str(missing))
    msg = str(info.value)
    assert str(missing) in msg and str(missing / "mnist") in msg
    assert "data.root" in msg and "FAIRFL_DATA_DIR" in msg and "download" in msg
    assert isinstance(info.value, FileNotFoundError)


def test_missing_fashion_mnist_mentions_debian_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ds_mod._SPECS["fashion_mnist"]
    monkeypatch.setitem(ds_mod._SPECS, "fashion_mnist", spec.__class__(**{**vars(spec), "debian_dir": tmp_path / "x"}))
    with pytest.raises(DatasetNotFoundError, match="dataset-fashion-mnist"):
        load_dataset("fashion_mnist", "test", root=str(tmp_path / "nowhere"))


def test_download_failure_raises_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(url: str, timeout: float):
        raise urllib.error.URLError("network unreachable")

    monkeypatch.setattr(ds_mod.urllib.request, "urlopen", offline)
    with pytest.raises(DatasetNotFoundError, match="failed: URLError"):
        load_dataset("mnist", "train", root=str(tmp_path / "nowhere"), download=True)
    assert not list((tmp_path / "home").rglob("*.gz")), "a failed download must leave no partial files"


def test_download_fetches_into_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = write_idx_dataset(tmp_path / "served", gz=True)
    seen: list[tuple[str, float]] = []

    def fake_urlopen(url: str, timeout: float) -> io.BytesIO:
        seen.append((url, timeout))
        return io.BytesIO((tmp_path / "served" / url.rsplit("/", 1)[1]).read_bytes())

    monkeypatch.setattr(ds_mod.urllib.request, "urlopen", fake_urlopen)
    ds = load_dataset("mnist", "train", download=True)
    np.testing.assert_array_equal(ds.y, raw["train"][1])
    assert len(seen) == 4 and all(u.startswith("https://ossci-datasets.s3.amazonaws.com/mnist/") for u, _ in seen)
    assert all(t <= 60 for _, t in seen)
    assert (tmp_path / "home" / ".cache" / "fairfl" / "mnist" / "t10k-images-idx3-ubyte.gz").is_file()


def test_unknown_name_or_split() -> None:
    with pytest.raises(ValueError, match="fashion_mnist, mnist, cifar10"):
        load_dataset("imagenet", "train")
    with pytest.raises(ValueError, match="train, test"):
        load_dataset("mnist", "validation")


def test_array_dataset_validates() -> None:
    with pytest.raises(ValueError, match="float32"):
        ArrayDataset(np.zeros((2, 3)), np.zeros(2, np.int64), 2, "t")
    with pytest.raises(ValueError, match="disagree"):
        ArrayDataset(np.zeros((2, 3), np.float32), np.zeros(3, np.int64), 2, "t")
    with pytest.raises(ValueError, match="labels outside"):
        ArrayDataset(np.zeros((2, 3), np.float32), np.array([0, 2]), 2, "t")


# -------------------------------------------------------------------------------------------------------------- CIFAR


@pytest.mark.parametrize("str_keys", [False, True])
def test_cifar_round_trip(tmp_path: Path, str_keys: bool) -> None:
    raw = write_cifar(tmp_path, str_keys=str_keys)
    train = load_dataset("cifar10", "train", root=str(tmp_path))
    test = load_dataset("cifar10", "test", root=str(tmp_path))
    assert train.x.shape == (30, 3, 32, 32) and test.x.shape == (6, 3, 32, 32)
    np.testing.assert_array_equal(train.y, np.concatenate([raw[f"data_batch_{i}"][1] for i in range(1, 6)]))
    data = raw["test_batch"][0]
    # Channel-major rows: element 1024 is the green value of pixel (0, 0); element 33 is red at (1, 1).
    mean, std = np.array([0.4914, 0.4822, 0.4465]), np.array([0.2470, 0.2435, 0.2616])
    np.testing.assert_allclose(test.x[0, 1, 0, 0], (data[0, 1024] / 255 - mean[1]) / std[1], rtol=1e-5)
    np.testing.assert_allclose(test.x[2, 0, 1, 1], (data[2, 33] / 255 - mean[0]) / std[0], rtol=1e-5)


def test_cifar_accepts_numpy1_module_name(tmp_path: Path) -> None:
    """The original files reference numpy.core.multiarray (numpy 1); numpy 2 writes numpy._core.multiarray."""
    raw = write_cifar(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    blob = path.read_bytes()
    if b"numpy._core.multiarray" in blob:
        path.write_bytes(blob.replace(b"numpy._core.multiarray", b"numpy.core.multiarray"))
    ds = load_dataset("cifar10", "test", root=str(tmp_path))
    np.testing.assert_array_equal(ds.y, raw["test_batch"][1])


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_cifar_pickle_with_foreign_global_is_refused(tmp_path: Path) -> None:
    write_cifar(tmp_path)
    marker = tmp_path / "pwned"
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    path.write_bytes(pickle.dumps({b"data": _Exploit(marker), b"labels": [0]}, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match=r"test_batch.*(posix|os|nt)\.system"):
        load_dataset("cifar10", "test", root=str(tmp_path))
    assert not marker.exists()


def test_cifar_codecs_only_latin1(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    # GLOBAL _codecs.encode, args ("x", "rot13"), REDUCE, STOP: a non-latin-1 codec must be refused.
    path.write_bytes(b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00xX\x05\x00\x00\x00rot13\x86R.")
    with pytest.raises(pickle.UnpicklingError, match="rot13"):
        ds_mod.load_restricted_pickle(path)


def test_cifar_bad_shape_raises_value_error(tmp_path: Path) -> None:
    write_cifar(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, protocol=2))
    with pytest.raises(ValueError, match="3072"):
        load_dataset("cifar10", "test", root=str(tmp_path))


# -------------------------------------------------------------------------------------------------------- partitions


def test_shards_label_limited_equal_disjoint_covering() -> None:
    labels = np.repeat(np.arange(10), 60)  # sorted, 600 samples
    rng = np.random.default_rng(0)
    parts = partition_shards(labels, num_clients=20, shards_per_client=2, rng=rng)
    assert len(parts) == 20
    assert_disjoint_cover(parts, len(labels))
    assert {len(p) for p in parts} == {30}
    assert max(len(np.unique(labels[p])) for p in parts) <= 2


def test_shards_validates() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="num_clients \\* shards_per_client"):
        partition_shards(np.zeros(10, np.int64), 6, 2, rng)
    with pytest.raises(ValueError, match="shards_per_client"):
        partition_shards(np.zeros(10, np.int64), 2, 0, rng)


def test_dirichlet_determinism_min_size_and_cover() -> None:
    labels = np.random.default_rng(5).integers(0, 10, 2000)
    a = partition_dirichlet(labels, 20, 0.5, np.random.default_rng(1), min_size=10)
    b = partition_dirichlet(labels, 20, 0.5, np.random.default_rng(1), min_size=10)
    c = partition_dirichlet(labels, 20, 0.5, np.random.default_rng(2), min_size=10)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    assert min(len(p) for p in a) >= 10
    assert_disjoint_cover(a, len(labels))


def test_dirichlet_small_alpha_is_more_skewed() -> None:
    labels = np.repeat(np.arange(10), 300)

    def mean_entropy(alpha: float) -> float:
        parts = partition_dirichlet(labels, 10, alpha, np.random.default_rng(3), min_size=5)
        return float(np.mean([label_entropy(labels[p]) for p in parts]))

    assert mean_entropy(0.05) < 1.0 < 2.0 < mean_entropy(100.0)


def test_dirichlet_validates_and_gives_up_clearly() -> None:
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 10)
    with pytest.raises(ValueError, match="alpha"):
        partition_dirichlet(labels, 5, 0.0, rng)
    with pytest.raises(ValueError, match="num_clients"):
        partition_dirichlet(labels, 0, 1.0, rng)
    with pytest.raises(ValueError, match="min_size"):
        partition_dirichlet(labels, 20, 1.0, rng, min_size=10)
    with pytest.raises(ValueError, match="after 5 attempts"):
        partition_dirichlet(labels, 10, 0.01, rng, min_size=9, max_attempts=5)


def test_iid_sizes_differ_by_at_most_one() -> None:
    labels = np.arange(103) % 7
    parts = partition_iid(labels, 10, np.random.default_rng(0))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert_disjoint_cover(parts, len(labels))
    with pytest.raises(ValueError, match="num_clients"):
        partition_iid(labels, 0, np.random.default_rng(0))


def test_test_split_following_exact_sizes_and_proportions() -> None:
    test_labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 50))
    train_sets = [
        np.array([3] * 30 + [7] * 10),  # 75% / 25%
        np.arange(100) % 10,  # uniform
        np.array([1, 1, 2]),  # 2/3, 1/3 -> largest remainder
    ]
    parts = partition.test_split_following(train_sets, test_labels, 20, 10, np.random.default_rng(1))
    assert [len(p) for p in parts] == [20, 20, 20]
    for p in parts:
        assert len(np.unique(p)) == len(p)  # without replacement within a client
    np.testing.assert_array_equal(np.bincount(test_labels[parts[0]], minlength=10)[[3, 7]], [15, 5])
    assert set(np.unique(test_labels[parts[0]])) == {3, 7}
    assert np.all(np.bincount(test_labels[parts[1]], minlength=10) == 2)
    np.testing.assert_array_equal(np.bincount(test_labels[parts[2]], minlength=10)[[1, 2]], [13, 7])


def test_test_split_following_caps_small_pools() -> None:
    test_labels = np.array([0] * 3 + [1] * 50)
    parts = partition.test_split_following([np.array([0, 0, 0, 1])], test_labels, 20, 2, np.random.default_rng(0))
    np.testing.assert_array_equal(np.bincount(test_labels[parts[0]], minlength=2), [3, 17])
    with pytest.raises(ValueError, match="only 3"):
        partition.test_split_following([np.array([0])], test_labels, 4, 2, np.random.default_rng(0))


# --------------------------------------------------------------------------------------------------------- synthetic


def test_synthetic_leaf_shapes_range_determinism() -> None:
    train, test, tr_idx, te_idx = synthetic_leaf(1.0, 1.0, num_clients=8, seed=7)
    assert train.x.shape[1:] == (60,) and train.x.dtype == np.float32 and train.num_classes == 10
    assert train.y.min() >= 0 and train.y.max() < 10
    assert len(tr_idx) == len(te_idx) == 8
    assert_disjoint_cover(tr_idx, len(train))
    assert_disjoint_cover(te_idx, len(test))
    for tr, te in zip(tr_idx, te_idx, strict=True):
        n = len(tr) + len(te)
        assert 50 <= n <= 1000 and abs(len(te) - 0.2 * n) <= 1
    again = synthetic_leaf(1.0, 1.0, num_clients=8, seed=7)
    np.testing.assert_array_equal(train.x, again[0].x)
    np.testing.assert_array_equal(test.y, again[1].y)
    other = synthetic_leaf(1.0, 1.0, num_clients=8, seed=8)
    assert len(other[0]) != len(train) or not np.array_equal(other[0].x, train.x)


def test_synthetic_leaf_validates() -> None:
    with pytest.raises(ValueError, match="test_fraction"):
        synthetic_leaf(1.0, 1.0, 3, 0, test_fraction=1.0)
    with pytest.raises(ValueError, match="num_clients"):
        synthetic_leaf(1.0, 1.0, 0, 0)


# ---------------------------------------------------------------------------------------------------- build_federated


def test_build_federated_synthetic() -> None:
    fd = build_federated("synthetic", 5, "iid", seed=3, params={"alpha": 0.5, "beta": 0.5})
    assert isinstance(fd, FederatedData)
    assert fd.num_clients == 5 and fd.num_classes == 10 and fd.input_shape == (60,)
    assert fd.client_label_counts(2).sum() == len(fd.train_indices[2])
    again = build_federated("synthetic", 5, "shards", seed=3, params={"alpha": 0.5, "beta": 0.5})
    np.testing.assert_array_equal(fd.train.x, again.train.x)


@pytest.mark.parametrize("part", ["iid", "shards", "dirichlet"])
def test_build_federated_fashion_mnist_from_idx(tmp_path: Path, part: str) -> None:
    write_idx_dataset(tmp_path, n_train=200, n_test=50)
    kwargs = {"root": str(tmp_path), "min_size": 5, "alpha": 1.0}
    fd = build_federated("fashion_mnist", 10, part, seed=11, **kwargs)
    assert fd.num_clients == 10 and fd.input_shape == (1, 28, 28)
    assert_disjoint_cover(fd.train_indices, 200)
    assert [len(t) for t in fd.test_indices] == [5] * 10  # default len(test) // num_clients
    for c in range(fd.num_clients):
        present = fd.client_label_counts(c) > 0
        assert not np.any(fd.client_label_counts(c, "test")[~present]), "test labels must follow train labels"
    if part == "shards":
        assert max(int(np.count_nonzero(fd.client_label_counts(c))) for c in range(10)) <= 2
    clear_cache()
    again = build_federated("fashion_mnist", 10, part, seed=11, **kwargs)
    for a, b in zip(fd.train_indices + fd.test_indices, again.train_indices + again.test_indices, strict=True):
        np.testing.assert_array_equal(a, b)
    client = fd.client_train(0)
    np.testing.assert_array_equal(client.y, fd.train.y[fd.train_indices[0]])


def test_build_federated_validates(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="partition"):
        build_federated("mnist", 4, "pathological", seed=0, root=str(tmp_path))
    with pytest.raises(ValueError, match="num_clients"):
        build_federated("mnist", 0, "iid", seed=0, root=str(tmp_path))


# ------------------------------------------------------------------------------------------------------ real dataset


@pytest.mark.skipif(not DEBIAN_FMNIST.is_dir(), reason="Debian package dataset-fashion-mnist not installed")
def test_real_debian_fashion_mnist() -> None:
    ds = load_dataset("fashion_mnist", "test")
    assert ds.x.shape == (10000, 1, 28, 28)
    np.testing.assert_array_equal(np.bincount(ds.y), [1000] * 10)
    # The fixed train-set constants standardise the test set to roughly zero mean, unit std.
    assert abs(float(ds.x.mean())) < 0.05 and abs(float(ds.x.std()) - 1.0) < 0.05
