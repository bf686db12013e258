"""DP helpers shared by the aggregator and the client agent: where the randomness of DP mechanisms comes from.

Poisson sampling and Gaussian noise of a DP release must be secret from whoever sees the release. Seeds derived from
public values (the run seed, the task seed the server chose) make a run reproducible, which the in-process oracle and
the gRPC-vs-in-process tests need, but anyone who knows them could regenerate the noise and subtract it. So there are
two sources: 'task' (seeded, reproducible: simulation only) and 'secure' (the OS CSPRNG: deployments). The agent and
aggregator processes read FAIRFL_DP_RANDOMNESS (default secure); in-process runs are simulations and use 'task'.

It also holds the accountant's sound range: the parameters for which dp_accounting 0.6.0 (RDP and PLD) returns a
finite, non-zero ε on which both accountants agree, in reasonable time and memory. The experiment config refuses
values outside it at load and the privacy service refuses them in every request (fairfl/accounting.py).

And the scale of DP-SGD's noise in a client's update: the divisor of a noisy sum, which the agent divides by, and the
noise's expected energy in the update it releases, which the aggregator may discount (DP-q-FFL's h_k).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets

import numpy as np

from fairfl.v1 import federation_pb2

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


# --- DP-SGD's noise in a client's update --------------------------------------------------------------------------


def noise_divisor(dp: federation_pb2.DpSgd, n: int, realized: float) -> float:
    """The divisor b of a DP-SGD step's noisy sum (seed-fedfdp §9.6): the expected batch q·n by default, the batch's
    realized size, or a fixed one."""
    if dp.grad_normalizer == federation_pb2.GRAD_NORMALIZER_REALIZED:
        return float(max(realized, 1))
    if dp.grad_normalizer == federation_pb2.GRAD_NORMALIZER_FIXED:
        return float(max(dp.fixed_batch, 1))
    return dp.sample_rate * n


def update_noise_energy(train: federation_pb2.LocalTrainingConfig, n: int, dim: int) -> float:
    """E‖ν‖², ν the part of a client's update x_k − x_t that is DP-SGD's Gaussian noise: each of the K = local_steps
    steps adds N(0, (σC/b)² I) to the gradient, and SGD (momentum β, weight decay wd, lr η: linear in the gradient)
    carries a unit added at step s into the final parameters with a gain a_s, so E‖ν‖² = d (σC/b)² Σ_s a_s².
    Plain SGD: a_s = −η, E‖ν‖² = K d (ησC/b)². Public values only (n is the client's reported size; a realized
    batch's b is taken at its expectation q·n, which understates E[1/b²] for small batches), so subtracting it from a
    released update's norm is post-processing. Not modelled: a FedProx term's pull on the noise (it passes through
    the clipping coefficients). Adam rescales the noise per coordinate by the gradient's history: no such formula
    (callers refuse it)."""
    dp = train.dp
    if train.optimizer == federation_pb2.OPTIMIZER_ADAM:
        raise ValueError("the noise energy of a DP-SGD update is defined for SGD, not Adam")
    divisor = noise_divisor(dp, n, realized=dp.sample_rate * n)
    gain = _sgd_noise_gain(train.local_steps, train.lr, train.momentum, train.weight_decay)
    return dim * (dp.noise_multiplier * dp.clip_norm / divisor) ** 2 * gain


@functools.lru_cache(maxsize=64)  # one round's clients share their training settings
def _sgd_noise_gain(steps: int, lr: float, beta: float, decay: float) -> float:
    """Σ_s a_s² for K SGD steps: the K responses of the final parameters to a unit gradient at each step, all at once
    (torch.optim.SGD's recurrence: buf = g at the first step, β·buf + g after; g includes wd·p; p −= η·buf)."""
    position = np.zeros(steps)  # entry s: the response to a unit gradient added at step s
    velocity = np.zeros(steps)
    for t in range(steps):
        grad = decay * position
        grad[t] += 1.0
        velocity = grad if t == 0 or beta == 0 else beta * velocity + grad
        position = position - lr * velocity
    return float(np.dot(position, position))
