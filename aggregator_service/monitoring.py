"""The aggregator's Prometheus metrics: fairness and system metrics from the round engine's events, and phase timings.

The engine needs no metrics code: `RunMonitor` consumes the RunEvents it already emits, and thin wrappers around its
transport, selector, privacy gate and strategy time each step of a round. Metric definitions live in fairfl.telemetry.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from prometheus_client import Gauge

from aggregator_service.engine import ClientTransport, PhaseOutcome, PrivacyGate, Selector
from fairfl import telemetry as t
from fairfl.config import ExperimentConfig
from fairfl.metrics.fairness import client_disagreement, psi, weight_entropy
from fairfl.params import ParamLayout
from fairfl.protocol import ClientResult
from fairfl.strategy import AggregateOutcome, RoundContext, Strategy
from fairfl.v1 import control_pb2, federation_pb2, tensor_pb2

log = logging.getLogger(__name__)

_PHASES = {
    federation_pb2.PHASE_TRAIN: "train",
    federation_pb2.PHASE_PROBE: "probe",
    federation_pb2.PHASE_EVALUATE: "evaluate",
}
_ACTIVE = {control_pb2.RUN_STATE_PENDING, control_pb2.RUN_STATE_RUNNING}
_TAILS = (
    ("worst", "0.05", "worst_5"),
    ("worst", "0.1", "worst_10"),
    ("best", "0.05", "best_5"),
    ("best", "0.1", "best_10"),
)

SCOPE = t.RunScope("aggregator")


@contextmanager
def timed(phase: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        t.PHASE_DURATION.labels(phase).observe(time.perf_counter() - started)


def phase_name(phase: int) -> str:
    return _PHASES.get(phase, "other")


class RunMonitor:
    """Turns one run's RunEvents into Prometheus samples. Never raises: metrics must not break a run."""

    def __init__(self, run_id: str, config: ExperimentConfig) -> None:
        self.run_id = run_id
        self.client_limit = config.runtime.metrics_client_limit
        self.lock = threading.Lock()
        self.clients: set[str] = set()  # client_id labels currently exported
        self.epsilon = 0.0
        SCOPE.enter(run_id)
        t.RUN_INFO.labels(run_id, config.strategy.name, config.data.dataset).set(1)
        t.RUN_ACTIVE.labels(run_id).set(1)
        t.RUN_ROUNDS.labels(run_id).set(config.rounds)
        t.RUN_ROUND.labels(run_id).set(0)
        t.RUN_EPSILON.labels(run_id).set(0.0)
        t.RUN_LAST_PROGRESS.labels(run_id).set(time.time())

    def __call__(self, event: control_pb2.RunEvent) -> None:
        try:
            with self.lock:
                if SCOPE.run_id != self.run_id:  # a newer run took over the series
                    return
                if event.HasField("status"):
                    t.RUN_ACTIVE.labels(self.run_id).set(1 if event.status.state in _ACTIVE else 0)
                elif event.HasField("round"):
                    self._round(event.round)
        except Exception:
            log.exception("run %s: updating metrics failed", self.run_id)

    def _round(self, r: control_pb2.RoundEvent) -> None:
        run = self.run_id
        t.ROUNDS_COMPLETED.inc()
        t.ROUND_DURATION.observe(r.duration_seconds)
        t.RUN_ROUND.labels(run).set(r.round)
        t.RUN_LAST_PROGRESS.labels(run).set(time.time())
        self.epsilon = max(self.epsilon, r.epsilon_spent)  # spend only grows; a replayed round reports the same
        t.RUN_EPSILON.labels(run).set(self.epsilon)
        if not math.isnan(r.mean_train_loss) and r.aggregation_weights:
            t.RUN_TRAIN_LOSS.labels(run).set(r.mean_train_loss)
        for metric in r.strategy_metrics:
            t.STRATEGY_METRIC.labels(run, metric.name).set(metric.value)
        if r.aggregation_weights:
            _set_if_defined(t.WEIGHT_ENTROPY, run, weight_entropy, list(r.aggregation_weights))
        if r.evaluated:
            self._evaluation(r)

    def _evaluation(self, r: control_pb2.RoundEvent) -> None:
        run, f = self.run_id, r.fairness
        t.FAIRNESS_ROUND.labels(run).set(r.round)
        # Accuracies travel in percent; Prometheus convention is ratios in 0..1.
        t.ACCURACY_MEAN.labels(run).set(f.mean / 100)
        t.ACCURACY_POOLED.labels(run).set(f.weighted_accuracy / 100)
        t.ACCURACY_VARIANCE.labels(run).set(f.variance / 100**2)
        t.ACCURACY_STD.labels(run).set(f.std / 100)
        for tail, fraction, field in _TAILS:
            t.ACCURACY_TAIL.labels(run, tail, fraction).set(getattr(f, field) / 100)
        t.JAIN_INDEX.labels(run).set(f.jain_index)
        t.ACCURACY_CV.labels(run).set(f.cv)
        t.LOSS_MEAN.labels(run).set(f.mean_loss)
        t.LOSS_VARIANCE.labels(run).set(f.loss_variance)
        t.EVALUATED_CLIENTS.labels(run).set(f.evaluated_clients)
        t.MISSING_CLIENTS.labels(run).set(f.missing_clients)
        losses = [c.loss for c in r.clients]
        _set_if_defined(t.PSI, run, psi, losses, [c.num_samples for c in r.clients])
        _set_if_defined(t.DISAGREEMENT, run, client_disagreement, losses)
        histogram = t.CLIENT_ACCURACY_HISTOGRAM.labels(run)
        exported = set()
        for c in r.clients:
            histogram.observe(c.accuracy / 100)
            if c.client_id < self.client_limit:
                cid = str(c.client_id)
                t.CLIENT_ACCURACY.labels(run, cid).set(c.accuracy / 100)
                t.CLIENT_LOSS.labels(run, cid).set(c.loss)
                exported.add(cid)
        for gone in self.clients - exported:  # not evaluated this time: no stale value
            t.CLIENT_ACCURACY.remove(run, gone)
            t.CLIENT_LOSS.remove(run, gone)
        self.clients = exported


def _set_if_defined(gauge: Gauge, run_id: str, fn: Callable[..., float], *args: Sequence[float]) -> None:
    """Set a run's fairness metric, skipping inputs it is undefined for (empty, non-finite, zero weights): no sample
    rather than a made-up 0 (a labelled child reads 0 from the moment it exists)."""
    try:
        value = fn(*args)
    except ValueError as err:
        log.debug("metric skipped: %s", err)
        return
    gauge.labels(run_id).set(value)


class InstrumentedTransport(ClientTransport):
    """Times each phase's exchange and counts tasks sent and left unanswered; delegates everything else."""

    def __init__(self, inner: ClientTransport) -> None:
        self.inner = inner

    def start_run(self, run_id: str, config: ExperimentConfig, layout: ParamLayout) -> None:
        self.inner.start_run(run_id, config, layout)

    def wait_for_clients(self, num_clients: int, timeout: float, stop: threading.Event) -> None:
        self.inner.wait_for_clients(num_clients, timeout, stop)

    def available_clients(self) -> list[int]:
        return self.inner.available_clients()

    def publish(self, flat: Any) -> tensor_pb2.BlobRef:
        with timed("publish"):
            return self.inner.publish(flat)

    def execute(
        self,
        tasks: list[federation_pb2.Task],
        timeout: float,
        quorum: int | None = None,
        on_result: Callable[[ClientResult], None] | None = None,
    ) -> PhaseOutcome:
        phase = phase_name(tasks[0].phase) if tasks else "other"
        t.TASKS_SENT.labels(phase).inc(len(tasks))
        with timed(phase):
            outcome = self.inner.execute(tasks, timeout, quorum, on_result)
        t.TASKS_UNANSWERED.labels(phase).inc(len(outcome.missing))
        return outcome

    def refused_after_close(self, round_number: int) -> tuple[int, int]:
        return self.inner.refused_after_close(round_number)

    def end_run(self, run_id: str) -> None:
        self.inner.end_run(run_id)


class TimedSelector:
    def __init__(self, inner: Selector) -> None:
        self.inner = inner

    def select(self, *args: Any, **kwargs: Any) -> list[int]:
        with timed("select"):
            return self.inner.select(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # anything else a selector offers (reports, checkpoint state, close)
        return getattr(self.inner, name)


class TimedPrivacy:
    def __init__(self, inner: PrivacyGate) -> None:
        self.inner = inner

    def start(self, *args: Any, **kwargs: Any) -> None:
        self.inner.start(*args, **kwargs)

    def authorize_round(self, *args: Any, **kwargs: Any) -> float:
        with timed("authorize"):
            return self.inner.authorize_round(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # anything else a gate offers (the engine's Protocol may grow)
        return getattr(self.inner, name)


class TimedStrategy:
    """Times `aggregate`; everything else (methods, declared capabilities, strategy-specific state) is the wrapped
    strategy's, so the engine sees the same strategy with or without monitoring."""

    def __init__(self, inner: Strategy) -> None:
        self.inner = inner

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        with timed("aggregate"):
            return self.inner.aggregate(ctx, phases)

    def __getattr__(self, name: str) -> Any:  # only called for what this wrapper does not define itself
        return getattr(self.inner, name)
