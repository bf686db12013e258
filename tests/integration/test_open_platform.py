"""Issue #19's first acceptance item, end to end through the `fairfl` command line, as a user meets it.

tests/plugin_testpkg/fairfl_testplug is a package outside the installed fairfl, written against `fairfl.api` only:
a model factory, a Dataset (scikit-learn's bundled digits), a sampler, and a strategy with its own client-side
procedure (every client reports the norm of its update; the strategy records the mean in its round metrics). The same
short experiment names them

- by `package.module:attr`, with the package's directory on PYTHONPATH, and
- by the entry-point names of the `fairfl-testplug` distribution (tests/plugin_testpkg/pyproject.toml), installed
  here with pip into a temporary directory that is the only plug-in path on PYTHONPATH,

and runs (a) in-process, (b) over gRPC with mTLS and every service its own process, (c) inside `fairfl compare
--jobs 2`. PYTHONPATH is set only in the environment of the `fairfl` subprocesses, never in this process: every
process that needs a plug-in (the CLI, the aggregator, the clustering service, the agents, the compare workers) must
import it itself. (b) covers both ways a user starts services, one per naming (to keep the file short on two
cores): `fairfl run` starting them itself (its launcher, an ephemeral CA) for module:attr, and every service and agent
started by hand with `fairfl serve` and its own identity from `fairfl certs`, driven by `fairfl run --aggregator ...
--tls-dir` as the operator, for the entry points. The gRPC and in-process final models are bit-equal.

A plug-in that cannot be imported (missing, raising on import, an entry-point name whose distribution is not
installed), or gets a bad parameter, stops `fairfl run` before round 1 with a one-line error
naming the config field and no traceback.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from fairfl.announce import parse_announcement

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PLUGIN_PROJECT = REPO / "tests" / "plugin_testpkg"  # the distribution's source: pyproject.toml + fairfl_testplug/
FAIRFL = [sys.executable, "-m", "fairfl.compose"]
TIMEOUT_S = 120

MODULE_ATTR = {
    "model": "fairfl_testplug.models:small_mlp",
    "dataset": "fairfl_testplug.data:Digits",
    "sampler": "fairfl_testplug.sampling:RoundRobin",
    "strategy": "fairfl_testplug.strategy:CoordinateMedian",
}
ENTRY_POINTS = {  # tests/plugin_testpkg/pyproject.toml
    "model": "testplug_mlp",
    "dataset": "testplug_digits",
    "sampler": "testplug_round_robin",
    "strategy": "testplug_median",
}
STRATEGY_METRICS = ("testplug_mean_update_norm", "testplug_clients_reporting", "testplug_total_steps")
SEED = 11
NUM_CLIENTS, PER_ROUND, LOCAL_STEPS = 6, 3, 3
FINAL_SHA: dict[str, str] = {}  # the first naming's final model: the other must train the very same one


def experiment(names: dict[str, str]) -> dict[str, Any]:
    return {
        "name": "open-platform",
        "seed": SEED,
        "rounds": 2,
        "data": {"dataset": names["dataset"], "params": {"test_every": 4}, "num_clients": NUM_CLIENTS},
        "model": {"name": names["model"], "params": {"width": 16}},
        "training": {"local_steps": LOCAL_STEPS, "batch_size": 16, "lr": 0.2},
        "selection": {"method": names["sampler"], "clients_per_round": PER_ROUND, "params": {"offset": 1}},
        "strategy": {"name": names["strategy"], "params": {"norm_scale": 2.0}},
        "evaluation": {"every": 1},
        "runtime": {"agents": 2, "device": "cpu", "round_timeout_s": 60, "register_timeout_s": 60},
    }


def environment(plugin_path: Path | None) -> dict[str, str]:
    """This process's environment with PYTHONPATH = the plug-in path (and the repository, as CI has it)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (plugin_path, REPO) if p is not None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def fairfl(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*FAIRFL, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def completed(proc: subprocess.CompletedProcess[str], out: Path) -> dict[str, Any]:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    assert results["state"] == "RUN_STATE_COMPLETED", results["message"]
    return results


def check_plugins_ran(results: dict[str, Any], names: dict[str, str]) -> None:
    """The config names the plug-ins, and each of them visibly did its part."""
    config = results["config"]
    assert config["model"]["name"] == names["model"]
    assert config["data"]["dataset"] == names["dataset"]
    assert config["selection"]["method"] == names["sampler"]
    assert config["strategy"]["name"] == names["strategy"]
    rounds = results["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    # RoundRobin with offset 1: a window of 3 of the 6 clients moving on by 3 each round.
    assert [sorted(r["selected"]) for r in rounds] == [[1, 2, 3], [0, 4, 5]]
    for r in rounds:
        metrics = {m["name"]: m["value"] for m in r["strategy_metrics"]}
        assert set(STRATEGY_METRICS) <= set(metrics), metrics
        # The client procedure ran on every selected client: the strategy read its metrics from each result.
        assert metrics["testplug_clients_reporting"] == PER_ROUND
        assert metrics["testplug_total_steps"] == PER_ROUND * LOCAL_STEPS
        assert metrics["testplug_mean_update_norm"] > 0
        assert len(r["clients"]) == NUM_CLIENTS  # every client of the Digits dataset was evaluated
    assert results["final_model_sha256"] and results["rounds_completed"] == 2


# --- the two ways of naming the plug-ins ----------------------------------------------------------------------------


def install_distribution(tmp: Path) -> Path:
    """pip-install the fairfl-testplug distribution into tmp/site (offline: no index, the venv's setuptools)."""
    source = tmp / "fairfl-testplug"
    shutil.copytree(PLUGIN_PROJECT, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    site = tmp / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    proc = subprocess.run(
        [*cmd, "--target", str(site), str(source)], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entry_points = next(site.glob("fairfl_testplug-*.dist-info")) / "entry_points.txt"
    assert "[fairfl.strategies]" in entry_points.read_text()
    return site


@pytest.fixture(scope="module", params=["module_attr", "entry_points"])
def plugins(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, str], Path, bool]:
    """(the names the config uses, the plug-in path the subprocesses get on PYTHONPATH, whether the gRPC run's
    services are started by `fairfl run`'s launcher rather than by hand). Each naming runs over one way of starting
    the services, which keeps the file short on two cores; both are mutual TLS with every service its own process."""
    if request.param == "module_attr":
        return MODULE_ATTR, PLUGIN_PROJECT, True
    return ENTRY_POINTS, install_distribution(tmp_path_factory.mktemp("distribution")), False


# --- services started by hand: `fairfl certs`, then `fairfl serve` per service and agent ----------------------------


def _announced_port(process: subprocess.Popen[str], name: str, log: Path, timeout: float = 60.0) -> int:
    lines: queue.Queue[str] = queue.Queue()
    assert process.stdout is not None
    stdout = process.stdout

    def pump() -> None:
        for line in stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            line = ""
        ports = parse_announcement(line) if line else None
        if ports is not None and ports[0]:
            return ports[0]
        if not line:
            raise AssertionError(f"{name} did not announce its port:\n{log.read_text()[-3000:]}")


@contextmanager
def served_deployment(tmp: Path, env: dict[str, str]) -> Iterator[str]:
    """Privacy, clustering, aggregator and two agents, each `fairfl serve` with its own identity from `fairfl certs`;
    yields the aggregator's address."""
    tmp.mkdir(parents=True, exist_ok=True)
    certs = tmp / "certs"
    half = NUM_CLIENTS // 2
    agents = {"site-a": f"0-{half - 1}", "site-b": f"{half}-{NUM_CLIENTS - 1}"}
    made = fairfl(["certs", str(certs), *(f"--agent={n}={r}" for n, r in agents.items())], env, tmp)
    assert made.returncode == 0, made.stderr
    children: list[subprocess.Popen[str]] = []

    def serve(component: str, identity: str, args: list[str], announce: bool) -> int:
        log = tmp / f"{identity}.log"
        with log.open("w") as log_file:
            process = subprocess.Popen(
                [*FAIRFL, "serve", component, *args, "--tls-dir", str(certs / identity), "--metrics-port", "-1"],
                cwd=tmp,
                env={**env, "PYTHONUNBUFFERED": "1"},
                stdout=subprocess.PIPE if announce else log_file,
                stderr=log_file,
                text=True,
            )
        children.append(process)
        return _announced_port(process, identity, log) if announce else 0

    try:
        bind = ["--bind", "127.0.0.1:0"]
        privacy = serve("privacy", "privacy", [*bind, "--db", str(tmp / "ledger.sqlite")], announce=True)
        clustering = serve("clustering", "clustering", bind, announce=True)
        peers = ["--clustering", f"127.0.0.1:{clustering}", "--privacy", f"127.0.0.1:{privacy}"]
        aggregator = f"127.0.0.1:{serve('aggregator', 'aggregator', [*bind, *peers], announce=True)}"
        for name, clients in agents.items():
            args = ["--aggregator", aggregator, "--clients", clients, "--name", name, "--device", "cpu"]
            serve("agent", name, args, announce=False)
        yield aggregator
    finally:
        for process in children:
            process.terminate()
        for process in children:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()


# --- (a), (b), (c) --------------------------------------------------------------------------------------------------


def run_over_grpc(
    config: Path, names: dict[str, str], launcher: bool, env: dict[str, str], tmp_path: Path
) -> dict[str, Any]:
    """`fairfl run` starting the services itself (its launcher: an ephemeral CA), or driving a deployment started by
    hand (`fairfl serve` per service and agent, identities from `fairfl certs`) as the operator."""
    if launcher:
        results = completed(fairfl(["run", str(config), "--output", "grpc"], env, tmp_path), tmp_path / "grpc")
        assert (tmp_path / "grpc" / "tls" / "operator" / "tls.crt").is_file()  # the launcher's mTLS identities
        logs = tmp_path / "grpc" / "logs"
        assert {p.stem for p in logs.glob("*.log")} == {"aggregator", "clustering", "privacy", "agent-0", "agent-1"}
    else:
        logs = tmp_path / "deployment"
        with served_deployment(logs, env) as aggregator:
            operator = ["--aggregator", aggregator, "--tls-dir", str(logs / "certs" / "operator")]
            proc = fairfl(["run", str(config), *operator, "--output", "grpc"], env, tmp_path)
            results = completed(proc, tmp_path / "grpc")
    check_plugins_ran(results, names)
    for log in logs.glob("*.log"):  # every service and agent imported the plug-ins it needed without an error
        assert "Traceback" not in log.read_text(), f"{log.name}:\n{log.read_text()[-3000:]}"
    return results


def test_user_plugins_run_in_process_over_mtls_grpc_and_in_compare(
    plugins: tuple[dict[str, str], Path, bool], tmp_path: Path
) -> None:
    names, plugin_path, launcher = plugins
    env = environment(plugin_path)
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump(experiment(names), sort_keys=False))

    # (a) in-process
    inprocess = completed(
        fairfl(["run", str(config), "--transport", "inprocess", "--output", "inprocess"], env, tmp_path),
        tmp_path / "inprocess",
    )
    check_plugins_ran(inprocess, names)
    assert inprocess["transport"] == "inprocess"
    expected = inprocess["final_model_sha256"]
    assert inprocess["rounds"][0]["model_sha256"] != expected, "training must move the model"
    assert FINAL_SHA.setdefault("inprocess", expected) == expected, (
        "module:attr and entry points ran different plug-ins"
    )

    # (b) gRPC, mutual TLS, every service and agent its own process
    grpc = run_over_grpc(config, names, launcher, env, tmp_path)
    assert grpc["transport"] == "grpc"
    assert grpc["final_model_sha256"] == expected
    for got, want in zip(grpc["rounds"], inprocess["rounds"], strict=True):
        assert got["model_sha256"] == want["model_sha256"]
        assert got["strategy_metrics"] == want["strategy_metrics"]

    # (c) inside `fairfl compare --jobs 2`: the run's seed and another, each in its own `fairfl run` worker.
    spec = {"name": "open-platform", "base": config.name, "seeds": [SEED, SEED + 1], "runs": [{"label": "plugins"}]}
    (tmp_path / "compare.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    compare = fairfl(["compare", "compare.yaml", "--jobs", "2", "--output", "compare"], env, tmp_path)
    assert compare.returncode == 0, compare.stdout[-3000:] + compare.stderr[-3000:]
    assert "2 runs, 2 at a time" in compare.stdout
    by_seed = {seed: completed(compare, tmp_path / "compare" / "plugins" / f"seed{seed}") for seed in (SEED, SEED + 1)}
    for results in by_seed.values():
        check_plugins_ran(results, names)
    assert by_seed[SEED]["final_model_sha256"] == expected
    assert by_seed[SEED + 1]["final_model_sha256"] != expected  # another seed: another initial model and data order


# --- a broken plug-in stops `fairfl run` before round 1, in one line naming the field ------------------------------

BROKEN_MODULE = "raise RuntimeError('this plug-in module is broken')\n"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        pytest.param(
            "strategy.name=fairfl_testplug_missing.strategy:CoordinateMedian",
            "error: strategy.name: cannot import module 'fairfl_testplug_missing.strategy'",
            id="not_importable",
        ),
        pytest.param(
            "model.name=broken_testplug:small_mlp",
            "error: model.name: importing module 'broken_testplug' for model 'broken_testplug:small_mlp' failed: "
            "RuntimeError: this plug-in module is broken",
            id="raises_on_import",
        ),
        pytest.param(
            f"selection.method={ENTRY_POINTS['sampler']}",  # an entry-point name without its distribution
            f"error: selection.method: unknown sampler '{ENTRY_POINTS['sampler']}'",
            id="not_installed",
        ),
        pytest.param(
            "strategy.params.norm_scale=-1",
            "error: strategy.params.norm_scale: must be > 0, got -1",
            id="bad_parameter",
        ),
        pytest.param(
            "data.params.test_evry=3",
            "error: data.params: unknown parameter 'test_evry'; valid parameters: test_every",
            id="unknown_parameter",
        ),
    ],
)
def test_a_broken_plugin_fails_before_round_one_naming_the_field(override: str, message: str, tmp_path: Path) -> None:
    (tmp_path / "broken_testplug.py").write_text(BROKEN_MODULE)
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump(experiment(MODULE_ATTR), sort_keys=False))
    env = environment(PLUGIN_PROJECT)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    proc = fairfl(["run", str(config), "--set", override, "--output", "out"], env, tmp_path)  # default: gRPC
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(message), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "round" not in proc.stdout and not (tmp_path / "out").exists()  # nothing started, nothing written
