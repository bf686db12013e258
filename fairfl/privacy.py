"""DP helpers shared by the aggregator and the client agent: where the randomness of DP mechanisms comes from.

Poisson sampling and Gaussian noise of a DP release must be secret from whoever sees the release. Seeds derived from
public values (the run seed, the task seed the server chose) make a run reproducible, which the in-process oracle and
the gRPC-vs-in-process tests need, but anyone who knows them could regenerate the noise and subtract it. So there are
two sources: 'task' (seeded, reproducible: simulation only) and 'secure' (the OS CSPRNG: deployments). The agent and
aggregator processes read FAIRFL_DP_RANDOMNESS (default secure); in-process runs are simulations and use 'task'.
"""

from __future__ import annotations

import os
import secrets

import numpy as np

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
