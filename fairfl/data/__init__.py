"""Datasets, federated partitioners and the federated view used by clients and the aggregator."""

from fairfl.data.datasets import (
    DATASET_NAMES,
    ENV_DATA_DIR,
    ArrayDataset,
    DatasetNotFoundError,
    clear_cache,
    load_dataset,
    parse_idx,
)
from fairfl.data.federated import PARTITIONS, FederatedData, build_federated
from fairfl.data.groups import GROUPED_PARTITIONS, client_groups
from fairfl.data.partition import (
    partition_dirichlet,
    partition_dirichlet_groups,
    partition_iid,
    partition_label_groups,
    partition_shards,
    test_split_following,
)
from fairfl.data.synthetic import synthetic_leaf

__all__ = [
    "DATASET_NAMES",
    "ENV_DATA_DIR",
    "GROUPED_PARTITIONS",
    "PARTITIONS",
    "ArrayDataset",
    "DatasetNotFoundError",
    "FederatedData",
    "build_federated",
    "clear_cache",
    "client_groups",
    "load_dataset",
    "parse_idx",
    "partition_dirichlet",
    "partition_dirichlet_groups",
    "partition_iid",
    "partition_label_groups",
    "partition_shards",
    "synthetic_leaf",
    "test_split_following",
]
