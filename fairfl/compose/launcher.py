"""Local launcher: the services and agents as separate OS processes on free loopback ports.

Each child announces its ports on stdout (`LISTENING <grpc port> METRICS <metrics port>`; an agent, which serves no
gRPC, says `METRICS <port>`), so nothing races for a port chosen in advance. Child logs go to files in the run
directory; the launcher stops every child it started on exit (SIGTERM, then SIGKILL after a grace period).

Children run in their own sessions: a Ctrl-C at the terminal reaches only the command that started them, which stops
its run in order and then its children (fairfl.compose.interrupt); it never lands in a child that is still importing.

Every connection is mutual TLS by default: the cluster makes an ephemeral CA (its key never leaves this process) and
writes one identity per child into `tls_dir` (services with role service, agents with role agent limited to their
client range, `operator` for whoever drives the cluster: `open_channel`). `tls=False` runs plaintext instead.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import grpc

from fairfl import tls as certs
from fairfl.announce import parse_announcement
from fairfl.rpc_channel import open_channel, wait_for_serving
from fairfl.rpc_security import TransportSecurity

STARTUP_TIMEOUT_S = 60.0
CLOSE_GRACE_S = 5.0  # how long close() lets children stop on SIGTERM before it kills them


@dataclass
class Child:
    name: str
    process: subprocess.Popen[str]
    log_path: Path
    port: int = 0
    metrics_port: int = 0  # 0: the child serves no /metrics

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_address(self) -> str:
        return f"127.0.0.1:{self.metrics_port}" if self.metrics_port else ""


def _pump_lines(stream: TextIO, lines: queue.Queue[str]) -> None:
    """Forward a child's stdout lines, then "" at EOF; it keeps draining the pipe so the child never blocks on it."""
    try:
        for line in stream:
            lines.put(line)
    except (OSError, ValueError):  # the launcher closed the pipe
        pass
    lines.put("")


def _announced_ports(child: Child, timeout: float) -> tuple[int, int]:
    """(gRPC port, metrics port) from the child's announcement line; 0 for a port it does not have.

    Lines are read on a helper thread, so a child that hangs without announcing (or dies) is reported after `timeout`
    instead of blocking the launcher in readline forever."""
    assert child.process.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_pump_lines, args=(child.process.stdout, lines), daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reason = f"did not announce its ports within {timeout:g}s (still running: it hangs)"
            break
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            continue
        if not line:  # EOF: the child closed stdout, normally by exiting
            try:
                code = child.process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                code = None
            reason = f"exited with code {code} before announcing its ports"
            break
        ports = parse_announcement(line)
        if ports is not None:
            return ports[0] or 0, ports[1] or 0
    tail = child.log_path.read_text()[-2000:] if child.log_path.exists() else ""
    raise RuntimeError(f"{child.name} did not start: it {reason}; log tail:\n{tail}")


@dataclass
class LocalCluster:
    """Starts and owns the processes of one local deployment."""

    log_dir: Path
    python: str = sys.executable
    metrics: bool = True  # every child serves /metrics on a free loopback port
    tls: bool = True  # mutual TLS on every connection (ephemeral CA); False: plaintext, explicitly
    tls_dir: Path | None = None  # where identities are written; default log_dir/tls
    children: list[Child] = field(default_factory=list)
    security: TransportSecurity | None = field(init=False, default=None)  # the operator's identity (role service)
    _certs: certs.LocalCertificates | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.tls:
            self._certs = certs.LocalCertificates(self.tls_dir or self.log_dir / "tls")
            self.security = self.issue("operator", certs.ROLE_SERVICE)

    def issue(self, name: str, role: str, clients: list[tuple[int, int]] | None = None) -> TransportSecurity | None:
        """A new identity signed by this cluster's CA (None on a plaintext cluster): for children, and for tests
        that play agents or operators."""
        if self._certs is None:
            return None
        return TransportSecurity.from_dir(self._certs.issue(name, role, clients))

    def open_channel(self, address: str, security: TransportSecurity | None = None) -> grpc.Channel:
        """A channel to one of the children, as the operator (or as `security`)."""
        return open_channel(address, security or self.security)

    def _transport_args(self, name: str, role: str, clients: list[tuple[int, int]] | None) -> list[str]:
        if self._certs is None:
            return ["--insecure"]
        return ["--tls-dir", str(self._certs.issue(name, role, clients))]

    def spawn(
        self,
        name: str,
        module: str,
        args: list[str],
        announce: bool,
        wait: bool = True,
        role: str = certs.ROLE_SERVICE,
        clients: list[tuple[int, int]] | None = None,
    ) -> Child:
        """Start `python -m module` as identity `name` with `role`; with `announce`, its stdout carries the port
        line, read now unless not `wait`."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        args = [*args, *self._transport_args(name, role, clients)]
        log_path = self.log_dir / f"{name}.log"
        log_file = log_path.open("w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        metrics = ["--metrics-port", "0", "--metrics-host", "127.0.0.1"] if self.metrics else ["--metrics-port", "-1"]
        process = subprocess.Popen(
            [self.python, "-m", module, *args, *metrics],
            stdout=subprocess.PIPE if announce else log_file,
            stderr=log_file,
            text=True,
            env=env,
            start_new_session=True,  # the terminal's Ctrl-C is the launcher's to handle (module docstring)
        )
        log_file.close()  # the child holds its own descriptor
        child = Child(name, process, log_path)
        self.children.append(child)
        if announce and wait:
            child.port, child.metrics_port = _announced_ports(child, STARTUP_TIMEOUT_S)
        return child

    def start_service(self, name: str, module: str, args: list[str], wait: bool = True) -> Child:
        """A service on a free loopback port; without `wait`, `ready` must be called before it is used."""
        child = self.spawn(name, module, ["--bind", "127.0.0.1:0", *args], announce=True, wait=False)
        return self.ready(child) if wait else child

    def ready(self, child: Child) -> Child:
        """Read a started service's ports and wait until it serves."""
        child.port, child.metrics_port = _announced_ports(child, STARTUP_TIMEOUT_S)
        wait_for_serving(child.address, timeout=STARTUP_TIMEOUT_S, security=self.security)
        return child

    def start_services(self, state_dir: Path, aggregator_args: Sequence[str] = ()) -> tuple[Child, Child, Child]:
        """Privacy, clustering and aggregator; `aggregator_args` adds options (e.g. --checkpoint-dir)."""
        db = str(state_dir / "privacy-ledger.sqlite")
        privacy = self.start_service("privacy", "privacy_service", ["--db", db], wait=False)
        clustering = self.start_service("clustering", "clustering_service", [], wait=False)  # side by side: both
        self.ready(privacy)  # spend seconds importing, and the aggregator needs both addresses
        self.ready(clustering)
        aggregator = self.start_service(
            "aggregator",
            "aggregator_service",
            ["--clustering", clustering.address, "--privacy", privacy.address, *aggregator_args],
        )
        return aggregator, clustering, privacy

    def start_agents(
        self,
        aggregator: str,
        num_clients: int,
        agents: int,
        device: str,
        threads: int,
        agent_args: Sequence[str] = (),
        placement: str = "partitioned",
    ) -> list[Child]:
        """`agents` agents splitting the client ids evenly (partitioned) or each hosting all of them (replicated,
        --shared-clients: the aggregator gives each task to the least-loaded agent); `agent_args` adds options to
        each."""
        if placement not in ("partitioned", "replicated"):
            raise ValueError(f"placement must be partitioned or replicated, got {placement!r}")
        started = []
        bounds = [round(i * num_clients / agents) for i in range(agents + 1)]
        shared = placement == "replicated"
        for i in range(agents):
            lo, hi = (0, num_clients - 1) if shared else (bounds[i], bounds[i + 1] - 1)
            started.append(
                self.spawn(
                    f"agent-{i}",
                    "client_agent",
                    [
                        "--aggregator",
                        aggregator,
                        "--clients",
                        f"{lo}-{hi}",
                        "--device",
                        device,
                        "--threads",
                        str(threads),
                        "--name",
                        f"agent-{i}",
                        *(["--shared-clients"] if shared else []),
                        *agent_args,
                    ],
                    announce=self.metrics,  # an agent announces only its metrics port
                    wait=False,  # agents start in parallel; their lines are read below
                    role=certs.ROLE_AGENT,
                    clients=[(lo, hi)],  # its certificate lets it host exactly its range
                )
            )
        if self.metrics:
            for child in started:
                child.port, child.metrics_port = _announced_ports(child, STARTUP_TIMEOUT_S)
        return started

    def restart(self, name: str) -> Child:
        """Start an ended child again: the same command and identity, and the same gRPC port (peers reconnect to it);
        its log goes on in the same file."""
        child = next(c for c in self.children if c.name == name)
        if child.process.poll() is None:
            raise RuntimeError(f"{name} is still running; kill it first")
        argv = [str(a) for a in child.process.args]  # type: ignore[union-attr]
        if child.port and "--bind" in argv:
            argv[argv.index("--bind") + 1] = f"127.0.0.1:{child.port}"
        announce = child.process.stdout is not None
        if child.process.stdout is not None:
            child.process.stdout.close()
        with child.log_path.open("a") as log_file:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            stdout = subprocess.PIPE if announce else log_file
            child.process = subprocess.Popen(
                argv, stdout=stdout, stderr=log_file, text=True, env=env, start_new_session=True
            )
        if announce:
            port, child.metrics_port = _announced_ports(child, STARTUP_TIMEOUT_S)
            if child.port and port != child.port:
                raise RuntimeError(f"{name} came back on port {port}, not {child.port}")
            child.port = port
        if child.port:
            wait_for_serving(child.address, timeout=STARTUP_TIMEOUT_S, security=self.security)
        return child

    def metrics_targets(self) -> dict[str, list[str]]:
        """Scrape targets of the running children by job: aggregator, clustering, privacy, agent."""
        targets: dict[str, list[str]] = {}
        for child in self.children:
            if child.metrics_port and child.process.poll() is None:
                targets.setdefault(child.name.split("-")[0], []).append(child.metrics_address)
        return targets

    def kill(self, name: str) -> None:
        for child in self.children:
            if child.name == name and child.process.poll() is None:
                child.process.kill()
                child.process.wait()

    def kill_all(self) -> int:
        """SIGKILL every running child now and reap it (a forced stop); the number killed. Safe from any thread."""
        from fairfl.compose.interrupt import kill_processes

        return kill_processes([child.process for child in list(self.children)])

    def close(self) -> None:
        """Stop every child: SIGTERM to all at once (a service that stops cancels its agents' long polls, so they
        end sooner than one by one), SIGKILL for any still running CLOSE_GRACE_S later."""
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.terminate()
        deadline = time.monotonic() + CLOSE_GRACE_S
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
            if child.process.stdout is not None:
                child.process.stdout.close()
        self.children.clear()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
