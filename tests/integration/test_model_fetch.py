"""Models you keep (issue #20), end to end through the `fairfl` command line against long-running services.

Real aggregator, privacy, clustering and agent processes talk mutual TLS (LocalCluster's CA); the aggregator writes
checkpoints. The operator, with its `operator` identity:

- runs a short experiment with `fairfl run --aggregator ... --tls-dir` (a subprocess), which leaves model.safetensors
  beside results.json (fetched with RunControl.FetchModel before the command ends);
- fetches the same run's model with `fairfl model fetch RUN --out FILE` (a subprocess);
- exports it from the aggregator's checkpoint with `fairfl model export RUN_DIR --out FILE`.

Every one of those files, and the one the aggregator itself left in the run's directory, reproduces the run's
final_model_sha256 and loads into the run's model (the two documented lines, and build_model_from_file) giving the same
outputs. Beside them, `fairfl run --transport inprocess` (a subprocess) writes a model.safetensors that matches its
results.json, and bad input (an unknown run, no TLS material, no aggregator, no or a corrupt checkpoint) ends in one
line on stderr and exit 1 or 2. Those last commands run in this process, against the same services, to keep the test
short: importing torch in a fresh interpreter is most of a command's time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fairfl.compose.launcher import LocalCluster
from fairfl.config import experiment_from_dict
from fairfl.model_file import build_model_from_file, flat_from_tensors, load_model_file, model_sha256
from fairfl.models import build_run_model

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FAIRFL = [sys.executable, "-m", "fairfl.compose"]
TIMEOUT_S = 120
NUM_CLIENTS = 6
EXPERIMENT: dict[str, Any] = {
    "name": "keep-model",
    "seed": 8,
    "rounds": 2,
    "data": {"dataset": "synthetic", "num_clients": NUM_CLIENTS},
    "model": {"name": "mlp", "params": {"hidden": [16]}},
    "training": {"local_steps": 2, "batch_size": 10, "lr": 0.1},
    "selection": {"clients_per_round": 3},
    "evaluation": {"every": 1},
    "runtime": {"agents": 2, "device": "cpu", "round_timeout_s": 60, "register_timeout_s": 60},
}


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "FAIRFL_AGGREGATOR_ADDRESS", "FAIRFL_TLS_DIR", "FAIRFL_INSECURE")
    }
    env["PYTHONPATH"] = str(REPO)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*FAIRFL, *args], cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@dataclass
class Done:
    code: int
    stdout: str
    stderr: str


def _wait(process: subprocess.Popen[str]) -> Done:
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    return Done(process.returncode, stdout, stderr)


def _ok(done: Done) -> Done:
    assert done.code == 0, f"exit {done.code}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@dataclass
class Session:
    tmp: Path
    aggregator: str  # address of the running aggregator
    operator: list[str]  # the options that dial it as the operator
    results: dict[str, Any]  # the run over gRPC
    run_dir: Path  # the aggregator's directory of the run
    fetched: Done  # `fairfl model fetch` of the run, as a subprocess
    inprocess: Path  # output directory of the in-process run

    @property
    def run_id(self) -> str:
        return str(self.results["run_id"])


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    tmp = tmp_path_factory.mktemp("model-fetch")
    config = tmp / "experiment.yaml"
    config.write_text(yaml.safe_dump(EXPERIMENT))
    # In the meantime, the same experiment in one process.
    inprocess = _start(["run", str(config), "--transport", "inprocess", "--output", str(tmp / "inprocess")], tmp)
    checkpoints = tmp / "checkpoints"
    with pytest.MonkeyPatch.context() as mp, LocalCluster(tmp / "logs", tls=True, tls_dir=tmp / "tls") as cluster:
        mp.chdir(REPO)
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
        aggregator, _, _ = cluster.start_services(tmp, ["--checkpoint-dir", str(checkpoints)])
        cluster.start_agents(aggregator.address, NUM_CLIENTS, 2, "cpu", 1)
        mp.undo()
        operator = ["--aggregator", aggregator.address, "--tls-dir", str(tmp / "tls" / "operator")]
        run = _ok(_wait(_start(["run", str(config), *operator, "--output", str(tmp / "grpc")], tmp)))
        results = json.loads((tmp / "grpc" / "results.json").read_text())
        assert results["state"] == "RUN_STATE_COMPLETED", run.stdout[-2000:]
        fetch = ["model", "fetch", results["run_id"], "--out", str(tmp / "fetched.safetensors"), *operator]
        fetched = _wait(_start(fetch, tmp))
        _ok(_wait(inprocess))
        yield Session(
            tmp, aggregator.address, operator, results, checkpoints / results["run_id"], fetched, tmp / "inprocess"
        )
        for child in list(cluster.children):  # nothing of theirs is under test now: no graceful exit to wait for
            cluster.kill(child.name)


def _fairfl(args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Done:
    """`fairfl ARGS` in this process (the subprocesses above show the commands' own processes work)."""
    from fairfl.compose.cli import main

    for name in ("FAIRFL_AGGREGATOR_ADDRESS", "FAIRFL_TLS_DIR", "FAIRFL_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    capsys.readouterr()
    code = main(args)
    out = capsys.readouterr()
    return Done(code, out.out, out.err)


def _loads_into_the_runs_model(path: Path, reference: Path) -> None:
    """The file loads with the documented two lines into the run's model, and rebuilt from its metadata, both giving
    the outputs of the model in `reference` (another copy of the same run's model)."""
    config = experiment_from_dict(EXPERIMENT)
    model = build_run_model(config)
    model.load_state_dict(load_file(path))
    other = build_run_model(config)
    other.load_state_dict(load_file(reference))
    x = torch.randn(5, 60)
    assert torch.equal(model(x), other(x))
    assert torch.equal(build_model_from_file(path)(x), other(x))


def test_fairfl_run_against_running_services_writes_the_final_model(session: Session) -> None:
    final = session.results["final_model_sha256"]
    assert final and session.results["rounds_completed"] == 2
    tensors, metadata = load_model_file(session.tmp / "grpc" / "model.safetensors")
    assert model_sha256(flat_from_tensors(tensors, metadata.tensor_order)) == metadata.sha256 == final
    assert (metadata.run_id, metadata.round, metadata.model_name) == (session.results["run_id"], 2, "mlp")
    # The aggregator left the same model in the run's directory, beside its checkpoint.
    _, kept = load_model_file(session.run_dir / "model.safetensors")
    assert kept.sha256 == final


def test_model_fetch_writes_the_runs_final_model(session: Session) -> None:
    done = _ok(session.fetched)
    assert f"sha256 {session.results['final_model_sha256']}" in done.stdout
    tensors, metadata = load_model_file(session.tmp / "fetched.safetensors")
    assert model_sha256(flat_from_tensors(tensors, metadata.tensor_order)) == session.results["final_model_sha256"]
    assert metadata.round == 2 and metadata.run_id == session.results["run_id"]
    assert metadata.model_params == {"hidden": [16]}  # from the config GetRun sends
    _loads_into_the_runs_model(session.tmp / "fetched.safetensors", session.tmp / "grpc" / "model.safetensors")


def test_model_export_from_the_checkpoint_gives_the_same_tensors(
    session: Session, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = session.tmp / "exported.safetensors"
    _ok(_fairfl(["model", "export", str(session.run_dir), "--out", str(out)], capsys, monkeypatch))
    fetched, _ = load_model_file(session.tmp / "fetched.safetensors")
    exported, metadata = load_model_file(out)
    assert metadata.sha256 == session.results["final_model_sha256"] and metadata.round == 2
    assert sorted(exported) == sorted(fetched)
    assert all(torch.equal(exported[name], fetched[name]) for name in fetched)
    _loads_into_the_runs_model(out, session.tmp / "fetched.safetensors")


def test_fairfl_run_in_process_writes_the_model_its_results_name(session: Session) -> None:
    results = json.loads((session.inprocess / "results.json").read_text())
    assert results["state"] == "RUN_STATE_COMPLETED"
    _, metadata = load_model_file(session.inprocess / "model.safetensors")
    assert metadata.sha256 == results["final_model_sha256"] and metadata.round == 2
    _loads_into_the_runs_model(session.inprocess / "model.safetensors", session.inprocess / "model.safetensors")


@pytest.mark.parametrize(
    ("case", "code", "says"),
    [
        ("unknown run", 2, "no run 'no-such-run'"),
        ("no identity", 2, "--tls-dir"),
        ("no aggregator", 1, "cannot reach the aggregator at 127.0.0.1:9"),
        ("no checkpoint", 2, "holds no checkpoint.pb"),
        ("corrupt checkpoint", 2, "not a checkpoint"),
    ],
)
def test_bad_input_is_one_line_and_an_exit_code(
    session: Session,
    case: str,
    code: int,
    says: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = ["--out", str(tmp_path / "x.safetensors")]
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "checkpoint.pb").write_bytes(b"\xff\xff not a checkpoint")
    args = {
        "unknown run": ["model", "fetch", "no-such-run", *out, *session.operator],
        "no identity": ["model", "fetch", session.run_id, *out, "--aggregator", session.aggregator],
        "no aggregator": ["model", "fetch", session.run_id, *out, "--insecure", "--aggregator", "127.0.0.1:9"],
        "no checkpoint": ["model", "export", str(session.tmp / "logs"), *out],
        "corrupt checkpoint": ["model", "export", str(tmp_path / "broken"), *out],
    }[case]
    done = _fairfl(args, capsys, monkeypatch)
    assert done.code == code, done.stderr
    assert says in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert not (tmp_path / "x.safetensors").exists()
