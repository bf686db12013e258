"""Ctrl-C and SIGTERM on `fairfl run` (issue #20): the completed rounds' results are written, every child process is
stopped, the exit code is 130 and nothing prints a traceback; a second Ctrl-C forces its way out at once.

The command runs as a user runs it: `python -m fairfl.compose run exp.yaml --output out` from the experiment's
directory (relative paths), in its own process group, and the signal goes to that whole group as a terminal's Ctrl-C
does."""

from __future__ import annotations

import csv
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = {
    "name": "interrupt",
    "seed": 0,
    "rounds": 2000,  # far more than the test waits for: the signal always lands mid-run
    "data": {"dataset": "synthetic", "num_clients": 8},
    "model": {"name": "mlp", "params": {"hidden": [16]}},
    "training": {"local_steps": 3, "batch_size": 20, "lr": 0.05},
    "selection": {"clients_per_round": 3},
    "evaluation": {"every": 1},  # every round prints a line to wait for
    "runtime": {"agents": 2},
}
ROUNDS_BEFORE_SIGNAL = 3

pytestmark = pytest.mark.integration


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a live process, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "
    return fields[0], int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """pid → start time of every live descendant of `root` (from /proc: psutil is not installed)."""
    parents: dict[int, int] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))) is not None:
            parents[int(entry.name)] = stat[1]
            starts[int(entry.name)] = stat[2]
    found: dict[int, int] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = starts[pid]
                frontier.append(pid)
    return found


def still_running(processes: dict[int, int]) -> list[int]:
    """The recorded processes still alive (the same process: same start time; a zombie has ended)."""
    alive = []
    for pid, started in processes.items():
        stat = proc_stat(pid)
        if stat is not None and stat[2] == started and stat[0] not in ("Z", "X"):
            alive.append(pid)
    return alive


class Run:
    """`fairfl run` in its own process group, its stdout lines collected as they come."""

    def __init__(self, directory: Path, transport: str, extra: list[str] | None = None) -> None:
        (directory / "exp.yaml").write_text(yaml.safe_dump(EXPERIMENT))
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "fairfl.compose", "run", "exp.yaml", "--transport", transport, "--output", "out"]
        cmd += extra or []
        self.directory = directory
        self.process = subprocess.Popen(
            cmd,
            cwd=directory,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            process_group=0,  # a terminal's foreground job: the signal goes to the whole group
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stdout: list[str] = []
        assert self.process.stdout is not None
        threading.Thread(target=self._pump, args=(self.process.stdout,), daemon=True).start()

    def _pump(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.lines.put(line)
        self.lines.put("")

    def wait_for_rounds(self, count: int, timeout: float = 180.0) -> int:
        """Wait until `count` round lines were printed; the number seen."""
        deadline = time.monotonic() + timeout
        seen = 0
        while seen < count:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if not line:
                break
            self.stdout.append(line)
            if line.startswith("round "):
                seen += 1
            if time.monotonic() > deadline:
                break
        if seen < count:
            self.process.kill()
            _, err = self.process.communicate()
            pytest.fail(f"saw {seen} of {count} rounds; stdout:\n{''.join(self.stdout)}\nstderr:\n{err}")
        return seen

    def signal(self, signum: int) -> None:
        os.killpg(self.process.pid, signum)

    def finish(self, timeout: float = 90.0) -> tuple[int, str, str]:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            pytest.fail(f"fairfl run did not exit within {timeout:g}s of the signal")
        assert self.process.stderr is not None
        err = self.process.stderr.read()
        while (line := self.lines.get(timeout=10)) != "":
            self.stdout.append(line)
        return code, "".join(self.stdout), err


def assert_results_of_completed_rounds(out: Path, seen: int) -> dict[str, object]:
    results = json.loads((out / "results.json").read_text())
    rounds = list(csv.DictReader((out / "rounds.csv").open()))
    clients = list(csv.DictReader((out / "clients.csv").open()))
    completed = results["rounds_completed"]
    assert completed >= seen >= ROUNDS_BEFORE_SIGNAL
    assert completed < EXPERIMENT["rounds"]
    assert [int(r["round"]) for r in rounds] == list(range(1, completed + 1))  # every completed round, only those
    assert len(results["rounds"]) == completed  # every round was evaluated
    assert {int(c["round"]) for c in clients} == set(range(1, completed + 1))
    assert len(clients) == completed * EXPERIMENT["data"]["num_clients"]  # type: ignore[index]
    assert results["final_round"] == completed
    return results


@pytest.mark.parametrize(
    ("transport", "signum"),
    [("inprocess", signal.SIGINT), ("inprocess", signal.SIGTERM), ("grpc", signal.SIGINT), ("grpc", signal.SIGTERM)],
    ids=["inprocess-SIGINT", "inprocess-SIGTERM", "grpc-SIGINT", "grpc-SIGTERM"],
)
def test_a_signal_writes_the_completed_rounds_and_stops_everything(
    tmp_path: Path, transport: str, signum: signal.Signals
) -> None:
    run = Run(tmp_path, transport)
    seen = run.wait_for_rounds(ROUNDS_BEFORE_SIGNAL)
    children = descendants(run.process.pid)
    if transport == "grpc":
        assert len(children) >= 5  # privacy, clustering, aggregator and two agents
    run.signal(signum)
    code, out, err = run.finish()

    assert code == 130, out + err
    assert "Traceback" not in err and "Traceback" not in out
    name = signal.Signals(signum).name
    assert f"{name}: stopping the run" in err
    assert f"{name}: interrupted after" in out and "results in out/" in out
    assert not still_running(children), f"left running: {still_running(children)}"

    results = assert_results_of_completed_rounds(tmp_path / "out", seen)
    assert results["state"] == "RUN_STATE_STOPPED"
    assert results["interrupted"] == {"signal": name, "forced": False}
    for png in ("accuracy.png", "variance.png", "worst5.png"):
        assert (tmp_path / "out" / png).stat().st_size > 0
    if transport == "grpc":  # the children stopped on SIGTERM, quietly
        logs = sorted((tmp_path / "out" / "logs").glob("*.log"))
        assert len(logs) == 5
        for log in logs:
            assert "Traceback" not in log.read_text(), log


def test_a_second_ctrl_c_forces_at_once(tmp_path: Path) -> None:
    run = Run(tmp_path, "grpc")
    seen = run.wait_for_rounds(ROUNDS_BEFORE_SIGNAL)
    children = descendants(run.process.pid)
    run.signal(signal.SIGINT)
    time.sleep(0.05)
    run.signal(signal.SIGINT)
    forced_at = time.monotonic()
    code, out, err = run.finish(timeout=30)

    assert code == 130, out + err
    assert time.monotonic() - forced_at < 15  # at once: no waiting for the run, no grace periods
    assert "Traceback" not in err and "Traceback" not in out
    assert "SIGINT again: forced exit" in err
    assert not still_running(children), f"left running: {still_running(children)}"
    results = assert_results_of_completed_rounds(tmp_path / "out", seen)
    assert results["interrupted"]["forced"] is True  # type: ignore[index]


def test_against_a_running_aggregator_the_run_is_stopped_there_and_its_rounds_written(tmp_path: Path) -> None:
    """`fairfl run --aggregator`: the first Ctrl-C sends StopRun and follows the run to its end; the deployment's
    processes are not this command's and keep running."""
    from fairfl.compose.launcher import LocalCluster
    from fairfl.v1 import control_pb2, control_pb2_grpc

    with LocalCluster(tmp_path / "deployment", tls=False) as cluster:
        aggregator, _, _ = cluster.start_services(tmp_path / "deployment")
        cluster.start_agents(aggregator.address, 8, 2, "cpu", 1)
        run = Run(tmp_path, "grpc", ["--aggregator", aggregator.address, "--insecure"])
        seen = run.wait_for_rounds(ROUNDS_BEFORE_SIGNAL)
        run.signal(signal.SIGINT)
        code, out, err = run.finish()

        assert code == 130, out + err
        assert "Traceback" not in err and "Traceback" not in out
        results = assert_results_of_completed_rounds(tmp_path / "out", seen)
        assert results["state"] == "RUN_STATE_STOPPED"
        assert all(child.process.poll() is None for child in cluster.children)  # not this command's to stop
        with cluster.open_channel(aggregator.address) as channel:
            status = control_pb2_grpc.RunControlStub(channel).GetRun(
                control_pb2.GetRunRequest(run_id=results["run_id"]), timeout=10
            )
        assert status.state == control_pb2.RUN_STATE_STOPPED
