"""Datasets, dataset plug-ins, federated partitioners and the federated view used by clients and the aggregator."""

from fairfl.data.datasets import (
    ENV_DATA_DIR,
    ArrayDataset,
    DatasetNotFoundError,
    clear_cache,
    load_dataset,
    parse_idx,
)
from fairfl.data.federated import PARTITIONS, FederatedData, build_federated
from fairfl.data.groups import GROUPED_PARTITIONS, client_groups
from fairfl.data.lazy import LazyRows, gather_rows, is_lazy, iter_row_chunks
from fairfl.data.partition import (
    partition_dirichlet,
    partition_dirichlet_groups,
    partition_iid,
    partition_label_groups,
    partition_shards,
    test_split_following,
)
from fairfl.data.plugin import DATASETS, DataProvider, DataRequest, Dataset, NoParams, resolve_dataset
from fairfl.data.run import load_run_data, run_dataset, run_signature
from fairfl.data.signature import DataSignature
from fairfl.data.site import SITE, SiteClient, SiteData, SiteDataError, open_site
from fairfl.data.synthetic import synthetic_leaf

__all__ = [
    "DATASETS",
    "ENV_DATA_DIR",
    "GROUPED_PARTITIONS",
    "PARTITIONS",
    "SITE",
    "ArrayDataset",
    "DataProvider",
    "DataRequest",
    "DataSignature",
    "Dataset",
    "DatasetNotFoundError",
    "FederatedData",
    "LazyRows",
    "NoParams",
    "SiteClient",
    "SiteData",
    "SiteDataError",
    "build_federated",
    "clear_cache",
    "client_groups",
    "gather_rows",
    "is_lazy",
    "iter_row_chunks",
    "load_dataset",
    "load_run_data",
    "open_site",
    "parse_idx",
    "partition_dirichlet",
    "partition_dirichlet_groups",
    "partition_iid",
    "partition_label_groups",
    "partition_shards",
    "resolve_dataset",
    "run_dataset",
    "run_signature",
    "synthetic_leaf",
    "test_split_following",
]
