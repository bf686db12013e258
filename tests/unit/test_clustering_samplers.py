"""Samplers: random (deterministic per (seed, round), uniform-ish, exact count), full, registry, input validation."""

from __future__ import annotations

import numpy as np
import pytest

from clustering_service.samplers import (
    ClusteredSampler,
    DivflSampler,
    FullSampler,
    HicsSampler,
    PowerOfChoiceSampler,
    RandomSampler,
    SelectionInput,
    SelectionOutput,
    get_sampler,
    select,
)
from fairfl.sampling import SAMPLERS, InvalidInput, RunState

CANDIDATES = list(range(100, 150))


def _random(candidates: list[int], k: int, seed: int, round_: int) -> SelectionOutput:
    return select("random", SelectionInput("run", round_, k, np.asarray(candidates), seed=seed), RunState("run"))


def test_random_is_deterministic_per_seed_and_round() -> None:
    a = _random(CANDIDATES, 7, seed=11, round_=3)
    b = _random(CANDIDATES, 7, seed=11, round_=3)
    assert a == b
    assert a.seconds >= 0.0


def test_random_matches_the_documented_rng_contract() -> None:
    # The aggregator's in-process oracle relies on exactly this recipe: sorted candidates, default_rng([seed, round]).
    shuffled = [7, 3, 42, 19, 5, 11, 23]
    rng = np.random.default_rng([5, 9])
    expected = sorted(np.sort(shuffled)[rng.choice(len(shuffled), size=3, replace=False)].tolist())
    assert _random(shuffled, 3, seed=5, round_=9).selected == tuple(expected)


def test_random_differs_across_rounds_and_seeds() -> None:
    by_round = {_random(CANDIDATES, 5, seed=1, round_=r).selected for r in range(20)}
    by_seed = {_random(CANDIDATES, 5, seed=s, round_=0).selected for s in range(20)}
    assert len(by_round) > 15 and len(by_seed) > 15


def test_random_ignores_candidate_order() -> None:
    rng = np.random.default_rng(0)
    shuffled = rng.permutation(CANDIDATES).tolist()
    assert _random(shuffled, 9, seed=4, round_=2) == _random(CANDIDATES, 9, seed=4, round_=2)


@pytest.mark.parametrize("k", [1, 5, 49, 50])
def test_random_selects_exactly_k_distinct_candidates_ascending(k: int) -> None:
    out = _random(CANDIDATES, k, seed=3, round_=1)
    assert len(out.selected) == k == len(set(out.selected))
    assert set(out.selected) <= set(CANDIDATES)
    assert list(out.selected) == sorted(out.selected)
    assert out.cluster_of_selected == ()


def test_random_is_uniform_ish_over_many_rounds() -> None:
    rounds, k = 400, 5
    counts = np.zeros(len(CANDIDATES), dtype=int)
    for r in range(rounds):
        counts[np.asarray(_random(CANDIDATES, k, seed=2024, round_=r).selected) - CANDIDATES[0]] += 1
    expected = rounds * k / len(CANDIDATES)  # 40 per candidate
    assert counts.min() > 0  # every candidate gets its turn
    assert expected * 0.4 < counts.min() and counts.max() < expected * 1.8


def test_full_returns_every_candidate_sorted() -> None:
    out = select("full", SelectionInput("run", 0, 1, np.asarray([5, 1, 3])), RunState("run"))
    assert out.selected == (1, 3, 5)


def test_builtins_are_entry_points_with_declared_capabilities() -> None:
    builtins = {
        "random": RandomSampler,
        "full": FullSampler,
        "hics": HicsSampler,
        "power_of_choice": PowerOfChoiceSampler,
        "clustered_sampling": ClusteredSampler,
        "clustered": ClusteredSampler,  # Fraboni et al.'s Alg. 2 under both names
        "divfl": DivflSampler,
    }
    assert set(builtins) <= set(SAMPLERS.names())
    for name, cls in builtins.items():
        assert SAMPLERS.load(name, "selection.method") is cls
        assert isinstance(get_sampler(name), cls)
    assert {n for n, c in builtins.items() if c.uniform} == {"random", "full"}
    assert HicsSampler.client_signatures == {"bias_update"} and PowerOfChoiceSampler.needs_losses
    assert ClusteredSampler.needs_similarity and DivflSampler.needs_similarity
    for bad in ("nope", "SELECTION_METHOD_FULL", "fairfl.config:ExperimentConfig"):
        with pytest.raises(InvalidInput, match="sampler"):
            get_sampler(bad)


@pytest.mark.parametrize(
    ("candidates", "k", "match"),
    [
        ([1, 2, 3], 0, "num_to_select"),
        ([1, 2, 3], 4, "num_to_select"),
        ([], 1, "num_to_select"),
        ([1, 2, 2, 3], 2, "unique"),
        ([-1, 2], 1, "non-negative"),
    ],
)
def test_selection_input_validation(candidates: list[int], k: int, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        SelectionInput("run", 0, k, np.asarray(candidates, dtype=np.int64))


def test_selection_input_sorts_aligned_fields_with_candidates() -> None:
    sim = np.array([[1.0, 0.1, 0.2], [0.1, 2.0, 0.3], [0.2, 0.3, 3.0]])
    inp = SelectionInput(
        "run",
        0,
        2,
        np.asarray([30, 10, 20]),
        candidate_losses=np.array([3.0, 1.0, 2.0]),
        candidate_num_samples=np.array([300, 100, 200]),
        similarity=sim,
    )
    assert inp.candidates.tolist() == [10, 20, 30]
    assert inp.candidate_losses.tolist() == [1.0, 2.0, 3.0]
    assert inp.candidate_num_samples.tolist() == [100, 200, 300]
    assert np.diag(inp.similarity).tolist() == [2.0, 3.0, 1.0]
    assert inp.similarity[0, 1] == 0.3  # (10, 20) was (index 1, index 2)
    with pytest.raises(InvalidInput, match="candidate_losses"):
        SelectionInput("run", 0, 1, np.asarray([1, 2]), candidate_losses=np.array([1.0]))


def test_selection_output_keeps_clusters_aligned_when_sorting() -> None:
    out = SelectionOutput(selected=(9, 2, 5), cluster_of_selected=(0, 1, 2))
    assert out.selected == (2, 5, 9) and out.cluster_of_selected == (1, 2, 0)
