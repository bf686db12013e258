"""DP helpers shared by the aggregator and the client agent: where the randomness of DP mechanisms comes from.

Poisson sampling and Gaussian noise of a DP release must be secret from whoever sees the release. Seeds derived from
public values (the run seed, the task seed the server chose) make a run reproducible, which the in-process oracle and
the gRPC-vs-in-process tests need, but anyone who knows them could regenerate the noise and subtract it. So there are
two sources: 'task' (seeded, reproducible: simulation only) and 'secure' (the OS CSPRNG: deployments). The agent and
aggregator processes read FAIRFL_DP_RANDOMNESS (default secure); in-process runs are simulations and use 'task'.

It also holds the accountant's sound range: the parameters for which dp_accounting 0.6.0 (RDP and PLD) returns a
finite, non-zero ε on which both accountants agree, in reasonable time and memory. The experiment config refuses
values outside it at load and the privacy service refuses them in every request (fairfl/accounting.py).
"""

from __future__ import annotations

import dataclasses
import os
import secrets

import numpy as np

# --- the accountant's sound range (measurements: docs/security.md, "The privacy ledger's sound range") -------------
# Below σ = 0.3 PLD costs 0.65 s (σ = 0.3), 2.6 s (0.1), 164 s (0.01) per Gaussian step and fails with MemoryError
# below 1e-3, and RDP of a subsampled Gaussian goes negative (reported as ε = 0) around 1e-156; above 1e4 a step's ε
# is below RDP's resolution (its conversion floor, then 0), and 1e300 overflows.
NOISE_MULTIPLIER_RANGE: tuple[float, float] = (0.3, 1e4)
# Below q = 1e-6 (at σ up to 1e4) dp_accounting's RDP series for the subsampled Gaussian yields negative divergences
# (q = 1e-7: from σ ≈ 4e3; q = 1e-300: at every σ), i.e. ε = 0.
SAMPLE_RATE_RANGE: tuple[float, float] = (1e-6, 1.0)
# Compositions of one (q, σ) in one event, and in a principal's history under PLD, whose convolutions grow with them
# (1e6: at most 2.2 s over this range; 1e8: 6 minutes); RDP composes linearly. 1e6 steps is far beyond any
# budget-limited DP-SGD run.
COUNT_MAX = 10**6
# PLD truncates tails at 1e-15 (ε = ∞ for δ ≤ 1e-15); above 0.01 ε collapses to 0 for ordinary mechanisms.
DELTA_RANGE: tuple[float, float] = (1e-12, 1e-2)
# Budgets and targets: ε = 100 already means no meaningful privacy; below 1e-3 nothing fits (RDP's conversion floor
# is ≈ 0.0035 at δ = 1e-5, PLD's grid 1e-4).
EPSILON_RANGE: tuple[float, float] = (1e-3, 100.0)
# RDP orders: each integer order α costs O(α) terms (α = 1e6: 28 s a step; 1e300 never returns).
ORDER_MAX = 1e4
ORDERS_MAX = 256  # orders in one grid (dp_accounting's default grid has 156)

RANDOMNESS = ("secure", "task")
RANDOMNESS_ENV = "FAIRFL_DP_RANDOMNESS"


def check_randomness(value: str) -> str:
    if value not in RANDOMNESS:
        raise ValueError(f"DP randomness must be 'secure' (OS entropy) or 'task' (seeded, reproducible), got {value!r}")
    return value


def process_randomness() -> str:
    """The DP randomness of a service or agent process: $FAIRFL_DP_RANDOMNESS, default 'secure'."""
    return check_randomness(os.environ.get(RANDOMNESS_ENV, "secure"))


def dp_seed(randomness: str, *words: int) -> int:
    """A 63-bit generator seed: from `words` (reproducible) for 'task', from the OS for 'secure'."""
    if check_randomness(randomness) == "secure":
        return secrets.randbits(63)
    state = np.random.SeedSequence([int(w) for w in words]).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


def out_of_sound_range(value: float, bounds: tuple[float, float]) -> str | None:
    """Why `value` lies outside `bounds` (inclusive) of the accountant's sound range, or None; NaN is outside."""
    low, high = bounds
    if low <= value <= high:
        return None
    return f"must be in [{low:g}, {high:g}], the range the privacy accountant handles soundly; got {float(value)!r}"


# --- ledger values: what a run's budget is and what a round spends, built by the aggregator, kept by the ledger ------


@dataclasses.dataclass(frozen=True)
class Budget:
    """A run's privacy budget. Equality ignores `created_at`, so an identical re-registration is recognised."""

    run_id: str
    epsilon: float
    delta: float
    accountant: str = "rdp"
    principal_kind: str = "client"
    orders: tuple[float, ...] | None = None  # None = the accountant's defaults
    created_at: float = dataclasses.field(default=0.0, compare=False)

    @property
    def private(self) -> bool:
        return self.principal_kind != "none"


@dataclasses.dataclass(frozen=True)
class Event:
    """`count` compositions of one mechanism for one principal (client id, or "federation")."""

    principal: str
    mechanism: str
    sample_rate: float
    noise_multiplier: float
    count: int = 1

    @property
    def key(self) -> tuple[str, str]:
        return (self.principal, self.mechanism)
