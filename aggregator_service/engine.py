"""The round engine: select → authorize spend → dispatch phases → aggregate → evaluate → report, every round.

It talks to clients only through `ClientTransport`, to selection through `Selector` and to the privacy ledger
through `PrivacyGate`. The gRPC implementations of these are the product; in-process ones run the same strategies
and the same client code without a network, as the oracle the distributed path is tested against.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from aggregator_service.checkpoint import RunCheckpointer
from aggregator_service.clustering_peer import NoClusterer
from aggregator_service.dp import DpController
from aggregator_service.selection import SelectionDriver, Selector
from fairfl import codec
from fairfl.config import ConfigError, ExperimentConfig
from fairfl.data import run_signature
from fairfl.data.groups import client_groups
from fairfl.fold import ResultFold
from fairfl.fold_kernel import kernel_for
from fairfl.metrics.fairness import fairness_report, psi_telemetry
from fairfl.models import build_run_model, require_signatures
from fairfl.params import ParamLayout, flatten_parameters
from fairfl.privacy import dp_seed
from fairfl.protocol import EVALUATE, PROBE, ClientResult
from fairfl.strategy import (
    PhasePlan,
    RoundContext,
    Strategy,
    build_strategy,
    load_strategy,
    measures_client_losses,
    train_results,
)
from fairfl.v1 import clustering_pb2, common_pb2, control_pb2, federation_pb2, tensor_pb2

log = logging.getLogger(__name__)
SELECTION_PROBE_PHASE = 98  # task-id phase index of power-of-choice's loss probe (evaluation is 99)
TASK_KEY_BYTES = 32
TASK_ID_HEX = 32  # a 128-bit HMAC-SHA256 tag


def task_id(key: bytes, run_id: str, round_number: int, phase_index: int, client_id: int) -> str:
    """A task's id: a keyed MAC of (run, round, phase, client) under the run's secret key. Nobody without the key can
    tell whose task an id is or derive another client's (docs/security.md), and the same key gives the same ids again
    after a resume, which an agent's DP-release cache relies on (docs/reliability.md)."""
    message = f"{run_id}/r{round_number}/p{phase_index}/c{client_id}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()[:TASK_ID_HEX]


def initial_model(config: ExperimentConfig, needs: dict[str, str] | None = None) -> tuple[ParamLayout, torch.Tensor]:
    """The run's initial model, flat. `needs` maps each client signature the run collects ("bias_update",
    "activation") to who declared it; the model must be able to give them (fairfl.models.require_signatures),
    checked here, before round 1, not on the clients mid-run."""
    model = build_run_model(config)  # from the dataset plug-in's declared signature: the server holds no data
    if needs:
        require_signatures(model, run_signature(config), needs)
    return ParamLayout.of(model), flatten_parameters(model)


def signature_needs(config: ExperimentConfig) -> dict[str, str]:
    """The client signatures the run's strategy and sampler declare, each with who declared it."""
    needs = {
        name: f"selection.method {config.selection.method}"
        for name in config.selection.sampler_class().client_signatures
    }
    strategy = load_strategy(config.strategy.name)
    needs.update({name: f"strategy.name {config.strategy.name}" for name in strategy.client_signatures})
    return needs


def task_seed(run_seed: int, round_number: int, client_id: int) -> int:
    """Seed of a client's tasks in one round: independent per (run, round, client), the same in every transport.

    Every phase of the round shares it, so a probe's gradient batch is the first batch of the same round's training,
    and a strategy that adds a probe phase trains on exactly the batches it would have trained on without one.
    """
    return dp_seed("task", run_seed, round_number, client_id)


@dataclass
class PhaseOutcome:
    results: list[ClientResult]  # accepted, sorted by client id
    missing: list[int] = field(default_factory=list)  # tasked clients without an accepted result
    rejected: int = 0


ResultSink = Callable[[ClientResult], None]


class ClientTransport(ABC):
    """How the engine reaches clients. Implementations: in-process (oracle) and gRPC (agents dial in)."""

    @abstractmethod
    def start_run(self, run_id: str, config: ExperimentConfig, layout: ParamLayout) -> None: ...

    @abstractmethod
    def wait_for_clients(self, num_clients: int, timeout: float, stop: threading.Event) -> None: ...

    @abstractmethod
    def available_clients(self) -> list[int]: ...

    @abstractmethod
    def publish(self, flat: torch.Tensor) -> tensor_pb2.BlobRef: ...

    @abstractmethod
    def execute(
        self,
        tasks: list[federation_pb2.Task],
        timeout: float,
        quorum: int | None = None,
        on_result: ResultSink | None = None,
    ) -> PhaseOutcome:
        """Run the tasks; return when all answered, at `timeout`, or once `quorum` results are in (the rest close).

        `on_result` (streaming aggregation) is called once with every accepted result as it arrives, from any
        thread, and has returned for all of them before `execute` returns; a result is accepted before it is passed."""

    def refused_after_close(self, round_number: int) -> tuple[int, int]:
        """(late, duplicate) results of this round refused after their task closed, not yet reported."""
        del round_number
        return 0, 0

    def end_run(self, run_id: str) -> None:
        del run_id


class PrivacyGate(Protocol):
    def start(self, run_id: str, config: ExperimentConfig) -> None: ...

    def authorize_round(
        self, run_id: str, round_number: int, config: ExperimentConfig, selected: list[int], population: int
    ) -> float:
        """Record the round's events (`selected` drawn from `population` live candidates); the ε spent so far."""
        ...


def _folding(folds: list[ResultFold]) -> ResultSink:
    """A sink folding each result into the phase's folds, then dropping the folded tensors: the aggregator keeps an
    accumulator per fold, not an update per client."""
    kinds = {fold.kind for fold in folds}

    def sink(result: ClientResult) -> None:
        for fold in folds:
            fold.add(result)
        for kind in kinds:
            result.payloads.pop(kind, None)

    return sink


def _log_failed_record(run_id: str, round_number: int) -> Callable[[Future[float]], None]:
    """A non-private round's ledger record that failed is logged where it fails: the round may already have ended
    another way (stopped, failed in its exchange), and then nothing else would read the error."""

    def check(record: Future[float]) -> None:
        if not record.cancelled() and (err := record.exception()) is not None:
            log.warning("run %s: the privacy ledger did not record round %d: %s", run_id, round_number, err)

    return check


class RunStopped(Exception):
    pass


class RunRefused(Exception):
    """The run cannot go on for a reason its message states and a person can act on (a peer service refused it): the
    run fails with the message, logged without a traceback, as a ConfigError is."""


@dataclass
class RunSummary:
    run_id: str
    state: int
    rounds_completed: int
    final_params: torch.Tensor
    message: str = ""


class RoundEngine:
    def __init__(
        self,
        run_id: str,
        config: ExperimentConfig,
        transport: ClientTransport,
        selector: Selector,
        privacy: PrivacyGate,
        on_event: Callable[[control_pb2.RunEvent], None],
        stop: threading.Event | None = None,
        dp_randomness: str = "task",
        clusterer: Callable[[clustering_pb2.ClusterRequest], clustering_pb2.ClusterReply] | None = None,
    ) -> None:
        self.run_id = run_id
        self.config = config
        self.transport = transport
        self.selector = selector
        self.privacy = privacy
        self.on_event = on_event
        self.stop = stop or threading.Event()
        # The client signatures the strategy and the sampler declare must be ones the model can give.
        self.layout, self.params = initial_model(config, signature_needs(config))
        # The model of the last completed (reported) round: what an ended run keeps (see _end).
        self.reported_params = self.params
        # What the selection method needs from rounds (signatures, probes, updates); see aggregator_service.selection.
        self.selection = SelectionDriver(config, selector, self.layout.numel)
        self.strategy: Strategy = build_strategy(
            config.strategy.name, config.strategy.params, config.strategy.server_lr
        )
        self.round = 0
        # Strategies that cluster (Equitable-FL) call the clustering service through this; in-process by default.
        self.clusterer = clusterer or NoClusterer()  # composition injects one
        groups = client_groups(config.data.partition, config.data.group_sizes)
        self.true_groups = None if groups is None else {cid: int(g) for cid, g in enumerate(groups)}
        self._published: tuple[torch.Tensor, tensor_pb2.BlobRef] | None = None
        # DP runs: DP-SGD settings in every TRAIN task, per-client loss clip bounds, client-level aggregation.
        self.dp = DpController(config, dp_randomness) if config.privacy.enabled else None
        # Reliability (docs/reliability.md): a checkpoint after every round, and where a resumed run starts.
        self.checkpointer: RunCheckpointer | None = None
        self.start_round = 1
        self.completed_round = 0
        # round -> (selected, population) of the rounds authorised before a crash and not in its checkpoint
        self.replay: dict[int, tuple[list[int], int]] = {}
        self.task_key = secrets.token_bytes(TASK_KEY_BYTES)  # task ids' MAC key; a resumed run gets its own back
        self.failed_rounds = 0  # consecutive rounds below runtime.min_completion
        # Streaming aggregation (fairfl/fold.py) unless something needs the round's updates whole: client-level
        # DP clips each one at aggregation, and Clustered Sampling / DivFL bank every client's last update.
        self._streams = not (self.dp is not None and self.dp.client_level) and self.selection.bank is None
        # Non-private rounds' ledger records, written while the round trains (see _authorize).
        self._ledger_writer: ThreadPoolExecutor | None = None

    def _status(self, state: int, message: str = "") -> None:
        status = control_pb2.RunStatus(
            run_id=self.run_id,
            state=state,
            round=self.round,
            total_rounds=self.config.rounds,
            message=message,
            registered_clients=len(self.transport.available_clients()),
        )
        self.on_event(control_pb2.RunEvent(run_id=self.run_id, status=status))

    def run(self) -> RunSummary:
        cfg = self.config
        self.reported_params = self.params  # a resumed run's: the checkpoint's model
        try:
            self.transport.start_run(self.run_id, cfg, self.layout)
            kernel_for(self.layout.numel)  # the exact fold's compiled kernel (fairfl/fold_kernel.py), before round 1
            resuming = f"resuming after round {self.start_round - 1}: " if self.start_round > 1 else ""
            self._status(control_pb2.RUN_STATE_PENDING, f"{resuming}waiting for {cfg.data.num_clients} clients")
            self.transport.wait_for_clients(cfg.data.num_clients, cfg.runtime.register_timeout_s, self.stop)
            self.privacy.start(self.run_id, cfg)
            self._status(control_pb2.RUN_STATE_RUNNING)
            for round_number in range(self.start_round, cfg.rounds + 1):
                if self.stop.is_set():
                    raise RunStopped("stopped on request")
                self.round = round_number
                self._run_round(round_number)
            if self.checkpointer is not None:  # the last rounds' writes: a failure fails the run, as in a round
                self.checkpointer.wait()
            state, message = self._end(control_pb2.RUN_STATE_COMPLETED, f"completed {cfg.rounds} rounds")
            completed = state == control_pb2.RUN_STATE_COMPLETED
            return RunSummary(self.run_id, state, self.completed_round, self.params, "" if completed else message)
        except RunStopped as stopped:
            state, message = self._end(control_pb2.RUN_STATE_STOPPED, str(stopped))
            return RunSummary(self.run_id, state, self.completed_round, self.params, message)
        except Exception as err:
            if isinstance(err, ConfigError | RunRefused):
                log.error("run %s failed: %s", self.run_id, err)
            else:
                log.exception("run %s failed", self.run_id)
            self._end(control_pb2.RUN_STATE_FAILED, f"{type(err).__name__}: {err}")
            return RunSummary(self.run_id, control_pb2.RUN_STATE_FAILED, self.completed_round, self.params, str(err))
        finally:
            if self._ledger_writer is not None:  # a record still in flight (the run ended inside a round) finishes
                self._ledger_writer.shutdown(wait=True)
            if self.checkpointer is not None:  # ended otherwise (BaseException): the writer finishes what it has
                self.checkpointer.close()
            self.transport.end_run(self.run_id)
            for peer in (self.selector, self.privacy, self.clusterer):  # remote peers hold a channel for the run
                close = getattr(peer, "close", None)
                if callable(close):
                    close()

    def _end(self, state: int, message: str) -> tuple[int, str]:
        """Mark the checkpoint final (a restarted aggregator must not resume an ended run), then report; the run's
        final state and message. A run that ended inside a round (stopped or failed after aggregating) keeps the
        model of its last completed round, the one its last RoundEvent's model_sha256 names: that is the model it is
        fetched, saved and resumed with. The rounds the checkpoint writer holds are written (and reported) first; a
        write that failed fails the run, as a failed write in a round does."""
        self.params = self.reported_params
        if self.checkpointer is not None:
            try:
                self.checkpointer.wait()
            except Exception as err:
                log.exception("run %s: a round's checkpoint could not be written", self.run_id)
                if state != control_pb2.RUN_STATE_FAILED:
                    state, message = control_pb2.RUN_STATE_FAILED, f"{type(err).__name__}: {err}"
            try:
                # After a failed write: the round and model on disk (the last round anyone heard of).
                self.completed_round, self.params = self.checkpointer.finished(self, state, message)
                self.reported_params = self.params
            except Exception:  # the run's outcome stands; an unmarked checkpoint is only resumed needlessly
                log.exception("run %s: could not mark its checkpoint final", self.run_id)
        self._status(state, message)
        return state, message

    def _publish_params(self) -> tensor_pb2.BlobRef:
        """Publish the global model once per version: evaluation, the round's sha256 and the next round reuse it."""
        if self._published is None or self._published[0] is not self.params:
            self._published = (self.params, self.transport.publish(self.params))
        return self._published[1]

    def _run_clients(self) -> list[int]:
        """Reachable clients of this run: agents may host more ids than the run's data.num_clients."""
        return [c for c in sorted(self.transport.available_clients()) if c < self.config.data.num_clients]

    def _round_train_config(self, round_number: int) -> federation_pb2.LocalTrainingConfig:
        t = self.config.training
        cfg = federation_pb2.LocalTrainingConfig(
            batch_size=t.batch_size,
            lr=t.lr * t.lr_decay ** (round_number - 1),
            optimizer=federation_pb2.OPTIMIZER_ADAM if t.optimizer == "adam" else federation_pb2.OPTIMIZER_SGD,
            momentum=t.momentum,
            weight_decay=t.weight_decay,
            prox_mu=t.prox_mu,
            loss_eval_batches=t.loss_eval_batches,
        )
        unit, count = t.budget()
        setattr(cfg, unit, count)
        cfg.want_bias_update = self.selection.wants_bias_update  # HiCS-FL's signature
        if self.dp is not None:
            self.dp.configure(cfg)
        if not cfg.HasField("dp"):  # F_i passes only where something reads them (DP-SGD: plaintext_telemetry decides)
            cfg.skip_losses = not measures_client_losses(self.strategy, t.loss_telemetry)
        return cfg

    def _tasks(
        self,
        round_number: int,
        phase_index: int,
        phase: int,
        clients: list[int],
        model: tensor_pb2.BlobRef,
        fill: Callable[[federation_pb2.Task], None],
    ) -> list[federation_pb2.Task]:
        deadline = time.time() + self.config.runtime.round_timeout_s
        tasks = []
        for cid in clients:
            task = federation_pb2.Task(
                task_id=task_id(self.task_key, self.run_id, round_number, phase_index, cid),
                run_id=self.run_id,
                round=round_number,
                phase=phase,
                client_id=cid,
                model=model,  # type: ignore[arg-type]
                seed=task_seed(self.config.seed, round_number, cid),
                deadline_unix=deadline,
            )
            fill(task)
            tasks.append(task)
        return tasks

    def _probe_losses(self, round_number: int, clients: list[int], model: tensor_pb2.BlobRef) -> dict[int, float]:
        """F_k(θ_t) of `clients` (power-of-choice's candidates): a loss-only PROBE of the global model."""
        t = self.config.training
        probe = federation_pb2.ProbeConfig(batch_size=t.batch_size, loss_eval_batches=t.loss_eval_batches)
        tasks = self._tasks(
            round_number, SELECTION_PROBE_PHASE, PROBE, clients, model, lambda task: task.probe.CopyFrom(probe)
        )
        outcome = self.transport.execute(tasks, self.config.runtime.round_timeout_s)
        return {r.client_id: r.loss_before for r in outcome.results}

    def _run_round(self, round_number: int) -> None:
        """select → authorise the spend → the strategy's exchanges → aggregate → evaluate → checkpoint and report."""
        started = time.monotonic()
        model_ref = self._publish_params()
        selected, population, quorum, selection_seconds = self._select(round_number, model_ref)
        recorded = self._authorize(round_number, selected, population)
        ctx = self._round_context(round_number, selected)
        event = control_pb2.RoundEvent(round=round_number, selected=selected, selection_seconds=selection_seconds)
        phases, complete = self._exchange(ctx, model_ref, quorum, event)
        # The ledger has the round before anything learns from it: a refused record fails the run with the selector's,
        # strategy's and model's state as the last reported round left them (a resumed run replays this round).
        event.epsilon_spent = recorded()
        self.selection.observe(self.run_id, train_results(phases))
        aggregated = complete and bool(phases)
        if aggregated:
            self._aggregate(ctx, phases, event)
        self._evaluate_if_due(round_number, event)
        self._report_round(round_number, event, started)
        self._log_round(event, aggregated)
        self._check_failed_rounds(round_number, event)

    def _log_round(self, event: control_pb2.RoundEvent, aggregated: bool) -> None:
        """One INFO line per round: what an operator following the aggregator's log needs to see it progress."""
        parts = [
            f"run {self.run_id} round {event.round}/{self.config.rounds}: {len(set(event.selected))} selected, "
            f"{event.results_accepted} accepted, {event.results_rejected} rejected, {event.results_late} late"
        ]
        if event.evaluated:
            f = event.fairness
            parts.append(
                f"accuracy mean {f.mean:.2f}% worst-5% {f.worst_5:.2f}% over {f.evaluated_clients} clients"
                + (f" ({f.missing_clients} missing)" if f.missing_clients else "")
            )
        if not aggregated:
            parts.append("model kept")
        elif math.isfinite(event.mean_train_loss):
            parts.append(f"train loss {event.mean_train_loss:.4f}")
        parts.append(f"{event.duration_seconds:.2f}s")
        if self.config.privacy.enabled:
            parts.append(f"ε {event.epsilon_spent:.4g}")
        log.info("; ".join(parts))

    def _select(self, round_number: int, model_ref: tensor_pb2.BlobRef) -> tuple[list[int], int, int, float]:
        """The round's clients (a replayed selection after a restart), the live candidates they were drawn from, the
        quorum k of results a phase needs, and the selection's seconds."""
        cfg = self.config
        candidates = self._run_clients() or self._await_clients()
        quorum = min(cfg.selection.clients_per_round, len(candidates))  # k: results a round aggregates
        # Over-selection: select ceil(k(1 + o)) and close each phase at the first k results (docs/reliability.md).
        count = min(len(candidates), math.ceil(quorum * (1 + cfg.runtime.over_selection) - 1e-9))
        if count == 0:
            raise RuntimeError("no clients available")
        selected, selection_seconds = self.selection.select(
            self.run_id,
            round_number,
            candidates,
            count,
            cfg.seed,
            lambda clients: self._probe_losses(round_number, clients, model_ref),
        )
        selected, population = self._replayed(round_number, selected, len(candidates))
        return selected, population, quorum, selection_seconds

    def _authorize(self, round_number: int, selected: list[int], population: int) -> Callable[[], float]:
        """Record the round in the privacy ledger; returns a call that waits for the record and gives the ε spent so
        far (raising what the ledger raised). A private round is authorised before any task leaves (a refusal stops
        the run with nothing released). A non-private round spends nothing and cannot be refused for its spend, so its
        audit record is written by a worker thread while the round trains, off the round's critical path (a
        synchronous RPC with a durable write each round); nothing learns from the round before it is recorded."""
        # Write-ahead: the planned round is on disk before the ledger records it, so a crash in between re-runs this
        # same selection (a replay to the ledger) rather than asking it to authorise a different one.
        if self.checkpointer is not None:
            self.checkpointer.planned(round_number, selected, population)
        args = (self.run_id, round_number, self.config, selected, population)
        if self.config.privacy.enabled:
            epsilon = self.privacy.authorize_round(*args)
            return lambda: epsilon
        if self._ledger_writer is None:
            self._ledger_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ledger-{self.run_id[:8]}")
        record = self._ledger_writer.submit(self.privacy.authorize_round, *args)
        record.add_done_callback(_log_failed_record(self.run_id, round_number))
        return record.result

    def _round_context(self, round_number: int, selected: list[int]) -> RoundContext:
        cfg = self.config
        return RoundContext(
            self.run_id,
            round_number,
            self.params,
            selected,
            self._round_train_config(round_number),
            self.transport.publish,
            seed=cfg.seed,
            num_clients=cfg.data.num_clients,
            true_groups=self.true_groups,
            cluster=self.clusterer,
        )

    def _exchange(
        self, ctx: RoundContext, model_ref: tensor_pb2.BlobRef, quorum: int, event: control_pb2.RoundEvent
    ) -> tuple[list[list[ClientResult]], bool]:
        """The strategy's phases, one after another, each planned from the results of the earlier ones: the results
        of every phase that completed, and False when one fell below runtime.min_completion (the model is kept)."""
        phases: list[list[ClientResult]] = []
        phase_index = 0
        while (plan := self.strategy.configure(ctx, phase_index, phases)) is not None:
            if phase_index >= self.strategy.max_phases:
                raise RuntimeError(
                    f"strategy {self.config.strategy.name}: planned phase {phase_index + 1} of round {ctx.round}, "
                    f"beyond its declared max_phases = {self.strategy.max_phases}"
                )
            # A sampler may draw a client twice (Clustered Sampling); it trains once.
            clients = plan.clients if plan.clients is not None else sorted(set(ctx.selected))
            outcome = self._run_phase(ctx, phase_index, plan, clients, model_ref, quorum)
            event.results_accepted += len(outcome.results)
            event.results_rejected += outcome.rejected
            if not self._phase_complete(ctx.round, phase_index, len(clients), quorum, outcome):
                self.failed_rounds += 1
                return phases, False
            phases.append(outcome.results)
            if self.dp is not None:
                self.dp.observe(outcome.results)
            phase_index += 1
        return phases, True

    def _run_phase(
        self,
        ctx: RoundContext,
        phase_index: int,
        plan: PhasePlan,
        clients: list[int],
        model_ref: tensor_pb2.BlobRef,
        quorum: int,
    ) -> PhaseOutcome:
        """Dispatch one phase's tasks and collect its results, folded as they arrive where the strategy streams."""

        def fill(task: federation_pb2.Task) -> None:
            if plan.train is not None:
                task.train.CopyFrom(plan.train)
            if plan.probe is not None:
                task.probe.CopyFrom(plan.probe)
            if self.dp is not None:
                self.dp.fill(task)

        timeout = self.config.runtime.round_timeout_s
        tasks = self._tasks(ctx.round, phase_index, plan.phase, clients, model_ref, fill)
        folds = self.strategy.folds(ctx, phase_index, plan) if self._streams else []
        sink = _folding(folds) if folds else None
        if len(clients) > quorum:  # over-selected: the first k results close the phase
            outcome = self.transport.execute(tasks, timeout, quorum=quorum, on_result=sink)
            ctx.selected = [r.client_id for r in outcome.results]  # later phases: the first k
        else:
            outcome = self.transport.execute(tasks, timeout, on_result=sink)
        if folds:
            ctx.folds[phase_index] = folds
        if self.stop.is_set():
            raise RunStopped("stopped on request")
        return outcome

    def _phase_complete(
        self, round_number: int, phase_index: int, tasked: int, quorum: int, outcome: PhaseOutcome
    ) -> bool:
        needed = math.ceil(self.config.runtime.min_completion * min(tasked, quorum))
        if len(outcome.results) >= needed:
            return True
        log.warning(
            "round %d phase %d: %d of %d results (need %d); model kept",
            round_number,
            phase_index,
            len(outcome.results),
            tasked,
            needed,
        )
        return False

    def _aggregate(self, ctx: RoundContext, phases: list[list[ClientResult]], event: control_pb2.RoundEvent) -> None:
        """The new global model from the round's results (client-level DP aggregates itself), and what the round
        event reports of it."""
        if self.dp is not None and self.dp.client_level:
            # Only the noisy model leaves a client-level DP round: no Ψ of the clients' losses (see dp.aggregate).
            outcome = self.dp.aggregate(ctx, phases)
            metrics = outcome.metrics
        else:
            outcome = self.strategy.aggregate(ctx, phases)
            # Ψ telemetry for every strategy, over the training phase's results that reported each loss (none where
            # the losses were not measured or were withheld). A metric the strategy reports under the same name wins:
            # FedFair's non-DP psi is Eq. 7 around its own global loss F.
            metrics = {**psi_telemetry(train_results(phases)), **outcome.metrics}
        if not codec.all_finite(outcome.params):  # one sum, not an element-wise pass (1 GiB models)
            raise RuntimeError(f"round {ctx.round}: aggregation produced non-finite parameters")
        self.params = outcome.params
        self.failed_rounds = 0
        event.aggregation_weights.extend(outcome.weights[c] for c in sorted(outcome.weights))
        event.strategy_metrics.extend(common_pb2.Metric(name=k, value=v) for k, v in metrics.items())
        groups = self.true_groups or {}
        event.clusters.extend(
            control_pb2.ClientCluster(client_id=c, cluster=k, true_group=groups.get(c, -1))
            for c, k in sorted(outcome.clusters.items())
        )
        # DP clients withhold train_loss unless plaintext telemetry was asked for: mean over those that sent it.
        losses = [r.metrics["train_loss"] for r in phases[-1] if "train_loss" in r.metrics]
        event.mean_train_loss = float(np.mean(losses)) if losses else math.nan

    def _evaluate_if_due(self, round_number: int, event: control_pb2.RoundEvent) -> None:
        """Every evaluation.every rounds, and on the last round (the budget's last, for DP runs)."""
        cfg = self.config
        last = round_number == cfg.rounds or (self.dp is not None and round_number == self.dp.last_round)
        if round_number % cfg.evaluation.every == 0 or last:
            self._evaluate(round_number, event)

    def _report_round(self, round_number: int, event: control_pb2.RoundEvent, started: float) -> None:
        if self.checkpointer is not None:  # the previous round's write; its failure fails the run, unreported
            self.checkpointer.wait()
        late, duplicate = self.transport.refused_after_close(round_number)
        event.results_late += late
        event.results_rejected += duplicate
        event.model_sha256 = self._publish_params().sha256
        event.duration_seconds = time.monotonic() - started
        self.completed_round = round_number
        self.reported_params = self.params
        reported = control_pb2.RunEvent(run_id=self.run_id, round=event)  # a copy: emitted later, from the writer
        if self.checkpointer is None:
            self.on_event(reported)
            return
        # Saved before anyone hears of the round (a reported round is never lost), off the critical path: the state is
        # taken now, the writer thread writes it and then emits the event while the next round already runs.
        self.checkpointer.completed(self, event, lambda: self.on_event(reported))

    def _check_failed_rounds(self, round_number: int, event: control_pb2.RoundEvent) -> None:
        cfg = self.config
        if self.failed_rounds >= cfg.runtime.max_failed_rounds:
            raise RuntimeError(
                f"{self.failed_rounds} rounds in a row ended with fewer results than runtime.min_completion = "
                f"{cfg.runtime.min_completion:g} of the selected clients (last: round {round_number}, "
                f"{event.results_accepted} results); start more client agents, raise runtime.round_timeout_s, "
                "lower runtime.min_completion or set runtime.over_selection"
            )

    def _await_clients(self) -> list[int]:
        """Every agent vanished (restarts, a network cut): wait for clients as at the start of a run."""
        timeout = self.config.runtime.register_timeout_s
        deadline = time.monotonic() + timeout
        log.warning("round %d: no client is reachable; waiting up to %.0fs for agents", self.round, timeout)
        while not (candidates := self._run_clients()):
            if self.stop.wait(0.2):
                raise RunStopped("stopped on request")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"round {self.round}: no client reachable for runtime.register_timeout_s = {timeout:g}s; "
                    "start client agents or check their connection to the aggregator"
                )
        return candidates

    def _replayed(self, round_number: int, selected: list[int], population: int) -> tuple[list[int], int]:
        """A round authorised before a crash is re-run with the selection it was authorised for, so the privacy
        ledger sees the identical authorisation (and counts nothing twice) and the run matches an uninterrupted one."""
        authorised = self.replay.pop(round_number, None)
        if authorised is None:
            return selected, population
        replayed, population = authorised
        if replayed != selected:
            log.info("round %d: re-running the selection authorised before the restart", round_number)
        return sorted(replayed), population

    def _evaluate(self, round_number: int, event: control_pb2.RoundEvent) -> None:
        ref = self._publish_params()
        clients = self._run_clients()
        tasks = self._tasks(
            round_number, 99, EVALUATE, clients, ref, lambda t: t.evaluate.CopyFrom(federation_pb2.EvaluateConfig())
        )
        outcome = self.transport.execute(tasks, self.config.runtime.round_timeout_s)
        if self.stop.is_set():
            raise RunStopped("stopped on request")
        results = outcome.results
        missing = self.config.data.num_clients - len(results)
        if not results:
            log.warning("round %d: no client could be evaluated", round_number)
            return
        report = fairness_report(
            [r.test_accuracy for r in results],
            losses=[r.test_loss for r in results],
            num_samples=[r.num_samples for r in results],
            missing_clients=missing,
        )
        event.evaluated = True
        event.fairness.CopyFrom(control_pb2.FairnessReport(**report.to_dict()))
        event.clients.extend(
            control_pb2.ClientEvaluation(
                client_id=r.client_id, accuracy=r.test_accuracy, loss=r.test_loss, num_samples=r.num_samples
            )
            for r in results
        )
