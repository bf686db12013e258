"""Observability end to end: a short run over gRPC (every service and an agent as its own process) with a real
Prometheus scraping them every second.

- each process's /metrics passes `promtool check metrics` and exports exactly its part of the catalog (the catalog is
  what the dashboards and rules are checked against, tests/unit/test_observability_assets.py);
- the variance, worst-5% accuracy and ε read back through the Prometheus HTTP API equal the run's results.json;
- Prometheus loaded the FairFL rules and evaluates every one without error.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from fairfl.compose.launcher import LocalCluster
from fairfl.compose.monitor import Prometheus, prometheus_binary
from fairfl.compose.results import RunRecorder
from fairfl.config import experiment_from_dict
from fairfl.telemetry import catalog_for
from fairfl.v1 import control_pb2, control_pb2_grpc

pytestmark = pytest.mark.integration

RUN_ID = "monitored"
ROUNDS = 3
PROMTOOL = shutil.which("promtool")
NO_PROMETHEUS = "prometheus not installed (Debian package prometheus)"
NO_PROMTOOL = "promtool not installed (Debian package prometheus)"

CONFIG = experiment_from_dict(
    {
        "name": "monitoring",
        "seed": 3,
        "rounds": ROUNDS,
        # Homogeneous Synthetic(0, 0): after 3 rounds the clients' accuracies spread over 0..100%.
        "data": {"dataset": "synthetic", "num_clients": 8, "params": {"alpha": 0.0, "beta": 0.0}},
        "model": {"name": "mlp", "params": {"hidden": [16]}},
        "training": {"local_steps": 10, "batch_size": 10, "lr": 0.1},
        "selection": {"clients_per_round": 4},
        "evaluation": {"every": 1},
        "runtime": {"agents": 1, "round_timeout_s": 60, "register_timeout_s": 60, "metrics_client_limit": 5},
    }
)


@dataclass
class Observed:
    results: dict[str, Any]
    metrics: dict[str, str]  # process name -> its /metrics text after the run
    prometheus: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)  # query -> samples
    rules: list[dict[str, Any]] = field(default_factory=list)


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        return reply.read().decode()


def _wait_for(prometheus: Prometheus, expr: str, expected: float, timeout: float = 20.0) -> None:
    """Until Prometheus holds a scrape taken after the run's last update of `expr`."""
    deadline = time.monotonic() + timeout
    seen: list[tuple[dict[str, str], float]] = []
    while time.monotonic() < deadline:
        seen = prometheus.query(expr)
        if seen and seen[0][1] == expected:
            return
        time.sleep(0.2)
    raise AssertionError(f"Prometheus never showed {expr} == {expected} (last: {seen}); log: {prometheus.log_path}")


QUERIES = {
    "variance": f'fairfl_fairness_accuracy_variance{{run_id="{RUN_ID}"}}',
    "worst_5": f'fairfl_fairness_accuracy_tail_ratio{{run_id="{RUN_ID}", tail="worst", fraction="0.05"}}',
    "tails": f'fairfl_fairness_accuracy_tail_ratio{{run_id="{RUN_ID}"}}',
    "mean": f'fairfl_fairness_accuracy_mean_ratio{{run_id="{RUN_ID}"}}',
    "jain_index": f'fairfl_fairness_jain_index{{run_id="{RUN_ID}"}}',
    "cv": f'fairfl_fairness_accuracy_coefficient_of_variation{{run_id="{RUN_ID}"}}',
    "epsilon_ledger": f'fairfl_privacy_epsilon_spent{{run_id="{RUN_ID}"}}',
    "epsilon_aggregator": f'fairfl_run_epsilon_spent{{run_id="{RUN_ID}"}}',
    "clients": f'fairfl_client_accuracy_ratio{{run_id="{RUN_ID}"}}',
    "rounds": "sum(fairfl_rounds_completed_total)",
    "tasks": "sum by (phase) (fairfl_tasks_sent_total)",
}


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Observed:
    work = tmp_path_factory.mktemp("monitoring")
    with LocalCluster(work / "logs") as cluster:
        aggregator, _, _ = cluster.start_services(work)
        cluster.start_agents(aggregator.address, CONFIG.data.num_clients, CONFIG.runtime.agents, "cpu", 1)
        targets = cluster.metrics_targets()
        assert sorted(targets) == ["agent", "aggregator", "clustering", "privacy"]
        prometheus = Prometheus.start(work / "monitor", targets, scrape_interval="1s") if prometheus_binary() else None
        try:
            recorder = RunRecorder(CONFIG, quiet=True)
            with cluster.open_channel(aggregator.address) as channel:
                control = control_pb2_grpc.RunControlStub(channel)
                control.StartRun(
                    control_pb2.StartRunRequest(experiment_yaml=CONFIG.to_yaml(), run_id=RUN_ID), timeout=30
                )
                for event in control.WatchRun(control_pb2.WatchRunRequest(run_id=RUN_ID), timeout=120):
                    recorder(event)
            recorder.write(work / "out")
            results = json.loads((work / "out" / "results.json").read_text())
            assert results["state"] == "RUN_STATE_COMPLETED", results["message"]
            metrics = {c.name: _scrape(c.metrics_address) for c in cluster.children if c.metrics_port}
            observed = Observed(results, metrics)
            if prometheus is not None:
                # Both the aggregator's and the ledger's last updates must have been scraped.
                _wait_for(prometheus, f'fairfl_fairness_evaluation_round{{run_id="{RUN_ID}"}}', ROUNDS)
                _wait_for(prometheus, "sum(fairfl_privacy_rounds_authorized_total)", ROUNDS)
                observed.prometheus = {key: prometheus.query(expr) for key, expr in QUERIES.items()}
                observed.rules = [rule for group in prometheus.api("rules")["groups"] for rule in group["rules"]]
        finally:
            if prometheus is not None:
                prometheus.stop()
    return observed


def _families(text: str) -> set[tuple[str, str]]:
    return {tuple(line.split()[2:4]) for line in text.splitlines() if line.startswith("# TYPE ")}  # type: ignore[misc]


@pytest.mark.parametrize("process", ["aggregator", "clustering", "privacy", "agent-0"])
def test_each_process_exports_exactly_its_catalog(observed: Observed, process: str) -> None:
    component = process.split("-")[0]
    declared = {(spec.name, spec.kind) for spec in catalog_for(component).values()}  # type: ignore[arg-type]
    assert _families(observed.metrics[process]) == declared


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
@pytest.mark.parametrize("process", ["aggregator", "clustering", "privacy", "agent-0"])
def test_promtool_finds_no_problem_in_metrics(observed: Observed, process: str) -> None:
    assert PROMTOOL is not None
    text = observed.metrics[process]
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr


def test_the_run_was_measured(observed: Observed) -> None:
    aggregator = observed.metrics["aggregator"]
    assert f'fairfl_run_round{{run_id="{RUN_ID}"}} {float(ROUNDS)}' in aggregator
    # The preset's small updates go in one UploadResult call each (bigger ones would stream with SubmitResult).
    assert 'fairfl_grpc_server_handled_total{code="OK",method="UploadResult",service="fairfl.v1.Federation"}' in (
        aggregator
    )
    assert 'fairfl_round_phase_duration_seconds_count{phase="aggregate"}' in aggregator
    assert 'fairfl_agent_tasks_total{outcome="submitted",phase="train"}' in observed.metrics["agent-0"]
    assert 'fairfl_clustering_selections_total{method="random"} 3.0' in observed.metrics["clustering"]


@pytest.mark.skipif(prometheus_binary() is None, reason=NO_PROMETHEUS)
def test_prometheus_reads_the_runs_results(observed: Observed) -> None:
    final = observed.results["final_fairness"]
    last_round = observed.results["rounds"][-1]

    def value(key: str) -> float:
        samples = observed.prometheus[key]
        assert len(samples) == 1, (key, samples)
        return samples[0][1]

    # Accuracies are exported as ratios (Prometheus base units); results.json holds percent.
    assert math.isclose(value("variance") * 100**2, final["variance"], rel_tol=0, abs_tol=1e-9)
    assert math.isclose(value("worst_5") * 100, final["worst_5"], rel_tol=0, abs_tol=1e-9)
    assert math.isclose(value("mean") * 100, final["mean"], rel_tol=0, abs_tol=1e-9)
    epsilon = last_round.get("epsilon_spent", 0.0)  # proto JSON omits a zero ε (a non-private run)
    assert math.isclose(value("epsilon_ledger"), epsilon, rel_tol=0, abs_tol=1e-9)
    assert math.isclose(value("epsilon_aggregator"), epsilon, rel_tol=0, abs_tol=1e-9)
    assert math.isclose(value("jain_index"), final["jain_index"], rel_tol=0, abs_tol=1e-9)
    assert math.isclose(value("cv"), final["cv"], rel_tol=0, abs_tol=1e-9)
    fields = {("worst", "0.05"): "worst_5", ("worst", "0.1"): "worst_10", ("best", "0.05"): "best_5"}
    fields[("best", "0.1")] = "best_10"
    tails = {fields[labels["tail"], labels["fraction"]]: v for labels, v in observed.prometheus["tails"]}
    assert tails.keys() == set(fields.values())
    for field_name, ratio in tails.items():
        assert math.isclose(ratio * 100, final[field_name], rel_tol=0, abs_tol=1e-9)
    assert value("rounds") == ROUNDS
    # Per-client series: runtime.metrics_client_limit = 5 of the 8 clients, equal to the last evaluation's.
    clients = {labels["client_id"]: v for labels, v in observed.prometheus["clients"]}
    # (proto JSON leaves out zeros: client id 0, accuracy 0)
    expected = {str(c.get("client_id", 0)): c.get("accuracy", 0.0) for c in last_round["clients"]}
    assert clients.keys() == {"0", "1", "2", "3", "4"}
    for client_id, accuracy in clients.items():
        assert math.isclose(accuracy * 100, expected[client_id], rel_tol=0, abs_tol=1e-9)
    assert len({round(v, 6) for v in clients.values()}) > 1  # a spread, not one repeated value
    tasks = {labels["phase"]: v for labels, v in observed.prometheus["tasks"]}
    assert tasks == {"train": ROUNDS * 4, "evaluate": ROUNDS * 8}


@pytest.mark.skipif(prometheus_binary() is None, reason=NO_PROMETHEUS)
def test_prometheus_evaluates_every_fairfl_rule(observed: Observed) -> None:
    names = {rule["name"] for rule in observed.rules}
    assert {"FairFLFairnessRegression", "FairFLClientDropoutHigh", "instance:fairfl_tasks_dropout:ratio_rate5m"} <= (
        names
    )
    assert all(rule["health"] == "ok" for rule in observed.rules), [r for r in observed.rules if r["health"] != "ok"]
    assert not [r for r in observed.rules if r.get("state") == "firing"]  # a healthy short run raises no alert


@pytest.mark.skipif(prometheus_binary() is None, reason=NO_PROMETHEUS)
def test_fairfl_run_monitor_works_the_way_make_monitor_runs_it(tmp_path: Path) -> None:
    """`make monitor` is `fairfl run CONFIG --monitor` from the checkout, writing to the default relative output
    directory (runs/<id>/): Prometheus must find its config there (it once looked for the relative path inside its
    own working directory and `make monitor` failed on a fresh clone), scrape every process, and serve the run's
    fairness through its HTTP API while the command holds the services up after the run."""
    (tmp_path / "experiment.yaml").write_text(yaml.safe_dump({**CONFIG.to_dict(), "output_dir": "runs"}))
    fairfl = Path(sys.executable).parent / "fairfl"
    command = subprocess.Popen(
        [str(fairfl), "run", "experiment.yaml", "--monitor", "--monitor-hold", "60"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = _prometheus_url_when_held(command)
        (run_dir,) = (tmp_path / "runs").iterdir()
        results = json.loads((run_dir / "results.json").read_text())
        assert results["state"] == "RUN_STATE_COMPLETED"
        prometheus = Prometheus(run_dir / "monitor", port=int(url.rsplit(":", 1)[1]))
        up = _until(lambda: prometheus.query("up"), lambda s: len(s) == 4 and all(v == 1.0 for _, v in s))
        jobs = sorted(labels["job"] for labels, _ in up)
        assert jobs == ["fairfl-agent", "fairfl-aggregator", "fairfl-clustering", "fairfl-privacy"]
        run_id = run_dir.name
        final = results["final_fairness"]
        expected = final["variance"] / 100**2  # exported in ratio² (Prometheus base units); results.json holds %²
        variance = _until(
            lambda: prometheus.query(f'fairfl_fairness_accuracy_variance{{run_id="{run_id}"}}'),
            lambda s: len(s) == 1 and math.isclose(s[0][1], expected, rel_tol=1e-9),
        )
        assert len(variance) == 1 and math.isclose(variance[0][1], expected, rel_tol=1e-9), (variance, final)
    finally:
        command.send_signal(signal.SIGINT)
        _out, err = command.communicate(timeout=60)
    assert "Traceback" not in err, err[-3000:]
    assert (run_dir / "monitor" / "prometheus.yml").is_file()
    assert "Error loading config" not in (run_dir / "monitor" / "prometheus.log").read_text()


def _prometheus_url_when_held(command: subprocess.Popen[str], timeout: float = 240.0) -> str:
    """Read the command's output until it says the services are held up after the run; the Prometheus URL it named."""
    assert command.stdout is not None
    deadline = time.monotonic() + timeout
    url, lines = "", []
    for line in command.stdout:
        lines.append(line)
        if line.startswith("monitoring: Prometheus at "):
            url = line.split()[3]
        if "services and Prometheus stay up" in line:
            assert url, "".join(lines)
            return url
        assert time.monotonic() < deadline, "".join(lines)
    assert command.stderr is not None
    raise AssertionError("the command ended before holding the services up: " + "".join(lines) + command.stderr.read())


def _until(read: Any, done: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.5)
        value = read()
    return value
