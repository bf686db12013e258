"""FairFL's public API: what a user imports to bring their own models, datasets, strategies, samplers and
client-side procedures. Everything not exported here is internal and may change between versions.

A plug-in is named in an experiment config by a registered name or by `package.module:attr`:

    model:     {name: my_pkg.models:small_cnn, params: {channels: 16}}
    data:      {dataset: my_pkg.data:CsvFolder, params: {path: /data/site}}
    strategy:  {name: my_pkg.robust:TrimmedMean, params: {trim: 0.1}}
    selection: {method: my_pkg.sampling:RoundRobin}

`module:attr` is imported in every process that needs the plug-in (the aggregator, each agent, the clustering
service, every `fairfl compare` worker), so the module must be importable there (installed, or on PYTHONPATH). A
distribution can instead register names through entry points of the groups in `ENTRY_POINT_GROUPS`; FairFL's own
built-ins are registered exactly that way (see pyproject.toml). `register_*` names a plug-in in the current process
only: enough for in-process runs and tests, not for services started as their own processes.

Each plug-in declares its parameters as a dataclass `Params` (every field with a default); the config's `params`
mapping is checked against it with the config's own validation (unknown keys, types, `Params.validate(path)`), and
each plug-in declares its capabilities on itself (a strategy's DP support, the selection it requires, the client
signatures it reads; a sampler's needs). A plug-in that cannot be imported, has the wrong shape, lacks what the run
needs or gets a bad parameter fails when the config is loaded, before round 1, with an error naming the field.
The guide with examples is docs/extending.md.
"""

from __future__ import annotations

from typing import Any

from fairfl.config import ExperimentConfig
from fairfl.data.datasets import ArrayDataset
from fairfl.data.federated import FederatedData
from fairfl.data.plugin import DATASETS, DataProvider, DataRequest, Dataset
from fairfl.data.signature import DataSignature
from fairfl.data.site import SiteClient, SiteData, SiteDataError, open_site
from fairfl.fold import ResultFold, sample_weighted
from fairfl.models import MODELS, Head, HeadError, ModelFactory, model_factory, model_head
from fairfl.plugins import NoParams, PluginError, Registry
from fairfl.procedure import PROCEDURES, LocalProcedure, LocalState, attach_procedure, register_procedure
from fairfl.protocol import EVALUATE, FIRST_STEP_UPDATE, GRADIENT, PROBE, TRAIN, UPDATE, ClientResult
from fairfl.sampling import (
    SAMPLERS,
    InvalidInput,
    RunState,
    Sampler,
    SelectionInput,
    SelectionOutput,
    Signature,
    register_sampler,
)
from fairfl.schema import ConfigError
from fairfl.strategy import (
    STRATEGIES,
    AggregateOutcome,
    PhasePlan,
    RoundContext,
    Strategy,
    phase_folds,
    register_strategy,
    train_results,
    weighted_sum,
)

__all__ = [
    "DATASETS",
    "ENTRY_POINT_GROUPS",
    "EVALUATE",
    "FIRST_STEP_UPDATE",
    "GRADIENT",
    "MODELS",
    "PROBE",
    "PROCEDURES",
    "SAMPLERS",
    "STRATEGIES",
    "TRAIN",
    "UPDATE",
    "AggregateOutcome",
    "ArrayDataset",
    "ClientResult",
    "ConfigError",
    "DataProvider",
    "DataRequest",
    "DataSignature",
    "Dataset",
    "ExperimentConfig",
    "FederatedData",
    "Head",
    "HeadError",
    "InvalidInput",
    "LocalProcedure",
    "LocalState",
    "ModelFactory",
    "NoParams",
    "PhasePlan",
    "PluginError",
    "Registry",
    "ResultFold",
    "RoundContext",
    "RunState",
    "Sampler",
    "SelectionInput",
    "SelectionOutput",
    "Signature",
    "SiteClient",
    "SiteData",
    "SiteDataError",
    "Strategy",
    "attach_procedure",
    "model_factory",
    "model_head",
    "open_site",
    "phase_folds",
    "register_dataset",
    "register_model",
    "register_procedure",
    "register_sampler",
    "register_strategy",
    "sample_weighted",
    "train_results",
    "weighted_sum",
]

# Entry-point group of each kind of plug-in: `[project.entry-points."fairfl.strategies"] my_name = "pkg.mod:Cls"`.
ENTRY_POINT_GROUPS: dict[str, str] = {
    registry.group.removeprefix("fairfl."): registry.group
    for registry in (MODELS, DATASETS, STRATEGIES, SAMPLERS, PROCEDURES)
}


def register_model(name: str, factory: Any) -> Any:
    """Name a model factory (`factory(signature: DataSignature, **params) -> nn.Module`) in this process."""
    return MODELS.register(name, factory)


def register_dataset(name: str, plugin: Any) -> Any:
    """Name a Dataset or DataProvider (an instance, or a subclass built without arguments) in this process."""
    return DATASETS.register(name, plugin)
