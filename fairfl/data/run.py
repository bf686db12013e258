"""A run's data from its config: the declared signature (every process) and the federated split (agents).

Both read `data.dataset` and `data.params` through the dataset registry, so a plug-in named by `module:attr` works in
whichever process needs it: the aggregator (signature only: it holds no data) and every agent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fairfl.data.federated import FederatedData, build_federated
from fairfl.data.plugin import DataPlugin, dataset_params, dataset_signature_of, resolve_dataset
from fairfl.data.signature import DataSignature

if TYPE_CHECKING:
    from fairfl.config import DataConfig, ExperimentConfig

__all__ = ["load_run_data", "run_dataset", "run_signature"]


def run_dataset(data: DataConfig, path: str = "data") -> tuple[DataPlugin, Any]:
    """The configured dataset plug-in and its parsed parameters; PluginError naming `<path>.dataset` or
    `<path>.params.<key>` when either is wrong."""
    plugin = resolve_dataset(data.dataset, f"{path}.dataset")
    return plugin, dataset_params(plugin, data.params, f"{path}.params")


def run_signature(config: ExperimentConfig) -> DataSignature:
    """Input shape and class count of the run's data, from the dataset plug-in's declaration (no data loaded)."""
    plugin, params = run_dataset(config.data)
    return dataset_signature_of(plugin, params, "data.dataset")


def load_run_data(config: ExperimentConfig) -> FederatedData:
    """The run's federated split; every process derives the same one from the config and seed."""
    d = config.data
    plugin, params = run_dataset(d)
    return build_federated(
        plugin,
        d.num_clients,
        d.partition,
        config.seed,
        root=d.root,
        download=d.download,
        shards_per_client=d.shards_per_client,
        alpha=d.alpha,
        min_size=d.min_size,
        test_per_client=d.test_per_client,
        params=params,
        group_sizes=d.group_sizes,
        group_classes=d.group_classes,
        samples_per_class=d.samples_per_class,
        group_alphas=d.group_alphas,
        test_split=d.test_split,
    )
