"""`fairfl runs list|status|watch|stop` and ListRuns against a RunControl server in this process (plaintext), with an
engine the test moves round by round: the fields the manager fills in, the output, and the exit codes."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import yaml

from aggregator_service.runs import RunControlServicer, RunManager
from fairfl.compose import operate
from fairfl.compose.cli import main
from fairfl.config import ExperimentConfig, experiment_from_dict
from fairfl.v1 import control_pb2, control_pb2_grpc

ROUNDS = 4


class SteppedEngine:
    """Emits RUNNING, then one round each time the test releases it (evaluated on even rounds), then COMPLETED; a
    stop ends it between rounds with the engine's own STOPPED message."""

    def __init__(self, run_id: str, config: ExperimentConfig, on_event, stop: threading.Event) -> None:
        self.run_id, self.config, self.on_event, self.stop = run_id, config, on_event, stop
        self.gate = threading.Semaphore(0)

    def _status(self, state: int, message: str = "", round_number: int = 0) -> None:
        status = control_pb2.RunStatus(
            run_id=self.run_id,
            state=state,
            round=round_number,
            total_rounds=self.config.rounds,
            message=message,
            registered_clients=4,
        )
        self.on_event(control_pb2.RunEvent(run_id=self.run_id, status=status))

    def run(self) -> None:
        self._status(control_pb2.RUN_STATE_RUNNING)
        for r in range(1, self.config.rounds + 1):
            while not self.gate.acquire(timeout=0.02):
                if self.stop.is_set():  # like the engine: the round in progress (r) is reported, not completed
                    self._status(control_pb2.RUN_STATE_STOPPED, "stopped on request", r)
                    return
            event = control_pb2.RoundEvent(
                round=r,
                selected=[0, 1, 2],
                results_accepted=3,
                mean_train_loss=1.0 / r,
                duration_seconds=0.01,
                model_sha256=f"{r:064x}",
            )
            if r % 2 == 0:
                event.evaluated = True
                event.fairness.mean = 50.0 + r
                event.fairness.variance = 10.0 / r
                event.fairness.worst_5 = 40.0 + r
                event.fairness.evaluated_clients = 4
            self.on_event(control_pb2.RunEvent(run_id=self.run_id, round=event))
        self._status(control_pb2.RUN_STATE_COMPLETED, f"completed {self.config.rounds} rounds", self.config.rounds)


class Server:
    def __init__(self) -> None:
        self.engines: dict[str, SteppedEngine] = {}
        self.manager = RunManager(self._engine)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        control_pb2_grpc.add_RunControlServicer_to_server(RunControlServicer(self.manager), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _engine(self, run_id, config, on_event, stop) -> SteppedEngine:
        self.engines[run_id] = SteppedEngine(run_id, config, on_event, stop)
        return self.engines[run_id]

    def start(self, run_id: str, name: str, strategy: str = "fedavg") -> SteppedEngine:
        config = experiment_from_dict({"name": name, "rounds": ROUNDS, "strategy": {"name": strategy}})
        self.manager.start(config, run_id)
        return self.engines[run_id]

    def wait(self, run_id: str, predicate, timeout: float = 5.0) -> control_pb2.RunStatus:
        deadline = time.monotonic() + timeout
        while not predicate(status := self.manager.status(run_id)):
            assert time.monotonic() < deadline, f"run {run_id}: {status}"
            time.sleep(0.01)
        return status


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    for engine in s.engines.values():
        engine.stop.set()
    s.server.stop(None)


def cli(capsys: pytest.CaptureFixture[str], server: Server, *args: str) -> tuple[int, str, str]:
    code = main(["runs", *args, "--aggregator", server.address, "--insecure"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def finish(server: Server, run_id: str) -> control_pb2.RunStatus:
    for _ in range(ROUNDS):
        server.engines[run_id].gate.release()
    return server.wait(run_id, lambda s: s.state == control_pb2.RUN_STATE_COMPLETED)


def test_list_runs_fills_the_new_fields_newest_first(server: Server) -> None:
    before = time.time()
    server.start("first", "alpha", "fedavg")
    finish(server, "first")
    time.sleep(0.01)
    server.start("second", "beta", "qffl")
    server.engines["second"].gate.release()
    server.wait("second", lambda s: s.round == 1)
    with grpc.insecure_channel(server.address) as channel:
        control = control_pb2_grpc.RunControlStub(channel)
        runs = control.ListRuns(control_pb2.ListRunsRequest(), timeout=5).runs
        got = control.GetRun(control_pb2.GetRunRequest(run_id="first"), timeout=5)
    assert [s.run_id for s in runs] == ["second", "first"]
    second, first = runs
    assert (first.name, first.strategy, first.state) == ("alpha", "fedavg", control_pb2.RUN_STATE_COMPLETED)
    assert (second.name, second.strategy, second.state) == ("beta", "qffl", control_pb2.RUN_STATE_RUNNING)
    assert before <= first.started_unix <= first.ended_unix <= second.started_unix <= time.time()
    assert second.ended_unix == 0 and second.round == 1 and second.total_rounds == ROUNDS
    assert first.model_sha256 == f"{ROUNDS:064x}" and second.model_sha256 == f"{1:064x}"
    assert first.experiment_yaml == "" and second.experiment_yaml == ""  # the config only on GetRun
    assert yaml.safe_load(got.experiment_yaml)["name"] == "alpha"
    assert got.ended_unix == first.ended_unix and got.model_sha256 == first.model_sha256


def test_a_stopped_run_reports_its_last_completed_round_end_time_and_reason(server: Server) -> None:
    engine = server.start("r", "stopme")
    engine.gate.release()
    server.wait("r", lambda s: s.round == 1)
    server.manager.stop("r", "maintenance window")
    status = server.wait("r", lambda s: s.state == control_pb2.RUN_STATE_STOPPED)
    assert status.message == "stopped on request: maintenance window"
    assert status.round == 1  # round 2 was in progress: not reported as done
    assert status.ended_unix >= status.started_unix > 0 and status.model_sha256 == f"{1:064x}"
    events = list(server.manager.watch("r", lambda: True))  # the stream ends at the terminal status
    assert events[-1].status.state == control_pb2.RUN_STATE_STOPPED and events[-1].status.name == "stopme"


def test_list_prints_a_table_and_json(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, server, "list")
    assert (code, err) == (0, "") and out == f"no runs on {server.address}\n"
    server.start("old-run", "alpha")
    finish(server, "old-run")
    time.sleep(0.01)
    server.start("new-run", "beta", "qffl")
    code, out, err = cli(capsys, server, "list")
    assert (code, err) == (0, "")
    header, newest, oldest = out.splitlines()
    assert header.split() == ["RUN", "ID", "NAME", "STRATEGY", "STATE", "ROUND", "CLIENTS", "STARTED"]
    assert newest.split()[:6] == ["new-run", "beta", "qffl", "RUNNING", f"0/{ROUNDS}", "4"]
    assert oldest.split()[:6] == ["old-run", "alpha", "fedavg", "COMPLETED", f"{ROUNDS}/{ROUNDS}", "4"]
    code, out, _ = cli(capsys, server, "list", "--json")
    listed = json.loads(out)
    assert [r["run_id"] for r in listed] == ["new-run", "old-run"]
    assert listed[0]["state"] == "RUN_STATE_RUNNING" and listed[0]["round"] == 0 and listed[1]["ended_unix"] > 0


def test_status_shows_state_round_latest_fairness_and_model(server: Server, capsys) -> None:
    engine = server.start("s", "gamma")
    for _ in range(3):
        engine.gate.release()
    server.wait("s", lambda s: s.round == 3)
    code, out, err = cli(capsys, server, "status", "s")
    assert (code, err) == (0, "")
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert fields["state"] == "RUNNING" and fields["round"] == f"3/{ROUNDS}" and fields["name"] == "gamma"
    assert fields["fairness"].startswith("after round 2: mean 52.00%  variance 5.00  worst 5% 42.00%")
    assert fields["model"] == f"sha256 {3:064x}" and fields["ended"] == "-"
    code, out, _ = cli(capsys, server, "status", "s", "--json")
    record = json.loads(out)
    assert record["latest_fairness"]["round"] == 2 and record["latest_fairness"]["mean"] == 52.0
    assert yaml.safe_load(record["experiment_yaml"])["name"] == "gamma"


def test_watch_prints_rounds_as_they_happen_and_exits_0_when_the_run_completes(server: Server) -> None:
    engine = server.start("w", "delta")
    engine.gate.release()
    lines: list[tuple[float, str]] = []

    class Out(io.StringIO):
        def write(self, text: str) -> int:
            lines.extend((time.monotonic(), line) for line in text.splitlines())
            return len(text)

    args = argparse.Namespace(aggregator=server.address, tls_dir="", insecure=True, run="w", json=False, reconnect=1)
    result: list[int] = []
    watcher = threading.Thread(target=lambda: result.append(operate.cmd_watch(args, Out())))
    watcher.start()
    deadline = time.monotonic() + 5
    while not any(text.startswith("round 1/") for _, text in lines):
        assert time.monotonic() < deadline, lines
        time.sleep(0.01)
    assert watcher.is_alive()  # round 1 was printed while the run goes on
    released = time.monotonic()
    for _ in range(ROUNDS - 1):
        engine.gate.release()
    watcher.join(5)
    assert result == [0]
    texts = [text for _, text in lines]
    assert texts[0] == "[running] run w"
    assert [t.split()[1] for t in texts if t.startswith("round ")] == [f"{r}/{ROUNDS}" for r in range(1, ROUNDS + 1)]
    assert "| acc 52.00  var 5.00  worst5% 42.00" in texts[2]
    assert texts[-1] == f"[completed] run w ended after round {ROUNDS}/{ROUNDS}: completed {ROUNDS} rounds"
    assert all(t >= released for t, text in lines if text.startswith("round 2/"))


def test_watch_json_and_stop(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    engine = server.start("j", "eps")
    engine.gate.release()
    server.wait("j", lambda s: s.round == 1)
    code, out, err = cli(capsys, server, "stop", "j", "--reason", "enough")
    assert (code, err) == (0, "")
    assert out == f"[stopped] run j ended after round 1/{ROUNDS}: stopped on request: enough\n"
    code, out, err = cli(capsys, server, "watch", "j", "--json")  # replayed to the end; a stopped run exits 1
    assert (code, err) == (1, "")
    events = [json.loads(line) for line in out.splitlines()]
    assert [next(iter(set(e) - {"run_id"})) for e in events] == ["status", "round", "status"]
    assert events[1]["round"]["round"] == 1 and events[-1]["status"]["state"] == "RUN_STATE_STOPPED"
    code, out, err = cli(capsys, server, "stop", "j")
    assert (code, err) == (0, "") and out.startswith("run j had already ended: [stopped]")


def test_unknown_run_and_unreachable_aggregator_are_one_line(server: Server, capsys) -> None:
    for command in ("status", "watch", "stop"):
        code, out, err = cli(capsys, server, command, "nosuch")
        assert (code, out, err) == (2, "", f"error: no run 'nosuch' on {server.address}\n")
    with socket_closed() as address:
        code = main(["runs", "list", "--aggregator", address, "--insecure"])
        captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    assert captured.err.startswith(f"error: cannot reach the aggregator at {address}") and captured.err.count("\n") == 1
    code = main(["runs", "list", "--aggregator", server.address])  # neither --tls-dir nor --insecure
    assert code == 2 and capsys.readouterr().err.startswith("error: no TLS material")


@contextlib.contextmanager
def socket_closed() -> Iterator[str]:
    """A loopback address nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    yield address


def _serve_again(server: Server) -> grpc.Server:
    """The same RunManager served again on the same port, as an aggregator that restarted."""
    again = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    control_pb2_grpc.add_RunControlServicer_to_server(RunControlServicer(server.manager), again)
    again.add_insecure_port(server.address)
    again.start()
    return again


def test_watch_follows_a_restarted_aggregator_and_passes_each_round_once(server: Server) -> None:
    engine = server.start("re", "zeta")
    engine.gate.release()
    server.wait("re", lambda s: s.round == 1)
    out, err = io.StringIO(), io.StringIO()
    args = argparse.Namespace(aggregator=server.address, tls_dir="", insecure=True, run="re", json=False, reconnect=10)
    result: list[int] = []
    watcher = threading.Thread(target=lambda: result.append(operate.cmd_watch(args, out)))
    with contextlib.redirect_stderr(err):
        watcher.start()
        deadline = time.monotonic() + 5
        while "round 1/" not in out.getvalue():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.server.stop(None).wait()  # the aggregator goes away mid-run
        engine.gate.release()  # round 2 happens while nobody can watch
        server.wait("re", lambda s: s.round == 2)
        time.sleep(0.3)
        again = _serve_again(server)
        try:
            for _ in range(ROUNDS - 2):
                engine.gate.release()
            watcher.join(10)
        finally:
            again.stop(None)
    assert result == [0]
    rounds = [line.split()[1] for line in out.getvalue().splitlines() if line.startswith("round ")]
    assert rounds == [f"{r}/{ROUNDS}" for r in range(1, ROUNDS + 1)]  # round 2 from the replay, none twice
    assert err.getvalue().startswith(f"lost the aggregator at {server.address} (UNAVAILABLE); watching again")


def test_watch_gives_up_when_the_aggregator_stays_away(server: Server, capsys) -> None:
    engine = server.start("gone", "eta")
    engine.gate.release()
    server.wait("gone", lambda s: s.round == 1)
    threading.Timer(0.5, lambda: server.server.stop(None)).start()
    started = time.monotonic()
    code = main(["runs", "watch", "gone", "--aggregator", server.address, "--insecure", "--reconnect", "1"])
    captured = capsys.readouterr()
    assert code == 1 and time.monotonic() - started < 10
    assert "round 1/" in captured.out
    lost, error = captured.err.splitlines()
    assert lost.startswith("lost the aggregator") and error.startswith("error: cannot reach the aggregator at")
