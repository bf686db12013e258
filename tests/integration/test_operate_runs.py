"""`fairfl runs list|status|watch|stop` against long-running services over mutual TLS.

An aggregator and its clustering service run as OS processes with certificates of one CA, an agent hosts the clients,
and `fairfl run --aggregator ADDR --tls-dir <operator>` starts a run too long to finish and watches it, as an operator
would. The `fairfl runs` commands, each its own process with the operator identity: `list` shows the run, `watch`
prints its rounds while it goes (the first line arrives long before the run ends), `status` reports its state, round,
fairness and model, `stop` ends it within seconds, after which `watch` exits 1 on the STOPPED status and the
`fairfl run` watcher writes results.json and rounds.csv for the completed rounds. An unknown run, an unreachable
aggregator, an agent's certificate and Ctrl-C during `watch` each end with one line and their exit code.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from aggregator_service.checkpoint import load, run_directory
from fairfl.compose.launcher import LocalCluster
from fairfl.tls import ROLE_AGENT
from tests.federation_support import REPO, start_aggregator

pytestmark = pytest.mark.integration

CONFIG = {
    "name": "operated",
    "seed": 3,
    "rounds": 100000,  # never completes: the test stops it
    "data": {"dataset": "synthetic", "num_clients": 4},
    "model": {"name": "mlp", "params": {"hidden": [8]}},
    "training": {"local_steps": 2, "batch_size": 16, "lr": 0.05},
    "selection": {"method": "random", "clients_per_round": 4},
    "evaluation": {"every": 1},
    # One of the 4 clients ignores each round's tasks (the agent's --fault-drop-fraction) and a round waits
    # round_timeout_s for it: a paced run that leaves the CPU to the commands under test.
    "runtime": {
        "agents": 1,
        "round_timeout_s": 1.0,
        "min_completion": 0.5,
        "max_failed_rounds": 100,  # a slow start on a loaded machine must not fail the run
        "register_timeout_s": 60,
        "device": "cpu",
    },
}
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FAIRFL_TLS_DIR", "FAIRFL_INSECURE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def spawn(*args: str | Path) -> subprocess.Popen[str]:
    """`fairfl ARGS` as its own process, its stdout and stderr piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "fairfl.compose", *map(str, args)],
        cwd=REPO,
        env=_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def ended(process: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a spawned command, once it has ended."""
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def fairfl(*args: str | Path, timeout: float = 30) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `fairfl ARGS`."""
    return ended(spawn(*args), timeout)


class Lines:
    """A child's stdout lines, each with the time it arrived."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: list[tuple[float, str]] = []
        self.new: queue.Queue[None] = queue.Queue()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            self.new.put(None)
        self.new.put(None)

    def wait_for(self, what: str, check: Callable[[list[str]], bool], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not check([text for _, text in self.lines]):
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {what} within {timeout:g}s: {self.lines[-5:]}"
            with contextlib.suppress(queue.Empty):
                self.new.get(timeout=remaining)

    def rounds(self) -> list[tuple[float, str]]:
        return [(t, text) for t, text in self.lines if text.startswith("round ")]


class LogLine:
    """When a line containing `text` appears in a log file (polled on a thread from now on)."""

    def __init__(self, path: Path, text: str) -> None:
        self.path, self.text = path, text
        self.seen_at: float | None = None
        self.start = path.stat().st_size
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        deadline = time.monotonic() + 60
        while self.seen_at is None and time.monotonic() < deadline:
            with self.path.open("rb") as fh:
                fh.seek(self.start)
                if self.text.encode() in fh.read():
                    self.seen_at = time.monotonic()
                    return
            time.sleep(0.02)


def _closed_port_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_operator_lists_watches_inspects_and_stops_a_run(tmp_path: Path) -> None:
    tls_dir, checkpoints, out = tmp_path / "tls", tmp_path / "checkpoints", tmp_path / "out"
    config_path = tmp_path / "operated.yaml"
    config_path.write_text(yaml.safe_dump(CONFIG))
    with LocalCluster(tmp_path / "logs", tls_dir=tls_dir) as cluster:
        aggregator = start_aggregator(cluster, args=["--checkpoint-dir", str(checkpoints)])
        address = aggregator.address
        operator = ["--aggregator", address, "--tls-dir", tls_dir / "operator"]
        assert (tls_dir / "operator" / "tls.key").is_file()  # the operator identity LocalCluster issued
        cluster.issue("intruder", ROLE_AGENT, [(0, 3)])
        closed = _closed_port_address()
        run = spawn("run", config_path, "--aggregator", address, "--tls-dir", tls_dir / "operator", "--output", out)
        # The failures, side by side with the agent's start: an unknown run, an unreachable aggregator, an agent's
        # certificate where the operator's belongs.
        failures = {
            "unknown": spawn("runs", "status", "no-such-run", *operator),
            "unreachable": spawn("runs", "list", "--aggregator", closed, "--tls-dir", tls_dir / "operator"),
            "intruder": spawn(
                "runs", "stop", "no-such-run", "--aggregator", address, "--tls-dir", tls_dir / "intruder"
            ),
        }
        cluster.start_agents(address, 4, 1, "cpu", 1, agent_args=["--fault-drop-fraction", "0.25"])
        failed = {name: ended(p) for name, p in failures.items()}
        watch = watch_json = None
        try:
            assert failed["unknown"] == (2, "", f"error: no run 'no-such-run' on {address}\n")
            code, stdout, stderr = failed["unreachable"]
            assert (code, stdout) == (1, "") and stderr.count("\n") == 1
            assert stderr.startswith(f"error: cannot reach the aggregator at {closed}")
            code, stdout, stderr = failed["intruder"]
            assert (code, stdout) == (2, "") and stderr.count("\n") == 1
            assert stderr.startswith(f"error: the aggregator at {address} refused this identity: ")
            assert "accepts only service identities" in stderr and "'intruder'" in stderr

            assert run.stdout is not None
            first = run.stdout.readline()
            match = re.match(r"FairFL run (\S+):", first)
            assert match, first + (run.stderr.read() if run.poll() is not None and run.stderr else "")
            run_id = match.group(1)
            threading.Thread(target=run.stdout.read, daemon=True).start()  # keep its pipe drained

            # list: the run is there (it may be waiting for StartRun, or for the agent)
            deadline = time.monotonic() + 30
            while True:
                code, stdout, stderr = fairfl("runs", "list", "--json", *operator)
                assert (code, stderr) == (0, "")
                runs = {r["run_id"]: r for r in json.loads(stdout)}
                if run_id in runs:
                    break
                assert time.monotonic() < deadline, stdout
                time.sleep(0.2)
            assert runs[run_id]["name"] == "operated" and runs[run_id]["strategy"] == "fedavg"
            assert runs[run_id]["total_rounds"] == 100000 and runs[run_id]["started_unix"] > 0
            assert runs[run_id]["state"] in ("RUN_STATE_PENDING", "RUN_STATE_RUNNING")

            # watch: rounds arrive while the run goes
            watch = spawn("runs", "watch", run_id, *operator)
            watch_json = spawn("runs", "watch", run_id, "--json", *operator)
            watched, watched_json = Lines(watch), Lines(watch_json)
            watched.wait_for("an evaluated round", lambda lines: any("| acc " in t for t in lines))

            table, status = spawn("runs", "list", *operator), spawn("runs", "status", run_id, *operator)
            code, stdout, stderr = ended(table)
            assert (code, stderr) == (0, "")
            header, *rows = stdout.splitlines()
            assert header.split() == ["RUN", "ID", "NAME", "STRATEGY", "STATE", "ROUND", "CLIENTS", "STARTED"]
            row = next(r.split() for r in rows if r.startswith(run_id))
            assert row[1:4] == ["operated", "fedavg", "RUNNING"] and row[4].endswith("/100000") and row[5] == "4"

            # status: state, round, latest fairness, model
            code, stdout, stderr = ended(status)
            assert (code, stderr) == (0, "")
            fields = dict(line.split(None, 1) for line in stdout.splitlines())
            assert fields["state"] == "RUNNING" and fields["name"] == "operated" and fields["strategy"] == "fedavg"
            done, total = map(int, fields["round"].split("/"))
            assert done >= 1 and total == 100000
            assert re.match(r"after round \d+: mean \d+\.\d\d%", fields["fairness"]), fields["fairness"]
            assert SHA256.match(fields["model"].removeprefix("sha256 ")), fields["model"]

            # Ctrl-C during watch: exit 130, one line, no traceback
            watched_json.wait_for("a JSON round event", lambda lines: any('"round": {' in t for t in lines))
            watch_json.send_signal(signal.SIGINT)
            assert watch_json.wait(10) == 130
            assert watch_json.stderr is not None
            stderr = watch_json.stderr.read()
            assert "Traceback" not in stderr and stderr.count("\n") <= 1, stderr
            events = [json.loads(text) for _, text in watched_json.lines]
            assert all(e["run_id"] == run_id for e in events)
            assert [e["status"]["state"] for e in events if "status" in e] == ["RUN_STATE_PENDING", "RUN_STATE_RUNNING"]
            assert [e["round"]["round"] for e in events if "round" in e][:1] == [1]

            # stop: ends the run promptly; watch sees the end and exits 1
            assert watch.poll() is None, "watch ended before the run did"
            requested = LogLine(aggregator.log_path, f"stop requested for run {run_id}: operator test")
            stop_at = time.monotonic()
            code, stdout, stderr = fairfl("runs", "stop", run_id, "--reason", "operator test", *operator)
            stop_took = time.monotonic() - stop_at
            assert (code, stderr) == (0, "")
            assert stdout.startswith(f"[stopped] run {run_id} ended after round ")
            assert stdout.rstrip().endswith("stopped on request: operator test")
            assert stop_took < 20, f"stop took {stop_took:.1f}s"  # the command's own start included
            assert watch.wait(10) == 1
            watched.thread.join(5)
            assert watch.stderr is not None and watch.stderr.read() == ""
            ended_round = int(re.findall(r"ended after round (\d+)/", stdout)[0])
            assert watched.lines[-1][1] == stdout.rstrip()
            # The run ended within seconds of the aggregator receiving StopRun (its round in progress abandoned).
            assert requested.seen_at is not None
            assert watched.lines[-1][0] - requested.seen_at < 3.0, watched.lines[-1][0] - requested.seen_at
            # The watch printed the rounds as they happened: the first before anyone asked the run (of 100000 rounds)
            # to stop, so while it was running.
            assert watched.rounds()[0][0] < stop_at
            rounds_seen = [int(text.split()[1].split("/")[0]) for _, text in watched.rounds()]
            assert rounds_seen == list(range(1, ended_round + 1))

            # The `fairfl run` watcher saw the end too, and wrote the results of the completed rounds.
            assert run.wait(30) in (0, 1)
            assert run.stderr is not None
            run_err = run.stderr.read()
            assert "Traceback" not in run_err, run_err

            status, table = (
                spawn("runs", "status", run_id, "--json", *operator),
                spawn("runs", "list", "--json", *operator),
            )
            after = json.loads(ended(status)[1])
            listed_after = {r["run_id"]: r for r in json.loads(ended(table)[1])}
        finally:
            for process in (run, watch, watch_json):
                if process is not None and process.poll() is None:
                    process.kill()
                    process.wait()

    results = json.loads((out / "results.json").read_text())
    assert results["run_id"] == run_id and results["state"] == "RUN_STATE_STOPPED"
    assert results["message"] == "stopped on request: operator test"
    assert results["rounds_completed"] == ended_round
    with (out / "rounds.csv").open() as fh:
        assert [int(r["round"]) for r in csv.DictReader(fh)] == list(range(1, ended_round + 1))
    assert results["final_model_sha256"] == after["model_sha256"]
    assert after["state"] == "RUN_STATE_STOPPED" and after["round"] == ended_round
    assert after["ended_unix"] >= after["started_unix"] > 0
    assert yaml.safe_load(after["experiment_yaml"])["name"] == "operated"
    assert listed_after[run_id]["state"] == "RUN_STATE_STOPPED" and listed_after[run_id]["experiment_yaml"] == ""
    # The aggregator's side: the run's checkpoint is marked final, at its last completed round.
    loaded = load(run_directory(checkpoints, run_id))
    assert loaded is not None and loaded.checkpoint.finished and loaded.checkpoint.final_state == "RUN_STATE_STOPPED"
    assert loaded.checkpoint.round == ended_round
