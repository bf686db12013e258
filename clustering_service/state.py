"""Per-run state of the clustering service: every run's `RunState` (fairfl.sampling: the latest signature of every
client seen in a run), kept in memory by run id. A restarted service rebuilds state from the next reports."""

from __future__ import annotations

import threading
import uuid

from fairfl.sampling import SIGNATURE_FIELDS, RunState, Signature

VECTOR_FIELDS = SIGNATURE_FIELDS
__all__ = ["VECTOR_FIELDS", "RunState", "Signature", "StateStore"]


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
