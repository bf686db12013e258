"""Per-run state of the clustering service: the latest signature of every client seen in a run.

HiCS-FL samples over *all* clients using the last bias update each one reported, so signatures outlive the round
that produced them. Everything is in memory: a restarted service rebuilds state from the next reports.
"""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from clustering_service.errors import InvalidInput

VECTOR_FIELDS = ("bias_update", "activation")


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
        for name in VECTOR_FIELDS:
            object.__setattr__(self, name, _signature_vector(self.client_id, name, getattr(self, name)))


class RunState:
    """State of one run. Signature access is locked; samplers that keep their own state use `lock` + `sampler_state`."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.lock = threading.RLock()
        # Free-form per-run scratch for stateful samplers (e.g. HiCS-FL's warm-up pool); guarded by `lock`.
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
                for name in VECTOR_FIELDS:
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


class StateStore:
    """All runs' state, keyed by run id. Thread-safe: gRPC handlers run on a thread pool."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, RunState] = {}
        # Told to callers with every reply, so a caller can tell a restarted (empty) store from the one it filled.
        self.instance_id = uuid.uuid4().hex

    def run(self, run_id: str) -> RunState:
        """The state of `run_id`, created empty on first use."""
        with self._lock:
            state = self._runs.get(run_id)
            if state is None:
                state = self._runs[run_id] = RunState(run_id)
            return state

    def get(self, run_id: str) -> RunState | None:
        with self._lock:
            return self._runs.get(run_id)

    def forget(self, run_id: str) -> bool:
        """Drop everything about a run; True when there was something to drop. Idempotent."""
        with self._lock:
            return self._runs.pop(run_id, None) is not None

    def run_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._runs)
