"""The exact fold's inner loop compiled into one pass (numba), with the torch ops as the fallback.

`ExactSum` folds w·v into a double-double (hi, lo) with Knuth's TwoSum per coordinate. As torch ops that is nine
passes over each block; compiled, it is one: 0.08 against 0.43 ms per update of 199k coordinates on this project's
2-core machine (the fold's ms/update printed by `python scripts/bench_aggregation.py --params 199210 --counts 100
--no-buffered --strategies fedavg`, with and without FAIRFL_FOLD_KERNEL=torch). Both run the same IEEE double
operations in the same order, so they give the same bits; a process where numba is missing or cannot compile folds
with torch and stays bit-equal to every process that can. Each process checks its kernel against the torch ops
before using it.

numba is imported and the kernel compiled (or loaded from numba's cache) on first use, ~0.5 s, and only for vectors
of at least MIN_NUMEL coordinates: small models gain nothing worth that in every process that folds. The engine asks
for it when a run starts (`kernel_for`), so the first round does not pay it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import numpy as np
import torch

log = logging.getLogger(__name__)

MIN_NUMEL = 1 << 15
DISABLE_ENV = "FAIRFL_FOLD_KERNEL"  # "torch": fold with torch ops only (benchmarks compare the two)

Kernel = Callable[[np.ndarray, np.ndarray, np.ndarray, float], None]
_kernel: Kernel | None = None
_tried = False
_lock = threading.Lock()


def _two_sum_fold(hi: np.ndarray, lo: np.ndarray, vector: np.ndarray, factor: float) -> None:
    """hi + lo += vector · factor, per coordinate, in two_sum_fold_ops' order of operations exactly:
    p = f64(v)·factor (exact: 24 × 24 bits); s = hi + p; z = s − hi; lo = (lo + (hi − (s − z))) + (p − z); hi = s."""
    for i in range(vector.shape[0]):
        p = np.float64(vector[i]) * factor
        h = hi[i]
        s = h + p
        z = s - h
        lo[i] = (lo[i] + (h - (s - z))) + (p - z)
        hi[i] = s


def two_sum_fold_ops(
    hi: torch.Tensor,
    lo: torch.Tensor,
    vector: torch.Tensor,
    factor: float,
    s: torch.Tensor,
    p: torch.Tensor,
    z: torch.Tensor,
) -> None:
    """The same fold as torch ops over whole float64 blocks, into `s` (the new hi: the caller swaps it in rather than
    copying it) and `lo`; `p` and `z` are scratch of the same size."""
    p.copy_(vector)  # to float64 first: the product must not round in float32
    p.mul_(factor)  # exact: 24-bit mantissa × 24-bit coordinate
    torch.add(hi, p, out=s)  # TwoSum(hi, p): s + error == hi + p exactly
    torch.sub(s, hi, out=z)
    p.sub_(z)  # p − (s − hi)
    torch.sub(s, z, out=z)
    torch.sub(hi, z, out=z)  # hi − (s − (s − hi))
    lo.add_(z).add_(p)  # the rounding error of s joins the low word


def _compile() -> Kernel | None:
    try:
        import numba
    except Exception as err:  # ImportError, or OSError when llvmlite's library cannot load
        log.info("numba is unavailable (%s): the exact fold uses torch ops (same bits, ~4x the CPU)", err)
        return None
    signature = "void(float64[::1], float64[::1], float32[::1], float64)"  # torch's .numpy() views are writable
    reasons = []
    for cache in (True, False):  # a cache directory that cannot be used: compile in this process instead (~1 s)
        try:
            kernel = numba.njit(signature, cache=cache, nogil=True, fastmath=False)(_two_sum_fold)
            _check(kernel)
            return kernel
        except Exception as err:  # numba raises many types (caching, lowering, LLVM): any of them means "not here"
            reasons.append(f"{'cached' if cache else 'uncached'}: {err}")
    log.warning("the compiled exact fold is unavailable (%s): using torch ops (same bits)", "; ".join(reasons))
    return None


def _check(kernel: Kernel) -> None:
    """The kernel against the torch ops on values whose sums round (mixed magnitudes, subnormals): a kernel that
    computed anything else (a dropped or simplified error term) is refused here, not found later in a run's results."""
    rng = np.random.default_rng(0)
    vector = (rng.standard_normal(4096) * np.exp2(rng.integers(-140, 40, 4096))).astype(np.float32)
    hi = rng.standard_normal(4096) * np.exp2(rng.integers(-1060, 30, 4096).astype(np.float64))
    lo = hi * 2.0**-60
    ops_hi, ops_lo = torch.from_numpy(hi.copy()), torch.from_numpy(lo.copy())
    s, p, z = (torch.empty_like(ops_hi) for _ in range(3))
    for factor in (1.0, 0.75, 2.0**-1000, 3.0 * 2.0**20):
        kernel(hi, lo, vector, factor)
        two_sum_fold_ops(ops_hi, ops_lo, torch.from_numpy(vector), factor, s, p, z)
        ops_hi, s = s, ops_hi
    if not (np.array_equal(hi, ops_hi.numpy()) and np.array_equal(lo, ops_lo.numpy())):
        raise RuntimeError("the compiled TwoSum differs from the torch ops")


def kernel_for(numel: int) -> Kernel | None:
    """The compiled fold for vectors of `numel` coordinates, or None where the torch ops should be used."""
    global _kernel, _tried
    if numel < MIN_NUMEL or os.environ.get(DISABLE_ENV, "").strip().lower() == "torch":
        return None
    with _lock:
        if not _tried:
            try:
                _kernel = _compile()
            finally:
                _tried = True  # one attempt per process, whatever happened
        return _kernel
