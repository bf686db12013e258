"""deploy/prometheus through Prometheus's own tools: `promtool check rules`, the rule unit tests (`promtool test rules`:
every alert fires on a synthetic bad series and stays silent on a healthy one) and `promtool check config` of the
configuration `fairfl run --monitor` generates."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from fairfl.compose.monitor import write_config

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)"),
]


def promtool(*args: str, cwd: Path = PROMETHEUS) -> str:
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


def test_rules_are_valid() -> None:
    files = sorted(str(p.relative_to(PROMETHEUS)) for p in (PROMETHEUS / "rules").glob("*.yml"))
    assert files == ["rules/alerts.yml", "rules/recording.yml"]
    output = promtool("check", "rules", *files)
    assert output.count("SUCCESS") == len(files)


def test_rule_unit_tests_pass() -> None:
    tests = sorted(str(p.relative_to(PROMETHEUS)) for p in (PROMETHEUS / "tests").glob("*.yml"))
    assert tests
    output = promtool("test", "rules", *tests)
    assert "FAILED" not in output


def test_generated_monitor_config_is_valid(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"aggregator": ["127.0.0.1:9464"], "agent": ["127.0.0.1:9465"]}, "1s")
    output = promtool("check", "config", str(config), cwd=tmp_path)
    assert "WARNING" not in output  # every target file exists
    assert "2 rule files found" in output
