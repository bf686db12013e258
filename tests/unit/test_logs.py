"""Log formats (fairfl.logs): text for people, one JSON object per line for collectors, chosen by `--log-format` on
every service or FAIRFL_LOG_FORMAT in any process (the agent included); a wrong choice is one line and exit 2. And
the aggregator's INFO line per round."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aggregator_service.engine import RoundEngine
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalSelector
from fairfl.config import experiment_from_dict
from fairfl.logs import ENV_LOG_FORMAT, JsonFormatter, configure_logging, log_format
from fairfl.v1 import control_pb2

REPO = Path(__file__).resolve().parents[2]
KEYS = {"time", "level", "logger", "pid", "message"}


def _record(message: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("fairfl.test", logging.WARNING, __file__, 1, message, args, exc_info)


def test_json_record_is_one_line_with_the_documented_keys() -> None:
    line = JsonFormatter().format(_record("round %d of %s:\nline two", 3, "r1"))
    assert "\n" not in line
    entry = json.loads(line)
    assert set(entry) == KEYS
    assert entry["message"] == "round 3 of r1:\nline two"
    assert entry["level"] == "WARNING" and entry["logger"] == "fairfl.test" and entry["pid"] == os.getpid()
    assert entry["time"].endswith("Z") and entry["time"][10] == "T" and len(entry["time"]) == 24  # ms, UTC


def test_json_record_carries_the_traceback_as_text() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError as err:
        line = JsonFormatter().format(_record("failed", exc=err))
    entry = json.loads(line)
    assert set(entry) == KEYS | {"exc_info"}
    assert entry["exc_info"].startswith("Traceback (most recent call last):")
    assert entry["exc_info"].rstrip().endswith("RuntimeError: boom")


def test_format_comes_from_the_argument_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_LOG_FORMAT, raising=False)
    assert log_format() == "text"
    monkeypatch.setenv(ENV_LOG_FORMAT, "JSON")
    assert log_format() == "json"
    assert log_format("text") == "text"  # the option wins over the environment
    monkeypatch.setenv(ENV_LOG_FORMAT, "yaml")
    with pytest.raises(ValueError, match=r"^FAIRFL_LOG_FORMAT must be one of text, json, got 'yaml'$"):
        log_format()
    with pytest.raises(ValueError, match=r"^--log-format must be one of text, json, got 'xml'$"):
        configure_logging("INFO", "xml")


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        check=False,
    )


def test_any_process_honours_the_environment_without_being_told() -> None:
    """What the agent does: configure_logging(level) with no format, FAIRFL_LOG_FORMAT=json in its environment."""
    code = (
        "import logging\nfrom fairfl.logs import configure_logging\nconfigure_logging('INFO')\n"
        "logging.getLogger('client_agent.agent').info('registered %d clients', 4)\n"
        "try:\n    1 / 0\nexcept ZeroDivisionError:\n    logging.getLogger('x').exception('oops')\n"
    )
    done = _python(code, {ENV_LOG_FORMAT: "json"})
    assert done.returncode == 0, done.stderr
    first, second = (json.loads(line) for line in done.stderr.splitlines())
    assert first["message"] == "registered 4 clients" and first["logger"] == "client_agent.agent"
    assert first["level"] == "INFO" and set(first) == KEYS
    assert "ZeroDivisionError" in second["exc_info"] and second["level"] == "ERROR"
    text = _python(code, {ENV_LOG_FORMAT: "text"})
    assert " I client_agent.agent[" in text.stderr and "] registered 4 clients" in text.stderr


@pytest.mark.parametrize("module", ["aggregator_service", "clustering_service", "privacy_service"])
def test_services_refuse_an_unknown_format_in_one_line(module: str, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", module, "--bind", "127.0.0.1:0", "--insecure", "--metrics-port", "-1"]
    env = {**os.environ, "PYTHONPATH": str(REPO), ENV_LOG_FORMAT: "yaml"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env, check=False)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1].endswith("error: FAIRFL_LOG_FORMAT must be one of text, json, got 'yaml'")
    assert "Traceback" not in done.stderr
    flag = subprocess.run([*argv, "--log-format", "xml"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=env, check=False)  # fmt: skip
    assert flag.returncode == 2 and "--log-format: invalid choice: 'xml'" in flag.stderr


def test_a_service_logs_json_lines_with_log_format_json(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "clustering_service", "--bind", "127.0.0.1:0", "--insecure", "--metrics-port", "-1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(ENV_LOG_FORMAT, None)
    process = subprocess.Popen(
        [*argv, "--log-format", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env=env,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("LISTENING ")  # serving: now stop it
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    entries = [json.loads(line) for line in stderr.splitlines() if line.strip()]
    assert entries and all(set(e) >= KEYS for e in entries)
    assert entries[0]["message"].startswith("serving fairfl.v1.Clustering on 127.0.0.1:0")  # logged before LISTENING


# --- the aggregator's line per round ---------------------------------------------------------------------------------


def _engine(privacy: bool) -> RoundEngine:
    config: dict[str, Any] = {
        "rounds": 5,
        "data": {"dataset": "synthetic", "num_clients": 4},
        "model": {"name": "mlp", "params": {"hidden": [8]}},
        "selection": {"method": "full" if privacy else "random", "clients_per_round": 4},
        "strategy": {"name": "fedfair" if privacy else "fedavg"},
        "runtime": {"agents": 1},
    }
    if privacy:
        config["privacy"] = {"enabled": True, "epsilon": 8.0, "sample_rate": 0.1, "noise_multiplier": 1.5}
    cfg = experiment_from_dict(config)
    return RoundEngine("r7", cfg, InProcessTransport(), LocalSelector(cfg.selection.method), LocalPrivacy(), print)


def test_round_line_reports_progress_results_fairness_loss_time_and_epsilon(caplog: pytest.LogCaptureFixture) -> None:
    event = control_pb2.RoundEvent(
        round=3,
        selected=[0, 1, 2, 2],  # a client drawn twice trains once
        results_accepted=3,
        results_rejected=1,
        results_late=2,
        duration_seconds=1.234,
        mean_train_loss=0.41234,
        evaluated=True,
        fairness=control_pb2.FairnessReport(mean=81.234, worst_5=60.5, evaluated_clients=3, missing_clients=1),
        epsilon_spent=1.23456,
    )
    with caplog.at_level(logging.INFO, logger="aggregator_service.engine"):
        _engine(privacy=True)._log_round(event, aggregated=True)
        _engine(privacy=False)._log_round(control_pb2.RoundEvent(round=4, selected=[1], duration_seconds=2), False)
    assert [r.getMessage() for r in caplog.records] == [
        "run r7 round 3/5: 3 selected, 3 accepted, 1 rejected, 2 late; accuracy mean 81.23% worst-5% 60.50% over 3 "
        "clients (1 missing); train loss 0.4123; 1.23s; ε 1.235",
        "run r7 round 4/5: 1 selected, 0 accepted, 0 rejected, 0 late; model kept; 2.00s",
    ]
