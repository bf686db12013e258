"""When the round engine records a round in the privacy ledger: a private round before any of its tasks leaves; a
non-private round (it spends nothing) while its clients train, yet always before the round's results are used; a
refused record fails the run with the round unreported and the model and strategy state of the last reported round
kept."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from aggregator_service.engine import RoundEngine, RunRefused
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalSelector
from fairfl.config import ExperimentConfig, experiment_from_dict
from fairfl.v1 import control_pb2
from tests.unit.test_dp_engine import dp_config

OVERLAP_WAIT_S = 5.0  # how long a held record waits for the round's tasks (a synchronous record would wait it all)
LATE_S = 0.3  # then it takes this long: longer than the round's training, so a round that did not wait is seen


class Timeline:
    """What happened, in order, from the engine's threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: list[str] = []
        self.dispatched: dict[int, threading.Event] = {}

    def add(self, entry: str) -> None:
        with self.lock:
            self.entries.append(entry)

    def dispatch_of(self, round_number: int) -> threading.Event:
        with self.lock:
            return self.dispatched.setdefault(round_number, threading.Event())


class RecordingTransport(InProcessTransport):
    def __init__(self, timeline: Timeline) -> None:
        super().__init__()
        self.timeline = timeline

    def execute(self, tasks: Any, timeout: float, quorum: Any = None, on_result: Any = None) -> Any:
        if tasks and tasks[0].round:
            self.timeline.add(f"dispatch {tasks[0].round}")
            self.timeline.dispatch_of(tasks[0].round).set()
        return super().execute(tasks, timeout, quorum, on_result)


class HeldLedger(LocalPrivacy):
    """The in-process ledger, whose record of a round waits (up to OVERLAP_WAIT_S) until the round's tasks have been
    dispatched, takes LATE_S more, then notes whether they had been; `refuse` rounds are refused as the privacy
    service would refuse them."""

    def __init__(self, timeline: Timeline, hold: bool, refuse: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.timeline = timeline
        self.hold = hold
        self.refuse = refuse
        self.threads: set[str] = set()

    def authorize_round(
        self, run_id: str, round_number: int, config: ExperimentConfig, selected: list[int], population: int
    ) -> float:
        self.threads.add(threading.current_thread().name)
        if self.hold:
            overlapped = self.timeline.dispatch_of(round_number).wait(OVERLAP_WAIT_S)
            time.sleep(LATE_S)
            self.timeline.add(f"record {round_number} {'while training' if overlapped else 'alone'}")
        else:
            self.timeline.add(f"record {round_number}")
        if round_number in self.refuse:
            raise RunRefused(f"the privacy ledger refused round {round_number}: test")
        return super().authorize_round(run_id, round_number, config, selected, population)


def run(config: ExperimentConfig, ledger: HeldLedger, timeline: Timeline) -> tuple[Any, RoundEngine]:
    def on_event(event: control_pb2.RunEvent) -> None:
        if event.HasField("round"):
            timeline.add(f"report {event.round.round}")

    transport = RecordingTransport(timeline)
    engine = RoundEngine("run", config, transport, LocalSelector(config.selection.method), ledger, on_event)
    aggregate = engine.strategy.aggregate

    def noted_aggregate(ctx: Any, phases: Any) -> Any:
        timeline.add(f"aggregate {ctx.round}")
        return aggregate(ctx, phases)

    engine.strategy.aggregate = noted_aggregate  # type: ignore[method-assign]
    return engine.run(), engine


def non_private(rounds: int = 3) -> ExperimentConfig:
    """FedAvg with server momentum: a strategy whose state every aggregation changes."""
    strategy = {"name": "fedavg", "params": {"server_momentum": 0.9}}
    return experiment_from_dict({**dp_config(rounds=rounds), "strategy": strategy, "privacy": {}})


def test_a_non_private_round_is_recorded_while_it_trains_and_before_its_results_are_used() -> None:
    timeline = Timeline()
    ledger = HeldLedger(timeline, hold=True)
    summary, _ = run(non_private(), ledger, timeline)
    assert summary.state == control_pb2.RUN_STATE_COMPLETED
    for r in (1, 2, 3):
        assert f"record {r} while training" in timeline.entries  # not before dispatch: off the critical path
        # ...but before the round's results are aggregated (it arrived LATE_S after dispatch: the engine waited).
        assert timeline.entries.index(f"record {r} while training") < timeline.entries.index(f"aggregate {r}")
    assert threading.current_thread().name not in ledger.threads  # written by the engine's ledger worker
    assert [e.round for e in ledger.ledger.events("run")] == []  # nothing spent...
    assert ledger.ledger.rounds_recorded("run") == 3  # ...and every round on the audit record


def test_a_private_round_is_authorised_before_any_task_leaves() -> None:
    timeline = Timeline()
    ledger = HeldLedger(timeline, hold=False)
    summary, _ = run(experiment_from_dict(dp_config(rounds=2)), ledger, timeline)
    assert summary.state == control_pb2.RUN_STATE_COMPLETED
    for r in (1, 2):
        assert timeline.entries.index(f"record {r}") < timeline.entries.index(f"dispatch {r}")


def test_a_refused_non_private_record_fails_the_run_with_its_round_unreported() -> None:
    timeline = Timeline()
    reference, after_one = run(non_private(rounds=1), HeldLedger(Timeline(), hold=False), Timeline())
    summary, engine = run(non_private(), HeldLedger(timeline, hold=False, refuse=frozenset({2})), timeline)
    assert summary.state == control_pb2.RUN_STATE_FAILED
    assert "refused round 2" in summary.message
    assert summary.rounds_completed == 1
    assert "report 1" in timeline.entries and "report 2" not in timeline.entries
    assert "aggregate 2" not in timeline.entries  # round 2's results were never used...
    # ...so the run keeps round 1's model and the strategy's momentum as round 1 left it.
    assert torch.equal(summary.final_params, reference.final_params)
    assert torch.equal(_velocity(engine), _velocity(after_one))


def _velocity(engine: RoundEngine) -> torch.Tensor:
    strategy = getattr(engine.strategy, "inner", engine.strategy)
    assert strategy.velocity is not None
    return strategy.velocity
