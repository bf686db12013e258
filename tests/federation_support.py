"""Shared by the security and hostile-input tests: a scripted client agent speaking the Federation API with a chosen
identity, a run started through RunControl, and reading a process's /metrics."""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from client_agent.trainer import ClientRuntime
from fairfl import codec
from fairfl.compose.launcher import Child, LocalCluster
from fairfl.config import ExperimentConfig, experiment_from_yaml
from fairfl.data import load_run_data
from fairfl.v1 import federation_pb2, federation_pb2_grpc, tensor_pb2

REPO = Path(__file__).resolve().parents[1]
RPC_TIMEOUT = 10.0


def start_aggregator(cluster: LocalCluster, name: str = "aggregator", args: Iterable[str] = ()) -> Child:
    """An aggregator process from this checkout, whatever pytest's cwd, with its own clustering-service process
    unless `args` give --clustering (the aggregator selects only through one)."""
    args = [*args]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
        mp.chdir(REPO)
        if "--clustering" not in args:
            clustering = cluster.start_service(f"{name}-clustering", "clustering_service", [])
            args = ["--clustering", clustering.address, *args]
        return cluster.start_service(name, "aggregator_service", args)


def start_service(cluster: LocalCluster, name: str, module: str, args: Iterable[str] = ()) -> Child:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
        mp.chdir(REPO)
        return cluster.start_service(name, module, [*args])


def call(fn: object, *args: object, **kwargs: object) -> tuple[grpc.StatusCode, str, object]:
    """(status code, details, response) of a unary or stream-unary call; never raises RpcError."""
    try:
        response = fn(*args, timeout=RPC_TIMEOUT, **kwargs)  # type: ignore[operator]
        return grpc.StatusCode.OK, "", response
    except grpc.RpcError as err:
        return err.code(), err.details() or "", None


class FakeAgent:
    """One agent identity (its own channel) hosting `clients`; computes correct results with the product's trainer."""

    def __init__(self, channel: grpc.Channel, name: str, clients: list[int]) -> None:
        self.channel = channel
        self.stub = federation_pb2_grpc.FederationStub(channel)
        self.name = name
        self.clients = clients
        self.agent_id = ""
        self.runtime: ClientRuntime | None = None
        self.models: dict[str, torch.Tensor] = {}

    def register(self) -> str:
        reply = self.stub.Register(
            federation_pb2.RegisterRequest(agent_name=self.name, client_ids=self.clients, device="cpu", version="t"),
            timeout=RPC_TIMEOUT,
        )
        self.agent_id = reply.agent_id
        return self.agent_id

    def prepare(self, run_id: str, config: ExperimentConfig) -> None:
        deadline = time.monotonic() + RPC_TIMEOUT
        while True:
            try:
                spec = self.stub.GetRunSpec(federation_pb2.RunSpecRequest(run_id=run_id), timeout=RPC_TIMEOUT)
                break
            except grpc.RpcError as err:  # the engine publishes the spec right after StartRun returns
                if err.code() != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        assert experiment_from_yaml(spec.experiment_yaml) == config
        data = load_run_data(config)
        self.runtime = ClientRuntime(config, data, self.clients, torch.device("cpu"), self._fetch)

    def _fetch(self, ref: tensor_pb2.BlobRef) -> torch.Tensor:
        if ref.sha256 not in self.models:
            _, tensors = codec.receive_bundle(self.stub.FetchBlob(ref, timeout=RPC_TIMEOUT))
            self.models[ref.sha256] = torch.cat([t.reshape(-1) for _, t in tensors])
        return self.models[ref.sha256]

    def poll(self, want: int, phase: int, timeout: float = 30.0) -> list[federation_pb2.Task]:
        """Poll until `want` tasks of `phase` arrived."""
        tasks: list[federation_pb2.Task] = []
        deadline = time.monotonic() + timeout
        while len(tasks) < want:
            assert time.monotonic() < deadline, f"{self.name}: got {len(tasks)} of {want} tasks"
            reply = self.stub.PollTasks(
                federation_pb2.PollRequest(agent_id=self.agent_id, max_tasks=16, wait_seconds=1.0),
                timeout=RPC_TIMEOUT,
            )
            tasks += [t for t in reply.tasks if t.phase == phase]
        return tasks

    def result_chunks(self, task: federation_pb2.Task, chunk_bytes: int = 512) -> list[federation_pb2.ResultChunk]:
        from fairfl.protocol import encode_result

        assert self.runtime is not None
        result = self.runtime.run(task)
        result.agent_id = self.agent_id
        return list(encode_result(result, self.runtime.layout, chunk_bytes=chunk_bytes))

    def submit(self, chunks: list[federation_pb2.ResultChunk]) -> tuple[grpc.StatusCode, str]:
        code, details, _ = call(self.stub.SubmitResult, iter(chunks))
        return code, details


def metric(child: Child, name: str, **labels: str) -> float:
    """Sum of the samples of `name` on the child's /metrics whose labels include `labels` (0 when none)."""
    with urllib.request.urlopen(f"http://{child.metrics_address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
