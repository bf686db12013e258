"""LEAF's Synthetic(α, β) federated dataset (Shamir et al. 2014; Li et al., FedProx 2020).

α controls how much the clients' *models* differ, β how much their *inputs* differ. Each client k draws
u_k ~ N(0, α), B_k ~ N(0, β); W_k ~ N(u_k, 1) (num_classes × dim), b_k ~ N(u_k, 1), v_k ~ N(B_k, 1) (dim);
x ~ N(v_k, Σ) with Σ = diag(j^-1.2); y = argmax(softmax(W_k x + b_k)). As in the reference generator, α and β are used
as standard deviations (identical to variances for the usual α = β = 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fairfl.data.datasets import ArrayDataset
from fairfl.data.federated import FederatedData
from fairfl.data.plugin import DataProvider, DataRequest
from fairfl.data.signature import DataSignature
from fairfl.schema import ConfigError

DIM = 60
NUM_CLASSES = 10


def synthetic_leaf(
    alpha: float,
    beta: float,
    num_clients: int,
    seed: int,
    dim: int = DIM,
    num_classes: int = NUM_CLASSES,
    test_fraction: float = 0.2,
    min_samples: int = 50,
    max_samples: int = 1000,
) -> tuple[ArrayDataset, ArrayDataset, list[np.ndarray], list[np.ndarray]]:
    """Generate Synthetic(α, β); returns (train, test, per-client train indices, per-client test indices).

    Client sizes follow lognormal(4, 2) clipped to [min_samples, max_samples] (power-law-like imbalance as in LEAF).
    Each client holds out ``test_fraction`` of its own samples (at least one, leaving at least one for training), so
    its test set comes from its own distribution. Pooled arrays store clients contiguously, train and test alike.
    """
    if alpha < 0 or beta < 0:
        raise ValueError(f"alpha and beta must be >= 0, got alpha={alpha!r}, beta={beta!r}")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients!r}")
    if dim < 1 or num_classes < 2:
        raise ValueError(f"dim must be >= 1 and num_classes >= 2, got dim={dim!r}, num_classes={num_classes!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    if not 2 <= min_samples <= max_samples:
        raise ValueError(f"need 2 <= min_samples <= max_samples, got {min_samples} and {max_samples}")

    rng = np.random.default_rng(seed)
    sizes = np.clip(rng.lognormal(4.0, 2.0, num_clients).astype(np.int64), min_samples, max_samples)
    u = rng.normal(0.0, alpha, num_clients)
    big_b = rng.normal(0.0, beta, num_clients)
    std_x = np.arange(1, dim + 1, dtype=np.float64) ** -0.6  # sqrt of Σ_jj = j^-1.2

    train_x, train_y, test_x, test_y = [], [], [], []
    train_idx: list[np.ndarray] = []
    test_idx: list[np.ndarray] = []
    n_train = n_test = 0
    for k in range(num_clients):  # loop over clients only; samples are drawn as whole matrices
        w = rng.normal(u[k], 1.0, (num_classes, dim))
        b = rng.normal(u[k], 1.0, num_classes)
        v = rng.normal(big_b[k], 1.0, dim)
        x = v + rng.standard_normal((sizes[k], dim)) * std_x
        y = np.argmax(x @ w.T + b, axis=1)  # softmax is monotone, so argmax of the logits suffices
        n_te = min(max(1, round(sizes[k] * test_fraction)), sizes[k] - 1)
        perm = rng.permutation(sizes[k])
        te, tr = perm[:n_te], perm[n_te:]
        train_x.append(x[tr])
        train_y.append(y[tr])
        test_x.append(x[te])
        test_y.append(y[te])
        train_idx.append(np.arange(n_train, n_train + len(tr), dtype=np.int64))
        test_idx.append(np.arange(n_test, n_test + len(te), dtype=np.int64))
        n_train += len(tr)
        n_test += len(te)

    name = f"synthetic({alpha},{beta})"

    def pooled(xs: list[np.ndarray], ys: list[np.ndarray]) -> ArrayDataset:
        return ArrayDataset(
            np.concatenate(xs).astype(np.float32), np.concatenate(ys).astype(np.int64), num_classes, name
        )

    return pooled(train_x, train_y), pooled(test_x, test_y), train_idx, test_idx


@dataclass(frozen=True)
class SyntheticParams:
    """`data.params` of synthetic: LEAF's α (how much the clients' models differ) and β (how much their inputs do)."""

    alpha: float = 1.0
    beta: float = 1.0

    def validate(self, path: str) -> None:
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{path}.{name}: must be >= 0 and finite, got {value}")


class Synthetic(DataProvider):
    """LEAF's Synthetic(α, β): every client's data generated from the run seed, with its own train/test split."""

    Params = SyntheticParams

    def signature(self, params: Any) -> DataSignature:
        return DataSignature((DIM,), NUM_CLASSES)

    def clients(self, params: Any, request: DataRequest) -> FederatedData:
        train, test, train_idx, test_idx = synthetic_leaf(params.alpha, params.beta, request.num_clients, request.seed)
        return FederatedData(train, test, train_idx, test_idx)


SYNTHETIC = Synthetic()
