"""The sampler API (public, ground floor): what a client-selection method implements and what it is given.

A sampler is a `Sampler` subclass named in `selection.method` by a registered name (`hics`) or by
`package.module:attr`. It declares its parameters as a dataclass (`Params`, read from `selection.params` with the
config's validation) and what it needs from the run as class attributes, which config validation and the aggregator
read instead of lists of names:

- `uniform`: every candidate is equally likely whatever the clients sent (random, full); only such samplers may run
  under DP, whose accounting assumes uniform sampling.
- `client_signatures`: the per-client vectors trained clients must report (`"bias_update"`: HiCS-FL's output-layer
  bias updates), stored in the run's `RunState` and readable with `RunState.gather`.
- `needs_losses`: the sampler may answer `needs_losses` (power-of-choice): the aggregator probes those candidates'
  losses at the global model and asks again with them.
- `needs_similarity`: the sampler reads `SelectionInput.similarity`, the Gram matrix of the candidates' last updates.
- `validate_run(params, cfg)`: rules across config sections; `run_params(params, cfg)`: values the run supplies.

Selection runs in the clustering service (the sampler is resolved there through the same registry, so a user's
sampler runs in that process) or in-process; both build the same `SelectionInput` and get the same `SelectionOutput`.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from fairfl.plugins import NoParams, PluginError, Registry, coerce_params
from fairfl.schema import ConfigError

if TYPE_CHECKING:
    from fairfl.config import ExperimentConfig

__all__ = [
    "SAMPLERS",
    "SIGNATURE_FIELDS",
    "InvalidInput",
    "NoParams",
    "RunState",
    "Sampler",
    "SelectionInput",
    "SelectionOutput",
    "Signature",
    "register_sampler",
    "resolve_params",
]


class InvalidInput(ValueError):
    """A selection request (or signature report) is unusable; the message names what and why. The clustering service
    answers it with INVALID_ARGUMENT."""


# -- per-run state: the latest signature of every client ---------------------------------------------------------------

SIGNATURE_FIELDS = ("bias_update", "activation")  # the vectors a client signature may carry


def _signature_vector(client_id: int, name: str, value: Any) -> NDArray[np.float64] | None:
    """Validate one signature vector and store it as a read-only float64 copy (safe to share across threads)."""
    if value is None:
        return None
    arr = np.asarray(value)
    if arr.dtype not in (np.float32, np.float64):
        raise InvalidInput(f"client {client_id}: {name} must be float32 or float64, got {arr.dtype}")
    if arr.ndim != 1:
        raise InvalidInput(f"client {client_id}: {name} must be 1-D, got shape {list(arr.shape)}")
    if arr.size == 0:
        raise InvalidInput(f"client {client_id}: {name} is empty")
    if not np.isfinite(arr).all():
        raise InvalidInput(f"client {client_id}: {name} contains NaN or inf")
    out = np.array(arr, dtype=np.float64, copy=True)
    out.flags.writeable = False
    return out


@dataclass(frozen=True, eq=False)
class Signature:
    """What one client reported after training in `round`. Vectors are float64, 1-D, finite and read-only."""

    client_id: int
    round: int
    num_samples: int
    bias_update: NDArray[np.float64] | None = None
    activation: NDArray[np.float64] | None = None
    loss: float = 0.0

    def __post_init__(self) -> None:
        for name in ("client_id", "round", "num_samples"):
            if int(getattr(self, name)) < 0:
                raise InvalidInput(f"client {self.client_id}: {name} must be >= 0, got {getattr(self, name)}")
        if not math.isfinite(self.loss):
            raise InvalidInput(f"client {self.client_id}: loss must be finite, got {self.loss}")
        for name in SIGNATURE_FIELDS:
            object.__setattr__(self, name, _signature_vector(self.client_id, name, getattr(self, name)))


class RunState:
    """State of one run. Signature access is locked; samplers that keep their own state use `lock` + `sampler_state`.

    HiCS-FL samples over *all* clients using the last bias update each one reported, so signatures outlive the round
    that produced them. Everything is in memory: a restarted service rebuilds state from the next reports."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.lock = threading.RLock()
        # Free-form per-run scratch for stateful samplers (e.g. HiCS-FL's frozen bias updates); guarded by `lock`.
        self.sampler_state: dict[str, Any] = {}
        self._signatures: dict[int, Signature] = {}
        self._dims: dict[str, int] = {}  # vector field -> the length every client of this run must use
        self._tables: dict[str, tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.float64]]] = {}

    def put(self, signatures: Iterable[Signature]) -> int:
        """Store a batch atomically (all or nothing) and return how many were stored.

        A report older than the stored one for that client is ignored (late delivery must not roll state back);
        a report for the same round replaces it, so retries are idempotent.
        """
        batch = list(signatures)
        ids = [s.client_id for s in batch]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise InvalidInput(f"clients {dup} appear more than once in one report")
        with self.lock:
            dims = dict(self._dims)
            for sig in batch:
                for name in SIGNATURE_FIELDS:
                    vec = getattr(sig, name)
                    if vec is None:
                        continue
                    expected = dims.setdefault(name, vec.size)
                    if vec.size != expected:
                        raise InvalidInput(
                            f"client {sig.client_id}: {name} has length {vec.size} but run {self.run_id!r} "
                            f"uses length {expected}"
                        )
            stored = 0
            for sig in batch:
                old = self._signatures.get(sig.client_id)
                if old is not None and sig.round < old.round:
                    continue
                self._signatures[sig.client_id] = sig
                stored += 1
            self._dims = dims
            if stored:
                self._tables.clear()
            return stored

    def get(self, client_id: int) -> Signature | None:
        with self.lock:
            return self._signatures.get(client_id)

    def signatures(self) -> dict[int, Signature]:
        """A snapshot (signatures are immutable, so a shallow copy is enough)."""
        with self.lock:
            return dict(self._signatures)

    def gather(
        self, name: str, client_ids: NDArray[np.int64]
    ) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.bool_]]:
        """The stored `name` vectors ([n, dim], zero rows for clients without one), data sizes (0 where unknown) and
        a has-vector mask of `client_ids`, gathered with one vectorised lookup into a table rebuilt only after a put
        (samplers over 10,000 clients read it every round)."""
        with self.lock:
            table = self._tables.get(name)
            if table is None:
                sigs = [s for s in self._signatures.values() if getattr(s, name) is not None]
                ids = np.fromiter((s.client_id for s in sigs), dtype=np.int64, count=len(sigs))
                order = np.argsort(ids)
                dim = self._dims.get(name, 1)
                vectors = np.stack([getattr(s, name) for s in sigs]) if sigs else np.zeros((0, dim))
                sizes = np.fromiter((s.num_samples for s in sigs), dtype=np.float64, count=len(sigs))
                table = self._tables[name] = (ids[order], vectors[order], sizes[order])
        ids, vectors, sizes = table
        n = client_ids.size
        if ids.size == 0:
            return np.zeros((n, vectors.shape[1])), np.zeros(n), np.zeros(n, dtype=bool)
        pos = np.minimum(np.searchsorted(ids, client_ids), ids.size - 1)
        found = ids[pos] == client_ids
        return vectors[pos] * found[:, None], sizes[pos] * found, found

    def dim(self, name: str) -> int | None:
        """The vector length this run uses for `name` ("bias_update" or "activation"), or None before any report."""
        with self.lock:
            return self._dims.get(name)

    def __len__(self) -> int:
        with self.lock:
            return len(self._signatures)


# -- one selection: request and answer ---------------------------------------------------------------------------------


def _readonly(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True, eq=False)
class SelectionInput:
    """One selection request, validated and put in canonical order on construction.

    Candidates are sorted ascending and every aligned array (losses, sample counts, similarity rows and columns) is
    permuted with them, so a sampler's result depends only on the *set* of candidates, never on the caller's order.
    `params` is the sampler's own `Params` instance (None: its defaults; `run_sampler` fills it in).
    """

    run_id: str
    round: int
    num_to_select: int
    candidates: NDArray[np.int64]
    seed: int = 0
    params: Any = None
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
    (power-of-choice's candidate set); only a sampler that declares `needs_losses` may answer so."""

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


# -- the sampler base class --------------------------------------------------------------------------------------------


class Sampler(ABC):
    """One selection method. Instances hold no per-run data: anything that must persist goes into `RunState`."""

    Params: ClassVar[type] = NoParams  # a dataclass whose fields all have defaults (selection.params)
    uniform: ClassVar[bool] = False  # every candidate equally likely, independent of what clients sent (DP-safe)
    client_signatures: ClassVar[frozenset[str]] = frozenset()  # of SIGNATURE_FIELDS the clients must report
    needs_losses: ClassVar[bool] = False  # may answer SelectionOutput.needs_losses (the aggregator probes losses)
    needs_similarity: ClassVar[bool] = False  # reads SelectionInput.similarity (Gram matrix of last updates)

    @classmethod
    def validate_run(cls, params: Any, cfg: ExperimentConfig) -> None:
        """Rules across config sections (e.g. a parameter bounded by data.num_clients); raise ConfigError naming the
        field. Runs at config load, before round 1."""
        return None

    @classmethod
    def run_params(cls, params: Any, cfg: ExperimentConfig) -> Any:
        """The parameters every selection of the run is sent, with what the run supplies filled in (HiCS-FL's
        total_rounds = rounds). Default: `params` as configured."""
        return params

    @classmethod
    def similarity_sketch_dim(cls, params: Any) -> int:
        """For `needs_similarity` samplers: the aggregator keeps count sketches of this many buckets per client
        instead of the exact updates (0 = exact)."""
        return 0

    @abstractmethod
    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        """Choose clients from `request.candidates`; deterministic for a given request and state. `request.params`
        is an instance of `Params`. Raise InvalidInput for a request this sampler cannot serve."""


def _check_sampler(obj: Any) -> str | None:
    if not (isinstance(obj, type) and issubclass(obj, Sampler)):
        return f"expected a subclass of fairfl.sampling.Sampler, got {obj!r}"
    if getattr(obj, "__abstractmethods__", None):
        return f"{obj.__name__} does not implement {', '.join(sorted(obj.__abstractmethods__))}"
    if not dataclasses.is_dataclass(obj.Params):
        return f"{obj.__name__}.Params must be a dataclass, got {obj.Params!r}"
    unknown = set(obj.client_signatures) - set(SIGNATURE_FIELDS)
    if unknown:
        return f"{obj.__name__}.client_signatures names {sorted(unknown)}; known: {', '.join(SIGNATURE_FIELDS)}"
    return None


# The built-ins are entry points of group fairfl.samplers (pyproject.toml), like any third party's.
SAMPLERS: Registry[type[Sampler]] = Registry("sampler", "fairfl.samplers", _check_sampler)


def uniform_samplers() -> list[str]:
    """Names of the installed samplers that declare uniform selection (for error messages)."""
    out = []
    for name in SAMPLERS.names():
        try:
            if SAMPLERS.load(name, "selection.method").uniform:
                out.append(name)
        except PluginError:
            continue
    return out


def register_sampler(name: str, cls: type[Sampler]) -> type[Sampler]:
    """Make `cls` available as `selection.method: name` in this process (module:attr works in every process)."""
    return SAMPLERS.register(name, cls)


def resolve_params(cls: type[Sampler], params: Any, path: str = "params") -> Any:
    """`params` as an instance of `cls.Params`: None gives the defaults, a mapping is parsed and validated (errors
    name `path`); anything but an instance is refused with InvalidInput."""
    try:
        return coerce_params(cls.Params, params, path)
    except ConfigError as err:  # the clustering service answers INVALID_ARGUMENT with it
        raise InvalidInput(str(err)) from None
