"""Privacy accounting for Poisson-subsampled Gaussian mechanisms, as pure functions over Google's dp_accounting.

An event is `count` compositions of PoissonSampledDpEvent(q, GaussianDpEvent(σ)) with add/remove-one adjacency
(seed-fedfdp §2.1); q == 1 is the plain Gaussian. No RDP formula is written here: per-step RDP curves come from
dp_accounting's RdpAccountant and the RDP → (ε, δ) conversion from its `compute_epsilon`; PLD uses its PLDAccountant.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Literal, NamedTuple

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

AccountantName = Literal["rdp", "pld"]
ACCOUNTANTS: tuple[str, ...] = ("rdp", "pld")

# dp_accounting's default orders: [1.1, 1.2, ..., 10.9] + [11..63] + [128, 256, 512, 1024].
DEFAULT_ORDERS: tuple[float, ...] = tuple(float(a) for a in rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
# The FedFDP code's grid (seed-fedfdp §2.4, Λ_code): integer orders only.
PAPER_ORDERS: tuple[float, ...] = tuple(float(a) for a in [*range(2, 64), 128, 256, 512])

# Upper bound for max_rounds when the per-round events spend nothing (or almost nothing).
MAX_ROUNDS_LIMIT = 10**9


class EventSpec(NamedTuple):
    """`count` compositions of a Poisson-subsampled Gaussian with rate `sample_rate` and `noise_multiplier`."""

    sample_rate: float
    noise_multiplier: float
    count: int = 1


# --- validation -------------------------------------------------------------------------------------------------------


def check_finite(value: float, name: str) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def check_sample_rate(q: float, name: str = "sample_rate") -> float:
    q = check_finite(q, name)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {q!r}")
    return q


def check_noise_multiplier(sigma: float, name: str = "noise_multiplier") -> float:
    sigma = check_finite(sigma, name)
    if sigma <= 0.0:
        raise ValueError(f"{name} must be > 0 (σ = 0 means ε = ∞), got {sigma!r}")
    return sigma


def check_delta(delta: float, name: str = "delta") -> float:
    delta = check_finite(delta, name)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {delta!r}")
    return delta


def check_epsilon(eps: float, name: str = "target_epsilon") -> float:
    eps = check_finite(eps, name)
    if eps <= 0.0:
        raise ValueError(f"{name} must be > 0, got {eps!r}")
    return eps


def check_count(count: int, name: str = "count") -> int:
    if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {count!r}")
    return int(count)


def check_accountant(accountant: str, name: str = "accountant") -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"{name} must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
    return accountant


def check_orders(orders: Iterable[float] | None, name: str = "orders") -> tuple[float, ...] | None:
    """None (or empty) means the accountant's defaults; otherwise every order must be finite and > 1."""
    if orders is None:
        return None
    out = tuple(check_finite(a, name) for a in orders)
    if not out:
        return None
    bad = [a for a in out if a <= 1.0]
    if bad:
        raise ValueError(f"{name} must all be > 1, got {bad[0]!r}")
    return out


def check_events(events: Iterable[EventSpec], name: str = "events") -> list[EventSpec]:
    out = []
    for i, ev in enumerate(events):
        q, sigma, count = ev
        out.append(
            EventSpec(
                check_sample_rate(q, f"{name}[{i}].sample_rate"),
                check_noise_multiplier(sigma, f"{name}[{i}].noise_multiplier"),
                check_count(count, f"{name}[{i}].count"),
            )
        )
    return out


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
    curve = dp_accounting.rdp.RdpAccountant(list(orders)).compose(_single_event(q, sigma)).rdp
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
    eps, order = rdp_privacy_accountant.compute_epsilon(orders, curve, delta)
    return float(eps), float(order)


@lru_cache(maxsize=1024)
def _pld_epsilon(events: tuple[EventSpec, ...], delta: float) -> float:
    # PLD composition is a numerical convolution (~0.4 s); cached per grouped history, which principals often share.
    acc = dp_accounting.pld.PLDAccountant()
    for q, sigma, count in events:
        acc.compose(dp_accounting.SelfComposedDpEvent(_single_event(q, sigma), count))
    return float(acc.get_epsilon(delta))


def epsilon(
    events: Iterable[EventSpec],
    delta: float,
    accountant: str = "rdp",
    orders: Iterable[float] | None = None,
) -> tuple[float, float]:
    """(ε, optimal RDP order) spent by composing `events` at `delta`; the order is nan for PLD or no events."""
    grouped = group_events(check_events(events))
    delta = check_delta(delta)
    accountant = check_accountant(accountant)
    order_grid = check_orders(orders) or DEFAULT_ORDERS
    if not grouped:
        return 0.0, math.nan
    if accountant == "pld":
        return _pld_epsilon(grouped, delta), math.nan
    return _rdp_epsilon(_rdp_curve(grouped, order_grid), order_grid, delta)


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
    (reached when a round spends nothing). 0 when even the spent events alone exceed the target.
    """
    per_round = group_events(check_events(per_round_events, "per_round_events"))
    spent = group_events(check_events(already_spent_events, "already_spent_events"))
    target_eps = check_epsilon(target_eps)
    delta = check_delta(delta)
    accountant = check_accountant(accountant)
    order_grid = check_orders(orders) or DEFAULT_ORDERS
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit!r}")

    if accountant == "rdp":
        base, step = _rdp_curve(spent, order_grid), _rdp_curve(per_round, order_grid)

        def eps_at(t: int) -> float:  # t = 0 skips t·step: 0·∞ (an order where one step is unbounded) is nan
            return _rdp_epsilon(base + t * step if t else base, order_grid, delta)[0]
    else:

        def eps_at(t: int) -> float:
            return epsilon([*spent, *(EventSpec(q, s, n * t) for q, s, n in per_round)], delta, "pld")[0]

    if eps_at(0) > target_eps:
        return 0
    if not per_round:
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
    error is of that order anyway).
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

    def eps_at(sigma: float) -> float:
        return epsilon([EventSpec(q, sigma, steps)], delta, accountant, order_grid)[0]

    high = 1.0
    while eps_at(high) > target_eps:
        high *= 2
        if high > 1e6:
            raise ValueError(f"no noise multiplier up to 1e6 reaches target_epsilon={target_eps!r}")
    low = high / 2
    while eps_at(low) <= target_eps:  # the answer may lie below 1
        high, low = low, low / 2
        if low < tol:
            return high

    def fresh_accountant() -> dp_accounting.PrivacyAccountant:
        if accountant == "pld":
            return dp_accounting.pld.PLDAccountant()
        return dp_accounting.rdp.RdpAccountant(list(order_grid or DEFAULT_ORDERS))

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
