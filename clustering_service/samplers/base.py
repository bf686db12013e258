"""The sampler interface: plain dataclasses in and out, so the gRPC servicer and the aggregator's in-process
transport run exactly the same selection code (the in-process path is the oracle for the distributed one)."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
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
    """Method-specific knobs (fairfl.v1.SelectionParams); each sampler reads only its own."""

    # HiCS-FL
    temperature: float = 0.0
    lambda_entropy: float = 0.0
    gamma0: float = 0.0
    num_clusters: int = 0
    total_rounds: int = 0
    warmup_rounds: int = 0
    # power-of-choice: d, the size of the candidate set whose losses are compared (proto: `candidates`)
    choice_candidates: int = 0


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
    """Selected client ids, ascending; `cluster_of_selected` is aligned with them, or empty for methods that do not
    cluster. `seconds` is the time the sampler took (not part of equality: the oracle compares choices only)."""

    selected: tuple[int, ...]
    cluster_of_selected: tuple[int, ...] = ()
    seconds: float = field(default=0.0, compare=False)

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

    @abstractmethod
    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        """Choose clients from `request.candidates`; deterministic for a given request and state."""
