"""Helpers shared by the built-in samplers (warm-up blocks, Gumbel-top-k, seeded per-round randomness, parameter
range checks). The sampler interface itself is public, on the ground floor: fairfl.sampling."""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from fairfl.sampling import InvalidInput, Sampler, SelectionInput, SelectionOutput
from fairfl.schema import ConfigError

__all__ = [
    "Sampler",
    "SelectionInput",
    "SelectionOutput",
    "check_at_least",
    "check_finite",
    "data_sizes",
    "gumbel_top_k",
    "require_similarity",
    "round_rng",
    "warmup_block",
    "warmup_selection",
]


def check_finite(params: object, names: tuple[str, ...], path: str, positive: bool = False) -> None:
    """Each of `names` that is set is finite and > 0 (`positive`) or >= 0; ConfigError naming `path.name`."""
    for name in names:
        value = getattr(params, name)
        if value is not None and not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
            raise ConfigError(f"{path}.{name}: must be {'> 0' if positive else '>= 0'} and finite, got {value}")


def check_at_least(params: object, names: tuple[str, ...], minimum: int, path: str) -> None:
    """Each of `names` that is set is >= `minimum`; ConfigError naming `path.name`."""
    for name in names:
        value = getattr(params, name)
        if value is not None and value < minimum:
            raise ConfigError(f"{path}.{name}: must be >= {minimum}, got {value}")


# --- helpers shared by samplers -------------------------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """splitmix64's finaliser, element-wise (uint64 arithmetic wraps, which is the point)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def warmup_block(candidates: NDArray[np.int64], count: int, seed: int, round_number: int) -> NDArray[np.int64]:
    """Warm-up round `round_number` (1-based) of random selection without replacement (seed-hicsfl.md Alg. 1 l. 3-4):
    block t of the candidates in a seeded random order, so rounds 1..⌈N/K⌉ visit every client exactly once.

    The order comes from a keyed hash of each client id, not from the round or the list, so the selection is
    stateless (a retried or replayed round gets the same block) and a client's place does not move when others
    come and go. The last block is short when K does not divide N (§1.11.5).
    """
    with np.errstate(over="ignore"):
        key = _mix64(np.array([seed], dtype=np.uint64))[0] ^ (candidates.astype(np.uint64) * _GOLDEN)
        key = _mix64(key)
    order = candidates[np.argsort(key, kind="stable")]
    start = max(round_number - 1, 0) * count
    return order[start : start + count]


def warmup_selection(request: SelectionInput, warmup_rounds: int) -> SelectionOutput | None:
    """This round's warm-up block while `request.round` <= `warmup_rounds`; None after the warm-up (or when the block
    is empty: fewer candidates than the warm-up expected)."""
    if warmup_rounds > 0 and request.round <= warmup_rounds:
        block = warmup_block(request.candidates, request.num_to_select, request.seed, request.round)
        if block.size:
            return SelectionOutput(selected=tuple(block.tolist()))
    return None


def require_similarity(request: SelectionInput, method: str) -> NDArray[np.float64]:
    """The update-similarity matrix a model-similarity sampler needs; InvalidInput naming the method if absent."""
    if request.similarity is None:
        raise InvalidInput(
            f"{method} needs similarity: the Gram matrix (inner products) of the candidates' last updates"
        )
    return request.similarity


def gumbel_top_k(log_weights: NDArray[np.float64], count: int, rng: np.random.Generator) -> NDArray[np.int64]:
    """Indices of `count` items drawn one by one without replacement, each ∝ exp(log_weights) among those left
    (Gumbel-top-k: the same distribution as the sequential draw, in one vectorised pass). -inf weights are never
    drawn unless nothing else is left."""
    keys = log_weights + rng.gumbel(size=log_weights.size)
    return np.argsort(-keys, kind="stable")[:count]


def data_sizes(sizes: NDArray[np.int64] | NDArray[np.float64]) -> NDArray[np.float64]:
    """Sampling weights from data sizes: a client of unknown (0) size counts as the mean known size (1 when nothing
    is known), so it can still be drawn."""
    sizes = np.asarray(sizes, dtype=np.float64)
    positive = sizes > 0
    fill = sizes[positive].mean() if positive.any() else 1.0
    return np.where(positive, sizes, fill)


def round_rng(seed: int, round_number: int) -> np.random.Generator:
    """The randomness of one round's selection: independent per (seed, round), the same in every transport."""
    return np.random.default_rng([seed, round_number])
