"""The clustering service as a real OS process on loopback: LISTENING handshake, health, Select/Cluster over gRPC,
status codes for bad and unimplemented requests, and a clean exit on SIGTERM."""

from __future__ import annotations

import math
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import grpc
import numpy as np
import pytest

from clustering_service.samplers import SelectionInput
from clustering_service.samplers import select as select_in_process
from clustering_service.state import RunState, Signature
from fairfl.codec import tensor_to_proto
from fairfl.rpc import SHORT_DEADLINE
from fairfl.rpc_channel import open_channel, wait_for_serving
from fairfl.v1 import clustering_pb2 as pb
from fairfl.v1 import clustering_pb2_grpc

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT = 60.0  # generous: CI machines are small and may be busy


class ServiceProcess:
    def __init__(self, proc: subprocess.Popen[str], port: int, log_path: Path) -> None:
        self.proc, self.port, self.log_path = proc, port, log_path
        self.address = f"127.0.0.1:{port}"


def _read_listening_port(stdout: IO[str], proc: subprocess.Popen[str], log_path: Path) -> int:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stdout], [], [], 0.1)
        if ready:
            line = stdout.readline()
            if line.startswith("LISTENING "):
                return int(line.split()[1])
            if not line and proc.poll() is not None:
                break
    raise RuntimeError(f"service printed no LISTENING line (exit {proc.poll()}):\n{log_path.read_text()}")


def _launch(log_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    with log_path.open("w") as log:  # logs go to a file so a chatty child can never block on a full pipe
        return subprocess.Popen(
            # Plaintext, asked for explicitly (mTLS and roles: tests/integration/test_security.py).
            [sys.executable, "-m", "clustering_service", "--bind", "127.0.0.1:0", "--insecure"],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )


def _ready(proc: subprocess.Popen[str], log_path: Path) -> ServiceProcess:
    """Read the LISTENING handshake, then wait until health says SERVING."""
    assert proc.stdout is not None
    service = ServiceProcess(proc, _read_listening_port(proc.stdout, proc, log_path), log_path)
    wait_for_serving(service.address, timeout=STARTUP_TIMEOUT, service="fairfl.v1.Clustering")
    return service


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=5)
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[subprocess.Popen[str], Path]]]:
    """Two service processes started together (start-up is mostly imports): one serves the RPC tests, the other is
    shut down by SIGTERM. Whatever happens, both are gone after the module."""
    logs = tmp_path_factory.mktemp("clustering")
    procs: dict[str, tuple[subprocess.Popen[str], Path]] = {}
    try:
        for name in ("rpc", "sigterm"):
            procs[name] = (_launch(logs / f"{name}.log"), logs / f"{name}.log")
        yield procs
    finally:
        for proc, _ in procs.values():
            _stop(proc)


@pytest.fixture(scope="module")
def service(launched: dict[str, tuple[subprocess.Popen[str], Path]]) -> ServiceProcess:
    return _ready(*launched["rpc"])


@pytest.fixture(scope="module")
def stub(service: ServiceProcess) -> Iterator[clustering_pb2_grpc.ClusteringStub]:
    with open_channel(service.address) as channel:
        yield clustering_pb2_grpc.ClusteringStub(channel)


def test_select_over_grpc_matches_in_process_oracle(stub: clustering_pb2_grpc.ClusteringStub) -> None:
    candidates = [41, 3, 17, 8, 29, 12, 33, 5]
    for round_ in range(3):
        reply = stub.Select(
            pb.SelectRequest(
                run_id="it",
                round=round_,
                num_to_select=3,
                candidates=candidates,
                sampler="random",
                seed=7,
            ),
            timeout=SHORT_DEADLINE,
        )
        oracle = select_in_process(
            "random", SelectionInput("it", round_, 3, np.asarray(candidates), seed=7), RunState("it")
        )
        assert tuple(reply.selected) == oracle.selected
        assert reply.selection_seconds >= 0.0


def test_a_user_sampler_by_module_attr_runs_inside_the_service(stub: clustering_pb2_grpc.ClusteringStub) -> None:
    # Resolved by the service through the registry: the module is imported in its process, not in the caller's.
    ref = "tests.unit.test_user_sampler:BiasNormSampler"
    rng = np.random.default_rng(5)
    bias = {c: rng.standard_normal(4) * (c + 1) for c in range(6)}
    signatures = [
        pb.ClientSignature(client_id=c, round=1, num_samples=10, bias_update=tensor_to_proto("b", bias[c]))
        for c in range(6)
    ]
    stub.ReportSignatures(pb.ReportSignaturesRequest(run_id="user", signatures=signatures), timeout=SHORT_DEADLINE)
    request = pb.SelectRequest(run_id="user", round=2, num_to_select=2, candidates=[5, 0, 3, 1], sampler=ref, seed=1)
    request.sampler_params.update({"largest": False})
    reply = stub.Select(request, timeout=SHORT_DEADLINE)
    state = RunState("user")
    state.put([Signature(c, 1, 10, bias_update=bias[c]) for c in range(6)])
    selection = SelectionInput("user", 2, 2, np.asarray([5, 0, 3, 1]), seed=1, params={"largest": False})
    smallest = sorted([5, 0, 3, 1], key=lambda c: float(np.linalg.norm(bias[c])))[:2]
    assert tuple(reply.selected) == select_in_process(ref, selection, state).selected == tuple(sorted(smallest))
    request.sampler_params.update({"largest": "no"})
    with pytest.raises(grpc.RpcError) as bad:
        stub.Select(request, timeout=SHORT_DEADLINE)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampler_params.largest: expected true or false" in bad.value.details()


def test_cluster_over_grpc(stub: clustering_pb2_grpc.ClusteringStub) -> None:
    groups = np.array([0, 0, 1, 1, 1, 0])
    rng = np.random.default_rng(0)
    rows = -rng.uniform(0.5, 3.0, size=(2, 16))[groups] + 0.01 * rng.standard_normal((6, 16))
    reply = stub.Cluster(
        pb.ClusterRequest(
            run_id="it",
            method=pb.CLUSTER_METHOD_SPECTRAL,
            num_clusters=2,
            client_ids=list(range(6)),
            rows=tensor_to_proto("rows", rows.astype(np.float32)),
            seed=3,
            true_groups=groups.tolist(),
        ),
        timeout=SHORT_DEADLINE,
    )
    assert list(reply.labels) == [0, 0, 1, 1, 1, 0]
    assert list(reply.sizes) == [3, 3]
    assert sum(reply.equal_cluster_weights) == pytest.approx(1.0)
    assert reply.nmi == pytest.approx(1.0)
    ward = stub.Cluster(
        pb.ClusterRequest(
            method=pb.CLUSTER_METHOD_HIERARCHICAL, num_clusters=2, client_ids=list(range(6)),
            rows=tensor_to_proto("rows", rows),
        ),
        timeout=SHORT_DEADLINE,
    )  # fmt: skip
    assert list(ward.labels) == list(reply.labels) and math.isnan(ward.nmi)


def test_invalid_requests(stub: clustering_pb2_grpc.ClusteringStub) -> None:
    with pytest.raises(grpc.RpcError) as bad:
        stub.Select(
            pb.SelectRequest(run_id="it", num_to_select=5, candidates=[1, 2], sampler="random"),
            timeout=SHORT_DEADLINE,
        )
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_to_select" in bad.value.details()
    with pytest.raises(grpc.RpcError) as hics:
        stub.Select(
            pb.SelectRequest(run_id="it", num_to_select=1, candidates=[1, 2], sampler="hics"),
            timeout=SHORT_DEADLINE,
        )
    assert hics.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "total_rounds" in hics.value.details()


def test_sigterm_exits_cleanly(launched: dict[str, tuple[subprocess.Popen[str], Path]]) -> None:
    svc = _ready(*launched["sigterm"])
    svc.proc.send_signal(signal.SIGTERM)
    assert svc.proc.wait(timeout=5) == 0, svc.log_path.read_text()
