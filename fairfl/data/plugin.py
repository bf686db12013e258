"""Dataset plug-ins: the two shapes a run's data can come in, and their registry (group `fairfl.datasets`).

- A `Dataset` is a central labelled set (fashion_mnist, mnist, cifar10): it declares its signature and loads its
  train and test splits; the run's `data.partition` and `data.test_split` split them among the clients.
- A `DataProvider` builds every client's data itself (synthetic: generated per client; a site's own files): it
  declares its signature and returns the clients' data; `data.partition` and `data.test_split` do not apply.

`data.dataset` names one by a registered name or `package.module:attr` (an instance, or a subclass built without
arguments); `data.params` are its declared `Params` (a dataclass, checked like the rest of the config). The
signature is declared, not read off the arrays, because the aggregator builds the initial model without any data.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fairfl.data.signature import DataSignature
from fairfl.plugins import NoParams, PluginError, Registry, parse_params

if TYPE_CHECKING:
    from fairfl.data.datasets import ArrayDataset
    from fairfl.data.federated import FederatedData

__all__ = [
    "DATASETS",
    "DataPlugin",
    "DataProvider",
    "DataRequest",
    "Dataset",
    "NoParams",
    "dataset_params",
    "dataset_signature_of",
    "resolve_dataset",
]


@dataclass(frozen=True)
class DataRequest:
    """What a run asks of its data besides the plug-in's own parameters (the `data:` fields every dataset shares)."""

    root: str | None = None  # data.root: where to look for files first
    download: bool = False  # data.download: whether fetching missing files is allowed
    num_clients: int = 1  # data.num_clients
    seed: int = 0  # the run seed: the same request always gives the same data


class Dataset(ABC):
    """A central dataset whose train split the run's `data.partition` splits among the clients."""

    Params: ClassVar[type] = NoParams
    partitions_itself: ClassVar[bool] = False
    at_sites: ClassVar[bool] = False  # True: the data is at the sites' agents (fairfl.data.site), never loaded here

    @abstractmethod
    def signature(self, params: Any) -> DataSignature:
        """Input shape and class count, known without loading anything."""

    @abstractmethod
    def load(self, split: str, params: Any, request: DataRequest) -> ArrayDataset:
        """The whole `split` ('train' or 'test'); the same arguments must always give the same arrays."""


class DataProvider(ABC):
    """Builds each client's train and test data itself; the run's partition settings do not apply to it."""

    Params: ClassVar[type] = NoParams
    partitions_itself: ClassVar[bool] = True
    at_sites: ClassVar[bool] = False  # True: the data is at the sites' agents (fairfl.data.site), never loaded here

    @abstractmethod
    def signature(self, params: Any) -> DataSignature:
        """Input shape and class count, known without building anything."""

    @abstractmethod
    def clients(self, params: Any, request: DataRequest) -> FederatedData:
        """`request.num_clients` clients' data, the same for the same request in every process."""


DataPlugin = Dataset | DataProvider


def _check(obj: Any) -> str | None:
    if isinstance(obj, Dataset | DataProvider):
        return None
    if isinstance(obj, type) and issubclass(obj, Dataset | DataProvider):
        return None
    return (
        f"expected a fairfl.data Dataset or DataProvider (an instance or a subclass), got {type(obj).__name__} {obj!r}"
    )


DATASETS: Registry[Any] = Registry("dataset", "fairfl.datasets", _check)


def resolve_dataset(ref: str | DataPlugin | type, field: str = "data.dataset") -> DataPlugin:
    """The dataset plug-in `ref` names (or is), as an instance; PluginError naming `field` otherwise."""
    obj = DATASETS.load(ref, field) if isinstance(ref, str) else ref
    reason = _check(obj)
    if reason is not None:
        raise PluginError(f"{field}: {obj!r} is not a dataset: {reason}")
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as err:  # a subclass that needs constructor arguments, or raises: say which and why
            raise PluginError(
                f"{field}: cannot instantiate dataset class {obj.__qualname__} without arguments "
                f"({type(err).__name__}: {err}); register an instance instead"
            ) from None
    return obj


def dataset_params(plugin: DataPlugin, raw: Any, path: str = "data.params") -> Any:
    """`data.params` parsed into the plug-in's declared Params (unknown keys and mistyped values name `path`)."""
    return parse_params(getattr(plugin, "Params", NoParams), raw, path)


def dataset_signature_of(plugin: DataPlugin, params: Any, field: str = "data.dataset") -> DataSignature:
    """The plug-in's declared signature, checked to be a DataSignature; PluginError naming `field` otherwise."""
    try:
        signature = plugin.signature(params)
    except PluginError:
        raise
    except Exception as err:
        raise PluginError(f"{field}: {_name(plugin)}.signature() failed: {type(err).__name__}: {err}") from None
    if not isinstance(signature, DataSignature):
        raise PluginError(
            f"{field}: {_name(plugin)}.signature() returned {type(signature).__name__}, expected a "
            "fairfl.data.DataSignature"
        )
    return signature


def _name(plugin: Any) -> str:
    return type(plugin).__qualname__
