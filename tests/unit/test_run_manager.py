"""Run control: a run that fails to start frees the aggregator, and recorded events never change afterwards."""

from __future__ import annotations

import threading

import pytest

from aggregator_service.runs import RunManager, RunStartError
from fairfl.config import experiment_from_dict
from fairfl.v1 import control_pb2


class _Engine:
    def __init__(self, on_event, stop: threading.Event) -> None:
        self.on_event = on_event
        self.stop = stop

    def run(self) -> None:
        status = control_pb2.RunStatus(state=control_pb2.RUN_STATE_RUNNING)
        self.on_event(control_pb2.RunEvent(status=status))
        for r in (1, 2):
            self.on_event(control_pb2.RunEvent(round=control_pb2.RoundEvent(round=r)))
        self.on_event(control_pb2.RunEvent(status=control_pb2.RunStatus(state=control_pb2.RUN_STATE_COMPLETED)))


def test_a_run_that_cannot_start_does_not_block_the_next() -> None:
    calls = []

    def factory(run_id, config, on_event, stop):
        calls.append(run_id)
        if run_id == "bad":
            raise ValueError("no round is affordable")
        return _Engine(on_event, stop)

    manager = RunManager(factory)
    config = experiment_from_dict({"rounds": 2})
    with pytest.raises(RunStartError, match="no round is affordable"):
        manager.start(config, "bad")
    assert manager.status("bad").state == control_pb2.RUN_STATE_FAILED
    assert manager.active() is None
    manager.start(config, "good")
    manager.get("good").thread.join(5)
    assert manager.status("good").state == control_pb2.RUN_STATE_COMPLETED


def test_recorded_status_events_are_not_rewritten_by_later_rounds() -> None:
    manager = RunManager(lambda run_id, config, on_event, stop: _Engine(on_event, stop))
    manager.start(experiment_from_dict({"rounds": 2}), "r")
    run = manager.get("r")
    run.thread.join(5)
    running = next(e.status for e in run.events if e.HasField("status"))
    assert running.state == control_pb2.RUN_STATE_RUNNING and running.round == 0
    events = list(manager.watch("r", lambda: True))
    assert [e.round.round for e in events if e.HasField("round")] == [1, 2]
