"""The sampler interface: plain dataclasses in and out, so the gRPC servicer and the aggregator's in-process
transport run exactly the same selection code (the in-process path is the oracle for the distributed one)."""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import ClassVar

import numpy as np
from numpy.typing import NDArray

from clustering_service.errors import InvalidInput
from clustering_service.state import RunState


class SelectionMethod(enum.IntEnum):
    """Mirrors fairfl.v1.SelectionMethod (same numbers), so conversion is `SelectionMethod(proto_value)`."""

    UNSPECIFIED = 0
    RANDOM = 1
    POWER_OF_CHOICE = 2
    CLUSTERED_SAMPLING = 3
    HICS = 4
    DIVFL = 5
    FULL = 6


@dataclass(frozen=True)
class SelectionParams:
    """Method-specific knobs (fairfl.v1.SelectionParams, and `selection.params` of an experiment). None = the
    method's default (the paper's value); each sampler accepts only the fields it lists in `Sampler.params_used`."""

    # HiCS-FL (seed-hicsfl.md §1.10): T of softmax(Δb/T), λ of the distance, γ0 of the annealing, M clusters
    # (0 = the number selected per round, the paper's M = K), 𝒯 for γ_t = γ0(1 − t/𝒯).
    temperature: float | None = None
    lambda_entropy: float | None = None
    gamma0: float | None = None
    num_clusters: int | None = None
    total_rounds: int | None = None
    # Rounds of random selection without replacement first (HiCS-FL, DivFL: ⌈N/K⌉; Clustered Sampling: 0).
    warmup_rounds: int | None = None
    # power-of-choice: d, the size of the candidate set whose losses are compared (0 = every candidate, the paper's
    # ideal setting; proto: `candidates`).
    choice_candidates: int | None = None
    # Code-parity options (seed-hicsfl.md §1.12): Ward on the distance rows as features, clients of a cluster equally
    # likely instead of ∝ data size, bias updates frozen after the warm-up.
    ward_rows_as_features: bool | None = None
    uniform_within_cluster: bool | None = None
    freeze_after_warmup: bool | None = None
    # Exact Ward up to this many clients; above, Ward on this many representatives (samplers/hierarchy.py).
    max_ward_points: int | None = None
    # Aggregator side, never sent: Clustered Sampling / DivFL similarities from count sketches of this many buckets
    # instead of the full updates (0 = exact).
    sketch_dim: int | None = None

    def given(self) -> list[str]:
        """Names of the fields that are set."""
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]


FLOAT_PARAMS = ("temperature", "lambda_entropy", "gamma0")
BOOL_PARAMS = ("ward_rows_as_features", "uniform_within_cluster", "freeze_after_warmup")
INT_PARAMS = ("num_clusters", "total_rounds", "warmup_rounds", "choice_candidates", "max_ward_points", "sketch_dim")


def param_label(field_name: str) -> str:
    """The name a person writes (config key, proto field): power-of-choice's d is `candidates`."""
    return "candidates" if field_name == "choice_candidates" else field_name


def check_param_values(params: SelectionParams) -> None:
    """Range checks shared by the service (INVALID_ARGUMENT) and config loading (ConfigError); names the field."""
    p = params
    if p.temperature is not None and not (math.isfinite(p.temperature) and p.temperature > 0):
        raise InvalidInput(f"temperature: must be > 0 and finite, got {p.temperature}")
    for name in ("lambda_entropy", "gamma0"):
        value = getattr(p, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise InvalidInput(f"{name}: must be >= 0 and finite, got {value}")
    for name in ("num_clusters", "warmup_rounds", "choice_candidates", "sketch_dim"):
        value = getattr(p, name)
        if value is not None and value < 0:
            raise InvalidInput(f"{param_label(name)}: must be >= 0, got {value}")
    if p.total_rounds is not None and p.total_rounds < 1:
        raise InvalidInput(f"total_rounds: must be >= 1, got {p.total_rounds}")
    if p.max_ward_points is not None and p.max_ward_points < 2:
        raise InvalidInput(f"max_ward_points: must be >= 2, got {p.max_ward_points}")


def _readonly(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True, eq=False)
class SelectionInput:
    """One selection request, validated and put in canonical order on construction.

    Candidates are sorted ascending and every aligned array (losses, sample counts, similarity rows and columns) is
    permuted with them, so a sampler's result depends only on the *set* of candidates, never on the caller's order.
    """

    run_id: str
    round: int
    num_to_select: int
    candidates: NDArray[np.int64]
    seed: int = 0
    params: SelectionParams = field(default_factory=SelectionParams)
    candidate_losses: NDArray[np.float64] | None = None  # aligned with candidates
    candidate_num_samples: NDArray[np.int64] | None = None  # aligned with candidates
    similarity: NDArray[np.float64] | None = None  # [n, n], rows/columns aligned with candidates

    def __post_init__(self) -> None:
        cands = np.asarray(self.candidates)
        if cands.ndim != 1 or (cands.size and not np.issubdtype(cands.dtype, np.integer)):
            raise InvalidInput(f"candidates must be a 1-D sequence of client ids, got shape {list(cands.shape)}")
        cands = cands.astype(np.int64)
        n = cands.size
        if n and cands.min() < 0:
            raise InvalidInput("candidates must be non-negative client ids")
        if self.round < 0 or self.seed < 0:
            raise InvalidInput(f"round and seed must be >= 0, got round={self.round} seed={self.seed}")
        if not 1 <= self.num_to_select <= n:
            raise InvalidInput(f"num_to_select must be in [1, {n}] (number of candidates), got {self.num_to_select}")
        order = np.argsort(cands, kind="stable")
        cands = cands[order]
        if n > 1 and (repeated := cands[1:][cands[1:] == cands[:-1]]).size:
            raise InvalidInput(f"candidates must be unique; repeated: {np.unique(repeated).tolist()}")
        object.__setattr__(self, "candidates", _readonly(cands))

        if self.candidate_losses is not None:
            losses = np.asarray(self.candidate_losses, dtype=np.float64)
            if losses.shape != (n,):
                raise InvalidInput(f"candidate_losses has {losses.size} values for {n} candidates")
            if not np.isfinite(losses).all():
                raise InvalidInput("candidate_losses contains NaN or inf")
            object.__setattr__(self, "candidate_losses", _readonly(losses[order]))
        if self.candidate_num_samples is not None:
            sizes = np.asarray(self.candidate_num_samples, dtype=np.int64)
            if sizes.shape != (n,):
                raise InvalidInput(f"candidate_num_samples has {sizes.size} values for {n} candidates")
            if (sizes < 0).any():
                raise InvalidInput("candidate_num_samples must be >= 0")
            object.__setattr__(self, "candidate_num_samples", _readonly(sizes[order]))
        if self.similarity is not None:
            sim = np.asarray(self.similarity, dtype=np.float64)
            if sim.shape != (n, n):
                raise InvalidInput(f"similarity must be [{n}, {n}] for {n} candidates, got {list(sim.shape)}")
            if not np.isfinite(sim).all():
                raise InvalidInput("similarity contains NaN or inf")
            object.__setattr__(self, "similarity", _readonly(sim[np.ix_(order, order)]))


@dataclass(frozen=True)
class SelectionOutput:
    """Selected client ids, ascending (Clustered Sampling may repeat one: a client drawn twice); `cluster_of_selected`
    is aligned with them, or empty for methods that do not cluster. `seconds` is the time the sampler took (not part
    of equality: the oracle compares choices only).

    `needs_losses`: not a selection yet. `selected` are the clients whose losses at the global model the caller must
    measure and send back (as `candidates` with `candidate_losses`) in a second call for the same round
    (power-of-choice's candidate set)."""

    selected: tuple[int, ...]
    cluster_of_selected: tuple[int, ...] = ()
    seconds: float = field(default=0.0, compare=False)
    needs_losses: bool = False

    def __post_init__(self) -> None:
        selected = [int(c) for c in self.selected]
        clusters = [int(c) for c in self.cluster_of_selected]
        if clusters and len(clusters) != len(selected):
            raise ValueError(f"{len(clusters)} cluster labels for {len(selected)} selected clients")
        order = sorted(range(len(selected)), key=selected.__getitem__)
        object.__setattr__(self, "selected", tuple(selected[i] for i in order))
        object.__setattr__(self, "cluster_of_selected", tuple(clusters[i] for i in order) if clusters else ())


class Sampler(ABC):
    """One selection method. Instances hold no per-run data: anything that must persist goes into `RunState`."""

    method: ClassVar[SelectionMethod]
    params_used: ClassVar[tuple[str, ...]] = ()  # the SelectionParams fields this method reads

    def check_params(self, params: SelectionParams) -> None:
        """Refuse fields this method does not read (a typo or a wrong method must not pass silently) and bad values."""
        unused = [name for name in params.given() if name not in self.params_used]
        if unused:
            valid = ", ".join(map(param_label, self.params_used)) or "none"
            raise InvalidInput(
                f"params.{param_label(unused[0])} does not apply to {self.method.name}; its parameters: {valid}"
            )
        try:
            check_param_values(params)
        except InvalidInput as err:
            raise InvalidInput(f"params.{err}") from None

    @abstractmethod
    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        """Choose clients from `request.candidates`; deterministic for a given request and state."""


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
