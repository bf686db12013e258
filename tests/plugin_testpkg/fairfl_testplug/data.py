"""A user's dataset: scikit-learn's bundled digits (1797 8x8 images, 10 classes), split deterministically."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fairfl.api import ArrayDataset, ConfigError, DataRequest, Dataset, DataSignature


@dataclass(frozen=True)
class DigitsParams:
    test_every: int = 4  # every test_every-th sample goes to the test split

    def validate(self, path: str) -> None:
        if self.test_every < 2:
            raise ConfigError(f"{path}.test_every: must be >= 2, got {self.test_every}")


class Digits(Dataset):
    Params = DigitsParams

    def signature(self, params: DigitsParams) -> DataSignature:
        return DataSignature((1, 8, 8), 10)

    def load(self, split: str, params: DigitsParams, request: DataRequest) -> ArrayDataset:
        from sklearn.datasets import load_digits  # ships with scikit-learn: nothing is downloaded

        digits = load_digits()
        x = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
        y = digits.target.astype(np.int64)
        test = np.arange(len(y)) % params.test_every == 0
        keep = test if split == "test" else ~test
        return ArrayDataset(np.ascontiguousarray(x[keep]), y[keep], 10, f"digits-{split}")
