"""Privacy accounting for Poisson-subsampled Gaussian mechanisms, as pure functions over Google's dp_accounting.

On the ground floor because both sides compute with it: the privacy service's ledger enforces budgets with it, and
the aggregator plans a DP run with it (the rounds a budget affords, refusing an unaccountable run before round 1).

An event is `count` compositions of PoissonSampledDpEvent(q, GaussianDpEvent(σ)) with add/remove-one adjacency
(seed-fedfdp §2.1); q == 1 is the plain Gaussian. No RDP formula is written here: per-step RDP curves come from
dp_accounting's RdpAccountant and the RDP → (ε, δ) conversion from its `compute_epsilon`; PLD uses its PLDAccountant.

dp_accounting is only trusted inside its sound range (fairfl.privacy: σ, q, compositions, δ, ε targets, orders), so
every input is checked against it, and every ε on the way out: a non-trivial composition whose ε comes back 0,
negative or not finite, or on which dp_accounting raises, is refused with UnsoundAccounting (a ValueError), and
`cross_check` refuses events on which RDP and PLD disagree. Nothing may be recorded on a refused number.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import Literal, NamedTuple

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from fairfl.privacy import (
    COUNT_MAX,
    DELTA_RANGE,
    EPSILON_RANGE,
    NOISE_MULTIPLIER_RANGE,
    ORDER_MAX,
    ORDERS_MAX,
    SAMPLE_RATE_RANGE,
    out_of_sound_range,
)

AccountantName = Literal["rdp", "pld"]
ACCOUNTANTS: tuple[str, ...] = ("rdp", "pld")

# dp_accounting's default orders: [1.1, 1.2, ..., 10.9] + [11..63] + [128, 256, 512, 1024].
DEFAULT_ORDERS: tuple[float, ...] = tuple(float(a) for a in rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
# The FedFDP code's grid (seed-fedfdp §2.4, Λ_code): integer orders only.
PAPER_ORDERS: tuple[float, ...] = tuple(float(a) for a in [*range(2, 64), 128, 256, 512])

# Upper bound for max_rounds when the per-round events spend nothing (or almost nothing).
MAX_ROUNDS_LIMIT = 10**9
# Compositions of one (q, σ) in a composed history (a principal's totals, a search's candidate): RDP composes linearly,
# so only a 64-bit count (the ledger's SQLite column) bounds it; PLD is bounded by COUNT_MAX (_check_pld_counts).
HISTORY_COUNT_MAX = 2**63 - 1

# PLD's grid: dp_accounting's default 1e-4 up to ε = 10 (by RDP), coarser in proportion beyond. A convolution's cost
# grows with the composed loss over the grid (q = 1, σ = 0.035: 16 s and GBs on 1e-4, 0.25 s scaled, same ε to 6
# digits); rounding stays pessimistic, so PLD remains an upper bound.
PLD_INTERVAL = 1e-4
PLD_FINE_EPSILON = 10.0
# The RDP/PLD cross-check: PLD (tight, discretised pessimistically) must stay within the RDP upper bound, up to
# PLD's discretisation. Over q in [1e-6, 1], σ in [0.3, 1e4] and 1..1e4 compositions at δ = 1e-5, PLD on a 1e-3 grid
# exceeded RDP by at most 0.054, and only where both are below 0.1 (σ >= 2); at the presets' settings PLD/RDP is
# 0.53 (one FedFDP round) to 0.93.
CROSS_CHECK_REL_TOL = 0.25
CROSS_CHECK_ABS_TOL = 0.05
CROSS_CHECK_PLD_INTERVAL = 1e-3  # 5x cheaper than 1e-4 and within 0.1% of it at those settings
# What dp_accounting raises when its numerics fail (ZeroDivisionError, OverflowError, FloatingPointError; ValueError;
# MemoryError when PLD asks for a grid it cannot allocate).
_NUMERIC_ERRORS = (ArithmeticError, ValueError, MemoryError)


class EventSpec(NamedTuple):
    """`count` compositions of a Poisson-subsampled Gaussian with rate `sample_rate` and `noise_multiplier`."""

    sample_rate: float
    noise_multiplier: float
    count: int = 1


class UnsoundAccounting(ValueError):
    """dp_accounting cannot account these events soundly: it raised, RDP and PLD disagree, or the ε of a non-trivial
    composition came back 0, negative or not finite. Nothing may be recorded on such a number."""


# --- validation -------------------------------------------------------------------------------------------------------


def check_finite(value: float, name: str) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _check_sound(value: float, name: str, bounds: tuple[float, float]) -> float:
    why = out_of_sound_range(value, bounds)
    if why is not None:
        raise ValueError(f"{name} {why}")
    return value


def check_sample_rate(q: float, name: str = "sample_rate") -> float:
    q = check_finite(q, name)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {q!r}")
    return _check_sound(q, name, SAMPLE_RATE_RANGE)


def check_noise_multiplier(sigma: float, name: str = "noise_multiplier") -> float:
    sigma = check_finite(sigma, name)
    if sigma <= 0.0:
        raise ValueError(f"{name} must be > 0 (σ = 0 means ε = ∞), got {sigma!r}")
    return _check_sound(sigma, name, NOISE_MULTIPLIER_RANGE)


def check_delta(delta: float, name: str = "delta") -> float:
    delta = check_finite(delta, name)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {delta!r}")
    return _check_sound(delta, name, DELTA_RANGE)


def check_epsilon(eps: float, name: str = "target_epsilon") -> float:
    eps = check_finite(eps, name)
    if eps <= 0.0:
        raise ValueError(f"{name} must be > 0, got {eps!r}")
    return _check_sound(eps, name, EPSILON_RANGE)


def check_count(count: int, name: str = "count", maximum: int = COUNT_MAX) -> int:
    """An integer in [0, maximum]: by default the compositions one event or calibration may hold (COUNT_MAX)."""
    if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {count!r}")
    if count > maximum:
        raise ValueError(f"{name} must be at most {maximum} compositions (the accountant's sound range), got {count}")
    return int(count)


def check_accountant(accountant: str, name: str = "accountant") -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"{name} must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
    return accountant


def check_orders(orders: Iterable[float] | None, name: str = "orders") -> tuple[float, ...] | None:
    """None (or empty) means the accountant's defaults; otherwise every order must be finite and > 1."""
    if orders is None:
        return None
    orders = list(orders)
    if len(orders) > ORDERS_MAX:
        raise ValueError(f"{name} must hold at most {ORDERS_MAX} orders, got {len(orders)}")
    out = tuple(check_finite(a, name) for a in orders)
    if not out:
        return None
    bad = [a for a in out if a <= 1.0]
    if bad:
        raise ValueError(f"{name} must all be > 1, got {bad[0]!r}")
    bad = [a for a in out if a > ORDER_MAX]
    if bad:
        raise ValueError(
            f"{name} must all be at most {ORDER_MAX:g} (an order α costs O(α) terms to compute), got {bad[0]!r}"
        )
    return out


def check_events(events: Iterable[EventSpec], name: str = "events") -> list[EventSpec]:
    out = []
    for i, ev in enumerate(events):
        q, sigma, count = ev
        out.append(
            EventSpec(
                check_sample_rate(q, f"{name}[{i}].sample_rate"),
                check_noise_multiplier(sigma, f"{name}[{i}].noise_multiplier"),
                check_count(count, f"{name}[{i}].count", HISTORY_COUNT_MAX),
            )
        )
    return out


def _grouped(events: Iterable[EventSpec], name: str = "events") -> tuple[EventSpec, ...]:
    return group_events(check_events(events, name))


def _check_pld_counts(events: Sequence[EventSpec], name: str = "events") -> None:
    """PLD's convolutions grow with the compositions (2 s at 1e6, 6 minutes at 1e8), so a merged (q, σ) may not
    exceed COUNT_MAX under PLD either; RDP composes linearly and needs no such bound."""
    for q, sigma, count in events:
        if count > COUNT_MAX:
            raise ValueError(
                f"{name}: {count} compositions of (q={q:g}, σ={sigma:g}) exceed {COUNT_MAX}, what the PLD accountant "
                "handles soundly"
            )


def _describe(events: Sequence[EventSpec]) -> str:
    return " + ".join(f"{n} x (q={q:g}, σ={s:g})" for q, s, n in events) or "no events"


@contextmanager
def _numerics(what: str) -> Iterator[None]:
    """dp_accounting's numeric failures become UnsoundAccounting, with what was being accounted."""
    try:
        yield
    except UnsoundAccounting:
        raise
    except _NUMERIC_ERRORS as err:
        raise UnsoundAccounting(
            f"dp_accounting failed on {what} ({type(err).__name__}: {err}); these settings are outside what it "
            "accounts soundly, nothing was recorded"
        ) from err


def _nonzero(eps: float, events: Sequence[EventSpec], accountant: str, delta: float) -> float:
    """ε of a non-trivial composition (σ finite, q > 0, count > 0) is never 0: a 0, negative or non-finite ε is
    dp_accounting's numerics collapsing, or a spend below what it can resolve, and is refused."""
    if not math.isfinite(eps) or eps <= 0.0:
        raise UnsoundAccounting(
            f"the {accountant.upper()} accountant gives ε = {eps!r} for {_describe(events)} at δ = {delta:g}; a "
            "non-trivial mechanism always spends some ε, so this is outside what the accountant resolves and nothing "
            "was recorded: lower the noise multiplier, raise the sample rate, or compose more steps per round"
        )
    return eps


# --- core -------------------------------------------------------------------------------------------------------------


def group_events(events: Iterable[EventSpec]) -> tuple[EventSpec, ...]:
    """Merge events with the same (q, σ) by summing counts; drop empty ones. Sorted, so it is a cache key."""
    totals: dict[tuple[float, float], int] = {}
    for q, sigma, count in events:
        if count:
            totals[(q, sigma)] = totals.get((q, sigma), 0) + count
    return tuple(EventSpec(q, s, n) for (q, s), n in sorted(totals.items()))


def _single_event(q: float, sigma: float) -> dp_accounting.DpEvent:
    gaussian = dp_accounting.GaussianDpEvent(sigma)
    return gaussian if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian)


@lru_cache(maxsize=4096)
def _step_rdp(q: float, sigma: float, orders: tuple[float, ...]) -> np.ndarray:
    """RDP curve of one step. Composition is additive, so a principal's curve is Σ count · step curve; caching the
    step curve makes accounting O(distinct mechanisms) instead of recomputing the series for every query."""
    with _numerics(f"the RDP of one step (q={q:g}, σ={sigma:g})"):
        curve = np.asarray(
            dp_accounting.rdp.RdpAccountant(list(orders)).compose(_single_event(q, sigma)).rdp, dtype=np.float64
        )
    # A Rényi divergence is >= 0; dp_accounting's series cancel to negative values (which it turns into ε = 0) or
    # NaN far outside the sound range.
    if np.isnan(curve).any() or (curve < 0).any():
        raise UnsoundAccounting(
            f"dp_accounting's RDP of one step (q={q:g}, σ={sigma:g}) is negative or NaN at some order: its numerics "
            "failed, so these settings cannot be accounted"
        )
    curve.setflags(write=False)
    return curve


def _rdp_curve(events: Sequence[tuple[float, float, float]], orders: tuple[float, ...]) -> np.ndarray:
    total = np.zeros(len(orders), dtype=np.float64)
    for q, sigma, count in events:
        if count:
            total += count * _step_rdp(q, sigma, orders)
    return total


def _rdp_epsilon(curve: np.ndarray, orders: tuple[float, ...], delta: float) -> tuple[float, float]:
    if not curve.any():
        return 0.0, math.nan
    with _numerics("the RDP to (ε, δ) conversion"):
        eps, order = rdp_privacy_accountant.compute_epsilon(orders, curve, delta)
    return float(eps), float(order)


@lru_cache(maxsize=1024)
def _pld_epsilon(events: tuple[EventSpec, ...], delta: float, interval: float = PLD_INTERVAL) -> float:
    # PLD composition is a numerical convolution (~0.4 s); cached per grouped history, which principals often share.
    with _numerics(f"the PLD of {_describe(events)}"):
        acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
        for q, sigma, count in events:
            acc.compose(dp_accounting.SelfComposedDpEvent(_single_event(q, sigma), count))
        return float(acc.get_epsilon(delta))


def _pld(events: tuple[EventSpec, ...], delta: float, interval: float = PLD_INTERVAL) -> float:
    """PLD ε on `interval`, coarsened in proportion to the RDP bound above PLD_FINE_EPSILON (bounded cost)."""
    if not events:
        return 0.0
    rdp, _ = _rdp_epsilon(_rdp_curve(events, DEFAULT_ORDERS), DEFAULT_ORDERS, delta)
    if not math.isfinite(rdp):
        raise UnsoundAccounting(f"the RDP bound of {_describe(events)} is not finite: PLD cannot be sized for it")
    return _pld_epsilon(events, delta, interval * max(1.0, rdp / PLD_FINE_EPSILON))


def epsilon(
    events: Iterable[EventSpec],
    delta: float,
    accountant: str = "rdp",
    orders: Iterable[float] | None = None,
) -> tuple[float, float]:
    """(ε, optimal RDP order) spent by composing `events` at `delta`; the order is nan for PLD or no events.

    UnsoundAccounting when dp_accounting fails on the events or their ε is 0, negative or not finite."""
    grouped = _grouped(events)
    delta = check_delta(delta)
    accountant = check_accountant(accountant)
    order_grid = check_orders(orders) or DEFAULT_ORDERS
    if not grouped:
        return 0.0, math.nan
    if accountant == "pld":
        _check_pld_counts(grouped)
        return _nonzero(_pld(grouped, delta), grouped, "pld", delta), math.nan
    eps, order = _rdp_epsilon(_rdp_curve(grouped, order_grid), order_grid, delta)
    return _nonzero(eps, grouped, "rdp", delta), order


@lru_cache(maxsize=1024)
def _cross_check(events: tuple[EventSpec, ...], delta: float, orders: tuple[float, ...]) -> tuple[float, float]:
    rdp, _ = _rdp_epsilon(_rdp_curve(events, orders), orders, delta)
    _nonzero(rdp, events, "rdp", delta)
    pld = _pld(events, delta, CROSS_CHECK_PLD_INTERVAL)
    if pld != 0.0:  # exactly 0 below a positive RDP bound is PLD being tighter: one round can be (0, δ)-DP (q <= δ)
        _nonzero(pld, events, "pld", delta)
    if pld > rdp * (1 + CROSS_CHECK_REL_TOL) + CROSS_CHECK_ABS_TOL:
        raise UnsoundAccounting(
            f"RDP and PLD disagree on {_describe(events)} at δ = {delta:g}: PLD ε = {pld:.6g} exceeds the RDP upper "
            f"bound ε = {rdp:.6g} by more than {CROSS_CHECK_REL_TOL:.0%} + {CROSS_CHECK_ABS_TOL:g}, so one of them "
            "is failing numerically; nothing was recorded"
        )
    return rdp, pld


def cross_check(
    events: Iterable[EventSpec], delta: float, orders: Iterable[float] | None = None
) -> tuple[float, float]:
    """(RDP ε, PLD ε) of `events`: RDP finite and > 0, PLD finite and >= 0 (0 where one round is (0, δ)-DP, which
    RDP's looser bound cannot show) and within the RDP upper bound (CROSS_CHECK_*), or
    UnsoundAccounting. Cached by the grouped events: a run's rounds usually repeat one shape, so this costs one PLD
    convolution (on a 1e-3 grid, 10-70 ms at the presets' settings) per shape."""
    grouped = _grouped(events)
    _check_pld_counts(grouped)
    delta = check_delta(delta)
    order_grid = check_orders(orders) or DEFAULT_ORDERS
    if not grouped:
        return 0.0, 0.0
    return _cross_check(grouped, delta, order_grid)


def max_rounds(
    per_round_events: Iterable[EventSpec],
    already_spent_events: Iterable[EventSpec],
    target_eps: float,
    delta: float,
    accountant: str = "rdp",
    orders: Iterable[float] | None = None,
    limit: int = MAX_ROUNDS_LIMIT,
) -> int:
    """The largest integer T such that ε(already spent + T rounds of `per_round_events`) ≤ `target_eps`.

    Exact (ε is monotone in T): exponential search for a bracket, then integer binary search. Capped at `limit`
    (reached when a round spends nothing) and, under PLD, where a (q, σ) would exceed COUNT_MAX compositions, so the
    search is bounded for any input. 0 when even the spent events alone exceed the target.
    """
    per_round = _grouped(per_round_events, "per_round_events")
    spent = _grouped(already_spent_events, "already_spent_events")
    target_eps = check_epsilon(target_eps)
    delta = check_delta(delta)
    accountant = check_accountant(accountant)
    order_grid = check_orders(orders) or DEFAULT_ORDERS
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit!r}")
    if accountant == "pld":
        _check_pld_counts(per_round, "per_round_events")
        _check_pld_counts(spent, "already_spent_events")
        if per_round:
            spent_counts = {(q, s): n for q, s, n in spent}
            limit = min(limit, *((COUNT_MAX - spent_counts.get((q, s), 0)) // n for q, s, n in per_round))

    if accountant == "rdp":
        base, step = _rdp_curve(spent, order_grid), _rdp_curve(per_round, order_grid)

        def eps_at(t: int) -> float:  # t = 0 skips t·step: 0·∞ (an order where one step is unbounded) is nan
            return _rdp_epsilon(base + t * step if t else base, order_grid, delta)[0]
    else:

        def eps_at(t: int) -> float:
            return _pld(group_events([*spent, *(EventSpec(q, s, n * t) for q, s, n in per_round)]), delta)

    if eps_at(0) > target_eps:
        return 0
    if not per_round or limit == 0:
        return limit
    ok, bad = 0, 1  # invariant: eps_at(ok) <= target < eps_at(bad) once a bracket is found
    while eps_at(bad) <= target_eps:
        ok = bad
        if bad >= limit:
            return limit
        bad = min(bad * 2, limit)
    while bad - ok > 1:
        mid = (ok + bad) // 2
        if eps_at(mid) <= target_eps:
            ok = mid
        else:
            bad = mid
    return ok


def paper_parity_max_rounds(
    sample_rate: float,
    noise_multiplier: float,
    target_eps: float,
    delta: float,
    orders: Iterable[float] | None = PAPER_ORDERS,
    tol: float = 0.01,
    upper: float = 100_000.0,
) -> int:
    """The FedFDP code's round count (seed-fedfdp §2.4 "code bisection", gradient mechanism only).

    Bisects a real-valued step count in [0, upper] until ε(high) − target ≤ tol and returns int(high). It may
    overshoot the target by up to `tol`; it exists only to reproduce the paper's T (778 for σ=2, q=0.05, ε=3.52).
    Use `max_rounds` for enforcement.
    """
    q = check_sample_rate(sample_rate)
    sigma = check_noise_multiplier(noise_multiplier)
    target_eps = check_epsilon(target_eps)
    delta = check_delta(delta)
    order_grid = check_orders(orders) or DEFAULT_ORDERS
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol!r}")
    step = _step_rdp(q, sigma, order_grid)

    def eps_at(steps: float) -> float:
        return _rdp_epsilon(steps * step, order_grid, delta)[0]

    low, high = 0.0, float(upper)
    eps_high = eps_at(high)
    if eps_high <= target_eps:
        return int(high)
    while eps_high - target_eps > tol:
        mid = (low + high) / 2
        eps_mid = eps_at(mid)
        if eps_mid > target_eps:
            high, eps_high = mid, eps_mid
        else:
            low = mid
    return int(high)


def calibrate_noise(
    target_eps: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    orders: Iterable[float] | None = None,
    tol: float | None = None,
) -> float:
    """The smallest noise multiplier σ (within `tol`) whose `steps` compositions spend at most `target_eps`.

    ε is decreasing in σ: a doubling/halving search brackets the answer, then dp_accounting's
    `calibrate_dp_mechanism` (Brent's method with a bisection fallback) returns a σ on the safe side, ε(σ) ≤ target.
    `tol` defaults to 1e-6 for RDP and 1e-3 for PLD (each PLD evaluation costs ~0.4 s, and its own discretisation
    error is of that order anyway). The search stays in the sound range of σ: the lower bound when it already meets
    the target, ValueError when even the upper bound does not.
    """
    target_eps = check_epsilon(target_eps)
    delta = check_delta(delta)
    q = check_sample_rate(sample_rate)
    steps = check_count(steps, "steps")
    accountant = check_accountant(accountant)
    order_grid = check_orders(orders)
    if steps == 0:
        raise ValueError("steps must be >= 1 to calibrate noise")
    if tol is None:
        tol = 1e-3 if accountant == "pld" else 1e-6
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol!r}")

    grid = order_grid or DEFAULT_ORDERS
    sigma_min, sigma_max = NOISE_MULTIPLIER_RANGE

    def eps_at(sigma: float) -> float:
        events = (EventSpec(q, sigma, steps),)
        if accountant == "pld":
            return _pld(events, delta)
        return _rdp_epsilon(_rdp_curve(events, grid), grid, delta)[0]

    if eps_at(sigma_max) > target_eps:
        raise ValueError(
            f"no noise multiplier in the accountant's sound range (σ <= {sigma_max:g}) reaches "
            f"target_epsilon={target_eps!r} for {steps} steps at sample_rate={q!r}: raise the target or take fewer "
            "steps"
        )
    if eps_at(sigma_min) <= target_eps:
        return sigma_min
    high = 1.0  # invariant once bracketed: eps_at(low) > target >= eps_at(high), low >= high / 2
    while eps_at(high) > target_eps:
        high = min(high * 2, sigma_max)
    low = max(high / 2, sigma_min)
    while low > sigma_min and eps_at(low) <= target_eps:  # the answer may lie below 1
        high, low = low, max(low / 2, sigma_min)

    def fresh_accountant() -> dp_accounting.PrivacyAccountant:
        if accountant == "pld":  # the grid `_pld` uses near the target
            interval = PLD_INTERVAL * max(1.0, target_eps / PLD_FINE_EPSILON)
            return dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
        return dp_accounting.rdp.RdpAccountant(list(grid))

    with _numerics(f"calibrating σ for {steps} steps at q={q:g}"):
        return float(
            dp_accounting.calibrate_dp_mechanism(
                fresh_accountant,
                lambda sigma: dp_accounting.SelfComposedDpEvent(_single_event(q, sigma), steps),
                target_eps,
                delta,
                dp_accounting.ExplicitBracketInterval(low, high),
                tol=tol,
            )
        )
