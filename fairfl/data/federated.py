"""Assemble a federated view of a dataset: pooled train/test arrays plus each client's index arrays."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from fairfl.data.datasets import ArrayDataset
from fairfl.data.groups import client_groups
from fairfl.data.partition import (
    PartitionError,
    partition_dirichlet,
    partition_dirichlet_groups,
    partition_iid,
    partition_label_groups,
    partition_shards,
    test_split_following,
)
from fairfl.data.plugin import (
    DataPlugin,
    DataProvider,
    DataRequest,
    dataset_params,
    dataset_signature_of,
    resolve_dataset,
)
from fairfl.data.signature import DataSignature
from fairfl.plugins import PluginError
from fairfl.schema import ConfigError

PARTITIONS = ("iid", "shards", "dirichlet", "label_groups", "dirichlet_groups")
TEST_SPLITS = ("follow_train", "iid")


class DataConfigError(ConfigError):
    """The run's data section asks for a split the data cannot hold; ``field`` is the config field to change (e.g.
    ``data.num_clients``), and the message starts with it, as every config error's does."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


@dataclass(eq=False)
class FederatedData:
    """Clients are index arrays into shared pooled datasets, so many logical clients cost no extra copies."""

    train: ArrayDataset
    test: ArrayDataset
    train_indices: list[np.ndarray]
    test_indices: list[np.ndarray]
    groups: np.ndarray | None = None  # ground-truth group id per client (fairfl.data.groups), None if not planted

    def __post_init__(self) -> None:
        if len(self.train_indices) != len(self.test_indices):
            raise ValueError(
                f"{len(self.train_indices)} train index arrays but {len(self.test_indices)} test index arrays"
            )
        if self.groups is not None and len(self.groups) != len(self.train_indices):
            raise ValueError(f"{len(self.groups)} group ids for {len(self.train_indices)} clients")

    @property
    def num_clients(self) -> int:
        return len(self.train_indices)

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.train.input_shape

    def client_label_counts(self, client: int, split: str = "train") -> np.ndarray:
        """Per-class sample counts of one client's train (default) or test data, length num_classes."""
        if split == "train":
            labels = self.train.y[self.train_indices[client]]
        elif split == "test":
            labels = self.test.y[self.test_indices[client]]
        else:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        return np.bincount(labels, minlength=self.num_classes)

    def client_train(self, client: int) -> ArrayDataset:
        return self.train.subset(self.train_indices[client])

    def client_test(self, client: int) -> ArrayDataset:
        return self.test.subset(self.test_indices[client])


def build_federated(
    dataset: str | DataPlugin | type,
    num_clients: int,
    partition: str,
    seed: int,
    *,
    root: str | None = None,
    download: bool = False,
    shards_per_client: int = 2,
    alpha: float = 0.5,
    min_size: int = 10,
    test_per_client: int | None = None,
    params: Any = None,
    group_sizes: list[int] | None = None,
    group_classes: list[int] | None = None,
    samples_per_class: int | None = None,
    group_alphas: list[float] | None = None,
    test_split: str = "follow_train",
) -> FederatedData:
    """Load ``dataset`` and split it among ``num_clients`` clients; the same arguments always give the same split.

    ``dataset`` is a dataset plug-in (fairfl.data.plugin), by name, ``package.module:attr`` or as the object;
    ``params`` its parameters (a mapping checked against its declared Params, or the parsed Params).
    ``partition`` ('iid' | 'shards' | 'dirichlet' | 'label_groups') splits the training set ('label_groups': clients
    in groups of ``group_sizes`` with disjoint label sets, see partition_label_groups; 'dirichlet_groups': HiCS-FL's
    groups of ``group_sizes`` clients with Dirichlet(``group_alphas[g]``) label skew, see partition_dirichlet_groups;
    ``groups`` gets the group ids of both).
    Each client's test set is drawn from the official test set following its train label mix (``test_per_client``
    samples, default len(test) // num_clients), or with ``test_split='iid'`` is a disjoint random slice of it (so the
    mean client accuracy is the accuracy on the union, the whole test set at the default size).
    A DataProvider (e.g. 'synthetic': LEAF's Synthetic(α, β)) builds its clients itself, ignoring ``partition``.

    A split the data cannot hold (more clients than samples, too few test samples for ``test_per_client``, ...)
    raises :class:`DataConfigError` naming the run's config field (``data.<argument>``): the arguments are the
    ``data`` section's fields.
    """
    if isinstance(num_clients, bool) or not isinstance(num_clients, int | np.integer) or num_clients < 1:
        raise DataConfigError("data.num_clients", f"num_clients must be >= 1, got {num_clients!r}")
    plugin = resolve_dataset(dataset)
    parsed = params if dataclasses.is_dataclass(params) else dataset_params(plugin, params)
    signature = dataset_signature_of(plugin, parsed)
    request = DataRequest(root=root, download=download, num_clients=num_clients, seed=seed)
    if isinstance(plugin, DataProvider):
        data = plugin.clients(parsed, request)
        if not isinstance(data, FederatedData) or data.num_clients != num_clients:
            got = f"{data.num_clients} clients" if isinstance(data, FederatedData) else type(data).__name__
            raise PluginError(
                f"data.dataset: {type(plugin).__qualname__}.clients() must return a FederatedData of {num_clients} "
                f"clients, got {got}"
            )
        _check_signature(plugin, signature, data.train, data.test)
        return data
    if partition not in PARTITIONS:
        raise DataConfigError("data.partition", f"unknown partition {partition!r}; valid: {', '.join(PARTITIONS)}")
    if test_split not in TEST_SPLITS:
        raise DataConfigError("data.test_split", f"unknown test_split {test_split!r}; valid: {', '.join(TEST_SPLITS)}")

    train = plugin.load("train", parsed, request)
    test = plugin.load("test", parsed, request)
    _check_signature(plugin, signature, train, test)
    # Independent child streams: changing how one step consumes randomness never shifts the other.
    partition_rng, test_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    # The test size defaults to an equal share of the test set: too many clients is then num_clients's fault.
    fields = {**_FIELDS, "size_per_client": "data.num_clients" if test_per_client is None else "data.test_per_client"}
    where = f"dataset {train.name!r}: {len(train)} training and {len(test)} test samples"
    try:
        train_idx, test_idx = _split(
            train,
            test,
            num_clients,
            partition,
            partition_rng,
            test_rng,
            shards_per_client=shards_per_client,
            alpha=alpha,
            min_size=min_size,
            test_per_client=test_per_client,
            group_sizes=group_sizes,
            group_classes=group_classes,
            samples_per_class=samples_per_class,
            group_alphas=group_alphas,
            test_split=test_split,
        )
    except PartitionError as err:
        raise DataConfigError(fields.get(err.argument, "data.partition"), f"{err} ({where})") from None
    return FederatedData(train, test, train_idx, test_idx, client_groups(partition, group_sizes or []))


def _check_signature(plugin: DataPlugin, signature: DataSignature, *splits: ArrayDataset) -> None:
    """The loaded arrays must match the declared signature: the aggregator built the model from the declaration."""
    for data in splits:
        if not isinstance(data, ArrayDataset):
            raise PluginError(
                f"data.dataset: {type(plugin).__qualname__} returned {type(data).__name__}, expected an "
                "fairfl.data.ArrayDataset"
            )
        if data.input_shape != signature.input_shape or data.num_classes != signature.num_classes:
            raise PluginError(
                f"data.dataset: {type(plugin).__qualname__} declares input_shape {signature.input_shape} and "
                f"{signature.num_classes} classes, but its data {data.name!r} has input_shape {data.input_shape} and "
                f"{data.num_classes} classes"
            )


# The partitioners' arguments that are the run's `data` fields by another name (the others have the field's name).
_FIELDS = {
    "num_clients": "data.num_clients",
    "shards_per_client": "data.shards_per_client",
    "alpha": "data.alpha",
    "min_size": "data.min_size",
    "group_sizes": "data.group_sizes",
    "group_classes": "data.group_classes",
    "samples_per_class": "data.samples_per_class",
    "group_alphas": "data.group_alphas",
    "train_label_sets": "data.min_size",  # a client without training data: min_size 0 allowed it
}


def _split(
    train: ArrayDataset,
    test: ArrayDataset,
    num_clients: int,
    partition: str,
    partition_rng: np.random.Generator,
    test_rng: np.random.Generator,
    *,
    shards_per_client: int,
    alpha: float,
    min_size: int,
    test_per_client: int | None,
    group_sizes: list[int] | None,
    group_classes: list[int] | None,
    samples_per_class: int | None,
    group_alphas: list[float] | None,
    test_split: str,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each client's train and test indices (build_federated's split); PartitionError when the data cannot hold it."""
    if partition == "iid":
        train_idx = partition_iid(train.y, num_clients, partition_rng)
    elif partition == "shards":
        train_idx = partition_shards(train.y, num_clients, shards_per_client, partition_rng)
    elif partition == "label_groups":
        sizes, classes = list(group_sizes or []), list(group_classes or [])
        if sum(sizes) != num_clients:
            raise PartitionError(
                "group_sizes", f"group_sizes {sizes} hold {sum(sizes)} clients, num_clients is {num_clients}"
            )
        train_idx = partition_label_groups(train.y, sizes, classes, partition_rng, samples_per_class)
    elif partition == "dirichlet_groups":
        sizes = list(group_sizes or [])
        if sum(sizes) != num_clients:
            raise PartitionError(
                "group_sizes", f"group_sizes {sizes} hold {sum(sizes)} clients, num_clients is {num_clients}"
            )
        train_idx = partition_dirichlet_groups(train.y, sizes, list(group_alphas or []), partition_rng, min_size)
    else:
        train_idx = partition_dirichlet(train.y, num_clients, alpha, partition_rng, min_size=min_size)

    size = len(test) // num_clients if test_per_client is None else test_per_client
    if size < 1:
        raise PartitionError(
            "size_per_client",
            f"test_per_client must be >= 1 (test set has {len(test)} samples for {num_clients} clients: fewer clients, "
            "or a test_per_client)",
        )
    if test_split == "iid":
        if size * num_clients > len(test):
            raise PartitionError(
                "size_per_client",
                f"test_split='iid' needs disjoint test sets: {num_clients} clients x {size} samples exceed the "
                f"{len(test)}-sample test set; lower test_per_client",
            )
        slices = np.split(test_rng.permutation(len(test))[: size * num_clients], num_clients)
        test_idx = [np.sort(part).astype(np.int64) for part in slices]
    else:
        test_idx = test_split_following([train.y[i] for i in train_idx], test.y, size, train.num_classes, test_rng)
    return train_idx, test_idx
