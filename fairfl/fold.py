"""Streaming aggregation: client vectors folded into a weighted sum as they arrive, in any order, to the same bits.

The aggregator never needs a round's updates side by side: each is added to a running sum and dropped, so memory
is one accumulator per sum whatever the number of clients per round. Arrival order over gRPC is a race, so the sum
must not depend on it, or a run would stop being reproducible (and stop matching the in-process oracle bit for bit):

- every weight is a float32 mantissa times a power of two (`Weight`), so weight × float32 coordinate is exact in
  float64 (24 + 24 significant bits);
- the exact products are summed in double-double (hi + lo, Knuth's TwoSum per coordinate), whose rounding error
  (~2^-100 of the terms) is far below a float32 ulp, so any order rounds to the same float32 result. Not a proof:
  `lo` is itself a float64 sum, so terms that cancel across more than ~100 binary orders of magnitude (1, −1 and
  2^-120 in one coordinate) can still round by order; for real updates that is ~n·2^-80 per coordinate;
- softmax weights exp(s_i) keep a running maximum exponent (a running log-sum-exp): when a larger one arrives the
  accumulator is rescaled by a power of two, which is exact, so no exp() ever overflows and no order is favoured.

The work is blocked (BLOCK coordinates at a time) so temporaries stay in cache and memory stays at the accumulator.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from fairfl.fold_kernel import kernel_for, two_sum_fold_ops
from fairfl.protocol import UPDATE, ClientResult

BLOCK = 1 << 18  # coordinates per block: 2 MiB of float64 temporaries, inside L2/L3
FOLD_THREADS = max(1, min(4, os.cpu_count() or 1))
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(FOLD_THREADS, thread_name_prefix="fold")
        return _POOL


def _split(numel: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous ranges cut at BLOCK boundaries."""
    blocks = -(-numel // BLOCK)
    edges = [min(numel, (blocks * i // parts) * BLOCK) for i in range(parts + 1)]
    return [(a, b) for a, b in itertools.pairwise(edges) if b > a] or [(0, numel)]


_LN2 = math.log(2.0)
F32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Weight:
    """mantissa · 2**exponent with a float32-representable mantissa (exactness of the products needs it)."""

    mantissa: float
    exponent: int

    @classmethod
    def linear(cls, value: float) -> Weight:
        """A weight given directly (sample counts, q-FFL's L·F^q); rounded to float32's 24 significant bits."""
        if not math.isfinite(value):
            raise ValueError(f"aggregation weight must be finite, got {value}")
        rounded = float(np.float32(value)) if abs(value) <= F32_MAX else math.inf
        if math.isinf(rounded) or (rounded == 0.0 and value != 0.0):
            raise ValueError(f"aggregation weight {value} is outside float32's range; pass it as a log-weight (exp)")
        mantissa, exponent = math.frexp(rounded)
        return cls(mantissa, exponent)

    @classmethod
    def exp(cls, log_value: float) -> Weight:
        """exp(log_value) without overflow (softmax weights): 2**e · exp(log_value − e·ln 2), the latter in [1, 2)."""
        if not math.isfinite(log_value):
            raise ValueError(f"aggregation log-weight must be finite, got {log_value}")
        exponent = math.floor(log_value / _LN2)
        mantissa, extra = math.frexp(float(np.float32(math.exp(log_value - exponent * _LN2))))
        return cls(mantissa, exponent + extra)

    def scaled(self, reference: int) -> float:
        """The weight divided by 2**reference, as a float (exact unless it underflows to negligible)."""
        return math.ldexp(self.mantissa, self.exponent - reference)


class _Buffers:
    """An ExactSum's float64 memory: `hi` in blocks of `size` coordinates (the last one padded), `lo` flat, and per
    part of the work (see _split) a spare block and two scratch blocks. `hi` is in blocks so that a fold can swap a
    freshly computed block in instead of copying it (one pass less per update)."""

    __slots__ = ("hi", "lo", "scratch", "size", "spare")

    def __init__(self, numel: int, parts: int) -> None:
        self.size = max(1, min(BLOCK, numel))
        self.hi = [torch.zeros(self.size, dtype=torch.float64) for _ in range(-(-numel // BLOCK) or 1)]
        self.lo = torch.zeros(numel, dtype=torch.float64)
        self.spare = [torch.empty(self.size, dtype=torch.float64) for _ in range(parts)]
        self.scratch = [
            (torch.empty(self.size, dtype=torch.float64), torch.empty_like(self.spare[0])) for _ in range(parts)
        ]

    def nbytes(self) -> int:
        return 8 * self.size * (len(self.hi) + 3 * len(self.spare)) + 8 * self.lo.numel()

    def zero(self) -> None:
        for block in self.hi:
            block.zero_()
        self.lo.zero_()


class _BufferPool:
    """ExactSum buffers handed out again once their sum is gone: every round folds into sums of the same sizes, and
    fresh memory costs more to touch (page faults) than zeroing reused memory. At most `max_idle_bytes` are kept."""

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._idle: dict[tuple[int, int], list[_Buffers]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, numel: int, parts: int) -> _Buffers:
        with self._lock:
            idle = self._idle.get((numel, parts))
            if idle:
                buffers = idle.pop()
                self._idle_bytes -= buffers.nbytes()
                buffers.zero()
                return buffers
        return _Buffers(numel, parts)

    def give(self, numel: int, parts: int, buffers: _Buffers) -> None:
        """Keep `buffers` for the next sum of this size, dropping idle ones of other sizes first to stay under the
        cap (a long-lived aggregator's next run may have another model: the last one's buffers must not pin memory)."""
        size = buffers.nbytes()
        with self._lock:
            for key in [k for k in self._idle if k != (numel, parts)]:
                while self._idle[key] and self._idle_bytes + size > self.max_idle_bytes:
                    self._idle_bytes -= self._idle[key].pop().nbytes()
                if not self._idle[key]:
                    del self._idle[key]
            if self._idle_bytes + size <= self.max_idle_bytes:
                self._idle.setdefault((numel, parts), []).append(buffers)
                self._idle_bytes += size


_BUFFERS = _BufferPool(max_idle_bytes=1 << 30)


class ExactSum:
    """Σ_i w_i·v_i over flat float32 vectors of one size, independent of the order of the terms; thread-safe."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.reference: int | None = None  # hi + lo hold the sum divided by 2**reference (the largest exponent)
        self.weights: list[Weight] = []
        self.keys: list[int] = []  # who each weight belongs to (client ids), in arrival order
        self._lock = threading.Lock()
        self._broken = ""  # why a fold failed part way (hi and lo are then unusable)
        self._kernel = kernel_for(numel)  # one compiled pass per block, or None: nine torch ops (the same bits)
        # Big vectors are folded by FOLD_THREADS workers on disjoint ranges (both kinds of kernel release the GIL).
        self._ranges = _split(numel, FOLD_THREADS if numel >= 4 * BLOCK else 1)
        self._buffers = _BUFFERS.take(numel, len(self._ranges))
        # Back to the pool when this sum is gone; nothing outside it holds its buffers (scaled_sum returns a copy).
        weakref.finalize(self, _BUFFERS.give, numel, len(self._ranges), self._buffers).atexit = False

    def _blocks(self, first: int, last: int) -> Iterator[tuple[int, int, int]]:
        """(block index, start, end) of the blocks of [first, last) (cut at BLOCK boundaries)."""
        for start in range(first, last, BLOCK):
            yield start // BLOCK, start, min(start + BLOCK, last)

    def add(self, vector: torch.Tensor, weight: Weight, key: int = -1) -> None:
        if vector.dtype != torch.float32 or vector.dim() != 1 or vector.numel() != self.numel:
            raise ValueError(
                f"expected a flat float32 vector of {self.numel} values, got {vector.dtype} {list(vector.shape)}"
            )
        with self._lock:
            self._check_intact()
            if weight.mantissa != 0.0:
                try:
                    self._fold_all(vector.detach().contiguous(), weight)
                except BaseException as err:  # hi and lo may hold part of it: the sum must not be used
                    self._broken = f"{type(err).__name__}: {err}"
                    raise
            self.weights.append(weight)
            self.keys.append(key)

    def _check_intact(self) -> None:
        if self._broken:
            raise RuntimeError(f"this sum is incomplete: a fold failed part way ({self._broken})")

    def _fold_all(self, vector: torch.Tensor, weight: Weight) -> None:
        if self.reference is None:
            self.reference = weight.exponent
        elif weight.exponent > self.reference:  # running log-sum-exp: rescale by a power of two (exact)
            shrink = math.ldexp(1.0, self.reference - weight.exponent)
            for index, start, end in self._blocks(0, self.numel):
                self._buffers.hi[index][: end - start].mul_(shrink)
            self._buffers.lo.mul_(shrink)
            self.reference = weight.exponent
        factor = weight.scaled(self.reference)
        if len(self._ranges) == 1:
            self._fold(vector, factor, 0)
        else:
            list(_pool().map(lambda i: self._fold(vector, factor, i), range(len(self._ranges))))

    def _fold(self, vector: torch.Tensor, factor: float, part: int) -> None:
        buffers = self._buffers
        if self._kernel is not None:
            values = vector.numpy()
            for index, start, end in self._blocks(*self._ranges[part]):
                hi = buffers.hi[index][: end - start].numpy()
                self._kernel(hi, buffers.lo[start:end].numpy(), values[start:end], factor)
            return
        product, carry = buffers.scratch[part]
        for index, start, end in self._blocks(*self._ranges[part]):
            n = end - start
            block, spare = buffers.hi[index], buffers.spare[part]
            hi, lo = block[:n], buffers.lo[start:end]
            two_sum_fold_ops(hi, lo, vector[start:end], factor, s=spare[:n], p=product[:n], z=carry[:n])
            buffers.hi[index], buffers.spare[part] = spare, block  # s is the new hi: swapped in, not copied

    def total_weight(self) -> float:
        """Σ w_i / 2**reference, correctly rounded (math.fsum), so also order-independent."""
        if self.reference is None:
            return 0.0
        return math.fsum(w.scaled(self.reference) for w in self.weights)

    def scaled_sum(self, scale: float) -> torch.Tensor:
        """float32(Σ w_i v_i / 2**reference · scale), formed block by block (no float64 temporaries of full size)."""
        out = torch.empty(self.numel, dtype=torch.float32)
        with self._lock:
            self._check_intact()
            part = self._buffers.scratch[0][0]
            for index, start, end in self._blocks(0, self.numel):
                block = part[: end - start]
                torch.add(self._buffers.hi[index][: end - start], self._buffers.lo[start:end], out=block)
                out[start:end].copy_(block.mul_(scale))
        return out

    def weighted_mean(self, scale: float = 1.0) -> torch.Tensor:
        """scale · Σ w_i v_i / Σ w_i as float32 (zeros when every weight is zero)."""
        total = self.total_weight()
        if total == 0.0:
            return torch.zeros(self.numel, dtype=torch.float32)
        return self.scaled_sum(scale / total)

    def normalized_weights(self) -> dict[int, float]:
        """w_i / Σ w by key, in key order (not arrival order: consumers iterate it)."""
        total = self.total_weight()
        with self._lock:
            terms = sorted(zip(self.keys, self.weights, strict=True), key=lambda kw: kw[0])
        return {key: w.scaled(self.reference or 0) / total if total else 0.0 for key, w in terms}


WeightOf = Callable[[ClientResult, torch.Tensor], Weight]


class ResultFold:
    """Payload `kind` of each result of a phase into an ExactSum with the weight `weight_of(result, vector)`.

    Streamed, the engine drops the payload once every fold of the phase has it (the rest of the result, losses and
    metrics, stays for the strategy to normalise with); buffered, `fill` folds the kept results the same way."""

    def __init__(self, numel: int, kind: int, weight_of: WeightOf) -> None:
        self.kind = kind
        self.weight_of = weight_of
        self.sum = ExactSum(numel)

    def add(self, result: ClientResult) -> None:
        vector = result.payloads[self.kind]
        weight = self.weight_of(result, vector)  # before anything is added: a bad weight leaves the sum untouched
        self.sum.add(vector, weight, result.client_id)

    def fill(self, results: Iterable[ClientResult]) -> ResultFold:
        for result in results:
            self.add(result)
        return self

    def weights_by_client(self) -> dict[int, float]:
        return self.sum.normalized_weights()


def sample_weighted(numel: int, kind: int = UPDATE) -> ResultFold:
    """FedAvg's p_i = n_i / Σ n: each client's payload `kind` weighted by its sample count."""
    return ResultFold(numel, kind, lambda result, _: Weight.linear(result.num_samples))


def softmax_weighted(numel: int, kind: int, log_weight: Callable[[ClientResult], float]) -> ResultFold:
    """p_i ∝ exp(log_weight(result)) (EBA, TERM), normalised at the end: a running log-sum-exp, see ExactSum."""
    return ResultFold(numel, kind, lambda result, _: Weight.exp(log_weight(result)))
