"""Per-run signature store: latest-wins, atomic validated batches, consistent lengths, forget, thread safety."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from clustering_service.errors import InvalidInput
from clustering_service.state import RunState, Signature, StateStore


def _sig(client_id: int, round_: int = 0, dim: int = 4, **kw: object) -> Signature:
    bias = kw.pop("bias_update", np.full(dim, float(client_id), dtype=np.float32))
    return Signature(client_id=client_id, round=round_, num_samples=10, bias_update=bias, **kw)  # type: ignore[arg-type]


def test_signature_is_stored_as_readonly_float64() -> None:
    sig = _sig(3, activation=np.arange(5, dtype=np.float64))
    assert sig.bias_update.dtype == np.float64 and sig.activation.dtype == np.float64
    with pytest.raises(ValueError):
        sig.bias_update[0] = 1.0


@pytest.mark.parametrize(
    ("vector", "match"),
    [
        (np.arange(4, dtype=np.int32), "float32 or float64"),
        (np.ones((2, 2)), "1-D"),
        (np.array([1.0, np.nan]), "NaN"),
        (np.array([], dtype=np.float32), "empty"),
    ],
)
def test_signature_rejects_bad_vectors_naming_the_client(vector: np.ndarray, match: str) -> None:
    with pytest.raises(InvalidInput, match=f"client 7: bias_update.*{match}"):
        _sig(7, bias_update=vector)


def test_latest_signature_wins_and_stale_reports_are_ignored() -> None:
    state = RunState("r")
    assert state.put([_sig(1, round_=5)]) == 1
    assert state.put([_sig(1, round_=3, bias_update=np.zeros(4))]) == 0  # late delivery of an older round
    assert state.get(1).round == 5 and state.get(1).bias_update[0] == 1.0
    assert state.put([_sig(1, round_=5, bias_update=np.full(4, 9.0))]) == 1  # retry of the same round replaces
    assert state.get(1).bias_update[0] == 9.0
    assert len(state) == 1 and state.dim("bias_update") == 4 and state.dim("activation") is None


def test_inconsistent_lengths_reject_the_whole_batch() -> None:
    state = RunState("r")
    state.put([_sig(1)])
    with pytest.raises(InvalidInput, match=r"client 3: bias_update has length 5 .* uses length 4"):
        state.put([_sig(2), _sig(3, dim=5)])
    assert sorted(state.signatures()) == [1]  # client 2 was not stored either
    fresh = RunState("s")
    with pytest.raises(InvalidInput, match="client 2"):
        fresh.put([_sig(1, dim=3), _sig(2, dim=4)])
    assert fresh.dim("bias_update") is None


def test_duplicate_clients_in_one_batch_are_rejected() -> None:
    with pytest.raises(InvalidInput, match=r"\[4\]"):
        RunState("r").put([_sig(4), _sig(4, round_=1)])


def test_store_runs_are_independent_and_forgettable() -> None:
    store = StateStore()
    store.run("a").put([_sig(1)])
    store.run("b").put([_sig(1, dim=8)])  # another run may use another length
    assert store.run_ids() == ["a", "b"]
    assert store.forget("a") and not store.forget("a")
    assert store.get("a") is None and len(store.run("a")) == 0
    assert len(store.get("b")) == 1


def test_concurrent_puts_lose_nothing() -> None:
    store = StateStore()

    def report(worker: int) -> None:
        for i in range(50):
            store.run("r").put([_sig(worker * 1000 + i)])

    threads = [threading.Thread(target=report, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.run("r")) == 400
