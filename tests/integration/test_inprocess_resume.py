"""Resuming an in-process run (`fairfl run --transport inprocess --resume`): a run stopped mid-way and resumed from its
checkpoint ends with the model, rounds and privacy spend of an uninterrupted run, bit for bit; Ctrl-C on the command
leaves it resumable; bad resumes are refused with a line naming what to change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from aggregator_service.checkpoint import CheckpointError, find_unfinished
from fairfl.compose.cli import run_inprocess
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.interrupt import Interrupts
from fairfl.compose.results import RunRecorder
from fairfl.compose.resume import find_resumable, resumable_run, run_lock, running_elsewhere, same_experiment
from fairfl.config import ExperimentConfig, experiment_from_dict
from fairfl.v1 import control_pb2

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration

BASE: dict[str, Any] = {
    "name": "resume",
    "seed": 3,
    "rounds": 7,
    "data": {"dataset": "synthetic", "num_clients": 6},
    "model": {"name": "mlp", "params": {"hidden": [16]}},
    "training": {"local_steps": 2, "batch_size": 16, "lr": 0.05},
    "selection": {"clients_per_round": 3},
    "evaluation": {"every": 2},
    "runtime": {"inprocess_workers": 2},
}
DP = {  # record-level DP: the ledger's spend must carry over the resume exactly
    "privacy": {
        "enabled": True,
        "epsilon": 50.0,
        "delta": 1e-5,
        "principal": "client",
        "sample_rate": 0.2,
        "noise_multiplier": 1.0,
        "clip_norm": 1.0,
    }
}


def config(checkpoints: Path, **changes: Any) -> ExperimentConfig:
    raw = {**BASE, **changes}
    raw["runtime"] = {**BASE["runtime"], "checkpoint_dir": str(checkpoints), **changes.get("runtime", {})}
    return experiment_from_dict(raw)


def in_round(
    monkeypatch: pytest.MonkeyPatch, round_number: int, action: Callable[[], None], phase: str = "train"
) -> None:
    """Call `action` once, as round `round_number`'s `phase` tasks (train, evaluate) are about to run. Training: after
    the round was authorised (and written to pending.pb), before any result, so a resume must replay it. Evaluation:
    after the round's aggregate changed the engine's state (model, strategy), before the round completed."""
    original = InProcessTransport.execute
    fired: list[bool] = []

    def execute(self: InProcessTransport, tasks: list[Any], *args: Any, **kwargs: Any) -> Any:
        if tasks and tasks[0].round == round_number and tasks[0].HasField(phase) and not fired:
            fired.append(True)
            action()
        return original(self, tasks, *args, **kwargs)

    monkeypatch.setattr(InProcessTransport, "execute", execute)


class Stopper(Interrupts):
    """The engine's stop as the first Ctrl-C sets it, without installing signal handlers."""

    def __init__(self) -> None:
        super().__init__()
        self.stop: Callable[[], None] = lambda: None

    def running(self, stop: Callable[[], None]) -> None:
        self.stop = stop

    def run_ended(self) -> None:
        pass


def run_to_end(cfg: ExperimentConfig, run_id: str, resume: Any = None) -> RunRecorder:
    recorder = RunRecorder(cfg, quiet=True)
    run_inprocess(cfg, recorder, run_id, resume=resume)
    assert recorder.status is not None and recorder.status.state == control_pb2.RUN_STATE_COMPLETED
    return recorder


def digest(recorder: RunRecorder) -> list[tuple[int, str, float, float]]:
    """Every round's model, ε and (evaluated rounds) mean client accuracy."""
    return [(r.round, r.model_sha256, r.epsilon_spent, r.fairness.mean) for r in recorder.rounds]


HICS = {"selection": {"method": "hics", "clients_per_round": 3, "params": {"temperature": 0.01}}}
MOMENTUM = {"strategy": {"name": "fedavg", "params": {"server_momentum": 0.9}}}  # cross-round strategy state


@pytest.mark.parametrize(
    ("extra", "privacy"),
    [({}, False), (DP, True), (HICS, False), (MOMENTUM, False)],
    ids=["fedavg", "record-level-dp", "hics-fl-sampler-state", "server-momentum"],
)
def test_a_stopped_run_resumes_to_the_uninterrupted_runs_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any], privacy: bool
) -> None:
    straight = run_to_end(config(tmp_path / "a", **extra), "straight")
    cfg = config(tmp_path / "b", **extra)
    stopper = Stopper()
    in_round(monkeypatch, 4, lambda: stopper.stop())
    first = RunRecorder(cfg, quiet=True)
    run_inprocess(cfg, first, "interrupted", interrupts=stopper)
    assert first.status is not None and first.status.state == control_pb2.RUN_STATE_STOPPED
    assert len(first.rounds) == 3
    monkeypatch.undo()

    loaded = resumable_run(cfg)
    assert loaded is not None and loaded.run_id == "interrupted" and loaded.origin == "inprocess"
    assert loaded.checkpoint.round == 3 and not loaded.checkpoint.finished  # the last completed round, unmarked
    assert [r.round for r in loaded.pending_rounds] == [4]  # authorised before the stop: replayed as authorised
    # Resumed with another worker count (how it runs, not what it computes): still the same experiment.
    resumed_cfg = config(tmp_path / "b", runtime={"inprocess_workers": 1}, **extra)
    second = run_to_end(resumed_cfg, "interrupted", resume=find_resumable(resumed_cfg))
    assert digest(second) == digest(straight)  # every round's model, ε and accuracy, earlier rounds included
    if privacy:
        assert second.rounds[-1].epsilon_spent > 0
    assert resumable_run(resumed_cfg) is None  # completed: nothing left to resume
    assert find_unfinished(tmp_path / "b", origin="inprocess", failed=True) == []


def test_a_failed_run_resumes_from_its_last_completed_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    straight = run_to_end(config(tmp_path / "a", **MOMENTUM), "straight")
    cfg = config(tmp_path / "b", **MOMENTUM)

    def fail() -> None:
        raise MemoryError("injected in round 4's evaluation")

    in_round(monkeypatch, 4, fail, phase="evaluate")  # the momentum already moved: that state must not be resumed
    first = RunRecorder(cfg, quiet=True)
    run_inprocess(cfg, first, "failed")
    assert first.status is not None and first.status.state == control_pb2.RUN_STATE_FAILED
    monkeypatch.undo()
    assert resumable_run(cfg, failed=False) is None  # a comparison re-runs a failed pair; `--resume` may go on
    loaded = find_resumable(cfg)
    assert loaded.checkpoint.finished and loaded.checkpoint.round == 3  # the disk's last round, not the failed one
    assert digest(run_to_end(cfg, "failed", resume=loaded)) == digest(straight)


def test_an_aggregator_never_resumes_an_in_process_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Their privacy gates keep the ledger in different places: either side resuming the other's checkpoint would
    lose the privacy spend so far."""
    from aggregator_service.runs import RunManager, RunStartError

    cfg = config(tmp_path, **DP)
    stopper = Stopper()
    in_round(monkeypatch, 3, lambda: stopper.stop())
    run_inprocess(cfg, RunRecorder(cfg, quiet=True), "local", interrupts=stopper)
    assert find_unfinished(tmp_path, origin="inprocess") and not find_unfinished(tmp_path)  # default: aggregator's
    manager = RunManager(lambda *a: pytest.fail("no engine may be made"), checkpoint_dir=str(tmp_path))
    with pytest.raises(RunStartError, match="written by an in-process run"):
        manager.start(cfg, "local")


def test_a_run_in_progress_holds_its_checkpoints(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    with run_lock(directory):
        assert running_elsewhere(tmp_path) == str(os.getpid())
        with pytest.raises(CheckpointError, match=f"is running in process {os.getpid()}"), run_lock(directory):
            pass
    assert running_elsewhere(tmp_path) is None


def test_resume_matches_the_experiment_not_the_execution(tmp_path: Path) -> None:
    a = config(tmp_path)
    assert same_experiment(a, config(tmp_path / "elsewhere", runtime={"inprocess_workers": 1}))
    assert not same_experiment(a, config(tmp_path, runtime={"threads_per_agent": 2}))  # kernels sum in another order
    assert not same_experiment(a, config(tmp_path, rounds=8))
    assert not same_experiment(a, config(tmp_path, runtime={"device": "cuda"}))


def write_experiment(directory: Path, **changes: Any) -> Path:
    raw = {**BASE, "rounds": 400, "evaluation": {"every": 1}, **changes}
    raw["runtime"] = {"inprocess_workers": 1, "checkpoint_dir": "checkpoints"}  # relative, as a user writes it
    path = directory / "exp.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def fairfl(directory: Path, *args: str, **popen: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "fairfl.compose", "run", "exp.yaml", "--transport", "inprocess", *args],
        cwd=directory,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **popen,
    )


def test_ctrl_c_then_resume_on_the_command_line(tmp_path: Path) -> None:
    write_experiment(tmp_path, rounds=60)
    straight = fairfl(tmp_path, "--output", "straight", "--set", "runtime.checkpoint_dir=straight-ckpt")
    assert straight.wait(timeout=300) == 0, straight.stderr.read() if straight.stderr else ""

    process = fairfl(tmp_path, "--output", "out", start_new_session=True)
    assert process.stdout is not None
    evaluated = 0
    for line in process.stdout:  # evaluation every round: one line per completed round
        evaluated += line.startswith("round ")
        if evaluated >= 5:
            break
    os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C goes to the whole group
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "the same command with --resume continues it" in out
    assert "Traceback" not in err
    interrupted = json.loads((tmp_path / "out" / "results.json").read_text())
    assert 5 <= interrupted["rounds_completed"] < 60

    resumed = fairfl(tmp_path, "--output", "out", "--resume")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert f"resuming after round {interrupted['rounds_completed']}" in out
    final = json.loads((tmp_path / "out" / "results.json").read_text())
    reference = json.loads((tmp_path / "straight" / "results.json").read_text())
    assert final["resumed_after_round"] == interrupted["rounds_completed"]
    assert final["rounds_completed"] == 60
    assert final["final_model_sha256"] == reference["final_model_sha256"]
    rounds_csv = (tmp_path / "out" / "rounds.csv").read_text().splitlines()
    assert rounds_csv[1:] and len(rounds_csv) - 1 == 60  # the earlier rounds are in the results too

    again = fairfl(tmp_path, "--resume")
    _, err = again.communicate(timeout=120)
    assert again.returncode == 2
    assert "no unfinished run of this experiment under runtime.checkpoint_dir 'checkpoints'" in err


@pytest.mark.parametrize(
    ("args", "changes", "expected"),
    [
        ((), {"runtime_dir": False}, "--resume needs the run's checkpoints: set runtime.checkpoint_dir"),
        (("--transport", "grpc"), {}, "--resume continues an in-process run (--transport inprocess)"),
    ],
)
def test_bad_resumes_are_refused_with_one_line(
    tmp_path: Path, args: tuple[str, ...], changes: dict[str, Any], expected: str
) -> None:
    path = write_experiment(tmp_path)
    if changes.get("runtime_dir") is False:
        raw = yaml.safe_load(path.read_text())
        raw["runtime"].pop("checkpoint_dir")
        path.write_text(yaml.safe_dump(raw))
    started = time.monotonic()
    process = fairfl(tmp_path, "--resume", *args)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 2 and expected in err and "Traceback" not in err
    assert time.monotonic() - started < 60
