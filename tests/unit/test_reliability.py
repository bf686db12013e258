"""Reliability without processes (docs/reliability.md): checkpoints and resume, over-selection, failed rounds, prompt
stop, vanished agents, the long-poll limit, the launcher's startup timeout, fault injection and signature re-reports.
The multi-process fault-injection runs are in tests/integration/test_fault_injection.py."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from aggregator_service import checkpoint
from aggregator_service.checkpoint import RunCheckpointer, decode_state, encode_state, run_directory
from aggregator_service.engine import RoundEngine
from aggregator_service.federation.admission import Rejected
from aggregator_service.federation.state import FederationState
from aggregator_service.federation.transport import GrpcTransport
from aggregator_service.runs import RunManager, RunStartError
from client_agent.faults import DropPlan
from fairfl.codec import CodecError
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalSelector
from fairfl.config import ConfigError, ExperimentConfig, experiment_from_dict
from fairfl.v1 import control_pb2, federation_pb2

RUN = "rel"


def _config(**overrides: Any) -> ExperimentConfig:
    base: dict[str, Any] = {
        "name": "reliability",
        "seed": 5,
        "rounds": 6,
        "data": {"dataset": "synthetic", "num_clients": 8},
        "model": {"name": "mlp", "params": {"hidden": [12]}},
        "training": {"local_steps": 2, "batch_size": 10, "lr": 0.1},
        "selection": {"clients_per_round": 4},
        "evaluation": {"every": 3},
        "strategy": {"name": "fedavg", "params": {"server_momentum": 0.5}},  # strategy state: the velocity
    }
    for key, value in overrides.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    return experiment_from_dict(base)


def _dp_config(**overrides: Any) -> ExperimentConfig:
    return _config(
        strategy={"name": "fedfair", "params": {"fair_lambda": 0.5}},
        selection={"method": "full", "clients_per_round": 8},
        privacy={"enabled": True, "epsilon": 50.0, "sample_rate": 0.2, "noise_multiplier": 1.0, "clip_norm": 1.0},
        **overrides,
    )


def _engine(config: ExperimentConfig, events: list[control_pb2.RunEvent], transport: Any = None) -> RoundEngine:
    return RoundEngine(
        RUN,
        config,
        transport or InProcessTransport(),
        LocalSelector(config.selection.method),
        LocalPrivacy(),
        events.append,
    )


class Crash(BaseException):
    """A process death: no handler of the engine may see it (it is not an Exception)."""


def _crash_in_round(engine: RoundEngine, round_number: int) -> None:
    """Kill the run while `round_number`'s first phase is out, i.e. after its privacy authorisation."""
    execute = engine.transport.execute

    def dying(tasks: list[federation_pb2.Task], timeout: float, *args: Any, **kwargs: Any) -> Any:
        if tasks and tasks[0].round == round_number:
            raise Crash()
        return execute(tasks, timeout, *args, **kwargs)

    engine.transport.execute = dying  # type: ignore[method-assign]


def _rounds(events: list[control_pb2.RunEvent]) -> list[control_pb2.RoundEvent]:
    return [e.round for e in events if e.HasField("round")]


@pytest.mark.parametrize("dp", [False, True], ids=["fedavg-momentum", "dp-fedfair"])
def test_a_run_killed_mid_round_resumes_to_the_uninterrupted_model(tmp_path: Path, dp: bool) -> None:
    config = _dp_config() if dp else _config()
    reference_events: list[control_pb2.RunEvent] = []
    reference_engine = _engine(config, reference_events)
    reference = reference_engine.run()
    assert reference.state == control_pb2.RUN_STATE_COMPLETED

    directory = run_directory(tmp_path, RUN)
    first_events: list[control_pb2.RunEvent] = []
    first = _engine(config, first_events)
    first.checkpointer = RunCheckpointer(directory, RUN, config)
    first.checkpointer.start_fresh()
    _crash_in_round(first, 4)
    with pytest.raises(Crash):
        first.run()
    loaded = checkpoint.load(directory)
    assert loaded is not None and not loaded.checkpoint.finished
    assert loaded.checkpoint.round == 3 and [r.round for r in loaded.rounds] == [1, 2, 3]
    assert loaded.pending is not None and loaded.pending.round == 4  # authorised before the crash
    assert list(loaded.pending.selected) == list(_rounds(reference_events)[3].selected)

    resumed_events: list[control_pb2.RunEvent] = []
    resumed = _engine(config, resumed_events)
    resumed.checkpointer = RunCheckpointer(directory, RUN, config)
    resumed.checkpointer.restore(resumed, loaded)
    summary = resumed.run()
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    assert torch.equal(summary.final_params, reference.final_params)
    # Every round once: 1-3 from before the crash, 4-6 after it, each the same as in the uninterrupted run.
    assert [r.round for r in _rounds(resumed_events)] == [4, 5, 6]
    final = checkpoint.load(directory)
    assert final is not None and final.checkpoint.finished and final.checkpoint.final_state == "RUN_STATE_COMPLETED"
    assert [r.model_sha256 for r in final.rounds] == [r.model_sha256 for r in _rounds(reference_events)]
    if dp:  # the in-memory ledger came back from the checkpoint, and round 4 was recorded once
        assert [r.epsilon_spent for r in final.rounds] == [r.epsilon_spent for r in _rounds(reference_events)]
        assert final.rounds[-1].epsilon_spent > final.rounds[0].epsilon_spent > 0

        def ledger(engine: RoundEngine) -> list[tuple[Any, ...]]:
            return [tuple(e)[:6] for e in engine.privacy.ledger.events(RUN)]

        assert ledger(resumed) == ledger(reference_engine)
        assert {row[0] for row in ledger(resumed)} == set(range(1, 7))


def test_a_run_killed_in_its_first_round_resumes(tmp_path: Path) -> None:
    """StartRun saves the run's starting point, so a run killed before any round completed is resumed too."""
    config = _dp_config(rounds=2, runtime={"checkpoint_dir": str(tmp_path)})
    reference = _engine(config, [])
    assert reference.run().state == control_pb2.RUN_STATE_COMPLETED
    engines: list[RoundEngine] = []

    def factory(run_id: str, cfg: ExperimentConfig, on_event: Any, stop: threading.Event) -> RoundEngine:
        engine = RoundEngine(run_id, cfg, InProcessTransport(), LocalSelector("full"), LocalPrivacy(), on_event, stop)
        engine.checkpointer = RunCheckpointer(run_directory(tmp_path, run_id), run_id, cfg)
        if not engines:  # the first aggregator dies in round 1, after its authorisation
            _crash_in_round(engine, 1)
            run = engine.run

            def dies() -> Any:
                with contextlib.suppress(Crash):
                    return run()

            engine.run = dies  # type: ignore[method-assign]
        engines.append(engine)
        return engine

    first = RunManager(factory)
    first.start(config, RUN)
    first.get(RUN).thread.join(60)
    loaded = checkpoint.load(run_directory(tmp_path, RUN))
    assert loaded is not None and loaded.checkpoint.round == 0 and not loaded.checkpoint.finished
    assert loaded.pending is not None and loaded.pending.round == 1
    restarted = RunManager(factory)  # a new aggregator process
    assert restarted.start(config, RUN).round == 0
    restarted.get(RUN).thread.join(60)
    assert restarted.status(RUN).state == control_pb2.RUN_STATE_COMPLETED, restarted.status(RUN).message
    assert torch.equal(engines[-1].params, reference.params)
    recorded = [tuple(e)[:6] for e in engines[-1].privacy.ledger.events(RUN)]  # without the time of recording
    assert recorded == [tuple(e)[:6] for e in reference.privacy.ledger.events(RUN)] and recorded  # each round once


def test_events_past_the_checkpoint_are_dropped_and_overwritten(tmp_path: Path) -> None:
    """A crash between appending a round's event and replacing the checkpoint: the event is not part of the run."""
    config = _config(rounds=3)
    directory = run_directory(tmp_path, RUN)
    engine = _engine(config, [])
    engine.checkpointer = RunCheckpointer(directory, RUN, config)
    engine.checkpointer.start_fresh()
    _crash_in_round(engine, 3)
    with pytest.raises(Crash):
        engine.run()
    with open(directory / checkpoint.EVENTS_FILE, "ab") as log:  # a third record the checkpoint never covered
        log.write(b"\x05\x00\x00\x00junk!")
    loaded = checkpoint.load(directory)
    assert loaded is not None and [r.round for r in loaded.rounds] == [1, 2]
    resumed = _engine(config, [])
    resumed.checkpointer = RunCheckpointer(directory, RUN, config)
    resumed.checkpointer.restore(resumed, loaded)
    assert resumed.run().state == control_pb2.RUN_STATE_COMPLETED
    final = checkpoint.load(directory)
    assert final is not None and [r.round for r in final.rounds] == [1, 2, 3]
    assert b"junk" not in (directory / checkpoint.EVENTS_FILE).read_bytes()


def _record_task_ids(engine: RoundEngine) -> dict[tuple[int, int], str]:
    """(round, client) -> task id of every task the engine dispatches from now on (phase 0: training)."""
    ids: dict[tuple[int, int], str] = {}
    execute = engine.transport.execute

    def recording(tasks: list[federation_pb2.Task], timeout: float, *args: Any, **kwargs: Any) -> Any:
        ids.update(((t.round, t.client_id), t.task_id) for t in tasks if t.phase == federation_pb2.PHASE_TRAIN)
        return execute(tasks, timeout, *args, **kwargs)

    engine.transport.execute = recording  # type: ignore[method-assign]
    return ids


def test_task_ids_are_keyed_per_run_and_a_resumed_run_issues_the_same_ones(tmp_path: Path) -> None:
    """Nothing in a task id tells its run, round or client (a MAC under the run's secret key); the key is in the
    checkpoint, so the round re-run after a crash carries the same ids: an agent's DP-release cache relies on it."""
    config = _config(rounds=4)
    directory = run_directory(tmp_path, RUN)
    crashed = _engine(config, [])
    crashed.checkpointer = RunCheckpointer(directory, RUN, config)
    crashed.checkpointer.start_fresh()
    _crash_in_round(crashed, 3)
    before = _record_task_ids(crashed)
    with pytest.raises(Crash):
        crashed.run()
    loaded = checkpoint.load(directory)
    assert loaded is not None and loaded.checkpoint.task_id_key == crashed.task_key and len(crashed.task_key) == 32
    resumed = _engine(config, [])
    resumed.checkpointer = RunCheckpointer(directory, RUN, config)
    resumed.checkpointer.restore(resumed, loaded)
    after = _record_task_ids(resumed)
    assert resumed.run().state == control_pb2.RUN_STATE_COMPLETED
    round_three = {key: value for key, value in before.items() if key[0] == 3}
    assert round_three and all(after[key] == value for key, value in round_three.items())
    another = _engine(config, [])  # the same run id and seed without the key: other ids
    fresh = _record_task_ids(another)
    assert another.run().state == control_pb2.RUN_STATE_COMPLETED
    assert not set(fresh.values()) & (set(before.values()) | set(after.values()))
    for task_id in [*before.values(), *after.values()]:
        assert re.fullmatch(r"[0-9a-f]{32}", task_id), task_id
    assert len(set(after.values())) == len(after), "one id per (round, client)"


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "checkpoint.pb"
    checkpoint.atomic_write(target, b"old")

    def no_rename(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(checkpoint.os, "replace", no_rename)
    with pytest.raises(OSError, match="disk gone"):
        checkpoint.atomic_write(target, b"new")
    assert target.read_bytes() == b"old"
    monkeypatch.undo()
    checkpoint.atomic_write(target, b"new")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["checkpoint.pb"]


def test_state_trees_round_trip_without_pickle() -> None:
    tree = {
        "velocity": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "log_lambda": np.array([0.5, -1.25]),
        "loss_clip": {3: 0.25, 7: float("nan")},
        "nested": [None, True, 2, "x", (1, 2)],
        "empty": torch.zeros(0),
    }
    text, tensors = encode_state(tree)
    out = decode_state(text, tensors)
    assert torch.equal(out["velocity"], tree["velocity"]) and out["velocity"].dtype == torch.float32
    assert isinstance(out["log_lambda"], np.ndarray) and np.array_equal(out["log_lambda"], tree["log_lambda"])
    assert set(out["loss_clip"]) == {3, 7} and out["loss_clip"][3] == 0.25 and np.isnan(out["loss_clip"][7])
    assert out["nested"] == [None, True, 2, "x", [1, 2]] and out["empty"].numel() == 0
    with pytest.raises(checkpoint.CheckpointError, match="cannot checkpoint a set"):
        encode_state({"bad": {1, 2}})


def test_run_ids_that_cannot_name_a_directory_are_refused(tmp_path: Path) -> None:
    for bad in ("../x", "a/b", "", ".hidden"):
        with pytest.raises(checkpoint.CheckpointError, match="cannot name a checkpoint directory"):
            run_directory(tmp_path, bad)


def test_start_run_resumes_a_checkpointed_run_and_refuses_a_finished_or_changed_one(tmp_path: Path) -> None:
    config = _config(rounds=4, runtime={"checkpoint_dir": str(tmp_path)})
    directory = run_directory(tmp_path, RUN)
    crashed = _engine(config, [])
    crashed.checkpointer = RunCheckpointer(directory, RUN, config)
    crashed.checkpointer.start_fresh()
    _crash_in_round(crashed, 3)
    with pytest.raises(Crash):
        crashed.run()

    engines: list[RoundEngine] = []

    def factory(run_id: str, cfg: ExperimentConfig, on_event: Any, stop: threading.Event) -> RoundEngine:
        engine = RoundEngine(run_id, cfg, InProcessTransport(), LocalSelector("random"), LocalPrivacy(), on_event, stop)
        engine.checkpointer = RunCheckpointer(directory, run_id, cfg)
        engines.append(engine)
        return engine

    manager = RunManager(factory)
    with pytest.raises(RunStartError, match="different experiment config"):
        manager.start(_config(rounds=5, runtime={"checkpoint_dir": str(tmp_path)}), RUN)
    manager = RunManager(factory)
    status = manager.start(config, RUN)
    assert status.round == 2  # resumed after its last completed round
    manager.get(RUN).thread.join(60)
    assert manager.status(RUN).state == control_pb2.RUN_STATE_COMPLETED
    watched = list(manager.watch(RUN, lambda: True))
    assert [e.round.round for e in watched if e.HasField("round")] == [1, 2, 3, 4]  # history first, then live
    with pytest.raises(KeyError, match="already ran to its end"):
        RunManager(factory).start(config, RUN)


def test_over_selection_aggregates_the_first_k(tmp_path: Path) -> None:
    config = _config(rounds=2, runtime={"over_selection": 0.5})
    events: list[control_pb2.RunEvent] = []
    assert _engine(config, events).run().state == control_pb2.RUN_STATE_COMPLETED
    for r in _rounds(events):
        assert len(r.selected) == 6  # ceil(4 * 1.5)
        assert len(r.aggregation_weights) == 4 and r.results_accepted == 4


class _Dropping(InProcessTransport):
    """The in-process transport with some clients that never answer (fault injection)."""

    def __init__(self, silent: set[int]) -> None:
        super().__init__()
        self.silent = silent

    def execute(self, tasks: list[federation_pb2.Task], timeout: float, *args: Any, **kwargs: Any) -> Any:
        return super().execute([t for t in tasks if t.client_id not in self.silent], timeout, *args, **kwargs)


def test_too_few_results_keep_the_model_and_stop_the_run_after_max_failed_rounds() -> None:
    config = _config(
        rounds=6, selection={"method": "full", "clients_per_round": 8}, runtime={"max_failed_rounds": 2}
    )  # min_completion 1.0 by default, and client 0 never answers
    events: list[control_pb2.RunEvent] = []
    summary = _engine(config, events, _Dropping({0})).run()
    assert summary.state == control_pb2.RUN_STATE_FAILED
    assert "2 rounds in a row" in summary.message and "runtime.min_completion" in summary.message
    rounds = _rounds(events)
    assert [r.round for r in rounds] == [1, 2] and all(not r.aggregation_weights for r in rounds)
    assert torch.equal(summary.final_params, _engine(config, []).params)  # no round moved the model


def test_a_failed_run_resumes_in_the_same_aggregator(tmp_path: Path) -> None:
    """Failed after max_failed_rounds, a run continues on StartRun with its id once its clients answer again, without
    an aggregator restart; its failed rounds stay in its history."""
    config = _config(
        rounds=4,
        selection={"method": "full", "clients_per_round": 8},
        runtime={"max_failed_rounds": 2, "checkpoint_dir": str(tmp_path)},
    )
    transports: list[Any] = [_Dropping({0}), InProcessTransport()]  # client 0 is silent, then back

    def factory(run_id: str, cfg: ExperimentConfig, on_event: Any, stop: threading.Event) -> RoundEngine:
        engine = RoundEngine(run_id, cfg, transports.pop(0), LocalSelector("full"), LocalPrivacy(), on_event, stop)
        engine.checkpointer = RunCheckpointer(run_directory(tmp_path, run_id), run_id, cfg)
        return engine

    manager = RunManager(factory)
    manager.start(config, RUN)
    manager.get(RUN).thread.join(60)
    assert manager.status(RUN).state == control_pb2.RUN_STATE_FAILED
    status = manager.start(config, RUN)
    assert status.round == 2
    manager.get(RUN).thread.join(60)
    assert manager.status(RUN).state == control_pb2.RUN_STATE_COMPLETED, manager.status(RUN).message
    rounds = [e.round for e in manager.watch(RUN, lambda: True) if e.HasField("round")]
    assert [r.round for r in rounds] == [1, 2, 3, 4]
    assert [bool(r.aggregation_weights) for r in rounds] == [False, False, True, True]
    with pytest.raises(KeyError, match="already used"):  # a completed run's id is not reused
        manager.start(config, RUN)

    tolerant = _config(selection={"method": "full", "clients_per_round": 8}, runtime={"min_completion": 0.8})
    events = []
    assert _engine(tolerant, events, _Dropping({0})).run().state == control_pb2.RUN_STATE_COMPLETED
    final = _rounds(events)[-1]
    assert final.fairness.evaluated_clients == 7 and final.fairness.missing_clients == 1
    assert 0 not in {c.client_id for c in final.clients}


def test_reliability_fields_are_validated_by_name() -> None:
    with pytest.raises(ConfigError, match=r"runtime\.over_selection: must be >= 0"):
        _config(runtime={"over_selection": -0.1})
    with pytest.raises(ConfigError, match=r"runtime\.over_selection: must be at most 10"):
        _config(runtime={"over_selection": 11.0})
    with pytest.raises(ConfigError, match=r"runtime\.max_failed_rounds: must be >= 1"):
        _config(runtime={"max_failed_rounds": 0})
    with pytest.raises(ConfigError, match=r"runtime\.checkpoint_dir: expected a string"):
        _config(runtime={"checkpoint_dir": 3})


# -- the gRPC transport's state, without processes ---------------------------------------------------------------------


def _task(client: int, round_number: int = 1) -> federation_pb2.Task:
    return federation_pb2.Task(
        task_id=f"r/r{round_number}/p0/c{client}",
        run_id="r",
        round=round_number,
        phase=federation_pb2.PHASE_TRAIN,
        client_id=client,
        deadline_unix=1e12,
    )


def test_stop_ends_a_waiting_phase_at_once() -> None:
    state = FederationState()
    state.register("a", [0], "cpu")
    transport = GrpcTransport(state)
    stop = threading.Event()
    transport.stop = stop

    def request_stop() -> None:
        time.sleep(0.2)
        stop.set()
        state.wake()  # what RunManager.stop does through its on_stop hook

    threading.Thread(target=request_stop).start()
    started = time.monotonic()
    outcome = transport.execute([_task(0)], timeout=60.0)
    assert time.monotonic() - started < 2.0 and outcome.missing == [0]


def test_a_vanished_agent_closes_the_phase_before_its_deadline() -> None:
    state = FederationState(heartbeat_interval=0.1, agent_timeout=0.4)
    state.register("a", [0, 1], "cpu")  # then silent: no poll, no heartbeat
    started = time.monotonic()
    outcome = GrpcTransport(state).execute([_task(0), _task(1)], timeout=60.0)
    assert 0.3 < time.monotonic() - started < 3.0
    assert outcome.results == [] and outcome.missing == [0, 1]
    assert state.live_clients() == []
    again = state.register("a", [0, 1], "cpu")  # it comes back: its clients are candidates again
    assert state.live_clients() == [0, 1] and state.touch(again.agent_id) is not None


def test_quorum_closes_the_phase_at_the_first_k_results() -> None:
    from fairfl.models import build_model
    from fairfl.params import ParamLayout
    from tests.unit.test_federation_state import _submit

    state = FederationState()
    layout = ParamLayout.of(build_model("mlp", (4,), 3, hidden=(5,)))
    state.layout = layout
    agent = state.register("a", [0, 1, 2], "cpu")

    def answer_two() -> None:
        tasks: list[federation_pb2.Task] = []
        while len(tasks) < 3:
            tasks += state.poll(agent.agent_id, 8, 0.5)
        for task in tasks[:2]:
            _submit(state, layout, task, agent.agent_id)

    answering = threading.Thread(target=answer_two)
    answering.start()
    started = time.monotonic()
    outcome = GrpcTransport(state).execute([_task(0), _task(1), _task(2)], timeout=30.0, quorum=2)
    answering.join(10)
    assert time.monotonic() - started < 10.0
    assert [r.client_id for r in outcome.results] == [0, 1] and outcome.missing == [2]


def test_a_phase_takes_no_result_beyond_its_quorum_before_it_wakes() -> None:
    """Results that arrive together, before the waiting phase wakes to close at its quorum, are not all taken."""
    from fairfl.models import build_model
    from fairfl.params import ParamLayout
    from tests.unit.test_federation_state import _submit

    state = FederationState()
    layout = ParamLayout.of(build_model("mlp", (4,), 3, hidden=(5,)))
    state.layout = layout
    agent = state.register("a", [0, 1, 2], "cpu")
    outcomes: list[Any] = []
    phase = threading.Thread(
        target=lambda: outcomes.append(
            GrpcTransport(state).execute([_task(0), _task(1), _task(2)], timeout=30.0, quorum=2)
        )
    )
    with state.lock:  # reentrant: results get in, the waiting phase cannot wake until all three arrived
        phase.start()
        tasks: list[federation_pb2.Task] = []
        while len(tasks) < 3:
            state.lock.wait(0.05)  # lets the phase thread queue its tasks
            tasks += state.poll(agent.agent_id, 8, 0.0)
        _submit(state, layout, tasks[2], agent.agent_id)
        _submit(state, layout, tasks[0], agent.agent_id)
        with pytest.raises(Rejected, match="closed while its result was arriving") as third:
            _submit(state, layout, tasks[1], agent.agent_id)
        assert third.value.code.name == "FAILED_PRECONDITION"
        with pytest.raises(Rejected, match="replay refused") as replay:  # an accepted result sent again
            _submit(state, layout, tasks[0], agent.agent_id)
        assert replay.value.code.name == "PERMISSION_DENIED"
    phase.join(10)
    (outcome,) = outcomes
    assert [r.client_id for r in outcome.results] == [0, 2] and outcome.missing == [1]


def test_a_result_sent_twice_at_once_counts_once_and_the_other_copy_is_a_replay() -> None:
    from fairfl.models import build_model
    from fairfl.params import ParamLayout
    from fairfl.protocol import UPDATE, ClientResult, encode_result

    state = FederationState()
    layout = ParamLayout.of(build_model("mlp", (4,), 3, hidden=(5,)))
    state.layout = layout
    agent = state.register("a", [0], "cpu")
    outcomes: list[Any] = []
    phase = threading.Thread(target=lambda: outcomes.append(GrpcTransport(state).execute([_task(0)], timeout=30.0)))
    phase.start()
    (task,) = state.poll(agent.agent_id, 8, 5.0)
    result = ClientResult(
        task.task_id, "r", 1, 0, federation_pb2.PHASE_TRAIN, num_samples=10, loss_before=1.0, loss_after=0.5
    )
    result.agent_id = agent.agent_id
    result.payloads[UPDATE] = torch.zeros(layout.numel)
    header, *data = list(encode_result(result, layout))

    def first_copy_gets_in_meanwhile() -> Any:
        state.accept(header.header, (c.data for c in data))
        yield from (c.data for c in data)

    with pytest.raises(Rejected, match="replay refused") as second:
        state.accept(header.header, first_copy_gets_in_meanwhile())
    assert second.value.code.name == "PERMISSION_DENIED" and second.value.cause == "replay"
    assert state.counters["accepted"] == 1 and state.counters["duplicate"] == 1
    phase.join(10)
    (outcome,) = outcomes
    assert [r.client_id for r in outcome.results] == [0]


def test_long_polls_beyond_the_limit_answer_at_once() -> None:
    state = FederationState(max_long_polls=1)
    first = state.register("a", [0], "cpu")
    second = state.register("b", [1], "cpu")
    waiting = threading.Thread(target=state.poll, args=(first.agent_id, 1, 2.0))
    waiting.start()
    for _ in range(200):
        if state.long_polls == 1:
            break
        time.sleep(0.005)
    started = time.monotonic()
    assert state.poll(second.agent_id, 1, 2.0) == []
    assert time.monotonic() - started < 0.5  # did not take a second worker for 2 s
    waiting.join()
    started = time.monotonic()
    assert state.poll(second.agent_id, 1, 0.3) == []
    assert time.monotonic() - started >= 0.25  # with the slot free again, it waits as asked


# -- launcher, agents, selector peer --------------------------------------------------------------------------------


def _child(tmp_path: Path, code: str) -> Any:
    import subprocess

    from fairfl.compose.launcher import Child

    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return Child("probe", process, tmp_path / "probe.log")


def test_launcher_reports_a_child_that_hangs_or_dies_before_announcing(tmp_path: Path) -> None:
    from fairfl.compose.launcher import _announced_ports

    hanging = _child(tmp_path, "import time; time.sleep(30)")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not announce its ports within 0\.5s"):
        _announced_ports(hanging, 0.5)
    assert time.monotonic() - started < 3.0
    hanging.process.kill()
    hanging.process.wait()
    dying = _child(tmp_path, "import sys; print('starting'); sys.exit(3)")
    with pytest.raises(RuntimeError, match="exited with code 3"):
        _announced_ports(dying, 10.0)
    talking = _child(
        tmp_path, "print('hello'); print('LISTENING 1234 METRICS 5678', flush=True); import time; time.sleep(5)"
    )
    assert _announced_ports(talking, 10.0) == (1234, 5678)
    talking.process.kill()
    talking.process.wait()


def test_drop_plan_is_deterministic_and_takes_the_configured_fraction() -> None:
    plan = DropPlan(0.3, seed=4)
    hosted = list(range(10, 30))
    rounds = [plan.dropped(hosted, r) for r in range(1, 6)]
    assert all(len(d) == 6 and d <= set(hosted) for d in rounds)
    assert len({frozenset(d) for d in rounds}) > 1  # a different set each round
    assert DropPlan(0.3, seed=4).dropped(hosted, 3) == rounds[2]
    with pytest.raises(ValueError, match="fault-drop-fraction"):
        DropPlan(1.0)


def test_selector_re_reports_signatures_to_a_restarted_clustering_service() -> None:
    from aggregator_service.peers import RemoteSelector
    from aggregator_service.selection import SelectionContext
    from clustering_service import StateStore, serve
    from fairfl import codec
    from fairfl.v1 import clustering_pb2

    first_store = StateStore()
    running = serve("127.0.0.1:0", first_store)
    port = running.port
    selector = RemoteSelector(f"127.0.0.1:{port}", "random", retry_s=20.0)
    try:
        signatures = [
            clustering_pb2.ClientSignature(
                client_id=c, round=1, num_samples=10, bias_update=codec.tensor_to_proto("b", np.ones(3) * c)
            )
            for c in range(4)
        ]
        selector.report_signatures(RUN, signatures)
        assert len(first_store.run(RUN)) == 4
        running.stop(grace=0)  # the service dies with its in-memory store
        second_store = StateStore()
        running = serve(f"127.0.0.1:{port}", second_store)
        context = SelectionContext(RUN, 2, [0, 1, 2, 3], 2, seed=1)
        assert len(selector.select(context).selected) == 2
        stored = second_store.run(RUN).signatures()
        assert sorted(stored) == [0, 1, 2, 3] and np.array_equal(stored[3].bias_update, np.ones(3) * 3)
        # A report that reaches a restarted store sends the whole cache along, not only the new signature.
        running.stop(grace=0)
        third_store = StateStore()
        running = serve(f"127.0.0.1:{port}", third_store)
        newer = clustering_pb2.ClientSignature(
            client_id=1, round=2, num_samples=10, bias_update=signatures[1].bias_update
        )
        selector.report_signatures(RUN, [newer])
        stored = third_store.run(RUN).signatures()
        assert sorted(stored) == [0, 1, 2, 3] and stored[1].round == 2
        # The cache survives an aggregator restart through the checkpoint, and is re-sent on first contact.
        clone = RemoteSelector(f"127.0.0.1:{port}", "random")
        text, tensors = encode_state(selector.state_dict())
        clone.load_state_dict(decode_state(text, tensors))
        assert sorted(c for _, c in clone.signatures) == [0, 1, 2, 3]
        running.stop(grace=0)
        fourth_store = StateStore()
        running = serve(f"127.0.0.1:{port}", fourth_store)
        clone.select(context)
        assert sorted(fourth_store.run(RUN).signatures()) == [0, 1, 2, 3]
        clone.close()
    finally:
        selector.close()
        running.stop(grace=0)


def test_checkpoint_duration_is_observed(tmp_path: Path) -> None:
    from fairfl import telemetry

    def count() -> float:
        return sum(
            s.value for m in telemetry.CHECKPOINT_DURATION.collect() for s in m.samples if s.name.endswith("_count")
        )

    before = count()
    config = _config(rounds=2)
    engine = _engine(config, [])
    engine.checkpointer = RunCheckpointer(run_directory(tmp_path, RUN), RUN, config)
    assert engine.run().state == control_pb2.RUN_STATE_COMPLETED
    assert count() - before == 2
    assert os.path.exists(run_directory(tmp_path, RUN) / checkpoint.CHECKPOINT_FILE)


def test_an_agent_sends_the_same_dp_release_for_a_task_sent_again() -> None:
    """A resumed round is re-run as authorised: its DP tasks come again, and must not draw fresh noise."""
    from aggregator_service.engine import initial_model, task_seed
    from client_agent.agent import Agent
    from client_agent.trainer import ClientRuntime
    from fairfl.data import load_run_data
    from fairfl.protocol import UPDATE

    config = _dp_config()
    _, params = initial_model(config)
    runtime = ClientRuntime(
        config, load_run_data(config), [0, 1], torch.device("cpu"), lambda ref: params, dp_randomness="secure"
    )
    agent = Agent("127.0.0.1:1", [0, 1], "cpu", dp_randomness="secure")  # never dials: no call is made
    engine = _engine(config, [])
    train = engine._round_train_config(1)
    task = federation_pb2.Task(
        task_id=f"{RUN}/r1/p0/c0",
        run_id=RUN,
        round=1,
        phase=federation_pb2.PHASE_TRAIN,
        client_id=0,
        seed=task_seed(config.seed, 1, 0),
        deadline_unix=time.time() + 60,
        train=train,
    )
    first = agent._result(runtime, task)
    again = federation_pb2.Task()
    again.CopyFrom(task)
    again.deadline_unix += 120  # re-sent after the restart, with a new deadline
    assert agent._result(runtime, again) is first
    fresh = runtime.run(task)  # what recomputing would have released: other noise (secure randomness)
    assert not torch.equal(fresh.payloads[UPDATE], first.payloads[UPDATE])
    other = federation_pb2.Task()
    other.CopyFrom(task)
    other.train.lr *= 2  # a different task for the same client is computed, not served from the cache
    assert agent._result(runtime, other) is not first
    later = federation_pb2.Task()
    later.CopyFrom(task)
    later.round, later.client_id, later.task_id = 2, 1, f"{RUN}/r2/p0/c1"
    agent._result(runtime, later)
    assert list(agent.released) == [1], "only the newest round can be sent again: older releases are dropped"
    agent.channel.close()


class _AnsweredCall:
    """A SubmitResult future that ends with `error` (None: accepted)."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.cancelled = False
        self.waited: float | None = None

    def result(self, timeout: float | None = None) -> object:
        self.waited = timeout
        if self.error is not None:
            raise self.error
        return object()

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_an_agent_survives_any_end_of_its_result_in_flight() -> None:
    import grpc

    from client_agent.agent import STOP_GRACE_S, Agent
    from client_agent.uploads import _Submission

    def submission(task_id: str, call: object | None, error: Exception | None = None) -> _Submission:
        sub = _Submission(task_id, "train", payload_bytes=0)
        if error is not None:
            sub.opened.set_exception(error)
        elif call is not None:
            sub.opened.set_result(call)  # type: ignore[arg-type]
        return sub

    agent = Agent("127.0.0.1:1", [0])
    try:
        agent.uploads._in_flight.append(submission("t/ok", _AnsweredCall(None)))
        agent.uploads.finish()
        assert agent.uploads.tasks_done == 1 and not agent.uploads._in_flight
        for error in (grpc.FutureCancelledError(), grpc.FutureTimeoutError()):
            call = _AnsweredCall(error)
            lost = submission("t/lost", call)
            agent.uploads._in_flight.append(lost)
            agent.uploads.finish(timeout=STOP_GRACE_S)  # no exception escapes: the agent keeps running
            assert call.cancelled and lost.abandoned and call.waited is not None and call.waited <= STOP_GRACE_S
            assert not agent.uploads._in_flight
        # Still encoding when the agent stops waiting (a short grace period): the call is then never opened.
        pending = submission("t/slow", None)
        agent.uploads._in_flight.append(pending)
        agent.uploads.finish(timeout=0.05)
        assert pending.abandoned and not agent.uploads._in_flight
        opened: list[object] = []
        agent.uploads.submit_async = lambda result, runtime: opened.append(result)  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="stopped before the result was sent"):
            agent.uploads._open(pending, object(), object())  # type: ignore[arg-type]
        assert opened == []
        # A payload the wire dtype cannot carry (float16 overflow) was never sent: counted failed, nothing raised.
        agent.uploads._in_flight.append(submission("t/f16", None, error=CodecError("overflow", reason="non_finite")))
        agent.uploads.finish()
        assert agent.uploads.tasks_done == 1
    finally:
        agent.channel.close()


def test_aggregator_refuses_fewer_than_one_thread(capsys: pytest.CaptureFixture[str]) -> None:
    from aggregator_service.server import main

    with pytest.raises(SystemExit) as ended:
        main(["--threads", "0", "--bind", "127.0.0.1:0"])
    assert ended.value.code == 2 and "--threads must be at least 1, got 0" in capsys.readouterr().err
