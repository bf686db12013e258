"""In-process transport: the same engine, strategies and client code without a network (oracle and fast path)."""

from __future__ import annotations

import threading

import torch

from aggregator_service.blobs import BlobStore
from aggregator_service.engine import ClientTransport, PhaseOutcome, ResultSink
from client_agent.trainer import ClientRuntime, resolve_device
from fairfl.codec import CodecError
from fairfl.config import ExperimentConfig
from fairfl.data import load_run_data
from fairfl.params import ParamLayout
from fairfl.protocol import ClientResult, as_received, check_against_task, check_result
from fairfl.v1 import federation_pb2, tensor_pb2


class InProcessTransport(ClientTransport):
    def __init__(self, device: str = "cpu", threads: int = 1) -> None:
        # Small models train fastest on one thread; several threads per process oversubscribe a few cores.
        torch.set_num_threads(threads)
        self.device = device
        self.blobs = BlobStore()
        self.runtime: ClientRuntime | None = None
        self.layout: ParamLayout | None = None
        self.stop = threading.Event()  # the run's stop event (from wait_for_clients): a phase ends at the next client

    def start_run(self, run_id: str, config: ExperimentConfig, layout: ParamLayout) -> None:
        data = load_run_data(config)
        self.layout = layout
        self.payload_dtype = layout.with_payload_dtype(config.transport.update_dtype).payload_dtype
        self.runtime = ClientRuntime(
            config, data, list(range(data.num_clients)), resolve_device(self.device), self._resolve
        )
        if self.runtime.layout != layout:
            raise RuntimeError("client model layout differs from the server's")

    def _resolve(self, ref: tensor_pb2.BlobRef) -> torch.Tensor:
        entry = self.blobs.get(ref.sha256)
        if entry is None:
            raise KeyError(f"blob {ref.sha256} not found")
        return entry[1]

    def wait_for_clients(self, num_clients: int, timeout: float, stop: threading.Event) -> None:
        assert self.runtime is not None
        self.stop = stop
        if len(self.runtime.clients) < num_clients:
            raise RuntimeError(f"{len(self.runtime.clients)} clients hosted, {num_clients} needed")

    def available_clients(self) -> list[int]:
        return sorted(self.runtime.clients) if self.runtime else []

    def publish(self, flat: torch.Tensor) -> tensor_pb2.BlobRef:
        assert self.layout is not None
        return self.blobs.put(self.layout, flat)

    def execute(
        self,
        tasks: list[federation_pb2.Task],
        timeout: float,
        quorum: int | None = None,
        on_result: ResultSink | None = None,
    ) -> PhaseOutcome:
        assert self.runtime is not None
        results: list[ClientResult] = []
        rejected = 0
        for task in sorted(tasks, key=lambda t: t.client_id):
            if quorum is not None and len(results) >= quorum:  # in-process, "first k" are the lowest client ids
                break
            if self.stop.is_set():  # the engine abandons the phase (RunStopped) as soon as it returns
                break
            result = self.runtime.run(task)
            try:
                as_received(result, self.payload_dtype)  # transport.update_dtype: what the wire would deliver
                check_result(result)
                check_against_task(result, task)
            except CodecError:
                rejected += 1
                continue
            if on_result is not None:
                on_result(result)
            results.append(result)
        done = {r.client_id for r in results}
        return PhaseOutcome(results, [t.client_id for t in tasks if t.client_id not in done], rejected=rejected)

    def end_run(self, run_id: str) -> None:
        self.blobs.clear()
