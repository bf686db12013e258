"""HiCS-FL, power-of-choice, Clustered Sampling (Fraboni Alg. 2) and DivFL samplers, and their Ward building blocks,
on planted cases (seed-hicsfl.md §1, §2, §5)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.cluster import hierarchy
from scipy.spatial.distance import pdist

from clustering_service.clustering import canonical_labels
from clustering_service.samplers import SelectionInput, select
from clustering_service.samplers.base import gumbel_top_k, warmup_block
from clustering_service.samplers.clustered import mass_capped_clusters, sampling_distributions
from clustering_service.samplers.hics import annealed_gamma, cluster_log_probabilities
from clustering_service.samplers.hierarchy import (
    HicsGeometry,
    entropy_estimate,
    facility_location_greedy,
    ward_clusters,
    ward_from_matrix,
    weighted_ward,
)
from fairfl.plugins import parse_params
from fairfl.sampling import SAMPLERS, InvalidInput, RunState, Signature
from fairfl.schema import ConfigError

C = 10


def _state(bias: np.ndarray, sizes: np.ndarray | None = None, run: str = "r") -> RunState:
    state = RunState(run)
    n = bias.shape[0]
    sizes = np.full(n, 100) if sizes is None else sizes
    state.put([Signature(c, 1, int(sizes[c]), bias_update=bias[c]) for c in range(n)])
    return state


def _planted_bias(groups: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Δb like SGD makes them (η(D − 1/C)): group 0 balanced, each other group dominated by one class."""
    rng = np.random.default_rng(seed)
    truth = np.repeat(np.arange(len(groups)), groups)
    dist = np.full((len(groups), C), 1.0 / C)
    for g in range(1, len(groups)):
        dist[g] = 0.01
        dist[g, g % C] = 1 - 0.01 * (C - 1)
    bias = 0.02 * (dist[truth] - 1.0 / C) + 1e-4 * rng.standard_normal((truth.size, C))
    return bias, truth


def _hics(state: RunState, round_: int, k: int, n: int, seed: int = 3, **params: object) -> tuple[int, ...]:
    p = dict(total_rounds=200, **params)  # type: ignore[arg-type]
    return select("hics", SelectionInput("r", round_, k, np.arange(n), seed=seed, params=p), state).selected


# --- HiCS-FL ----------------------------------------------------------------------------------------------------------


def test_hics_warmup_visits_every_client_exactly_once_then_picks_k_distinct() -> None:
    state = RunState("r")
    n, k = 23, 5  # K does not divide N: the last warm-up round is short (spec §1.11.5)
    rounds = [_hics(state, t, k, n) for t in range(1, math.ceil(n / k) + 1)]
    assert [len(r) for r in rounds] == [5, 5, 5, 5, 3]
    assert sorted(c for r in rounds for c in r) == list(range(n))
    assert rounds != [_hics(state, t, k, n, seed=4) for t in range(1, 6)]  # the order depends on the seed
    after = _hics(state, 6, k, n)  # no signatures yet: Δb = 0 for all, still K distinct
    assert len(set(after)) == k


def test_warmup_order_is_stable_when_other_clients_come_and_go() -> None:
    everyone = np.arange(40)
    order = np.concatenate([warmup_block(everyone, 8, 1, t) for t in range(1, 6)])
    without = np.concatenate([warmup_block(everyone[everyone != order[0]], 8, 1, t) for t in range(1, 6)])
    assert without.tolist() == [c for c in order.tolist() if c != order[0]]


def test_hics_is_deterministic_and_prefers_high_entropy_clusters_early_uniform_late() -> None:
    bias, truth = _planted_bias([6, 6, 6, 6, 6])
    state = _state(bias)
    n, k = truth.size, 5
    assert _hics(state, 20, k, n) == _hics(state, 20, k, n)
    early = np.zeros(5)
    late = np.zeros(5)
    for t in range(7, 107):
        early[truth[list(_hics(state, t, k, n, seed=t))]] += 1
        late[truth[list(_hics(state, 200, k, n, seed=t))]] += 1
    # γ_t ≈ 4: the balanced group (Ĥ ≈ ln 10 against ≈ 0.3) dominates; γ_𝒯 = 0: clusters uniformly (one per group).
    assert early[0] / early.sum() > 0.6
    assert late[0] / late.sum() < 0.35 and late.min() > 0


def test_hics_clusters_are_the_planted_groups() -> None:
    bias, truth = _planted_bias([4, 7, 5, 3, 6], seed=2)
    geometry = HicsGeometry(bias, entropy_estimate(bias, 0.0025), 10.0)
    labels = ward_clusters(geometry, 5, max_points=2000)
    assert labels.tolist() == canonical_labels(truth).tolist()
    state = _state(bias)
    out = select(
        "hics",
        SelectionInput("r", 40, 5, np.arange(truth.size), seed=1, params=dict(total_rounds=200)),
        state,
    )
    # cluster ids reported with the selection are Ward's clusters of the selected clients
    assert list(out.cluster_of_selected) == [labels[c] for c in out.selected]


def test_hics_sampling_probabilities_follow_eq_10() -> None:
    labels = np.array([0, 0, 1, 1, 1, 2])
    h = np.array([2.0, 2.2, 0.5, 0.3, 0.4, 1.0])
    log_pi = cluster_log_probabilities(labels, h, gamma=3.0)
    mean_h = np.array([2.1, 0.4, 1.0])
    np.testing.assert_allclose(np.exp(log_pi), np.exp(3 * mean_h) / np.exp(3 * mean_h).sum())
    np.testing.assert_allclose(np.exp(cluster_log_probabilities(labels, h, 0.0)), [1 / 3] * 3)  # γ = 0: uniform
    assert annealed_gamma(4.0, 1, 200) == pytest.approx(4.0 * 199 / 200)
    assert annealed_gamma(4.0, 200, 200) == 0.0 and annealed_gamma(4.0, 250, 200) == 0.0


def test_gumbel_top_k_is_sequential_sampling_without_replacement() -> None:
    # P(first = i) = w_i; P(second = j | first = i) = w_j / (1 − w_i): check the pair frequencies.
    w = np.array([0.5, 0.3, 0.2])
    rng = np.random.default_rng(0)
    trials = 20000
    pairs = np.array([gumbel_top_k(np.log(w), 2, rng) for _ in range(trials)])
    freq = np.zeros((3, 3))
    np.add.at(freq, (pairs[:, 0], pairs[:, 1]), 1.0 / trials)
    expected = w[:, None] * w[None, :] / (1 - w[:, None])
    np.fill_diagonal(expected, 0.0)
    np.testing.assert_allclose(freq, expected, atol=0.015)


def test_hics_within_cluster_draw_follows_data_size_or_uniform() -> None:
    bias = np.zeros((6, C))  # one cluster of everyone: only the within-cluster weights matter
    sizes = np.array([600, 100, 100, 100, 50, 50])
    state = _state(bias, sizes)
    counts = np.zeros(6)
    uniform = np.zeros(6)
    for t in range(20, 420):
        counts[list(_hics(state, t, 1, 6, seed=t, num_clusters=1))] += 1
        uniform[list(_hics(state, t, 1, 6, seed=t, num_clusters=1, uniform_within_cluster=True))] += 1
    np.testing.assert_allclose(counts / 400, sizes / sizes.sum(), atol=0.08)  # ~3.3 standard deviations
    np.testing.assert_allclose(uniform / 400, np.full(6, 1 / 6), atol=0.06)


def test_hics_freeze_after_warmup_keeps_the_warmup_signatures() -> None:
    bias, truth = _planted_bias([5, 5])
    state = _state(bias)
    n = truth.size
    before = [_hics(state, t, 2, n, seed=t, freeze_after_warmup=True) for t in range(10, 20)]
    # A later report that swaps the groups' signatures changes nothing while frozen, and everything when not.
    state.put([Signature(c, 5, 100, bias_update=bias[(c + 5) % n]) for c in range(n)])
    assert [_hics(state, t, 2, n, seed=t, freeze_after_warmup=True) for t in range(10, 20)] == before
    assert [_hics(state, t, 2, n, seed=t) for t in range(10, 20)] != before


def test_ward_rows_as_features_is_scipy_ward_on_the_distance_rows() -> None:
    bias, _ = _planted_bias([5, 5, 5], seed=4)
    geometry = HicsGeometry(bias, entropy_estimate(bias, 0.0025), 10.0)
    distance = geometry(None, None)
    expected = hierarchy.fcluster(hierarchy.linkage(distance, "ward"), 3, "maxclust")
    assert ward_from_matrix(distance, 3, rows_as_features=True).tolist() == canonical_labels(expected).tolist()
    with pytest.raises(InvalidInput, match="max_ward_points"):
        ward_clusters(geometry, 3, max_points=10, rows_as_features=True)


# --- Ward on weighted points and the coarse path --------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weighted_ward_equals_scipy_ward_on_the_expanded_multiset(seed: int) -> None:
    rng = np.random.default_rng(seed)
    points = rng.standard_normal((25, 3))
    weights = rng.integers(1, 5, size=25)
    expanded = np.repeat(points, weights, axis=0)
    owner = np.repeat(np.arange(25), weights)
    for k in (2, 5, 11):
        mine = weighted_ward(np.sqrt(((points[:, None] - points[None]) ** 2).sum(-1)), weights.astype(float), k)
        theirs = hierarchy.fcluster(hierarchy.linkage(pdist(expanded), "ward"), k, "maxclust")
        # scipy first merges the duplicates (height 0); its clusters of the originals are the weighted clusters.
        assert mine.tolist() == canonical_labels(theirs[np.searchsorted(owner, np.arange(25))]).tolist()


def test_coarse_ward_over_many_clients_recovers_planted_groups() -> None:
    bias, truth = _planted_bias([900, 700, 600, 500, 300], seed=5)
    geometry = HicsGeometry(bias, entropy_estimate(bias, 0.0025), 10.0)
    labels = ward_clusters(geometry, 5, max_points=400)  # 3000 clients through 400 representatives
    assert labels.tolist() == canonical_labels(truth).tolist()


def test_hics_over_many_clients_is_fast_and_deterministic() -> None:
    rng = np.random.default_rng(0)
    n = 3000
    state = _state(rng.standard_normal((n, C)) * 0.01, rng.integers(50, 500, n))
    params = dict(total_rounds=100, max_ward_points=500)  # the coarse path: 500 representatives
    first = select("hics", SelectionInput("r", 50, 100, np.arange(n), seed=2, params=params), state)
    again = select("hics", SelectionInput("r", 50, 100, np.arange(n), seed=2, params=params), state)
    assert first == again and len(set(first.selected)) == 100
    assert first.seconds < 5.0  # scripts/bench_selection.py times 10,000 clients; this only guards a regression


# --- power-of-choice --------------------------------------------------------------------------------------------------


def test_power_of_choice_asks_for_d_candidate_losses_then_takes_the_top_k() -> None:
    state = RunState("r")
    cands = np.arange(100, 120)
    first = select("power_of_choice", SelectionInput("r", 1, 3, cands), state)
    assert first.needs_losses and first.selected == tuple(cands.tolist())  # d = 0: every candidate (paper's d = N)
    d = select("power_of_choice", SelectionInput("r", 1, 3, cands, params=dict(candidates=8)), state)
    assert d.needs_losses and len(set(d.selected)) == 8
    losses = np.array([0.5, 2.0, 2.0, 0.1, 3.0, 1.0, 0.2, 0.3])
    probed = np.asarray(d.selected)
    top = select("power_of_choice", SelectionInput("r", 1, 3, probed, candidate_losses=losses), state)
    order = sorted(range(8), key=lambda i: (-losses[i], probed[i]))[:3]  # ties: lower client id
    assert not top.needs_losses and top.selected == tuple(sorted(probed[order].tolist()))


def test_power_of_choice_candidate_draw_follows_data_size() -> None:
    state = RunState("r")
    sizes = np.array([1000, 10, 10, 10, 10, 10])
    hits = np.zeros(6)
    for t in range(400):
        out = select(
            "power_of_choice",
            SelectionInput(
                "r",
                t,
                1,
                np.arange(6),
                seed=1,
                params=dict(candidates=2),
                candidate_num_samples=sizes,
            ),
            state,
        )
        hits[list(out.selected)] += 1
    assert hits[0] > 390  # the big client is in nearly every candidate set


# --- Clustered Sampling (Fraboni et al. Algorithm 2) -----------------------------------------------------------------


def _gram(truth: np.ndarray, dim: int = 30, noise: float = 0.05, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((truth.max() + 1, dim))
    updates = directions[truth] + noise * rng.standard_normal((truth.size, dim))
    return updates @ updates.T


def test_clustered_sampling_draws_one_client_from_each_planted_group() -> None:
    truth = np.repeat(np.arange(5), 4)  # 5 groups of 4 equal clients, K = 5: each group is a cluster of mass 1
    gram = _gram(truth)
    state = RunState("r")
    for t in range(30):
        out = select("clustered", SelectionInput("r", t, 5, np.arange(20), seed=t, similarity=gram), state)
        assert sorted(truth[list(out.selected)].tolist()) == [0, 1, 2, 3, 4]


def test_clustered_sampling_distributions_have_unit_mass_and_are_unbiased() -> None:
    rng = np.random.default_rng(1)
    n, k = 23, 4
    shares = rng.integers(1, 10, n).astype(float)
    shares /= shares.sum()
    assert shares.max() <= 1 / k
    angles = np.arccos(np.clip(np.corrcoef(rng.standard_normal((n, 6))), -1, 1))
    labels = mass_capped_clusters(angles, shares, k, rows=False)
    assert (np.bincount(labels, weights=shares) <= 1 / k + 1e-12).all()  # every cluster within 1/K
    rows = sampling_distributions(labels, shares, k, rng)
    assert rows.shape == (k, n)
    np.testing.assert_allclose(rows.sum(axis=1), 1.0)
    # Before normalisation each row held mass 1 and client k mass K·p_k in total, so after it too:
    np.testing.assert_allclose(rows.sum(axis=0), k * shares, atol=1e-9)


def test_clustered_sampling_keeps_repeated_draws_and_validates() -> None:
    # K = 2, three far-apart clients of share 1/3: rows {a: 2/3, c: 1/3} and {b: 2/3, c: 1/3}, so c comes twice
    # with probability 1/9, and the repeat is returned (a draw-weighted average counts it twice).
    gram = np.eye(3)
    repeats = 0
    for t in range(1, 91):
        out = select("clustered", SelectionInput("r", t, 2, np.arange(3), seed=t, similarity=gram), RunState("r"))
        assert len(out.selected) == 2
        repeats += out.selected[0] == out.selected[1]
    assert 2 <= repeats <= 25
    with pytest.raises(InvalidInput, match="needs similarity"):
        select("clustered", SelectionInput("r", 3, 2, np.arange(6)), RunState("r"))


# --- DivFL ------------------------------------------------------------------------------------------------------------


def test_divfl_picks_one_client_per_planted_group_after_the_warmup() -> None:
    truth = np.repeat(np.arange(4), [5, 3, 6, 2])
    gram = _gram(truth, noise=0.01)
    state = RunState("r")
    n, k = truth.size, 4
    warm = [select("divfl", SelectionInput("r", t, k, np.arange(n), seed=9), state).selected for t in (1, 2, 3, 4)]
    assert sorted(c for r in warm for c in r) == list(range(n))  # ⌈16/4⌉ = 4 warm-up rounds, everyone once
    out = select("divfl", SelectionInput("r", 5, k, np.arange(n), seed=9, similarity=gram), state)
    assert sorted(truth[list(out.selected)].tolist()) == [0, 1, 2, 3]


def test_facility_location_greedy_matches_brute_force_on_a_small_case() -> None:
    from itertools import combinations

    rng = np.random.default_rng(3)
    points = rng.standard_normal((9, 2))
    d = np.sqrt(((points[:, None] - points[None]) ** 2).sum(-1))
    first = facility_location_greedy(d, 1, np.arange(9))[0]
    assert first == int(np.argmin(d.sum(axis=0)))  # the medoid
    greedy = facility_location_greedy(d, 3, np.arange(9))
    cost = d[:, greedy].min(axis=1).sum()
    best = min(d[:, list(s)].min(axis=1).sum() for s in combinations(range(9), 3))
    assert best <= cost <= best * (1 + 1 / math.e) + 1e-9 and len(set(greedy.tolist())) == 3


# --- parameters -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "raw", "match"),
    [
        ("hics", {"temperature": 0}, "selection.params.temperature: must be > 0"),
        ("hics", {"temperature": "hot"}, "temperature: expected a number"),
        ("hics", {"num_clusters": 2.5}, "num_clusters: expected an integer"),
        ("hics", {"freeze_after_warmup": 1}, "expected true or false"),
        ("hics", {"candidates": 5}, "unknown parameter 'candidates'; valid parameters: temperature"),
        ("power_of_choice", {"gamma0": 1.0}, "valid parameters: candidates"),
        ("power_of_choice", {"candidates": -1}, "selection.params.candidates: must be >= 0"),
        ("divfl", {"warmup_rounds": -1}, "warmup_rounds: must be >= 0"),
        ("random", {"sketch_dim": 8}, "valid parameters: none"),
    ],
)
def test_declared_params_name_the_bad_key(method: str, raw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_params(SAMPLERS.load(method, "selection.method").Params, raw, "selection.params")


def test_declared_params_are_typed() -> None:
    assert parse_params(SAMPLERS.load("power_of_choice", "m").Params, {"candidates": 7}, "p").candidates == 7
    assert parse_params(SAMPLERS.load("hics", "m").Params, {"gamma0": 2}, "p").gamma0 == 2.0
