"""The images' entrypoints work as the manifests run them: every container of the rendered dev overlay (and, last, of
the central and site-example overlays: a real federation) is started as a local process with the command, arguments
and environment its pod gets, and must come up the way its probes expect.

What differs from the pod, and nothing else:
- `fairfl ARGS` (the image's console script) runs as `python -m fairfl.compose ARGS`: pyproject.toml maps the
  script `fairfl` to `fairfl.compose.cli:main`, which `python -m fairfl.compose` calls too (checked below); the test
  venv need not have the script installed. PYTHONPATH points at the checkout, which the image installs into its
  virtualenv instead.
- The image's ENV (the Dockerfile's runtime stage) is the base environment; PATH gets this interpreter's directory.
- Listen addresses `0.0.0.0:<port>` become `127.0.0.1:<a free port>`, so that every process can start at once, and
  FAIRFL_METRICS_PORT becomes 0 (with FAIRFL_METRICS_HOST=127.0.0.1): each process announces the port it bound
  (`LISTENING <grpc> METRICS <metrics>`).
- `<service>:<port>` addresses become `127.0.0.1:<the port given to the process behind that Service>`; a site
  agent's aggregator address (a public name outside its cluster) becomes the central aggregator's loopback port.
- Paths under the container's volume mounts (and $HOME, the working directory) move under a per-pod temporary
  directory; a ConfigMap volume gets the rendered ConfigMap's files; a site's data volume (a PersistentVolumeClaim
  mounted read-only) gets the site's files and is then made read-only.
- An agent's hostname, its StatefulSet pod name `fairfl-agent-<ordinal>`, from which it derives its clients, is set
  by replacing socket.gethostname in the child before the CLI runs.
- A Secret volume gets the files of the identity docs/deploy.md creates that Secret from: `fairfl certs DIR` is run
  once and Secret `fairfl-tls-<name>` holds DIR/<name>/ (ca.crt, tls.crt, tls.key), as `--from-file` would.
"""

from __future__ import annotations

import csv
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from fairfl.rpc_channel import open_channel, wait_for_serving
from fairfl.rpc_security import TransportSecurity
from fairfl.v1 import privacy_pb2, privacy_pb2_grpc
from tests.k8s_support import (
    COMPONENTS,
    REPO,
    SITE_DATA_MOUNT,
    Workload,
    by_component,
    env_of,
    find,
    labels_match,
    parse_dockerfile,
    quantity,
    render_overlay,
    workloads,
)

pytestmark = pytest.mark.integration

STARTUP_S = 60.0
SUBMIT = ["run", "/etc/fairfl/experiment.yaml", "--aggregator", "127.0.0.1:50051"]  # docs/deploy.md's command
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
HOSTNAME_SHIM = (
    "import socket, sys; socket.gethostname = lambda: {hostname!r}; from fairfl.compose.cli import main; "
    "sys.exit(main(sys.argv[1:]))"
)


@dataclass
class Pod:
    name: str
    workload: Workload
    root: Path
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    process: subprocess.Popen[str] | None = None
    log: list[str] = field(default_factory=list)
    grpc_port: int = 0
    health_port: int = 0
    announced_grpc_port: int = 0
    metrics_port: int = 0
    announced: threading.Event = field(default_factory=threading.Event)

    def reroot(self, path: str) -> str:
        return str(self.root / path.lstrip("/"))

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.argv, env=self.env, cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        threading.Thread(target=self._read, name=f"log-{self.name}", daemon=True).start()

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line)
            grpc_match, metrics_match = re.search(r"\bLISTENING (\d+)", line), re.search(r"\bMETRICS (\d+)", line)
            if grpc_match or metrics_match:
                self.announced_grpc_port = int(grpc_match.group(1)) if grpc_match else 0
                self.metrics_port = int(metrics_match.group(1)) if metrics_match else 0
                self.announced.set()

    def wait_announced(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while not self.announced.wait(0.2):
            assert self.process is not None
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not start (exit {self.process.poll()}):\n{self.output()}")

    def output(self) -> str:
        return "".join(self.log[-60:])

    def peak_rss_bytes(self) -> int:
        assert self.process is not None
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def _image_env() -> dict[str, str]:
    env = parse_dockerfile().stage("runtime").env()
    env["PATH"] = env["PATH"].replace("$PATH", os.environ.get("PATH", "/usr/bin:/bin"))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    return env


def _cli_argv(container: dict[str, Any], hostname: str | None) -> list[str]:
    command = [*container["command"], *container.get("args", [])]
    assert command[0] == "fairfl", command
    if hostname is None:
        return [sys.executable, "-m", "fairfl.compose", *command[1:]]
    return [sys.executable, "-c", HOSTNAME_SHIM.format(hostname=hostname), *command[1:]]


def _make_certs(tmp: Path, *options: str) -> Path:
    """The identities docs/deploy.md makes the Secrets from, by the documented command."""
    out = tmp / "certs"
    proc = subprocess.run(
        [sys.executable, "-m", "fairfl.compose", "certs", str(out), *options],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return out


def _make_pod(docs: list[dict[str, Any]], w: Workload, name: str, tmp: Path, hostname: str | None, certs: Path) -> Pod:
    c = w.container
    root = tmp / name
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in w.pod_spec.get("volumes", [])}
    pod = Pod(name, w, root, _cli_argv(c, hostname), {}, root)
    for path, mount in mounts.items():
        target = Path(pod.reroot(path))
        target.mkdir(parents=True, exist_ok=True)
        config_map = volumes.get(mount["name"], {}).get("configMap")
        if config_map:
            for key, text in find(docs, "ConfigMap", config_map["name"])["data"].items():
                (target / key).write_text(text)
        secret = volumes.get(mount["name"], {}).get("secret")
        if secret:
            identity = certs / secret["secretName"].removeprefix("fairfl-tls-")
            assert identity.is_dir(), f"no `fairfl certs` identity for Secret {secret['secretName']}"
            for file in identity.iterdir():
                (target / file.name).write_bytes(file.read_bytes())
    image_env = _image_env()
    workdir = parse_dockerfile().stage("runtime").last("WORKDIR")
    assert workdir in mounts and image_env["HOME"] in mounts, "the home directory must be a writable mount"
    pod.cwd = Path(pod.reroot(workdir))
    env = {**image_env, "HOME": pod.reroot(image_env["HOME"])}
    for key, value in env_of(c).items():
        if any(value == p or value.startswith(p.rstrip("/") + "/") for p in mounts):
            value = pod.reroot(value)
        env[key] = value
    env["PYTHONPATH"] = str(REPO)
    pod.env = env
    return pod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bind(pod: Pod) -> None:
    """Listen on loopback: the gRPC bind on a free port, the metrics endpoint on port 0 (announced)."""
    for key, value in list(pod.env.items()):
        if key == "FAIRFL_HEALTH_BIND":
            assert value.startswith("0.0.0.0:"), (key, value)
            pod.health_port = _free_port()
            pod.env[key] = f"127.0.0.1:{pod.health_port}"
        elif key.endswith("_BIND"):
            assert value.startswith("0.0.0.0:"), (key, value)
            pod.grpc_port = _free_port()
            pod.env[key] = f"127.0.0.1:{pod.grpc_port}"
        elif key == "FAIRFL_METRICS_PORT":
            pod.env[key] = "0"
            pod.env["FAIRFL_METRICS_HOST"] = "127.0.0.1"  # the pod's default is 0.0.0.0


def _wire(pod: Pod, docs: list[dict[str, Any]], pods: dict[str, Pod]) -> None:
    """Service addresses to the loopback ports of the pods behind those Services."""
    for key, value in list(pod.env.items()):
        if key.endswith("_ADDRESS"):
            host, _, _port = value.rpartition(":")
            svc = find(docs, "Service", host)
            (target,) = [p for p in pods.values() if labels_match(svc["spec"]["selector"], p.workload.labels)]
            pod.env[key] = f"127.0.0.1:{target.grpc_port}"


@dataclass
class LocalDeployment:
    docs: list[dict[str, Any]]
    pods: dict[str, Pod]
    tmp: Path

    def component(self, name: str) -> list[Pod]:
        return [p for p in self.pods.values() if p.workload.component == name]

    def one(self, name: str) -> Pod:
        (pod,) = self.component(name)
        return pod


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    docs = render_overlay("dev")
    tmp = tmp_path_factory.mktemp("pods")
    certs = _make_certs(tmp)
    comp = by_component(docs)
    pods: dict[str, Pod] = {}
    for name in COMPONENTS:
        w = comp[name]
        ordinals = range(w.replicas) if w.kind == "StatefulSet" else [None]
        for ordinal in ordinals:
            pod_name = f"{w.name}-{ordinal}" if ordinal is not None else w.name  # a StatefulSet pod's hostname
            pods[pod_name] = _make_pod(docs, w, pod_name, tmp, pod_name if name == "agent" else None, certs)
            _bind(pods[pod_name])
    try:
        for pod in pods.values():  # all at once, as a fresh deployment starts: agents retry until the aggregator is up
            _wire(pod, docs, pods)
            pod.start()
        for pod in pods.values():
            pod.wait_announced()
        yield LocalDeployment(docs, pods, tmp)
    finally:
        _stop_all(list(pods.values()))


def _stop_all(pods: list[Pod], grace: float = 30.0) -> dict[str, int]:
    """SIGTERM every process at once (as the kubelet does when the deployment is deleted), then SIGKILL what is still
    running after the grace period; the exit codes, -9 for a process that had to be killed."""
    running = {p.name: p.process for p in pods if p.process is not None and p.process.poll() is None}
    for process in running.values():
        process.terminate()
    deadline = time.monotonic() + grace
    codes = {}
    for name, process in running.items():
        try:
            codes[name] = process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            codes[name] = process.wait()
    return codes


# -------------------------------------------------------------------------------------------------------------- tests


def test_console_script_is_what_python_m_runs() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"fairfl": "fairfl.compose.cli:main"}
    main_module = (REPO / "fairfl" / "compose" / "__main__.py").read_text()
    assert "from fairfl.compose.cli import main\n" in main_module and "sys.exit(main())" in main_module


def test_every_dev_workload_was_started(deployment: LocalDeployment) -> None:
    assert sorted({p.workload.component for p in deployment.pods.values()}) == sorted(COMPONENTS)
    assert len(deployment.component("agent")) == by_component(deployment.docs)["agent"].replicas


@pytest.mark.parametrize("component", ["aggregator", "clustering", "privacy"])
def test_service_reports_serving_as_its_grpc_probe_asks(deployment: LocalDeployment, component: str) -> None:
    pod = deployment.one(component)
    assert pod.announced_grpc_port == pod.grpc_port, pod.output()
    # A kubelet gRPC probe without `service` asks for the server's overall status, in plaintext: the health port.
    wait_for_serving(f"127.0.0.1:{pod.health_port}", timeout=STARTUP_S, service="")
    # The gRPC port itself answers only mTLS with a certificate of the deployment's CA (here: the pod's own).
    wait_for_serving(f"127.0.0.1:{pod.grpc_port}", timeout=10, security=_pod_security(pod))
    with pytest.raises(TimeoutError):
        wait_for_serving(f"127.0.0.1:{pod.grpc_port}", timeout=1)
    assert pod.process is not None and pod.process.poll() is None


def _pod_security(pod: Pod) -> TransportSecurity:
    return TransportSecurity.from_dir(pod.env["FAIRFL_TLS_DIR"])


def test_privacy_ledger_is_on_the_volume(deployment: LocalDeployment) -> None:
    pod = deployment.one("privacy")
    db = env_of(pod.workload.container)["FAIRFL_PRIVACY_DB"]
    assert Path(pod.reroot(db)).is_file(), "the ledger must be created where the PersistentVolume is mounted"


def test_every_pod_serves_metrics_where_its_probes_and_prometheus_look(deployment: LocalDeployment) -> None:
    for pod in deployment.pods.values():
        assert pod.metrics_port, f"{pod.name} announced no metrics port:\n{pod.output()}"
        with urllib.request.urlopen(f"http://127.0.0.1:{pod.metrics_port}/metrics", timeout=10) as reply:
            assert reply.status == 200
            assert "# TYPE" in reply.read().decode()


def test_agents_derive_their_clients_from_their_ordinal(deployment: LocalDeployment) -> None:
    per_agent = int(env_of(by_component(deployment.docs)["agent"].container)["FAIRFL_CLIENTS_PER_AGENT"])
    aggregator = deployment.one("aggregator")
    deadline = time.monotonic() + STARTUP_S
    for agent in deployment.component("agent"):
        pattern = re.compile(rf"\({re.escape(agent.name)}:\d+, cpu\) registered {per_agent} clients")
        while not any(pattern.search(line) for line in aggregator.log):
            assert time.monotonic() < deadline, f"{agent.name} never registered:\n{agent.output()}"
            time.sleep(0.2)


def test_run_submitted_as_documented_completes(deployment: LocalDeployment) -> None:
    """docs/deploy.md's `fairfl run /etc/fairfl/experiment.yaml --aggregator 127.0.0.1:50051` from the aggregator
    pod, shortened to one round: every logical client must be hosted (the agents' ordinal ranges), and the aggregator
    must reach the privacy and clustering services at the addresses the manifests give it."""
    if not any(FASHION_MNIST.glob("train-images-idx3-ubyte*")):
        pytest.skip(f"Fashion-MNIST is not installed in {FASHION_MNIST} (Debian package dataset-fashion-mnist)")
    assert " ".join(["fairfl", *SUBMIT]) in (REPO / "docs" / "deploy.md").read_text()
    aggregator = deployment.one("aggregator")
    args = [*SUBMIT]
    args[1] = aggregator.reroot(args[1])
    args[3] = f"127.0.0.1:{aggregator.grpc_port}"
    output = deployment.tmp / "submitted"
    proc = subprocess.run(
        [sys.executable, "-m", "fairfl.compose", *args, "--rounds", "1", "--output", str(output)],
        env=aggregator.env,
        cwd=aggregator.cwd,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{aggregator.output()}"
    run_id = re.search(r"FairFL run (\S+):", proc.stdout).group(1)
    # As the aggregator (a service identity): agents may not read the ledger.
    with open_channel(f"127.0.0.1:{deployment.one('privacy').grpc_port}", _pod_security(aggregator)) as channel:
        try:
            privacy_pb2_grpc.PrivacyStub(channel).GetSpend(privacy_pb2.GetSpendRequest(run_id=run_id), timeout=10)
        except grpc.RpcError as err:
            pytest.fail(f"the aggregator did not register run {run_id} with the privacy service: {err.code().name}")


def test_peak_memory_stays_under_the_limits(deployment: LocalDeployment) -> None:
    """Peak resident memory of every process so far (after the run, when it ran) against its container's limit."""
    report = []
    for pod in deployment.pods.values():
        limit = quantity(pod.workload.container["resources"]["limits"]["memory"])
        peak = pod.peak_rss_bytes()
        report.append(f"{pod.name}: {peak / 2**20:.0f} MiB of {limit / 2**20:.0f} MiB")
        assert peak < 0.8 * limit, "; ".join(report)
    print("peak RSS: " + "; ".join(report))


def test_the_other_overlays_run_the_same_commands() -> None:
    dev = {w.component: w.container for w in workloads(render_overlay("dev"))}
    for overlay in ("gpu", "monitoring"):
        for w in workloads(render_overlay(overlay)):
            c = w.container
            assert (c["command"], c["args"]) == (dev[w.component]["command"], dev[w.component]["args"])
            assert set(env_of(c)) == set(env_of(dev[w.component])), (overlay, w.component)


def test_sigterm_stops_every_process_within_its_grace_period(deployment: LocalDeployment) -> None:
    """Last: what `kubectl delete` does to the pods. Every process drains and exits 0 within its pod's
    terminationGracePeriodSeconds (agents finish their long-poll first, so this takes a few seconds)."""
    grace = min(p.workload.pod_spec["terminationGracePeriodSeconds"] for p in deployment.pods.values())
    started = time.monotonic()
    codes = _stop_all(list(deployment.pods.values()), grace=grace)
    assert time.monotonic() - started < grace
    assert codes == {name: 0 for name in deployment.pods}, {n: p.output()[-800:] for n, p in deployment.pods.items()}


# ------------------------------------------------------------------------------------ a real federation: one site


def _site_data(directory: Path, clients: int, per_client: int) -> None:
    """The site's own files, as its operator copies them onto the data volume: one .npz per client (Fashion-MNIST
    images the site holds), named so that natural order maps them onto the site's client ids."""
    from fairfl.data.datasets import load_dataset

    train = load_dataset("fashion_mnist", "train")
    x = np.asarray(train.x, dtype=np.float32).reshape(len(train.x), 1, 28, 28)
    y = np.asarray(train.y, dtype=np.int64)
    for i in range(clients):
        rows = slice(i * per_client, (i + 1) * per_client)
        np.savez(directory / f"client-{i}.npz", x=x[rows], y=y[rows])


def _read_only(root: Path, writable: bool = False) -> None:
    for path in [root, *root.rglob("*")]:
        path.chmod((0o755 if path.is_dir() else 0o644) if writable else (0o555 if path.is_dir() else 0o444))


def test_site_agent_joins_the_central_federation(tmp_path: Path) -> None:
    """The per-site pattern end to end: the central overlay's services and the site-example overlay's agent, started
    as their pods would be, with the certificates docs/deploy.md section 6 issues (the site's identity limited to its
    clients, the aggregator's valid for the public name) and the site's data on a read-only mount. The agent reports
    its data's signature, the central experiment (shortened to one round over this one site) completes, and its
    clients are the site's."""
    if not any(FASHION_MNIST.glob("train-images-idx3-ubyte*")):
        pytest.skip(f"Fashion-MNIST is not installed in {FASHION_MNIST} (Debian package dataset-fashion-mnist)")
    from cryptography import x509

    from fairfl import tls

    central, site = render_overlay("central"), render_overlay("site-example")
    (agent_w,) = workloads(site)
    site_env = env_of(agent_w.container)
    name, ranges = site_env["FAIRFL_AGENT_NAME"], site_env["FAIRFL_CLIENTS"]
    public_host = site_env["FAIRFL_AGGREGATOR_ADDRESS"].rpartition(":")[0]
    docs_text = (REPO / "docs" / "deploy.md").read_text()
    assert f"--host {public_host}" in docs_text and f"--agent {name}={ranges}" in docs_text
    certs = _make_certs(tmp_path, "--host", public_host, "--agent", f"{name}={ranges}")
    cert = x509.load_pem_x509_certificate((certs / "aggregator" / "tls.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert public_host in names, "the sites dial the aggregator by its public name: its certificate must cover it"

    pods: dict[str, Pod] = {}
    comp = by_component(central)
    for component in ("aggregator", "clustering", "privacy"):
        w = comp[component]
        pod_name = f"{w.name}-0" if w.kind == "StatefulSet" else w.name
        pods[pod_name] = _make_pod(central, w, pod_name, tmp_path, None, certs)
        _bind(pods[pod_name])
    agent = _make_pod(site, agent_w, f"{agent_w.name}-0", tmp_path, None, certs)
    _bind(agent)
    data = Path(agent.env["FAIRFL_DATA"].split(",", 1)[0])
    assert data == Path(agent.reroot(SITE_DATA_MOUNT)), "FAIRFL_DATA is the read-only data mount"
    client_ids = [i for lo, hi in tls.parse_ranges(ranges) for i in range(lo, hi + 1)]
    _site_data(data, len(client_ids), per_client=60)
    _read_only(data)  # as the pod mounts it
    try:
        for pod in pods.values():
            _wire(pod, central, pods)
            pod.start()
        aggregator = pods["fairfl-aggregator-0"]
        aggregator.wait_announced()
        agent.env["FAIRFL_AGGREGATOR_ADDRESS"] = f"127.0.0.1:{aggregator.grpc_port}"  # fairfl.example.org, here
        agent.start()
        for pod in [*pods.values(), agent]:
            pod.wait_announced()
        config = find(central, "ConfigMap", "fairfl-experiment")["data"]["experiment.yaml"]
        assert "dataset: site" in config
        output = tmp_path / "submitted"
        args = [*SUBMIT]
        args[1], args[3] = aggregator.reroot(args[1]), f"127.0.0.1:{aggregator.grpc_port}"
        overrides = [f"data.num_clients={len(client_ids)}", "runtime.agents=1", "selection.clients_per_round=5"]
        proc = subprocess.run(
            [sys.executable, "-m", "fairfl.compose", *args, "--rounds", "1", "--output", str(output)]
            + [arg for o in overrides for arg in ("--set", o)],
            env=aggregator.env,
            cwd=aggregator.cwd,
            capture_output=True,
            text=True,
            timeout=240,
        )
        logs = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{aggregator.output()}\n{agent.output()}"
        assert proc.returncode == 0, logs
        results = json.loads((output / "results.json").read_text())
        evaluated = {int(row["client_id"]) for row in csv.DictReader((output / "clients.csv").open())}
        assert evaluated == set(client_ids), "the fairness report lists the site's clients, and only those"
        assert results["final_fairness"]["evaluated_clients"] == len(client_ids), logs
        registered = [line for line in aggregator.log if f"'{name}'" in line and f"{len(client_ids)} clients" in line]
        assert registered, f"the aggregator's log names the site and its clients:\n{logs}"
    finally:
        _stop_all([*pods.values(), agent])
        _read_only(data, writable=True)
