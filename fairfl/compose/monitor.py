"""Local monitoring: a real Prometheus (Debian's `prometheus` package) scraping the processes of a local run.

It runs deploy/prometheus as shipped: prometheus.yml and the rule files are copied into the run's `monitor/` folder and
the scrape targets are written as file_sd target files next to them, so the local Prometheus evaluates the same
recording and alert rules as a deployment does.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy"
PROMETHEUS_DIR = DEPLOY_DIR / "prometheus"
GRAFANA_DIR = DEPLOY_DIR / "grafana"
JOBS = ("aggregator", "clustering", "privacy", "agent")
INSTALL_HINT = "install Debian's prometheus package (apt-get install prometheus), or run `make monitor` as root"


class MonitorError(RuntimeError):
    pass


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def free_port(preferred: int = 0, host: str = "127.0.0.1") -> int:
    """`preferred` when it can be bound now, else a free port (the usual small race is acceptable locally)."""
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise MonitorError("no free port")


def write_config(directory: Path, targets: dict[str, list[str]], scrape_interval: str | None = None) -> Path:
    """deploy/prometheus/prometheus.yml and its rules in `directory`, with `targets` (job -> host:port) filled in."""
    directory.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    if scrape_interval:
        config["global"]["scrape_interval"] = scrape_interval
        config["global"]["evaluation_interval"] = scrape_interval
    shutil.copytree(PROMETHEUS_DIR / "rules", directory / "rules", dirs_exist_ok=True)
    (directory / "targets").mkdir(exist_ok=True)
    for job in JOBS:
        entries = [{"targets": targets[job]}] if targets.get(job) else []
        (directory / "targets" / f"{job}.json").write_text(json.dumps(entries, indent=2))
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@dataclass
class Prometheus:
    """A Prometheus child process with its storage and config in `directory`."""

    directory: Path
    port: int
    process: subprocess.Popen[bytes] | None = None
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.directory / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(
        cls,
        directory: Path,
        targets: dict[str, list[str]],
        port: int = 0,
        scrape_interval: str | None = None,
        timeout: float = 30.0,
    ) -> Prometheus:
        binary = prometheus_binary()
        if binary is None:
            raise MonitorError(f"prometheus not found on PATH; {INSTALL_HINT}")
        directory = directory.resolve()  # Prometheus runs in it: a relative path would be read from inside itself
        config = write_config(directory, targets, scrape_interval)
        prometheus = cls(directory, free_port(port))
        with prometheus.log_path.open("wb") as log:
            prometheus.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{prometheus.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=directory,
            )
        try:
            prometheus.wait_ready(timeout)
        except BaseException:
            prometheus.stop()
            raise
        return prometheus

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise MonitorError(f"prometheus exited ({self.process.returncode}); log:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise MonitorError(f"prometheus not ready after {timeout:.0f}s; log:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; returns `data`, raises MonitorError on an API error."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=5.0) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as err:
            body = json.load(err)
        if body.get("status") != "success":
            raise MonitorError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """Instant query: (labels, value) per series."""
        data = self.api("query", query=expr)
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def describe(prometheus: Prometheus, targets: dict[str, list[str]]) -> str:
    """Where to look, for a person watching the run."""
    lines = [
        f"monitoring: Prometheus at {prometheus.url} (graph; {prometheus.url}/alerts; {prometheus.url}/targets), "
        f"data and config in {prometheus.directory}",
    ]
    for job in JOBS:
        for address in targets.get(job, []):
            lines.append(f"  {job:<11} http://{address}/metrics")
    lines += [
        f"  Grafana: dashboards in {GRAFANA_DIR / 'dashboards'}, provisioning in {GRAFANA_DIR / 'provisioning'}; e.g.",
        f"    docker run --rm --network host -e FAIRFL_PROMETHEUS_URL={prometheus.url} "
        f"-v {GRAFANA_DIR / 'provisioning'}:/etc/grafana/provisioning:ro "
        f"-v {GRAFANA_DIR / 'dashboards'}:/var/lib/grafana/dashboards/fairfl:ro grafana/grafana  (then :3000)",
        "  docs/observability.md lists every metric and alert",
    ]
    return "\n".join(lines)
