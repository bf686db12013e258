"""Accountant against published reference values (landscape §3.2) and the FedFDP golden vectors (seed-fedfdp §2.5)."""

from __future__ import annotations

import math
import re

import pytest

from fairfl.accounting import (
    DEFAULT_ORDERS,
    MAX_ROUNDS_LIMIT,
    PAPER_ORDERS,
    EventSpec,
    UnsoundAccounting,
    _pld_epsilon,
    _step_rdp,
    calibrate_noise,
    cross_check,
    epsilon,
    max_rounds,
    paper_parity_max_rounds,
)
from fairfl.privacy import COUNT_MAX, NOISE_MULTIPLIER_RANGE, ORDERS_MAX

DELTA = 1e-5
Q = 0.05


def grad(t: int, sigma: float = 2.0) -> EventSpec:
    return EventSpec(Q, sigma, t)


def loss(t: int, sigma_l: float = 5.0) -> EventSpec:
    return EventSpec(Q, sigma_l, t)


# --- published anchors -----------------------------------------------------------------------------------------------


def test_tf_privacy_anchor_a() -> None:
    eps, order = epsilon([EventSpec(0.0025, 1.3, 6000)], DELTA)
    assert eps == pytest.approx(0.7242234026109595, abs=1e-6)
    assert order == 19.0


def test_opacus_anchor_c() -> None:
    eps, _ = epsilon([EventSpec(0.04, 1.5, 2250)], DELTA)
    assert eps == pytest.approx(7.32911117143, rel=1e-4)


# --- seed-fedfdp §2.5 ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("events", "paper", "default"),
    [
        ([grad(778)], (3.523354, 6.0), (3.509543, 6.4)),
        ([grad(778), loss(778)], (3.763360, 6.0), (3.761453, 6.2)),
        ([grad(683), loss(683)], (3.518967, 6.0), (3.503328, 6.5)),
        ([grad(65)], (0.995726, 16.0), (0.995726, 16.0)),
        ([grad(607, 1.65), loss(607)], (4.188746, 6.0), (4.172929, 5.6)),
        ([grad(778), loss(778, 1.0)], (11.291556, 3.0), (11.291556, 3.0)),
    ],
)
def test_fedfdp_golden_vectors(
    events: list[EventSpec], paper: tuple[float, float], default: tuple[float, float]
) -> None:
    eps, order = epsilon(events, DELTA, orders=PAPER_ORDERS)
    assert eps == pytest.approx(paper[0], abs=1e-6)
    assert order == paper[1]
    eps, order = epsilon(events, DELTA)
    assert eps == pytest.approx(default[0], abs=1e-6)
    assert order == pytest.approx(default[1])


def test_pld_is_tighter_than_rdp() -> None:
    eps, order = epsilon([grad(778), loss(778)], DELTA, accountant="pld")
    assert eps == pytest.approx(3.4570, abs=5e-4)
    assert math.isnan(order)


def test_events_with_equal_mechanisms_are_merged() -> None:
    split = [grad(300), grad(478), loss(0), loss(778)]
    assert epsilon(split, DELTA) == pytest.approx(epsilon([grad(778), loss(778)], DELTA))


def test_no_events_spends_nothing() -> None:
    eps, order = epsilon([], DELTA)
    assert eps == 0.0 and math.isnan(order)
    assert epsilon([grad(0)], DELTA)[0] == 0.0


def test_full_batch_is_plain_gaussian() -> None:
    # q = 1: one Gaussian release with σ = 1 has RDP α/2; minimised over orders it is finite and positive.
    eps, _ = epsilon([EventSpec(1.0, 1.0, 1)], DELTA)
    assert 0 < eps < epsilon([EventSpec(1.0, 1.0, 2)], DELTA)[0]


# --- inverse queries -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sigma", "target", "code", "grad_only", "grad_and_loss"),
    [
        (2.0, 1.0, 65, 65, 58),
        (2.0, 2.0, 268, 267, 237),
        (2.0, 3.0, 582, 580, 512),
        (2.0, 3.52, 778, 776, 683),
        (2.0, 4.0, 988, 988, 869),
        (1.65, 4.0, 607, 606, 559),
    ],
)
def test_rounds_for_target(sigma: float, target: float, code: int, grad_only: int, grad_and_loss: int) -> None:
    assert paper_parity_max_rounds(Q, sigma, target, DELTA) == code
    assert max_rounds([grad(1, sigma)], [], target, DELTA, orders=PAPER_ORDERS) == grad_only
    assert max_rounds([grad(1, sigma), loss(1)], [], target, DELTA, orders=PAPER_ORDERS) == grad_and_loss


def test_max_rounds_is_exact() -> None:
    per_round = [grad(1), loss(1)]
    t = max_rounds(per_round, [], 3.52, DELTA)
    assert t == 688  # dp_accounting default orders (§2.5)
    assert epsilon([grad(t), loss(t)], DELTA)[0] <= 3.52 < epsilon([grad(t + 1), loss(t + 1)], DELTA)[0]


def test_max_rounds_counts_what_was_already_spent() -> None:
    assert max_rounds([grad(1), loss(1)], [grad(600), loss(600)], 3.52, DELTA, orders=PAPER_ORDERS) == 83
    assert max_rounds([grad(1)], [grad(5000)], 3.52, DELTA) == 0


def test_max_rounds_with_multi_step_rounds() -> None:
    # K = 5 local steps per round: a fifth of the step budget, rounded down.
    assert max_rounds([grad(5)], [], 3.52, DELTA, orders=PAPER_ORDERS) == 776 // 5


def test_max_rounds_without_spend_is_capped() -> None:
    assert max_rounds([grad(0)], [], 1.0, DELTA, limit=1234) == 1234


def test_epsilon_is_monotone_in_rounds_rate_and_noise() -> None:
    eps_t = [epsilon([grad(t), loss(t)], DELTA)[0] for t in (1, 10, 100, 500, 1000, 5000)]
    assert eps_t == sorted(eps_t) and len(set(eps_t)) == len(eps_t)
    eps_q = [epsilon([EventSpec(q, 2.0, 100)], DELTA)[0] for q in (0.001, 0.01, 0.05, 0.2, 1.0)]
    assert eps_q == sorted(eps_q)
    eps_s = [epsilon([EventSpec(Q, s, 100)], DELTA)[0] for s in (8.0, 4.0, 2.0, 1.0, 0.5)]
    assert eps_s == sorted(eps_s)


@pytest.mark.parametrize(("target", "q", "steps"), [(8.0, 0.04, 2250), (1.0, 0.01, 1000), (3.52, 0.05, 778)])
def test_calibrate_noise_round_trip(target: float, q: float, steps: int) -> None:
    sigma = calibrate_noise(target, DELTA, q, steps)
    eps, _ = epsilon([EventSpec(q, sigma, steps)], DELTA)
    assert eps <= target  # always on the safe side
    assert eps == pytest.approx(target, abs=1e-4)
    assert epsilon([EventSpec(q, sigma - 1e-4, steps)], DELTA)[0] > target  # and close to the smallest such σ


def test_calibrate_noise_matches_opacus_anchor_e() -> None:
    # Opacus' get_noise_multiplier (its own orders, tolerance 0.01 in ε) gives 1.416 for these inputs.
    assert calibrate_noise(8.0, DELTA, 0.04, 2250) == pytest.approx(1.416, abs=2e-3)


def test_calibrate_noise_is_monotone() -> None:
    sigmas = [calibrate_noise(eps, DELTA, Q, 500, orders=PAPER_ORDERS) for eps in (0.5, 1.0, 2.0, 4.0)]
    assert sigmas == sorted(sigmas, reverse=True)


# --- validation ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: epsilon([EventSpec(0.0, 1.0, 1)], DELTA), "sample_rate"),
        (lambda: epsilon([EventSpec(1.5, 1.0, 1)], DELTA), "sample_rate"),
        (lambda: epsilon([EventSpec(math.nan, 1.0, 1)], DELTA), "sample_rate"),
        (lambda: epsilon([EventSpec(0.1, 0.0, 1)], DELTA), "noise_multiplier"),
        (lambda: epsilon([EventSpec(0.1, math.inf, 1)], DELTA), "noise_multiplier"),
        (lambda: epsilon([EventSpec(0.1, 1.0, -1)], DELTA), "count"),
        (lambda: epsilon([EventSpec(0.1, 1.0, 1.5)], DELTA), "count"),  # type: ignore[arg-type]
        (lambda: epsilon([grad(1)], 0.0), "delta"),
        (lambda: epsilon([grad(1)], 1.0), "delta"),
        (lambda: epsilon([grad(1)], DELTA, orders=[2.0, 1.0]), "orders"),
        (lambda: epsilon([grad(1)], DELTA, accountant="gdp"), "accountant"),
        (lambda: max_rounds([grad(1)], [], 0.0, DELTA), "target_eps"),
        (lambda: max_rounds([EventSpec(0.1, -1.0, 1)], [], 1.0, DELTA), "per_round_events[0].noise_multiplier"),
        (lambda: calibrate_noise(1.0, DELTA, Q, 0), "steps"),
        (lambda: calibrate_noise(-1.0, DELTA, Q, 10), "target_eps"),
        (lambda: paper_parity_max_rounds(2.0, 2.0, 3.52, DELTA), "sample_rate"),
    ],
)
def test_validation_names_the_argument(call: object, name: str) -> None:
    with pytest.raises(ValueError, match=name.replace("[", r"\[").replace("]", r"\]")):
        call()  # type: ignore[operator]


# --- the sound range (issue #18) --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "name"),
    [
        # dp_accounting: ε = 0 for σ = 1e-156 at q < 1, ZeroDivisionError at 1e-300, OverflowError at 1e300
        (lambda: epsilon([EventSpec(Q, 1e-156, 1)], DELTA), "events[0].noise_multiplier"),
        (lambda: epsilon([EventSpec(Q, 1e-300, 1)], DELTA), "events[0].noise_multiplier"),
        (lambda: epsilon([EventSpec(1.0, 1e300, 1)], DELTA), "events[0].noise_multiplier"),
        (lambda: epsilon([EventSpec(Q, 1e-156, 1)], DELTA, "pld"), "events[0].noise_multiplier"),
        (lambda: epsilon([EventSpec(Q, 0.29, 1)], DELTA), "events[0].noise_multiplier"),
        (lambda: epsilon([EventSpec(Q, 1.01e4, 1)], DELTA), "events[0].noise_multiplier"),
        (lambda: epsilon([EventSpec(1e-300, 2.0, 1)], DELTA), "events[0].sample_rate"),
        (lambda: epsilon([EventSpec(1e-7, 2.0, 1)], DELTA), "events[0].sample_rate"),
        (lambda: epsilon([EventSpec(Q, 2.0, COUNT_MAX + 1)], DELTA, "pld"), "compositions"),
        (lambda: epsilon([EventSpec(Q, 2.0, 2**63)], DELTA), "events[0].count"),
        (lambda: epsilon([EventSpec(Q, 2.0, COUNT_MAX), EventSpec(Q, 2.0, 1)], DELTA, "pld"), "compositions"),
        (lambda: epsilon([grad(1)], 1e-300), "delta"),
        (lambda: epsilon([grad(1)], 0.5), "delta"),
        (lambda: epsilon([grad(1)], DELTA, orders=[2.0, 1e300]), "orders"),
        (lambda: epsilon([grad(1)], DELTA, orders=[2.0] * (ORDERS_MAX + 1)), "orders"),
        (lambda: max_rounds([grad(1)], [], 1e300, DELTA), "target_eps"),
        (lambda: calibrate_noise(1e-300, DELTA, Q, 10), "target_eps"),
        (lambda: calibrate_noise(1.0, DELTA, Q, 2**63), "steps"),
    ],
)
def test_outside_the_sound_range_is_refused_naming_the_argument(call: object, name: str) -> None:
    with pytest.raises(ValueError, match=re.escape(name)) as err:
        call()  # type: ignore[operator]
    assert not isinstance(err.value, UnsoundAccounting)  # a plain argument error: INVALID_ARGUMENT at the service


def test_sound_range_bounds_are_accepted() -> None:
    low, high = NOISE_MULTIPLIER_RANGE
    assert epsilon([EventSpec(1.0, low, 1)], DELTA)[0] > 0
    assert epsilon([EventSpec(1.0, high, 1)], DELTA)[0] > 0  # RDP's floor, ≈ 0.0035 at δ = 1e-5
    assert epsilon([EventSpec(1e-6, 1.0, 10**4)], DELTA)[0] > 0


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_zero_epsilon_of_a_real_mechanism_is_refused(accountant: str) -> None:
    # In range, but the spend is below what either accountant resolves: both return ε = 0.
    with pytest.raises(UnsoundAccounting, match=r"ε = 0\.0 for 11 x \(q=0.001, σ=9000\)"):
        epsilon([EventSpec(0.001, 9000.0, 11)], DELTA, accountant)
    assert epsilon([], DELTA, accountant)[0] == 0.0  # no events: nothing spent, legitimately


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # dp_accounting's own overflow warnings on the way to failing
def test_dp_accounting_failures_become_unsound_accounting() -> None:
    """Below the range checks: dp_accounting's own exceptions and negative divergences never escape as such."""
    with pytest.raises(UnsoundAccounting, match="ZeroDivisionError"):
        _step_rdp(Q, 1e-300, DEFAULT_ORDERS)
    with pytest.raises(UnsoundAccounting, match="negative or NaN"):
        _step_rdp(Q, 1e-156, DEFAULT_ORDERS)  # dp_accounting itself would answer ε = 0
    with pytest.raises(UnsoundAccounting, match="OverflowError"):
        _pld_epsilon((EventSpec(1.0, 1e300, 1),), DELTA)


def test_cross_check_agrees_at_the_presets_settings() -> None:
    rdp, pld = cross_check([grad(1), loss(1)], DELTA)  # one FedFDP round
    assert rdp == pytest.approx(epsilon([grad(1), loss(1)], DELTA)[0])
    assert 0.4 * rdp < pld <= rdp
    rdp, pld = cross_check([EventSpec(0.1, 1.2, 2)], DELTA, PAPER_ORDERS)
    assert 0 < pld <= rdp


@pytest.mark.parametrize(
    ("events", "match"),
    [
        # PLD's grid swamps a per-step loss this small: 0.086 against the RDP bound 0.0086
        ([EventSpec(0.01, 1000.0, 10**5)], "RDP and PLD disagree"),
        # RDP's bound collapses to ε = 0 here: the ledger could state no spend
        ([EventSpec(1e-5, 1.0, 1)], "RDP accountant gives ε = 0"),
    ],
)
def test_cross_check_refuses_a_disagreement(events: list[EventSpec], match: str) -> None:
    with pytest.raises(UnsoundAccounting, match=match):
        cross_check(events, DELTA)


def test_cross_check_accepts_pld_at_zero_below_a_positive_rdp_bound() -> None:
    # One step at q = 1e-4, σ = 5 (or q = δ) is (0, δ)-DP, which PLD finds and RDP's looser bound (0.0195) cannot.
    for event in (EventSpec(1e-4, 5.0, 1), EventSpec(DELTA, 0.3, 1)):
        rdp, pld = cross_check([event], DELTA)
        assert rdp > 0 and pld == 0.0


def test_searches_are_bounded_by_the_sound_range() -> None:
    # A round spending almost nothing: RDP's cheap search stops at its limit, PLD's where a mechanism would exceed
    # COUNT_MAX compositions (beyond, its convolutions take minutes).
    assert max_rounds([EventSpec(1.0, 1e4, 1)], [], 100.0, DELTA) == MAX_ROUNDS_LIMIT
    assert max_rounds([EventSpec(1.0, 1e4, 10)], [EventSpec(1.0, 1e4, 10)], 100.0, DELTA, "pld") == COUNT_MAX // 10 - 1
    assert epsilon([EventSpec(Q, 2.0, COUNT_MAX), EventSpec(Q, 2.0, COUNT_MAX)], DELTA)[0] > 100  # RDP: no bound
    # Calibration stays inside [0.3, 1e4]: the bound itself when it meets the target, a refusal when none does.
    assert calibrate_noise(100.0, DELTA, Q, 1) == NOISE_MULTIPLIER_RANGE[0]
    with pytest.raises(ValueError, match="no noise multiplier in the accountant's sound range"):
        calibrate_noise(1e-3, DELTA, 1.0, 10**6)
