"""Run control: start, watch and stop runs. One run is active at a time; events are kept for replay to watchers."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from aggregator_service.checkpoint import AGGREGATOR, CheckpointError, Loaded, load, run_directory
from aggregator_service.engine import RoundEngine
from fairfl.config import ConfigError, ExperimentConfig, experiment_from_yaml
from fairfl.rpc import CHUNK_BYTES
from fairfl.rpc_refusals import refuse
from fairfl.v1 import control_pb2, control_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "fairfl.v1.RunControl"
TERMINAL = {control_pb2.RUN_STATE_COMPLETED, control_pb2.RUN_STATE_STOPPED, control_pb2.RUN_STATE_FAILED}

EngineFactory = Callable[[str, ExperimentConfig, Callable[[control_pb2.RunEvent], None], threading.Event], RoundEngine]


@dataclass
class _Run:
    run_id: str
    config: ExperimentConfig
    stop: threading.Event
    status: control_pb2.RunStatus
    events: list[control_pb2.RunEvent] = field(default_factory=list)
    thread: threading.Thread | None = None
    engine: RoundEngine | None = None
    stop_reason: str = ""  # what StopRun was told, added to the message of the run's STOPPED status
    last_round: int = 0  # the newest completed round (its RoundEvent recorded): what RunStatus.round reports


class RunManager:
    def __init__(
        self, make_engine: EngineFactory, on_stop: Callable[[], None] | None = None, checkpoint_dir: str = ""
    ) -> None:
        self.make_engine = make_engine
        self.on_stop = on_stop  # wakes a waiting phase, so a stop takes effect now rather than at its deadline
        self.checkpoint_dir = checkpoint_dir  # default root of run checkpoints (runtime.checkpoint_dir overrides)
        self.cond = threading.Condition()
        self.runs: dict[str, _Run] = {}

    def active(self) -> _Run | None:
        with self.cond:
            return next((r for r in self.runs.values() if r.status.state not in TERMINAL), None)

    def checkpoint_directory(self, run_id: str, config: ExperimentConfig) -> Path | None:
        root = config.runtime.checkpoint_dir or self.checkpoint_dir
        return run_directory(root, run_id) if root else None

    def _resumable(self, run_id: str, config: ExperimentConfig) -> Loaded | None:
        """The checkpoint a StartRun for `run_id` resumes (an unfinished or failed run), or None for a new run."""
        try:
            directory = self.checkpoint_directory(run_id, config)
            loaded = load(directory) if directory is not None else None
        except CheckpointError as err:
            raise RunStartError(str(err)) from err
        if loaded is None:
            return None
        if loaded.origin != AGGREGATOR:
            raise RunStartError(
                f"run {run_id!r} has a checkpoint in {loaded.directory} written by an in-process run (its privacy "
                "ledger is in the checkpoint, not in the privacy service): resume it with `fairfl run --transport "
                "inprocess --resume`, or use a new run id"
            )
        ckpt = loaded.checkpoint
        if ckpt.finished and ckpt.final_state != "RUN_STATE_FAILED":
            raise KeyError(
                f"run id {run_id!r} already ran to its end ({ckpt.final_state}; checkpoint in {loaded.directory}): "
                "use a new run id"
            )
        if loaded.config.to_dict() != config.to_dict():
            raise RunStartError(
                f"run {run_id!r} has a checkpoint in {loaded.directory} made with a different experiment config: "
                "resume it with the same config, or use a new run id"
            )
        return loaded

    def start(self, config: ExperimentConfig, run_id: str = "", resume: Loaded | None = None) -> control_pb2.RunStatus:
        """Start a run, or resume it from its checkpoint when one exists for `run_id` (docs/reliability.md)."""
        with self.cond:
            busy = self.active()
            if busy is not None:
                raise RuntimeError(f"run {busy.run_id} is still active; stop it first")
            run_id = run_id or uuid.uuid4().hex[:12]
            earlier = self.runs.get(run_id)
            if earlier is not None and earlier.status.state != control_pb2.RUN_STATE_FAILED:
                raise KeyError(f"run id {run_id!r} already used")
            if resume is None:
                resume = self._resumable(run_id, config)
            if earlier is not None and resume is None:
                raise KeyError(f"run id {run_id!r} already used (it failed, and has no checkpoint to resume)")
            status = control_pb2.RunStatus(
                run_id=run_id,
                state=control_pb2.RUN_STATE_PENDING,
                total_rounds=config.rounds,
                round=resume.checkpoint.round if resume else 0,
                name=config.name,
                strategy=config.strategy.name,
                started_unix=time.time(),
            )
            run = _Run(run_id, config, threading.Event(), status)
            if resume is not None:  # watchers get the run's history first, as if it had never stopped
                run.events = [control_pb2.RunEvent(run_id=run_id, round=r) for r in resume.rounds]
                run.last_round = resume.checkpoint.round
                if resume.rounds:
                    status.model_sha256 = resume.rounds[-1].model_sha256
            self.runs[run_id] = run
        if earlier is not None and earlier.thread is not None:
            earlier.thread.join(30)  # the failed attempt's engine is done once it has closed its transport run
        try:
            engine = self.make_engine(run_id, config, lambda e: self._record(run, e), run.stop)
            checkpointer = getattr(engine, "checkpointer", None)  # set by factories that checkpoint
            if checkpointer is not None:
                if resume is not None:
                    checkpointer.restore(engine, resume)
                else:
                    checkpointer.start_fresh(engine)
            elif resume is not None:
                raise RunStartError(f"run {run_id!r} has a checkpoint, but this aggregator writes none to resume")
        except Exception as err:  # a run that cannot start must not block the next one
            with self.cond:
                run.status.state = control_pb2.RUN_STATE_FAILED
                run.status.message = f"could not start: {type(err).__name__}: {err}"
                run.status.ended_unix = time.time()
                self.cond.notify_all()
            raise RunStartError(run.status.message) from err
        run.engine = engine
        run.thread = threading.Thread(target=engine.run, name=f"run-{run_id}", daemon=True)
        run.thread.start()
        return _copy(status)

    def _record(self, run: _Run, event: control_pb2.RunEvent) -> None:
        with self.cond:
            if event.HasField("status"):
                event = self._with_run_fields(run, event)
                run.status = _copy(event.status)  # the stored event must never change afterwards
                if event.status.state in TERMINAL:
                    log.info(
                        "run %s ended: %s after round %d/%d: %s",
                        run.run_id,
                        control_pb2.RunState.Name(event.status.state).removeprefix("RUN_STATE_"),
                        event.status.round,
                        event.status.total_rounds,
                        event.status.message,
                    )
            elif event.HasField("round"):
                run.last_round = run.status.round = event.round.round
                if event.round.model_sha256:
                    run.status.model_sha256 = event.round.model_sha256
            run.events.append(event)
            self.cond.notify_all()

    @staticmethod
    def _with_run_fields(run: _Run, event: control_pb2.RunEvent) -> control_pb2.RunEvent:
        """A copy of the engine's status event with what the manager knows of the run: its newest completed round (a
        run stopped during round n reports n - 1), name, strategy, start and end times, newest model, and the reason a
        stop was requested for."""
        out = control_pb2.RunEvent()
        out.CopyFrom(event)
        status, known = out.status, run.status
        status.round = run.last_round
        status.name, status.strategy = known.name, known.strategy
        status.started_unix = known.started_unix
        if not status.model_sha256:
            status.model_sha256 = known.model_sha256
        if status.state in TERMINAL:
            status.ended_unix = status.ended_unix or time.time()
            if status.state == control_pb2.RUN_STATE_STOPPED and run.stop_reason:
                status.message = f"{status.message}: {run.stop_reason}" if status.message else run.stop_reason
        return out

    def listing(self) -> list[control_pb2.RunStatus]:
        """Snapshots of every run this manager knows, newest first (by start time)."""
        with self.cond:
            runs = [_copy(r.status) for r in self.runs.values()]
        return sorted(runs, key=lambda s: s.started_unix, reverse=True)

    def get(self, run_id: str) -> _Run:
        with self.cond:
            if run_id not in self.runs:
                raise KeyError(f"run {run_id!r} not found")
            return self.runs[run_id]

    def status(self, run_id: str) -> control_pb2.RunStatus:
        """A snapshot of the run's status, safe to serialise while the engine keeps updating the original."""
        with self.cond:
            return _copy(self.get(run_id).status)

    def watch(self, run_id: str, is_active: Callable[[], bool]) -> Iterator[control_pb2.RunEvent]:
        run = self.get(run_id)
        sent = 0
        while is_active():
            with self.cond:
                while sent >= len(run.events) and run.status.state not in TERMINAL:
                    self.cond.wait(1.0)
                    if not is_active():
                        return
                batch = run.events[sent:]
                finished = run.status.state in TERMINAL
            yield from batch
            sent += len(batch)
            if finished and sent >= len(run.events):
                return

    def stop(self, run_id: str, reason: str) -> control_pb2.RunStatus:
        run = self.get(run_id)
        with self.cond:
            if run.status.state not in TERMINAL and not run.stop.is_set():
                run.stop_reason = reason
        run.stop.set()
        if self.on_stop is not None:
            self.on_stop()
        log.info("stop requested for run %s: %s", run_id, reason or "no reason given")
        return self.status(run_id)


class RunStartError(Exception):
    """The run was accepted but its engine could not be built (e.g. its privacy budget allows no round)."""


def _copy(status: control_pb2.RunStatus) -> control_pb2.RunStatus:
    out = control_pb2.RunStatus()
    out.CopyFrom(status)
    return out


class RunControlServicer(control_pb2_grpc.RunControlServicer):
    """Its requests carry run ids, a config and a reason, no numbers. Every refusal is counted (refuse): an
    unknown run as `unknown`, a config that does not parse as `malformed`, the others under their status code."""

    def __init__(self, manager: RunManager) -> None:
        self.manager = manager

    def StartRun(self, request: control_pb2.StartRunRequest, context: grpc.ServicerContext):
        try:
            config = experiment_from_yaml(request.experiment_yaml)
        except ConfigError as err:
            refuse(
                context,
                SERVICE_NAME,
                "malformed",
                grpc.StatusCode.INVALID_ARGUMENT,
                f"invalid experiment config: {err}",
            )
        try:
            return self.manager.start(config, request.run_id)
        except RunStartError as err:
            refuse(
                context, SERVICE_NAME, "invalid_argument", grpc.StatusCode.INVALID_ARGUMENT, f"run cannot start: {err}"
            )
        except RuntimeError as err:  # another run is active
            refuse(context, SERVICE_NAME, "failed_precondition", grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except KeyError as err:  # the run id is taken
            refuse(context, SERVICE_NAME, "already_exists", grpc.StatusCode.ALREADY_EXISTS, str(err.args[0]))

    def _run(self, run_id: str, context: grpc.ServicerContext) -> _Run:
        try:
            return self.manager.get(run_id)
        except KeyError as err:
            refuse(context, SERVICE_NAME, "unknown", grpc.StatusCode.NOT_FOUND, str(err.args[0]))

    def GetRun(self, request: control_pb2.GetRunRequest, context: grpc.ServicerContext):
        run = self._run(request.run_id, context)
        status = self.manager.status(request.run_id)
        status.experiment_yaml = run.config.to_yaml()
        return status

    def ListRuns(self, request: control_pb2.ListRunsRequest, context: grpc.ServicerContext):
        return control_pb2.ListRunsReply(runs=self.manager.listing())

    def WatchRun(self, request: control_pb2.WatchRunRequest, context: grpc.ServicerContext):
        self._run(request.run_id, context)
        yield from self.manager.watch(request.run_id, context.is_active)

    def StopRun(self, request: control_pb2.StopRunRequest, context: grpc.ServicerContext):
        self._run(request.run_id, context)
        return self.manager.stop(request.run_id, request.reason[:1000])

    def FetchModel(self, request: control_pb2.GetRunRequest, context: grpc.ServicerContext):
        run = self._run(request.run_id, context)
        engine = run.engine
        if engine is None and run.status.state in TERMINAL:  # its engine was never built: there never will be a model
            refuse(
                context,
                SERVICE_NAME,
                "failed_precondition",
                grpc.StatusCode.FAILED_PRECONDITION,
                f"run {request.run_id} ended without a model: {run.status.message[:300]}",
            )
        if engine is None:
            refuse(
                context,
                SERVICE_NAME,
                "unavailable",
                grpc.StatusCode.UNAVAILABLE,
                f"run {request.run_id} has no model yet; retry in a moment",
            )
        # The model the newest RoundEvent names (not one aggregated mid-round and not yet reported).
        yield from engine.layout.encode(engine.reported_params).chunks(CHUNK_BYTES)
