"""The checkpoint writer off the round's critical path (aggregator_service/checkpoint.py, docs/reliability.md): a
round's checkpoint is written by a writer thread while the next round runs, its event is reported only once it is on
disk, and a process death while a write is in flight re-runs the unsaved round and the next one as authorised."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import torch

from aggregator_service import checkpoint
from aggregator_service.checkpoint import RunCheckpointer, run_directory
from fairfl import codec
from fairfl.config import ExperimentConfig
from fairfl.v1 import control_pb2, federation_pb2
from privacy_service.ledger import SqliteLedger
from tests.unit.test_reliability import RUN, _config, _engine, _rounds

REPO = Path(__file__).resolve().parents[2]


def crash_config() -> ExperimentConfig:
    """DP-FedFair over 4 of 8 clients a round: the selection and its population are what the ledger records."""
    return _config(
        rounds=6,
        strategy={"name": "fedfair", "params": {"fair_lambda": 0.5}},
        selection={"method": "random", "clients_per_round": 4},
        privacy={"enabled": True, "epsilon": 50.0, "sample_rate": 0.2, "noise_multiplier": 1.0, "clip_norm": 1.0},
    )


def _hold_round(checkpointer: RunCheckpointer, round_number: int, gate: threading.Event) -> list[int]:
    """Make the writer wait for `gate` before it replaces the checkpoint of `round_number`; the rounds it saved."""
    save = checkpointer._save
    saved: list[int] = []

    def held(number: int, *args: Any, **kwargs: Any) -> None:
        if number == round_number:
            assert gate.wait(60), "the held write was never released"
        save(number, *args, **kwargs)
        saved.append(number)

    checkpointer._save = held  # type: ignore[method-assign]
    return saved


def test_a_held_write_delays_its_rounds_report_but_not_the_next_rounds_tasks(tmp_path: Path) -> None:
    config = _config(rounds=4)
    reference = _engine(config, []).run()
    directory = run_directory(tmp_path, RUN)
    events: list[control_pb2.RunEvent] = []
    on_disk: list[tuple[int, int]] = []  # (reported round, the checkpoint's round when it was reported)

    def report(event: control_pb2.RunEvent) -> None:
        if event.HasField("round"):
            loaded = checkpoint.load(directory)
            assert loaded is not None
            on_disk.append((event.round.round, loaded.checkpoint.round))
        events.append(event)

    engine = _engine(config, [])
    engine.on_event = report
    engine.checkpointer = RunCheckpointer(directory, RUN, config)
    engine.checkpointer.start_fresh(engine)
    gate = threading.Event()
    saved = _hold_round(engine.checkpointer, 2, gate)
    seen: dict[str, Any] = {}
    execute = engine.transport.execute

    def dispatch(tasks: list[federation_pb2.Task], timeout: float, *args: Any, **kwargs: Any) -> Any:
        if tasks[0].round == 3 and "reported" not in seen:  # round 3's first tasks leave while round 2 is unsaved
            seen["reported"] = [r.round for r in _rounds(events)]
            seen["loaded"] = checkpoint.load(directory)
            gate.set()
        return execute(tasks, timeout, *args, **kwargs)

    engine.transport.execute = dispatch  # type: ignore[method-assign]
    summary = engine.run()
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    assert seen["reported"] == [1], "round 2 was reported before its checkpoint was on disk"
    loaded = seen["loaded"]
    assert loaded.checkpoint.round == 1 and [r.round for r in loaded.rounds] == [1]  # round 2's event not covered
    assert [r.round for r in loaded.pending_rounds] == [2, 3]  # both authorised rounds kept for a resume
    assert saved == [1, 2, 3, 4, 4]  # each round once, then the end marker
    assert on_disk == [(1, 1), (2, 2), (3, 3), (4, 4)], "every round is reported after its checkpoint, in order"
    assert [e.status.state for e in events if e.HasField("status")][-1] == control_pb2.RUN_STATE_COMPLETED
    assert events[-1].HasField("status"), "the end is reported after every round"
    final = checkpoint.load(directory)
    assert final is not None and final.checkpoint.finished and final.checkpoint.round == 4
    assert torch.equal(summary.final_params, reference.final_params)
    assert (directory / "model.safetensors").exists()


def test_a_failed_write_fails_the_run_and_its_round_is_never_reported(tmp_path: Path) -> None:
    config = _config(rounds=5)
    events: list[control_pb2.RunEvent] = []
    engine = _engine(config, events)
    engine.checkpointer = RunCheckpointer(run_directory(tmp_path, RUN), RUN, config)
    engine.checkpointer.start_fresh(engine)
    save = engine.checkpointer._save

    def failing(number: int, *args: Any, **kwargs: Any) -> None:
        if number == 2:
            raise OSError("disk full")
        save(number, *args, **kwargs)

    engine.checkpointer._save = failing  # type: ignore[method-assign]
    summary = engine.run()
    assert summary.state == control_pb2.RUN_STATE_FAILED and "disk full" in summary.message
    assert [r.round for r in _rounds(events)] == [1]
    # The run ends where its checkpoint on disk is (round 1, the last round reported), marked final, with its model.
    assert summary.rounds_completed == 1
    status = events[-1].status
    assert status.state == control_pb2.RUN_STATE_FAILED and status.message == "OSError: disk full"
    final = checkpoint.load(run_directory(tmp_path, RUN))
    assert final is not None and final.checkpoint.finished and final.checkpoint.round == 1
    assert final.checkpoint.final_message == "OSError: disk full"
    assert torch.equal(summary.final_params, codec.tensor_from_proto(final.checkpoint.model).reshape(-1))
    assert (run_directory(tmp_path, RUN) / "model.safetensors").exists()


_CRASHING_RUN = textwrap.dedent(
    """
    import os, sys, threading
    from pathlib import Path
    from aggregator_service.checkpoint import RunCheckpointer
    from privacy_service.ledger import SqliteLedger
    from tests.unit.test_checkpoint_writer import crash_config
    from tests.unit.test_reliability import RUN, _engine

    directory, ledger = Path(sys.argv[1]), sys.argv[2]
    config = crash_config()
    engine = _engine(config, [])
    engine.privacy.ledger = SqliteLedger(ledger)  # on disk: it outlives this process, as the privacy service's
    engine.checkpointer = RunCheckpointer(directory, RUN, config)
    engine.checkpointer.start_fresh(engine)
    save = engine.checkpointer._save

    def never(number, *args, **kwargs):
        if number == 3:
            threading.Event().wait()  # round 3's checkpoint is still being written when the process dies
        save(number, *args, **kwargs)

    engine.checkpointer._save = never
    execute = engine.transport.execute

    def dying(tasks, timeout, *args, **kwargs):
        if tasks[0].round == 4:  # round 4 authorised (ledger and pending.pb), its tasks about to leave
            os._exit(17)
        return execute(tasks, timeout, *args, **kwargs)

    engine.transport.execute = dying
    engine.run()
    """
)


def test_a_process_killed_while_a_write_is_in_flight_resumes_to_the_uninterrupted_model(tmp_path: Path) -> None:
    config = crash_config()
    reference_events: list[control_pb2.RunEvent] = []
    reference_engine = _engine(config, reference_events)
    reference = reference_engine.run()
    assert reference.state == control_pb2.RUN_STATE_COMPLETED, reference.message

    directory, ledger_path = run_directory(tmp_path, RUN), tmp_path / "ledger.sqlite"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    died = subprocess.run(
        [sys.executable, "-c", _CRASHING_RUN, str(directory), str(ledger_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert died.returncode == 17, died.stderr[-3000:]
    loaded = checkpoint.load(directory)
    assert loaded is not None and not loaded.checkpoint.finished
    assert loaded.checkpoint.round == 2, "round 3's checkpoint was in flight: the last one on disk is round 2's"
    assert [r.round for r in loaded.pending_rounds] == [3, 4]
    reference_rounds = _rounds(reference_events)
    assert [list(r.selected) for r in loaded.pending_rounds] == [list(reference_rounds[i].selected) for i in (2, 3)]

    def recorded(ledger: SqliteLedger) -> list[tuple[Any, ...]]:
        return [tuple(e)[:6] for e in ledger.events(RUN)]  # without the time of recording

    assert {row[0] for row in recorded(SqliteLedger(str(ledger_path)))} == {1, 2, 3, 4}

    resumed_events: list[control_pb2.RunEvent] = []
    resumed = _engine(config, resumed_events)
    resumed.privacy.ledger = SqliteLedger(str(ledger_path))
    resumed.checkpointer = RunCheckpointer(directory, RUN, config)
    resumed.checkpointer.restore(resumed, loaded)
    assert resumed.replay == {r.round: (list(r.selected), r.population) for r in loaded.pending_rounds}
    summary = resumed.run()
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    assert torch.equal(summary.final_params, reference.final_params)
    assert [r.round for r in _rounds(resumed_events)] == [3, 4, 5, 6]
    final = checkpoint.load(directory)
    assert final is not None and final.checkpoint.finished
    assert [r.model_sha256 for r in final.rounds] == [r.model_sha256 for r in reference_rounds]
    assert [r.epsilon_spent for r in final.rounds] == [r.epsilon_spent for r in reference_rounds]
    # The ledger on disk holds every round once, with the uninterrupted run's events: rounds 3 and 4 were
    # re-authorised identically (a different selection would have been refused as a RoundConflict).
    assert recorded(resumed.privacy.ledger) == recorded(reference_engine.privacy.ledger)


def test_pending_log_reads_an_older_aggregators_record_and_skips_a_torn_one(tmp_path: Path) -> None:
    config = _config(rounds=3)
    directory = run_directory(tmp_path, RUN)
    engine = _engine(config, [])
    engine.checkpointer = RunCheckpointer(directory, RUN, config)
    engine.checkpointer.start_fresh(engine)  # the checkpoint of round 0
    legacy = checkpoint.checkpoint_pb2.PendingRound(run_id=RUN, round=1, selected=[1, 4], population=8)
    (directory / checkpoint.PENDING_FILE).write_bytes(legacy.SerializeToString())
    loaded = checkpoint.load(directory)
    assert loaded is not None and loaded.pending == legacy and len(loaded.pending_rounds) == 1

    writer = RunCheckpointer(directory, RUN, config)
    writer.planned(1, [0, 2], 8)  # replaces the old file with the log
    writer.planned(2, [3, 5], 8)
    writer.close()
    with open(directory / checkpoint.PENDING_FILE, "ab") as log:  # a crash mid-append of round 3's record
        log.write(b"\x09\x00\x00\x00\x00\x00\x00\x00\x0a\x03")
    loaded = checkpoint.load(directory)
    assert loaded is not None
    assert [(r.round, list(r.selected)) for r in loaded.pending_rounds] == [(1, [0, 2]), (2, [3, 5])]
