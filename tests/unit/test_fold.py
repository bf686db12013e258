"""Streaming aggregation (fairfl/fold.py): order-independent exact sums, running log-sum-exp,
thread safety, and the engine streaming to the same bits as a buffered round."""

from __future__ import annotations

import math
import random
import sys
import threading
from typing import Any

import numpy as np
import pytest
import torch

from aggregator_service.engine import RoundEngine
from fairfl import fold, fold_kernel
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalSelector
from fairfl.config import experiment_from_dict
from fairfl.fold import ExactSum, ResultFold, Weight
from fairfl.protocol import UPDATE, ClientResult
from fairfl.v1 import control_pb2, federation_pb2


def _vectors(count: int, numel: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Mixed magnitudes (1e-6 .. 1e3) make float32 summation visibly order-dependent.
    scales = torch.logspace(-6, 3, count)
    return [torch.randn(numel, generator=gen) * scales[i] for i in range(count)]


def _sum(vectors: list[torch.Tensor], weights: list[Weight], order: list[int]) -> ExactSum:
    total = ExactSum(vectors[0].numel())
    for i in order:
        total.add(vectors[i], weights[i], key=i)
    return total


def test_sum_is_bit_identical_in_every_order_and_matches_exact_arithmetic() -> None:
    numel = 300_000  # more than one BLOCK
    vectors = _vectors(24, numel, seed=1)
    rng = random.Random(0)
    weights = [Weight.linear(rng.uniform(1, 5000)) for _ in vectors]
    orders = [list(range(24))] + [rng.sample(range(24), 24) for _ in range(4)]
    means = [_sum(vectors, weights, order).weighted_mean() for order in orders]
    for mean in means[1:]:
        assert torch.equal(mean, means[0])
    # The plain float32 fold of the same terms does depend on the order (which is why ExactSum exists).
    naive = [sum((vectors[i] * float(weights[i].scaled(0)) for i in order), torch.zeros(numel)) for order in orders]
    assert any(not torch.equal(n, naive[0]) for n in naive[1:])
    # Against correctly rounded arithmetic on a sample of coordinates: Σ w_i v_i with math.fsum of the exact products.
    total = math.fsum(w.scaled(0) for w in weights)
    for j in range(0, numel, 9973):
        exact = math.fsum(w.scaled(0) * float(v[j]) for w, v in zip(weights, vectors, strict=True)) / total
        assert float(means[0][j]) == pytest.approx(exact, rel=2**-23, abs=1e-30)


def test_softmax_weights_use_a_running_log_sum_exp_without_overflow() -> None:
    vectors = _vectors(5, 1000, seed=2)
    logs = [900.0, -900.0, 905.5, 0.0, 904.0]  # exp() of these overflows / underflows in float64
    weights = [Weight.exp(x) for x in logs]
    a = _sum(vectors, weights, [1, 3, 0, 2, 4])
    b = _sum(vectors, weights, [2, 4, 0, 1, 3])  # the largest first: no rescale at all
    assert torch.equal(a.weighted_mean(), b.weighted_mean())
    p = np.exp(np.array(logs) - max(logs))
    p /= p.sum()
    want = sum(float(pi) * v.double() for pi, v in zip(p, vectors, strict=True))
    assert torch.allclose(a.weighted_mean().double(), want, rtol=1e-6, atol=1e-9)
    assert a.normalized_weights() == pytest.approx(dict(enumerate(p)), rel=2**-22, abs=1e-300)


def test_weights_round_to_float32_mantissas() -> None:
    for value in (1.0, 3.0, 600.0, 0.1, 12345.678, 2.0**-40):
        w = Weight.linear(value)
        assert w.scaled(0) == float(np.float32(value))
        assert float(np.float32(w.mantissa)) == w.mantissa
    for log_value in (-50.0, 0.0, 0.3, 700.0):
        w = Weight.exp(log_value)
        assert float(np.float32(w.mantissa)) == w.mantissa
        assert math.log(w.mantissa) + w.exponent * math.log(2) == pytest.approx(log_value, abs=1e-7)
    with pytest.raises(ValueError, match="finite"):
        Weight.linear(float("nan"))
    with pytest.raises(ValueError, match="finite"):
        Weight.exp(float("inf"))
    for out_of_range in (1e39, -1e39, 1e-46):
        with pytest.raises(ValueError, match="float32's range"):
            Weight.linear(out_of_range)


def test_concurrent_adds_give_the_sequential_bits() -> None:
    vectors = _vectors(16, 50_000, seed=3)
    weights = [Weight.linear(i + 1) for i in range(16)]
    sequential = _sum(vectors, weights, list(range(16))).weighted_mean()
    shared = ExactSum(50_000)
    threads = [threading.Thread(target=lambda i=i: shared.add(vectors[i], weights[i], key=i)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(shared.weighted_mean(), sequential)
    assert sorted(shared.normalized_weights()) == list(range(16))


def test_a_bad_vector_or_weight_leaves_the_sum_untouched() -> None:
    total = ExactSum(10)
    total.add(torch.ones(10), Weight.linear(2.0), key=0)
    before = total.weighted_mean().clone()
    with pytest.raises(ValueError, match="flat float32 vector of 10"):
        total.add(torch.ones(11), Weight.linear(1.0), key=1)
    fold = ResultFold(10, UPDATE, lambda result, _: Weight.exp(result.loss_after))
    result = ClientResult("t", "r", 1, 5, federation_pb2.PHASE_TRAIN, 3, loss_after=float("nan"))
    result.payloads[UPDATE] = torch.ones(10)
    with pytest.raises(ValueError, match="finite"):
        fold.add(result)
    assert fold.sum.reference is None and not fold.sum.weights
    assert torch.equal(total.weighted_mean(), before) and list(total.normalized_weights()) == [0]


class _Recording(InProcessTransport):
    """Records whether the engine streamed each phase, and what the results held when the phase closed."""

    def __init__(self) -> None:
        super().__init__()
        self.streamed: list[bool] = []
        self.payload_kinds: list[set[int]] = []

    def execute(self, tasks: list[federation_pb2.Task], timeout: float, *args: Any, **kwargs: Any) -> Any:
        outcome = super().execute(tasks, timeout, *args, **kwargs)
        if tasks and tasks[0].phase == federation_pb2.PHASE_TRAIN:
            self.streamed.append(kwargs.get("on_result") is not None)
            self.payload_kinds.extend(set(r.payloads) for r in outcome.results)
        return outcome


def _config(strategy: dict[str, Any]) -> Any:
    return experiment_from_dict(
        {
            "name": "fold",
            "seed": 3,
            "rounds": 3,
            "data": {"dataset": "synthetic", "num_clients": 6, "partition": "iid"},
            "model": {"name": "mlp", "params": {"hidden": [16]}},
            "training": {"local_steps": 3, "batch_size": 8, "lr": 0.1},
            "strategy": strategy,
            "selection": {"method": "random", "clients_per_round": 4},
            "evaluation": {"every": 3},
        }
    )


@pytest.mark.parametrize(
    "strategy",
    [
        {"name": "fedavg"},
        {"name": "fedeba", "params": {"tau": 0.5}},
        {"name": "fedeba_plus", "params": {"tau": 0.5, "alpha": 0.5}},  # gradient probe + aligned training
        {"name": "fedeba_plus", "params": {"tau": 0.5, "alpha": 0.5, "mode": "model"}},
        {"name": "fedeba_plus", "params": {"tau": 0.5, "alpha": 0.5, "mode": "adaptive", "theta_degrees": 0.0}},
        {"name": "fedeba_plus", "params": {"tau": 0.5, "mode": "adaptive", "theta_degrees": 89.0, "use_prior": True}},
        {"name": "term", "params": {"tilt": 1.0}},
        {"name": "fedprox", "params": {"mu": 0.1}},
        {"name": "fedfair", "params": {"fair_lambda": 0.5}},
    ],
    ids=lambda s: "-".join([s["name"], *(f"{k}={v}" for k, v in s.get("params", {}).items())]),
)
def test_engine_streams_updates_away_and_matches_the_buffered_round_bit_for_bit(strategy: dict[str, Any]) -> None:
    """Streamed (payloads dropped on arrival) and buffered rounds give the same model and the same metrics."""
    config = _config(strategy)
    finals = []
    for streaming in (True, False):
        transport = _Recording()
        events: list[control_pb2.RunEvent] = []
        engine = RoundEngine("fold", config, transport, LocalSelector("random"), LocalPrivacy(), events.append)
        engine._streams = streaming
        summary = engine.run()
        assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
        assert transport.streamed and all(s == streaming for s in transport.streamed)
        if streaming:  # the aggregator kept no update: every folded tensor was dropped on arrival
            assert all(not kinds for kinds in transport.payload_kinds)
        metrics = [[(m.name, m.value) for m in e.round.strategy_metrics] for e in events if e.HasField("round")]
        finals.append((summary.final_params, metrics))
    assert torch.equal(finals[0][0], finals[1][0])
    assert finals[0][1] == finals[1][1]


@pytest.mark.parametrize(
    "strategy",
    [{"name": "prac_fedeba_plus", "params": {"tau": 0.5}}, {"name": "fedeba", "params": {"clamp_eps": 1e-3}}],
    ids=["prac_fedeba_plus", "fedeba-clamp"],
)
def test_strategies_that_need_every_result_are_not_streamed(strategy: dict[str, Any]) -> None:
    transport = _Recording()
    engine = RoundEngine("fold", _config(strategy), transport, LocalSelector("random"), LocalPrivacy(), lambda _: None)
    summary = engine.run()
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    assert transport.streamed and not any(transport.streamed)


def test_big_vectors_fold_in_parallel_ranges_to_the_serial_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    numel = 4 * fold.BLOCK + 12345
    vectors = _vectors(6, numel, seed=4)
    weights = [Weight.exp(0.3 * i) for i in range(6)]
    means = []
    for threads in (1, 3):
        monkeypatch.setattr(fold, "FOLD_THREADS", threads)
        total = _sum(vectors, weights, [5, 0, 3, 1, 4, 2])
        assert len(total._ranges) == threads
        means.append(total.weighted_mean())
    assert torch.equal(means[0], means[1])


def test_the_buffer_pool_keeps_one_size_under_its_cap_and_drops_other_sizes_first() -> None:
    from fairfl.fold import _BufferPool, _Buffers

    small, large = _Buffers(1000, 1), _Buffers(4000, 1)
    pool = _BufferPool(max_idle_bytes=large.nbytes() + small.nbytes() // 2)
    pool.give(1000, 1, small)
    assert pool.take(1000, 1) is small  # reused (zeroed), not allocated again
    pool.give(1000, 1, small)
    pool.give(4000, 1, large)  # a run with another model: the last one's idle buffers make room
    assert pool.take(4000, 1) is large
    assert pool.take(1000, 1) is not small


def _sum_with(kernel: bool, vectors: list[torch.Tensor], weights: list[Weight], order: list[int]) -> ExactSum:
    """The sum folded by the compiled kernel (fairfl/fold_kernel.py) or by the torch ops it replaces."""
    numel = vectors[0].numel()
    total = ExactSum(numel) if kernel else _torch_folded(numel)
    assert (total._kernel is not None) == kernel
    for i in order:
        total.add(vectors[i], weights[i], key=i)
    return total


def _torch_folded(numel: int) -> ExactSum:
    original = fold.kernel_for
    fold.kernel_for = lambda _: None
    try:
        return ExactSum(numel)
    finally:
        fold.kernel_for = original


def test_the_compiled_fold_is_there_for_big_vectors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # numba is a pinned requirement: a kernel that stopped compiling would silently cost ~4x the aggregator's fold CPU.
    monkeypatch.delenv(fold_kernel.DISABLE_ENV, raising=False)
    assert fold_kernel.kernel_for(fold_kernel.MIN_NUMEL) is not None
    assert fold_kernel.kernel_for(fold_kernel.MIN_NUMEL - 1) is None
    monkeypatch.setenv(fold_kernel.DISABLE_ENV, "torch")
    assert fold_kernel.kernel_for(fold_kernel.MIN_NUMEL) is None


def _fresh_compile(monkeypatch: pytest.MonkeyPatch, numba: Any) -> Any:
    """kernel_for in a process that has not tried yet, with `numba` as the importable module (None: not there)."""
    monkeypatch.setattr(fold_kernel, "_tried", False)
    monkeypatch.setattr(fold_kernel, "_kernel", None)
    monkeypatch.setitem(sys.modules, "numba", numba)
    monkeypatch.delenv(fold_kernel.DISABLE_ENV, raising=False)
    return fold_kernel.kernel_for(fold_kernel.MIN_NUMEL)


class _FakeNumba:
    """A numba whose njit raises, or compiles to `compiled` (a kernel that would give other bits)."""

    def __init__(self, compiled: Any = None) -> None:
        self.compiled = compiled
        self.caches: list[bool] = []

    def njit(self, _signature: str, cache: bool, **_options: Any) -> Any:
        self.caches.append(cache)
        if self.compiled is None:
            raise OSError("no LLVM here")
        return lambda _function: self.compiled


def test_without_numba_or_a_working_compile_the_torch_ops_fold(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert _fresh_compile(monkeypatch, None) is None  # import numba raises ImportError
    failing = _FakeNumba()
    assert _fresh_compile(monkeypatch, failing) is None
    assert failing.caches == [True, False]  # an unusable cache is retried without one
    assert "no LLVM here" in caplog.text

    def fast_two_sum(hi: np.ndarray, lo: np.ndarray, vector: np.ndarray, factor: float) -> None:
        p = vector.astype(np.float64) * factor
        s = hi + p
        lo += p - (s - hi)  # exact only where |hi| >= |p|: other bits elsewhere
        hi[:] = s

    assert _fresh_compile(monkeypatch, _FakeNumba(fast_two_sum)) is None  # refused by the run-time check
    assert "differs from the torch ops" in caplog.text
    # A sum made now folds with torch ops, to the same bits as any other process.
    vectors, weights = _vectors(3, fold_kernel.MIN_NUMEL, seed=8), [Weight.linear(w) for w in (1.0, 2.0, 7.0)]
    plain = _sum(vectors, weights, [2, 0, 1])
    assert plain._kernel is None
    monkeypatch.setattr(fold_kernel, "_tried", False)
    monkeypatch.delitem(sys.modules, "numba")
    assert torch.equal(plain.weighted_mean(), _sum_with(True, vectors, weights, [1, 2, 0]).weighted_mean())


def test_a_fold_that_fails_part_way_leaves_a_sum_that_refuses_to_be_used() -> None:
    vectors = _vectors(2, fold_kernel.MIN_NUMEL, seed=9)
    total = ExactSum(fold_kernel.MIN_NUMEL)
    total.add(vectors[0], Weight.linear(2.0), key=0)

    def half_then_fail(hi: np.ndarray, lo: np.ndarray, vector: np.ndarray, factor: float) -> None:
        hi[: len(hi) // 2] += vector[: len(hi) // 2] * factor
        raise MemoryError("out of memory mid-fold")

    total._kernel = half_then_fail
    with pytest.raises(MemoryError):
        total.add(vectors[1], Weight.linear(3.0), key=1)
    assert total.keys == [0]  # the failed term is not counted
    for use in (lambda: total.weighted_mean(), lambda: total.add(vectors[1], Weight.linear(3.0), key=1)):
        with pytest.raises(RuntimeError, match="incomplete: a fold failed part way"):
            use()


@pytest.mark.parametrize("threads", [1, 3])
def test_the_compiled_fold_gives_the_torch_ops_bits_in_hi_and_lo(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    monkeypatch.setattr(fold, "FOLD_THREADS", threads)
    numel = 4 * fold.BLOCK + 777  # several blocks, split into `threads` ranges
    vectors = _vectors(7, numel, seed=5)
    # Softmax weights arriving smallest first: the running log-sum-exp rescales the accumulator between folds.
    weights = [Weight.exp(s) for s in (0.0, 40.0, -3.0, 90.0, 12.5, 89.0, -60.0)]
    order = [6, 0, 2, 1, 4, 5, 3]
    compiled, plain = _sum_with(True, vectors, weights, order), _sum_with(False, vectors, weights, order)
    assert compiled.reference == plain.reference == weights[3].exponent > weights[6].exponent
    hi = [torch.cat(total._buffers.hi)[:numel] for total in (compiled, plain)]  # the last block's padding aside
    assert torch.equal(hi[0], hi[1])
    assert torch.equal(compiled._buffers.lo, plain._buffers.lo)
    assert torch.count_nonzero(plain._buffers.lo) > numel // 2  # the low words carry the rounding errors
    assert torch.equal(compiled.weighted_mean(), plain.weighted_mean())
