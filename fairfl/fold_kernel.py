"""The exact fold's inner loop compiled into one pass (numba), with the torch ops as the fallback.

`ExactSum` folds w·v into a double-double (hi, lo) with Knuth's TwoSum per coordinate. As torch ops that is nine
passes over each block; compiled, it is one: about 4x less CPU per update (see the fold's ms/update printed by
`python scripts/bench_aggregation.py --params 199210 --counts 100 --no-buffered --strategies fedavg`, with and
without FAIRFL_FOLD_KERNEL=torch). Both run the same IEEE double operations in the same order, so they give the same
bits, and a process that cannot compile (numba missing, an unsupported platform, no writable cache and no compiler
cache at all) folds with torch and stays bit-equal to every process that can.

numba is imported and the kernel compiled on first use, and only for vectors of at least MIN_NUMEL coordinates:
small models gain nothing worth numba's import (~0.3 s) in every process that folds.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)

MIN_NUMEL = 1 << 15
# FAIRFL_FOLD_KERNEL=torch folds with torch ops only (benchmarks compare the two; a platform numba misbehaves on).
_DISABLED = os.environ.get("FAIRFL_FOLD_KERNEL", "").strip().lower() == "torch"

Kernel = Callable[[np.ndarray, np.ndarray, np.ndarray, float], None]
_kernel: Kernel | None = None
_tried = False
_lock = threading.Lock()


def _two_sum_fold(hi: np.ndarray, lo: np.ndarray, vector: np.ndarray, factor: float) -> None:
    """hi + lo += vector · factor, per coordinate. The order of operations is ExactSum's torch fallback's exactly:
    p = f64(v)·factor (exact: 24 × 24 bits); s = hi + p; z = s − hi; lo = (lo + (hi − (s − z))) + (p − z); hi = s."""
    for i in range(vector.shape[0]):
        p = np.float64(vector[i]) * factor
        h = hi[i]
        s = h + p
        z = s - h
        lo[i] = (lo[i] + (h - (s - z))) + (p - z)
        hi[i] = s


def _compile() -> Kernel | None:
    try:
        import numba
    except ImportError:
        log.info("numba is not installed: the exact fold uses torch ops (same bits, ~4x the CPU)")
        return None
    signature = "void(float64[::1], float64[::1], float32[::1], float64)"  # torch's .numpy() views are writable
    options = {"nogil": True, "boundscheck": False, "fastmath": False, "error_model": "numpy"}
    for cache in (True, False):  # no writable cache directory: compile in this process instead (~1 s)
        try:
            kernel = numba.njit(signature, cache=cache, **options)(_two_sum_fold)
            _self_check(kernel)
            return kernel
        except Exception as err:  # numba raises many types (caching, lowering, LLVM): any of them means "not here"
            reason = err
    log.warning("the compiled exact fold is unavailable (%s): using torch ops (same bits, ~4x the CPU)", reason)
    return None


def _self_check(kernel: Kernel) -> None:
    """One TwoSum whose rounding error only lands in `lo` if the kernel keeps IEEE order (no reassociation)."""
    hi, lo = np.array([1.0]), np.zeros(1)
    kernel(hi, lo, np.array([2.0**-30], dtype=np.float32), 2.0**-30)
    if hi[0] != 1.0 or lo[0] != 2.0**-60:
        raise RuntimeError(f"compiled TwoSum gave hi={hi[0]!r}, lo={lo[0]!r}")


def kernel_for(numel: int) -> Kernel | None:
    """The compiled fold for vectors of `numel` coordinates, or None where the torch ops should be used."""
    global _kernel, _tried
    if _DISABLED or numel < MIN_NUMEL:
        return None
    if not _tried:
        with _lock:
            if not _tried:
                _kernel = _compile()
                _tried = True
    return _kernel
