"""Shared pieces of the benchmark scripts (scripts/bench_*.py): the figures JSON every script writes, the machine it
ran on, /proc readings (CPU time, peak memory), a byte-counting TCP proxy, and a traced `fairfl run` over gRPC.

A script's JSON (`--json PATH`) is what scripts/bench_report.py renders into docs/benchmarks.md:

    {"benchmark": "round", "command": "...", "machine": {...}, "quick": false, "elapsed_s": 81.2,
     "figures": [{"name": "...", "value": 1.08, "unit": "x", "target": {"op": "<=", "value": 1.15}, "note": "..."}],
     "notes": ["..."], "details": {...}}

A figure without `target` is reported as measured (no pass/fail). `value` None means "not measured" (the note says
why), which never passes a target.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fairfl.cores import usable_cores  # noqa: E402  (the repository on the path first)

os.environ.setdefault("OMP_NUM_THREADS", "1")  # every process a benchmark starts inherits one intra-op thread

TARGET_OPS = ("<=", ">=")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# --- figures ------------------------------------------------------------------------------------------------------


def figure(
    name: str,
    value: float | None,
    unit: str = "",
    target: tuple[str, float] | None = None,
    note: str = "",
    key: str = "",
) -> dict[str, Any]:
    """One reported figure; `target` is (op, bound) with op '<=' or '>='. `key` names it for tests and other tools."""
    out: dict[str, Any] = {"name": name, "value": value, "unit": unit}
    if key:
        out["key"] = key
    if target is not None:
        op, bound = target
        if op not in TARGET_OPS:
            raise ValueError(f"target op must be one of {TARGET_OPS}, got {op!r}")
        out["target"] = {"op": op, "value": bound}
    if note:
        out["note"] = note
    return out


def command_line() -> str:
    """The command that ran this script, relative to the repository root when possible (for the report)."""
    script = Path(sys.argv[0]).resolve()
    with suppress(ValueError):
        script = script.relative_to(REPO)
    return " ".join(["python", str(script), *sys.argv[1:]])


def write_result(
    path: Path | None,
    benchmark: str,
    figures: list[dict[str, Any]],
    started: float,
    quick: bool = False,
    notes: list[str] | None = None,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Print the figures and, with `path`, write the script's JSON there. Returns the JSON object."""
    result = {
        "benchmark": benchmark,
        "command": command_line(),
        "machine": machine_info(),
        "quick": quick,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "figures": figures,
        "notes": notes or [],
        "details": details or {},
    }
    print(f"\n{benchmark}: {len(figures)} figures")
    for f in figures:
        value = "not measured" if f["value"] is None else f"{f['value']:.4g} {f['unit']}".rstrip()
        target = f" (target {f['target']['op']} {f['target']['value']:g})" if "target" in f else ""
        print(f"  {f['name']}: {value}{target}")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, allow_nan=False, default=_json_default) + "\n")
    return result


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy and torch scalars
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to the figures JSON")


# --- the machine --------------------------------------------------------------------------------------------------


def _first_line(path: str, prefix: str) -> str:
    with suppress(OSError), open(path) as fh:
        for line in fh:
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    return ""


def _gpu() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    except Exception:  # a broken CUDA install is "no GPU" for the report
        pass
    return "none"


def _git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{head}{' (with uncommitted changes)' if dirty else ''}"


def machine_info() -> dict[str, Any]:
    """What a figure depends on: CPU, cores, memory, GPU, versions, load and date."""
    import grpc
    import numpy
    import torch

    mem_kib = _first_line("/proc/meminfo", "MemTotal").split()
    usable = usable_cores()
    return {
        "cpu": _first_line("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "ram_gib": round(int(mem_kib[0]) / 2**20, 1) if mem_kib else None,
        "gpu": _gpu(),
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "numpy": numpy.__version__,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


# --- /proc readings -----------------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            # The command name (field 2) may hold spaces: split after its closing parenthesis.
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime (fields 14 and 15 of stat)


def children_cpu_seconds() -> float:
    """User + system CPU time of this process's live children (the in-process transport's worker processes)."""
    pid = os.getpid()
    children: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                children += [int(c) for c in fh.read().split()]
        except OSError:
            continue
    return sum(cpu_seconds(child) for child in children)


def peak_rss_bytes(pid: int) -> int | None:
    """The resident-set high-water mark of a live process (VmHWM), None when it cannot be read."""
    value = _first_line(f"/proc/{pid}/status", "VmHWM")
    return int(value.split()[0]) * 1024 if value else None


def self_peak_rss_bytes() -> int:
    return peak_rss_bytes(os.getpid()) or 0


# --- Prometheus text scrape ---------------------------------------------------------------------------------------


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(address: str, timeout: float = 10.0) -> Samples:
    """Every sample of a /metrics endpoint: (sample name, sorted labels) -> value. Empty when it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metric(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and wanted <= set(lab))


# --- byte-counting TCP proxy --------------------------------------------------------------------------------------


class ByteCountingProxy:
    """A loopback TCP proxy in front of one server that counts every byte it forwards, each way.

    Whatever the peers put on the wire (TLS records, HTTP/2 frames, gRPC and protobuf framing, pings) passes through
    and is counted: `sent_to_server` (client → server) and `sent_to_client` (server → client) are exact byte counts
    of the TCP payloads forwarded so far. One thread per direction per connection; each counter has one writer.
    """

    BUFFER = 1 << 18

    def __init__(self, target: str, host: str = "127.0.0.1") -> None:
        target_host, _, target_port = target.rpartition(":")
        self.target = (target_host or "127.0.0.1", int(target_port))
        self.listener = socket.create_server((host, 0))
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._counters: list[list[int]] = []  # per connection: [to server, to client]
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self.connections = 0
        self._acceptor = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as gRPC sets it: no added latency
            counter = [0, 0]
            with self._lock:
                if self._closed.is_set():
                    client.close()
                    upstream.close()
                    return
                self.connections += 1
                self._counters.append(counter)
                self._sockets += [client, upstream]
                for src, dst, slot in ((client, upstream, 0), (upstream, client, 1)):
                    thread = threading.Thread(target=self._pump, args=(src, dst, counter, slot), daemon=True)
                    self._threads.append(thread)
                    thread.start()

    def _pump(self, src: socket.socket, dst: socket.socket, counter: list[int], slot: int) -> None:
        buffer = bytearray(self.BUFFER)
        view = memoryview(buffer)
        try:
            while True:
                n = src.recv_into(buffer)
                if n == 0:
                    break
                dst.sendall(view[:n])
                counter[slot] += n
        except OSError:
            pass
        with suppress(OSError):
            dst.shutdown(socket.SHUT_WR)  # pass the half-close on, so the other side sees EOF too

    def counts(self) -> tuple[int, int]:
        """(bytes client → server, bytes server → client) forwarded so far."""
        with self._lock:
            counters = list(self._counters)
        return sum(c[0] for c in counters), sum(c[1] for c in counters)

    @property
    def total(self) -> int:
        return sum(self.counts())

    def close(self) -> None:
        self._closed.set()
        with suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() that close() alone leaves blocked
        self.listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in [self._acceptor, *self._threads]:
            thread.join(timeout=5.0)

    def __enter__(self) -> ByteCountingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- a traced `fairfl run` over gRPC ------------------------------------------------------------------------------


@dataclass
class RunTrace:
    """What a traced gRPC run observed: every event with its arrival time, CPU time of every process at each round
    event, the processes' peak memory and /metrics at the end."""

    run_id: str
    config: Any
    state: str = ""
    message: str = ""
    started: float = 0.0  # monotonic, when StartRun was sent
    rounds: list[Any] = field(default_factory=list)  # RoundEvents in arrival order
    arrivals: list[float] = field(default_factory=list)  # monotonic arrival time of each RoundEvent
    cpu: list[dict[str, float]] = field(default_factory=list)  # per RoundEvent: process name -> CPU seconds
    peak_rss: dict[str, int | None] = field(default_factory=dict)  # process name -> VmHWM bytes at the end
    metrics: dict[str, Samples] = field(default_factory=dict)  # process name -> /metrics at the end
    snapshots: dict[int, dict[str, Samples]] = field(default_factory=dict)  # round -> /metrics when its event came
    client_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # agent name -> (lo, hi) client ids
    registered_clients: int = 0
    bytes_to_server: int = 0  # through the proxy, when agents dialled one
    bytes_to_client: int = 0
    proxy_connections: int = 0

    @property
    def completed(self) -> bool:
        return self.state == "RUN_STATE_COMPLETED"

    def round_wall(self, skip: int = 1) -> tuple[float, int]:
        """(seconds per round, rounds measured): wall time between the arrival of round `skip`'s event and the last
        one, over the rounds in between; round 1 (agents fetch the spec and load data) is the setup left out."""
        if len(self.arrivals) <= skip:
            raise RuntimeError(f"only {len(self.arrivals)} rounds arrived; need more than {skip}")
        n = len(self.arrivals) - skip
        return (self.arrivals[-1] - self.arrivals[skip - 1]) / n, n

    def round_cpu(self, skip: int = 1) -> dict[str, float]:
        """CPU seconds per round of each process over the same window as round_wall."""
        first, last = self.cpu[skip - 1], self.cpu[-1]
        n = len(self.cpu) - skip
        return {name: (last[name] - first.get(name, 0.0)) / n for name in last}


def run_grpc_traced(
    config: Any,
    workdir: Path,
    proxy: bool = False,
    tls: bool = True,
    on_round: Callable[[Any], None] | None = None,
    snapshot_rounds: frozenset[int] = frozenset(),
    profile_dir: Path | None = None,
) -> RunTrace:
    """Run `config` as `fairfl run` does over gRPC: privacy, clustering and aggregator services (checkpointing into
    workdir) and `runtime.agents` client agents as processes, mutual TLS with an ephemeral CA, /metrics on every
    process. With `proxy`, agents dial the aggregator through a ByteCountingProxy; `snapshot_rounds`: scrape every
    /metrics endpoint when those rounds' events arrive (to leave setup out of telemetry); `profile_dir`: every child
    runs under scripts/stack_sampler.py and leaves `<name>.stacks` there. Returns the trace."""
    import grpc

    from fairfl.compose.cli import follow_run
    from fairfl.compose.launcher import LocalCluster
    from fairfl.v1 import control_pb2, control_pb2_grpc

    run_id = f"bench-{config.name}-{int(time.time())}"
    trace = RunTrace(run_id, config)
    python = sys.executable if profile_dir is None else str(_profiling_python(profile_dir))
    with LocalCluster(workdir / "logs", python=python, tls=tls, tls_dir=workdir / "tls") as cluster:
        aggregator, _, _ = cluster.start_services(workdir, ["--checkpoint-dir", str(workdir / "checkpoints")])
        with _maybe_proxy(aggregator.address, proxy) as counting:
            address = counting.address if counting is not None else aggregator.address
            agents = cluster.start_agents(
                address,
                config.data.num_clients,
                config.runtime.agents,
                config.runtime.device,
                config.runtime.threads_per_agent,
                placement=config.agent_placement(),
            )
            if config.agent_placement() == "replicated":  # every agent hosts every client
                trace.client_ranges = {a.name: (0, config.data.num_clients - 1) for a in agents}
            else:
                bounds = [round(i * config.data.num_clients / len(agents)) for i in range(len(agents) + 1)]
                trace.client_ranges = {a.name: (bounds[i], bounds[i + 1] - 1) for i, a in enumerate(agents)}
            pids = {child.name: child.process.pid for child in cluster.children}

            def on_event(event: Any) -> None:
                now = time.monotonic()
                if event.HasField("round"):
                    trace.rounds.append(event.round)
                    trace.arrivals.append(now)
                    trace.cpu.append({name: cpu_seconds(pid) for name, pid in pids.items()})
                    if event.round.round in snapshot_rounds:
                        trace.snapshots[event.round.round] = {
                            c.name: scrape(c.metrics_address) for c in cluster.children if c.metrics_port
                        }
                    if on_round is not None:
                        on_round(event.round)
                else:
                    trace.state = control_pb2.RunState.Name(event.status.state)
                    trace.message = event.status.message
                    trace.registered_clients = max(trace.registered_clients, event.status.registered_clients)

            with cluster.open_channel(aggregator.address) as channel:
                control = control_pb2_grpc.RunControlStub(channel)
                trace.started = time.monotonic()
                control.StartRun(
                    control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id=run_id), timeout=30
                )
                try:
                    follow_run(control, run_id, on_event, reconnect_s=0.0)
                except grpc.RpcError as err:
                    trace.state = trace.state or "RPC_FAILED"
                    trace.message = f"{err.code().name}: {err.details()}"
            for child in cluster.children:
                trace.peak_rss[child.name] = peak_rss_bytes(child.process.pid)
                if child.metrics_port:
                    trace.metrics[child.name] = scrape(child.metrics_address)
            if counting is not None:
                trace.bytes_to_server, trace.bytes_to_client = counting.counts()
                trace.proxy_connections = counting.connections
    if profile_dir is not None:  # the children wrote <pid>.stacks as they exited
        for name, pid in pids.items():
            written = profile_dir / f"{pid}.stacks"
            if written.exists():
                written.replace(profile_dir / f"{name}.stacks")
    return trace


def _profiling_python(directory: Path) -> Path:
    """An interpreter stand-in that runs `-m module ...` under the stack sampler, writing <directory>/<pid>.stacks."""
    directory.mkdir(parents=True, exist_ok=True)
    wrapper = directory / "python-sampled"
    sampler = Path(__file__).resolve().with_name("stack_sampler.py")
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{sampler}" "{directory}/$$.stacks" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


@contextmanager
def _maybe_proxy(target: str, wanted: bool) -> Iterator[ByteCountingProxy | None]:
    if not wanted:
        yield None
        return
    with ByteCountingProxy(target) as proxy:
        yield proxy


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Any:
    from fairfl.config import load_experiment

    return load_experiment(str(path), overrides or {})


def with_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """A validated copy of `config` with dotted-path overrides (as `fairfl run --set`)."""
    from fairfl.config import apply_overrides, experiment_from_dict

    return experiment_from_dict(apply_overrides(config.to_dict(), overrides))


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
