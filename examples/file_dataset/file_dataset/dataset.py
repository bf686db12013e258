"""A dataset read from CSV files: `<directory>/train.csv` and `<directory>/test.csv`, a header line, then one row
per sample with the integer label first and the features after it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fairfl.api import ArrayDataset, ConfigError, DataRequest, Dataset, DataSignature


@dataclass(frozen=True)
class CsvFolderParams:
    """`data.params`, checked when the config loads (unknown keys, types, then `validate`)."""

    directory: str = ""  # holds train.csv and test.csv; a relative path is taken from the working directory
    num_features: int = 64  # feature columns after the label
    num_classes: int = 10  # labels are 0 .. num_classes - 1

    def validate(self, path: str) -> None:
        if not self.directory:
            raise ConfigError(f"{path}.directory: required (the folder with train.csv and test.csv)")
        if self.num_features < 1 or self.num_classes < 2:
            raise ConfigError(f"{path}: need num_features >= 1 and num_classes >= 2")


class CsvFolder(Dataset):
    """A central dataset: the run's `data.partition` splits its train split among the clients."""

    Params = CsvFolderParams

    def signature(self, params: CsvFolderParams) -> DataSignature:
        # Declared from the parameters, not read from the files: the aggregator builds the model without any data.
        return DataSignature((params.num_features,), params.num_classes)

    def load(self, split: str, params: CsvFolderParams, request: DataRequest) -> ArrayDataset:
        x, y = _read(str(Path(params.directory) / f"{split}.csv"), params.num_features, params.num_classes)
        return ArrayDataset(x, y, params.num_classes, f"csv:{split}")


@functools.lru_cache(maxsize=4)  # one agent hosts many clients: read each file once per process
def _read(path: str, num_features: int, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such file (write it with examples/file_dataset/make_digits.py)")
    table = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64, ndmin=2)
    if table.shape[1] != 1 + num_features:
        raise ValueError(f"{path}: {table.shape[1]} columns, expected a label and {num_features} features")
    x, y = table[:, 1:].astype(np.float32), table[:, 0].astype(np.int64)
    if y.min() < 0 or y.max() >= num_classes:
        raise ValueError(f"{path}: labels outside [0, {num_classes})")
    x.flags.writeable = y.flags.writeable = False  # shared by every client of the process
    return x, y
