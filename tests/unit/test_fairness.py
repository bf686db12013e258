"""Fairness metrics checked against values worked out by hand in the comments."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fairfl.metrics import (
    FairnessReport,
    best_fraction,
    client_disagreement,
    coefficient_of_variation,
    fairness_report,
    jain_index,
    kl_to_uniform,
    loss_angle_degrees,
    mean_accuracy,
    nmi,
    pooled_accuracy,
    psi,
    std,
    variance,
    weight_entropy,
    worst_fraction,
)

ACC = [50.0, 70.0, 90.0, 100.0]
# mean = (50 + 70 + 90 + 100) / 4 = 310 / 4 = 77.5
# deviations -27.5, -7.5, 12.5, 22.5; squares 756.25 + 56.25 + 156.25 + 506.25 = 1475; var = 1475 / 4 = 368.75
# Σx² = 2500 + 4900 + 8100 + 10000 = 25500; Jain = 310² / (4 · 25500) = 96100 / 102000
ACC_MEAN, ACC_VAR, ACC_SUMSQ = 77.5, 368.75, 25500.0


def test_mean_variance_std_by_hand() -> None:
    assert mean_accuracy(ACC) == pytest.approx(ACC_MEAN)
    assert variance(ACC) == pytest.approx(ACC_VAR)  # population (1/m), not 1475 / 3
    assert std(ACC) == pytest.approx(math.sqrt(ACC_VAR))
    assert variance([3.0, 3.0, 3.0]) == 0.0


def test_worst_and_best_fraction_small() -> None:
    # m = 4: ceil(0.25 · 4) = 1 → the single extreme; ceil(0.5 · 4) = 2 → mean of two.
    assert worst_fraction(ACC, 0.25) == 50.0
    assert worst_fraction(ACC, 0.5) == pytest.approx((50 + 70) / 2)
    assert best_fraction(ACC, 0.5) == pytest.approx((90 + 100) / 2)
    # ceil(0.05 · 4) = 1 (at least one client), fraction 1 → the mean.
    assert worst_fraction(ACC, 0.05) == 50.0
    assert best_fraction(ACC, 0.05) == 100.0
    assert worst_fraction(ACC, 1.0) == pytest.approx(ACC_MEAN)


def test_worst_5_over_20_is_single_lowest() -> None:
    values = np.random.default_rng(0).permutation(np.arange(1.0, 21.0))  # 1..20 shuffled
    assert worst_fraction(values, 0.05) == 1.0  # ceil(0.05 · 20) = 1
    assert worst_fraction(values, 0.10) == pytest.approx(1.5)  # ceil(2) → (1 + 2) / 2
    assert best_fraction(values, 0.05) == 20.0


def test_worst_5_over_100_is_mean_of_lowest_5() -> None:
    values = np.random.default_rng(1).permutation(np.arange(100.0))  # 0..99 shuffled
    assert worst_fraction(values, 0.05) == pytest.approx(2.0)  # (0+1+2+3+4) / 5
    assert worst_fraction(values, 0.10) == pytest.approx(4.5)  # (0+…+9) / 10
    assert best_fraction(values, 0.05) == pytest.approx(97.0)  # (95+…+99) / 5
    assert best_fraction(values, 0.10) == pytest.approx(94.5)  # (90+…+99) / 10


def test_fraction_rounding_does_not_overshoot() -> None:
    # 0.07 · 100 = 7.000000000000001 in floating point; the tail must still be 7 clients: (0+…+6) / 7 = 3.
    assert worst_fraction(np.arange(100.0), 0.07) == pytest.approx(3.0)


def test_jain_index() -> None:
    assert jain_index(ACC) == pytest.approx(96100 / 102000)
    assert jain_index([7.0, 7.0, 7.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)  # 1² / (4 · 1)
    assert jain_index([0.0, 0.0]) == 1.0  # all equal, 0/0 defined as 1


def test_coefficient_of_variation() -> None:
    assert coefficient_of_variation(ACC) == pytest.approx(math.sqrt(ACC_VAR) / ACC_MEAN)
    assert coefficient_of_variation([5.0, 5.0]) == 0.0
    assert coefficient_of_variation([0.0, 0.0]) == 0.0
    assert coefficient_of_variation([-1.0, 1.0]) == math.inf  # mean 0, std 1


def test_loss_angle_by_hand_and_identity() -> None:
    # cos θ = Σx / (‖x‖ √m) = 310 / (√25500 · 2)
    expected = math.degrees(math.acos(310 / (math.sqrt(ACC_SUMSQ) * 2)))
    assert loss_angle_degrees(ACC) == pytest.approx(expected)
    assert loss_angle_degrees([2.0, 2.0, 2.0]) == pytest.approx(0.0, abs=1e-6)
    assert loss_angle_degrees([0.0, 0.0]) == 0.0
    # [1, 0]: cos θ = 1 / (1 · √2) → 45°.
    assert loss_angle_degrees([1.0, 0.0]) == pytest.approx(45.0)
    rng = np.random.default_rng(2)
    for _ in range(20):
        x = rng.uniform(0.0, 5.0, size=int(rng.integers(2, 50)))
        assert loss_angle_degrees(x) == pytest.approx(math.degrees(math.atan(coefficient_of_variation(x))))


def test_psi_by_hand() -> None:
    losses, weights = [1.0, 2.0, 4.0], [1.0, 1.0, 2.0]
    # p = [0.25, 0.25, 0.5]; F = 0.25 + 0.5 + 2 = 2.75
    # Ψ = 0.25 · 1.75² + 0.25 · 0.75² + 0.5 · 1.25² = 0.765625 + 0.140625 + 0.78125 = 1.6875
    assert psi(losses, weights) == pytest.approx(1.6875)
    # Given F = 2: 0.25 · 1 + 0.25 · 0 + 0.5 · 4 = 2.25
    assert psi(losses, weights, global_loss=2.0) == pytest.approx(2.25)
    # Scaling the weights changes nothing (they are normalised).
    assert psi(losses, [10.0, 10.0, 20.0]) == pytest.approx(1.6875)


def test_psi_uniform_weights_is_population_variance() -> None:
    x = np.random.default_rng(3).normal(size=17)
    assert psi(x, np.ones(17)) == pytest.approx(variance(x))
    assert psi(ACC, [1, 1, 1, 1]) == pytest.approx(ACC_VAR)


def test_client_disagreement_literal_and_unordered() -> None:
    # Pairs of [1, 2, 4]: |1−2| = 1, |1−4| = 3, |2−4| = 2 → 6 over C(3, 2) = 3 pairs.
    # Literal eq. 9 sums ordered pairs: 12 / 3 = 4; unordered: 6 / 3 = 2.
    assert client_disagreement([1.0, 2.0, 4.0]) == pytest.approx(4.0)
    assert client_disagreement([4.0, 1.0, 2.0], unordered=True) == pytest.approx(2.0)
    assert client_disagreement([3.0]) == 0.0
    assert client_disagreement([2.0, 2.0, 2.0]) == 0.0


def test_client_disagreement_matches_brute_force() -> None:
    x = np.random.default_rng(4).uniform(0, 3, size=31)
    r = x.size
    brute = np.abs(x[:, None] - x[None, :]).sum() / (r * (r - 1) / 2)
    assert client_disagreement(x) == pytest.approx(brute)
    assert client_disagreement(x, unordered=True) == pytest.approx(brute / 2)


def test_weight_entropy() -> None:
    for m in (1, 2, 7, 100):
        assert weight_entropy(np.full(m, 3.0)) == pytest.approx(math.log(m))
    # p = [0.25, 0.25, 0.5]: H = 2 · 0.25 · ln 4 + 0.5 · ln 2 = 1.5 ln 2
    assert weight_entropy([1.0, 1.0, 2.0]) == pytest.approx(1.5 * math.log(2))
    assert weight_entropy([0.0, 1.0, 1.0]) == pytest.approx(math.log(2))  # 0 · log 0 = 0
    assert weight_entropy([0.0, 5.0]) == 0.0


def test_kl_to_uniform() -> None:
    # KL = log m − H(â): [1, 1, 2] → ln 3 − 1.5 ln 2
    assert kl_to_uniform([1.0, 1.0, 2.0]) == pytest.approx(math.log(3) - 1.5 * math.log(2))
    assert kl_to_uniform([80.0, 80.0, 80.0]) == pytest.approx(0.0, abs=1e-12)
    assert kl_to_uniform([1.0, 0.0, 0.0]) == pytest.approx(math.log(3))


def test_nmi() -> None:
    truth = [0, 0, 1, 1, 2, 2]
    assert nmi(truth, [5, 5, 3, 3, 9, 9]) == pytest.approx(1.0)  # relabelled perfect clustering
    assert nmi([0, 0, 1, 1], [0, 1, 0, 1]) == pytest.approx(0.0, abs=1e-12)  # independent
    with pytest.raises(ValueError, match="nmi"):
        nmi([0, 1], [0, 1, 2])


def test_pooled_accuracy() -> None:
    # (1 · 50 + 3 · 100) / 4 = 87.5
    assert pooled_accuracy([50.0, 100.0], [1, 3]) == pytest.approx(87.5)


def test_report_fields_match_functions() -> None:
    rng = np.random.default_rng(5)
    acc = rng.uniform(40, 95, size=100)
    losses = rng.uniform(0.1, 2.0, size=100)
    n = rng.integers(10, 500, size=100)
    report = fairness_report(acc, losses=losses, num_samples=n, missing_clients=3)
    assert isinstance(report, FairnessReport)
    assert report.mean == pytest.approx(mean_accuracy(acc))
    assert report.variance == pytest.approx(variance(acc))
    assert report.std == pytest.approx(std(acc))
    assert report.worst_5 == pytest.approx(worst_fraction(acc, 0.05))
    assert report.worst_10 == pytest.approx(worst_fraction(acc, 0.10))
    assert report.best_5 == pytest.approx(best_fraction(acc, 0.05))
    assert report.best_10 == pytest.approx(best_fraction(acc, 0.10))
    assert report.jain_index == pytest.approx(jain_index(acc))
    assert report.cv == pytest.approx(coefficient_of_variation(acc))
    assert report.weighted_accuracy == pytest.approx(float(np.sum(n * acc) / np.sum(n)))
    assert report.mean_loss == pytest.approx(losses.mean())
    assert report.loss_variance == pytest.approx(variance(losses))
    assert (report.evaluated_clients, report.missing_clients) == (100, 3)
    d = report.to_dict()
    assert set(d) == {
        "mean", "variance", "std", "worst_5", "worst_10", "best_5", "best_10", "jain_index", "cv",
        "weighted_accuracy", "mean_loss", "loss_variance", "evaluated_clients", "missing_clients",
    }  # fmt: skip
    assert d["mean"] == report.mean


def test_report_by_hand_without_losses_or_sizes() -> None:
    report = fairness_report(ACC)
    assert report.mean == pytest.approx(ACC_MEAN)
    assert report.variance == pytest.approx(ACC_VAR)
    assert report.weighted_accuracy == pytest.approx(ACC_MEAN)  # no sizes → plain mean
    assert report.worst_5 == 50.0 and report.best_5 == 100.0  # ceil(0.05 · 4) = 1
    assert math.isnan(report.mean_loss) and math.isnan(report.loss_variance)
    assert (report.evaluated_clients, report.missing_clients) == (4, 0)
    with pytest.raises(AttributeError):
        report.mean = 1.0  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"accuracies_pct": []}, "no client accuracies to report on"),
        ({"accuracies_pct": [50.0, float("nan")]}, "accuracies_pct"),
        ({"accuracies_pct": [50.0, float("inf")]}, "accuracies_pct"),
        ({"accuracies_pct": [50.0, 120.0]}, r"\[0, 100\]"),
        ({"accuracies_pct": [50.0, 60.0], "losses": [0.1, float("nan")]}, "losses"),
        ({"accuracies_pct": [50.0, 60.0], "losses": [0.1]}, "losses"),
        ({"accuracies_pct": [50.0, 60.0], "num_samples": [1, 2, 3]}, "sample counts"),
        ({"accuracies_pct": [50.0, 60.0], "num_samples": [0, 0]}, "positive sum"),
        ({"accuracies_pct": [50.0, 60.0], "missing_clients": -1}, "missing_clients"),
    ],
)
def test_report_bad_inputs(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fairness_report(**kwargs)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: mean_accuracy([]), "mean_accuracy"),
        (lambda: variance([1.0, float("nan")]), "variance"),
        (lambda: std([[1.0, 2.0]]), "std"),
        (lambda: worst_fraction([1.0, 2.0], 0.0), "worst_fraction"),
        (lambda: best_fraction([1.0, 2.0], 1.5), "best_fraction"),
        (lambda: jain_index([1.0, -1.0]), "jain_index"),
        (lambda: coefficient_of_variation([float("inf")]), "coefficient_of_variation"),
        (lambda: loss_angle_degrees([]), "loss_angle_degrees"),
        (lambda: psi([1.0, 2.0], [1.0]), "psi"),
        (lambda: psi([1.0, 2.0], [1.0, -1.0]), "psi"),
        (lambda: psi([1.0, 2.0], [1.0, 1.0], global_loss=float("nan")), "psi"),
        (lambda: client_disagreement([float("nan")]), "client_disagreement"),
        (lambda: weight_entropy([0.0, 0.0]), "weight_entropy"),
        (lambda: kl_to_uniform([]), "kl_to_uniform"),
        (lambda: nmi([], []), "nmi"),
    ],
)
def test_functions_reject_bad_inputs(call, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        call()
