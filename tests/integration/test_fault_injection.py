"""Fault injection with real processes (docs/reliability.md): the aggregator, a client agent and the clustering
service are SIGKILLed mid-run and restarted, and 30% of the selected clients drop out of every round."""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from client_agent.faults import DropPlan
from fairfl.compose.cli import follow_run
from fairfl.compose.launcher import Child, LocalCluster
from fairfl.compose.results import RunRecorder
from fairfl.config import ExperimentConfig, experiment_from_dict
from fairfl.privacy import RANDOMNESS_ENV
from fairfl.v1 import control_pb2, control_pb2_grpc
from tests.federation_support import metric, start_aggregator
from tests.integration.test_grpc_equivalence import fetch_model, oracle
from tests.integration.test_privacy_dp import dp_config, spend, uninterrupted_epsilon

# Fast liveness for tests: agents heartbeat every 0.3 s and count as gone after 1.5 s of silence.
LIVENESS = ["--heartbeat-interval", "0.3", "--agent-timeout", "1.5"]


def _config(**sections: Any) -> ExperimentConfig:
    base: dict[str, Any] = {
        "name": "reliability",
        "seed": 3,
        "data": {"dataset": "synthetic", "num_clients": 8},
        "model": {"name": "mlp", "params": {"hidden": [16]}},
        "training": {"local_steps": 2, "batch_size": 20, "lr": 0.1},
        "strategy": {"name": "fedavg"},
        "runtime": {"agents": 2, "round_timeout_s": 20, "register_timeout_s": 60},
    }
    for key, value in sections.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    return experiment_from_dict(base)


class Watcher:
    """Follows a run's events on a thread, so the test can act when a round is reported. With `reconnect`, it
    watches the way `fairfl run` does (fairfl.compose.cli.follow_run: again after the aggregator restarts)."""

    def __init__(self, control: control_pb2_grpc.RunControlStub, run_id: str, reconnect: bool = False) -> None:
        self.events: list[control_pb2.RunEvent] = []
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._follow, args=(control, run_id, reconnect), daemon=True)
        self.thread.start()

    def _add(self, event: control_pb2.RunEvent) -> None:
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def _follow(self, control: control_pb2_grpc.RunControlStub, run_id: str, reconnect: bool) -> None:
        try:
            if reconnect:
                follow_run(control, run_id, self._add, reconnect_s=120)
            else:
                request = control_pb2.WatchRunRequest(run_id=run_id)
                for event in control.WatchRun(request, timeout=300, wait_for_ready=True):
                    self._add(event)
        except BaseException as err:  # reported by wait_for
            self.error = err
        with self.cond:
            self.cond.notify_all()

    @property
    def rounds(self) -> list[control_pb2.RoundEvent]:
        with self.cond:
            return [e.round for e in self.events if e.HasField("round")]

    def wait_for(self, what: str, check: Callable[[list[control_pb2.RoundEvent]], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not check([e.round for e in self.events if e.HasField("round")]):
                if not self.thread.is_alive() or time.monotonic() > deadline:
                    raise AssertionError(f"gave up waiting for {what}; watch error {self.error}; {self.events[-3:]}")
                self.cond.wait(0.2)

    def final(self) -> control_pb2.RunStatus:
        self.thread.join(120)
        statuses = [e.status for e in self.events if e.HasField("status")]
        assert statuses and not self.thread.is_alive(), f"the run did not end for this watcher: {self.error!r}"
        return statuses[-1]


def _ledger_rounds(db: Path, run_id: str) -> dict[int, float]:
    if not db.exists():
        return {}
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as ledger:
        rows = ledger.execute("SELECT round, recorded_at FROM rounds WHERE run_id = ?", (run_id,)).fetchall()
    return dict(rows)


@pytest.mark.integration
def test_aggregator_killed_mid_round_resumes_to_the_uninterrupted_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RANDOMNESS_ENV, "task")  # seeded DP noise: the resumed run can match the oracle
    config = dp_config(rounds=8)
    expected, oracle_rounds = oracle(config)
    db = tmp_path / "privacy-ledger.sqlite"
    with LocalCluster(tmp_path / "logs") as cluster:
        aggregator, _clustering, privacy = cluster.start_services(
            tmp_path, ["--checkpoint-dir", str(tmp_path / "checkpoints"), *LIVENESS]
        )
        cluster.start_agents(aggregator.address, config.data.num_clients, config.runtime.agents, "cpu", 1)
        with cluster.open_channel(aggregator.address) as channel:
            control = control_pb2_grpc.RunControlStub(channel)
            control.StartRun(control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id="crash"), timeout=30)
            follower = Watcher(control, "crash", reconnect=True)  # as `fairfl run --aggregator` watches
            follower.wait_for("round 3", lambda rounds: len(rounds) >= 3)
            # Round 4 is authorised (its privacy events recorded) before any of its tasks leave: kill it in flight.
            deadline = time.monotonic() + 30
            while 4 not in _ledger_rounds(db, "crash") and time.monotonic() < deadline:
                time.sleep(0.01)
            cluster.kill("aggregator")  # SIGKILL
            killed_at = time.time()
            reported = {r.round: r.model_sha256 for r in follower.rounds}
            recorded_before = {r for r, at in _ledger_rounds(db, "crash").items() if at < killed_at}
            cluster.restart("aggregator")  # same port and checkpoint directory: it resumes the run by itself
            resumed = Watcher(control, "crash")  # a new watcher gets the history first
            final = resumed.final()
            params = fetch_model(control, "crash")
            assert follower.final().state == control_pb2.RUN_STATE_COMPLETED
        log = aggregator.log_path.read_text()
        reply = spend(privacy.address, "crash", cluster.security)

    assert final.state == control_pb2.RUN_STATE_COMPLETED, final.message
    rounds = resumed.rounds
    assert [r.round for r in rounds] == list(range(1, 9)), "every round exactly once, history included"
    assert [r.round for r in follower.rounds] == list(range(1, 9)), "the CLI's watcher passed each round on once"
    # No completed round was lost: every round reported before the kill is in the resumed history, unchanged.
    assert reported and all(rounds[n - 1].model_sha256 == sha for n, sha in reported.items())
    (resumed_after,) = map(int, re.findall(r"run crash resumes after round (\d+) of 8", log))
    assert resumed_after >= max(reported)
    # The same selections and the same model as an uninterrupted run of the seed.
    for got, want in zip(rounds, oracle_rounds, strict=True):
        assert list(got.selected) == list(want.selected)
        assert got.epsilon_spent == pytest.approx(want.epsilon_spent, rel=1e-12)
    assert float((params - expected).abs().max()) <= 1e-6
    # The ledger counted every round once; a round authorised before the kill was re-run under that authorisation.
    want = uninterrupted_epsilon(config, 8)
    assert reply.rounds_recorded == 8
    assert all(s.epsilon == pytest.approx(want, rel=1e-12) and s.events == 2 * 8 for s in reply.spends)
    assert max(recorded_before) >= 4
    if max(recorded_before) > resumed_after:
        assert f"round {resumed_after + 1} of run crash was already recorded" in log


@pytest.mark.integration
def test_killed_agent_and_clustering_service_leave_the_run_going(tmp_path: Path) -> None:
    config = _config(
        rounds=500,  # ended by StopRun once every fault has been seen through
        selection={"method": "full", "clients_per_round": 8},
        evaluation={"every": 1000},
        runtime={"min_completion": 0.5},
    )
    with LocalCluster(tmp_path / "logs") as cluster:
        aggregator, _clustering, _privacy = cluster.start_services(tmp_path, LIVENESS)
        cluster.start_agents(aggregator.address, 8, 2, "cpu", 1)  # agent-0: clients 0-3, agent-1: 4-7
        with cluster.open_channel(aggregator.address) as channel:
            control = control_pb2_grpc.RunControlStub(channel)
            control.StartRun(control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id="faults"), timeout=30)
            watcher = Watcher(control, "faults")
            watcher.wait_for("round 3", lambda rounds: len(rounds) >= 3)

            cluster.kill("agent-1")  # SIGKILL mid-run: its clients' tasks of the round in flight go unanswered
            killed_round = len(watcher.rounds) + 1
            watcher.wait_for(
                "rounds without agent-1", lambda rounds: any(list(r.selected) == [0, 1, 2, 3] for r in rounds)
            )
            cut = next(r for r in watcher.rounds if r.round == killed_round)
            # The round in flight aggregated what it had (min_completion 0.5): agent-1 answers its clients one by one,
            # so the kill may come before, between or after its results. When some were lost with it, the round
            # closed once the agent fell silent, before its 20 s deadline.
            assert 4 <= cut.results_accepted <= 8 and len(cut.aggregation_weights) == cut.results_accepted
            if cut.results_accepted < 8:
                assert cut.duration_seconds < config.runtime.round_timeout_s

            cluster.restart("agent-1")
            watcher.wait_for(
                "agent-1's clients back",
                lambda rounds: any(
                    r.round > killed_round and list(r.selected) == list(range(8)) and r.results_accepted == 8
                    for r in rounds
                ),
            )

            cluster.kill("clustering")  # SIGKILL: every Select of the next round fails until it returns
            before = len(watcher.rounds)
            cluster.restart("clustering")  # on its port, with an empty store; the aggregator's Select retries meanwhile
            watcher.wait_for("3 rounds after the clustering restart", lambda rounds: len(rounds) >= before + 4)

            asked = time.monotonic()
            control.StopRun(control_pb2.StopRunRequest(run_id="faults", reason="test done"), timeout=10)
            final = watcher.final()
            stop_took = time.monotonic() - asked
    assert final.state == control_pb2.RUN_STATE_STOPPED and "stopped on request" in final.message
    assert stop_took < 5.0, "a stop takes effect at once, not at the phase's deadline"
    rounds = watcher.rounds
    assert [r.round for r in rounds] == list(range(1, len(rounds) + 1)), "no round was skipped or repeated"
    assert all(r.aggregation_weights for r in rounds), "every round aggregated"


@pytest.mark.integration
def test_a_third_of_the_selected_clients_dropping_every_round(tmp_path: Path) -> None:
    num_clients, k, fraction, seed = 20, 6, 0.3, 7
    config = _config(
        rounds=20,
        data={"num_clients": num_clients},
        selection={"clients_per_round": k},
        evaluation={"every": 20},
        # Select 12 per round and aggregate the first 6 results: 6 of 20 clients drop each round, so at least 6 of
        # the 12 answer and no training phase waits for its deadline; the evaluation does, for the silent clients.
        runtime={"agents": 1, "over_selection": 1.0, "round_timeout_s": 8},
    )
    with LocalCluster(tmp_path / "logs") as cluster:
        aggregator, _clustering, _privacy = cluster.start_services(tmp_path, LIVENESS)
        cluster.start_agents(
            aggregator.address,
            num_clients,
            1,
            "cpu",
            1,
            ["--fault-drop-fraction", str(fraction), "--fault-seed", str(seed)],
        )
        with cluster.open_channel(aggregator.address) as channel:
            control = control_pb2_grpc.RunControlStub(channel)
            control.StartRun(control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id="drops"), timeout=30)
            watcher = Watcher(control, "drops")
            final = watcher.final()
    assert final.state == control_pb2.RUN_STATE_COMPLETED, final.message
    rounds = watcher.rounds
    assert [r.round for r in rounds] == list(range(1, 21))
    plan = DropPlan(fraction, seed)

    def dropped(round_number: int) -> set[int]:  # the agent drops 6 of its 20 clients
        return set(plan.dropped(list(range(num_clients)), round_number))

    dropped_selected = 0
    for r in rounds:
        assert len(r.selected) == 12 and r.results_accepted == k and len(r.aggregation_weights) == k
        assert len(dropped(r.round)) == 6
        dropped_selected += len(dropped(r.round) & set(r.selected))
    assert 0.2 <= dropped_selected / (12 * 20) <= 0.4  # about 30% of the selected clients dropped
    evaluated = [r for r in rounds if r.evaluated]
    assert [r.round for r in evaluated] == [20]
    for r in evaluated:  # fairness over every client that could be evaluated, and a count of those that could not
        assert {c.client_id for c in r.clients} == set(range(num_clients)) - dropped(r.round)
        assert r.fairness.evaluated_clients == 14 and r.fairness.missing_clients == 6
    recorder = RunRecorder(config, quiet=True)
    for event in watcher.events:
        recorder(event)
    table = recorder.fairness_table()
    assert re.search(r"clients evaluated\s+14\b", table) and re.search(r"clients missing\s+6\b", table)
    assert recorder.summary()["final_fairness"]["missing_clients"] == 6
    assert not torch.isnan(torch.tensor(evaluated[-1].fairness.mean))


def _models_received(agent: Child) -> float:
    """Models the agent received (with a poll reply or fetched): one per round it took tasks in."""
    name = "fairfl_agent_model_fetches_total"
    return metric(agent, name, cache="inline") + metric(agent, name, cache="miss")


@pytest.mark.integration
def test_an_agent_killed_mid_round_gets_its_tasks_again_when_it_restarts(tmp_path: Path) -> None:
    """SIGKILL an agent while it trains its tasks of a round and start it again (same name and certificate): the tasks
    it had taken are sent to its new registration, so the round completes long before its 120 s deadline instead of
    failing at it (issue #18)."""
    config = _config(
        rounds=2,
        training={"local_steps": 800, "batch_size": 32, "lr": 0.05},  # ~0.5 s a task: time to kill one mid-round
        model={"name": "mlp", "params": {"hidden": [64]}},
        selection={"method": "full", "clients_per_round": 8},
        evaluation={"every": 1000},
        runtime={"round_timeout_s": 120},
    )
    # Liveness long enough that the restarted agent is back before its old registration counts as vanished.
    liveness = ["--heartbeat-interval", "0.3", "--agent-timeout", "60"]
    with LocalCluster(tmp_path / "logs") as cluster:
        aggregator = start_aggregator(cluster, args=liveness)  # selection and privacy in-process: a faster start
        _, agent = cluster.start_agents(aggregator.address, 8, 2, "cpu", 1)  # agent-1: clients 4-7
        with cluster.open_channel(aggregator.address) as channel:
            control = control_pb2_grpc.RunControlStub(channel)
            start = control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id="crashed")
            control.StartRun(start, timeout=30)
            watcher = Watcher(control, "crashed")
            watcher.wait_for("round 1", lambda rounds: len(rounds) >= 1, timeout=120)
            deadline = time.monotonic() + 30
            while _models_received(agent) < 2:  # round 2's tasks reached agent-1: it is training them now
                assert time.monotonic() < deadline, "agent-1 never got its tasks of round 2"
                time.sleep(0.02)
            time.sleep(0.3)
            cluster.kill("agent-1")  # SIGKILL: the tasks it took die with it
            assert len(watcher.rounds) == 1, "round 2 ended before the kill: the test proves nothing"
            cluster.restart("agent-1")  # same name, certificate and clients
            watcher.wait_for("round 2", lambda rounds: len(rounds) >= 2, timeout=40)
            final = watcher.final()
        log = aggregator.log_path.read_text()
    assert final.state == control_pb2.RUN_STATE_COMPLETED, final.message
    rounds = watcher.rounds
    assert [r.round for r in rounds] == [1, 2]
    second = rounds[1]
    assert second.results_accepted == 8 and len(second.aggregation_weights) == 8, "the round lost agent-1's clients"
    assert second.duration_seconds < 30, f"round 2 took {second.duration_seconds:.1f}s: it waited for its deadline"
    assert "phase closed without results" not in log
