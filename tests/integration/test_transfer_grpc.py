"""The transfer path over a real aggregator process (mutual TLS): FetchBlob byte ranges and their refusals, ranges
fetched on concurrent streams, result digests in a trailer, and runs whose agents send float16 / bfloat16 updates.

A model of ~17 MB (above fetch.SEGMENT_BYTES) makes the real agent fetch it as ranges on concurrent streams.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch

from aggregator_service.engine import RoundEngine, initial_model
from fairfl import codec, fetch
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.launcher import Child, LocalCluster
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalSelector
from fairfl.config import ExperimentConfig, experiment_from_dict
from fairfl.params import ParamLayout
from fairfl.protocol import TRAIN, ClientResult, encode_result
from fairfl.rpc_channel import open_channel
from fairfl.tls import ROLE_AGENT
from fairfl.v1 import control_pb2, control_pb2_grpc, federation_pb2, tensor_pb2
from tests.federation_support import REPO, FakeAgent, call, metric, start_aggregator

pytestmark = pytest.mark.integration

torch.set_num_threads(1)
Code = grpc.StatusCode
HIDDEN = [2048, 2048]  # 60·2048 + 2048² + 2048·10 weights and biases: 17.3 MB, two fetch segments


def _config(run: str, update_dtype: str = "float32") -> ExperimentConfig:
    return experiment_from_dict(
        {
            "name": run,
            "seed": 3,
            "rounds": 1,
            "data": {"dataset": "synthetic", "num_clients": 1},
            "model": {"name": "mlp", "params": {"hidden": HIDDEN}},
            "training": {"local_steps": 2, "batch_size": 16, "lr": 0.05},
            "selection": {"method": "full", "clients_per_round": 1},
            "runtime": {"agents": 1, "round_timeout_s": 120, "register_timeout_s": 60, "device": "cpu"},
            "transport": {"update_dtype": update_dtype},
        }
    )


# -- one open training task, served to a scripted agent ---------------------------------------------------------------


@dataclass
class Open:
    aggregator: Child
    agent: FakeAgent
    task: federation_pb2.Task
    layout: ParamLayout


@pytest.fixture(scope="module")
def open_task(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Open]:
    work = tmp_path_factory.mktemp("transfer")
    config = _config("ranges")
    with LocalCluster(work / "logs") as cluster:
        aggregator = start_aggregator(cluster, args=["--rate-limit", "0"])
        with (
            cluster.open_channel(aggregator.address) as operator,
            open_channel(aggregator.address, cluster.issue("agent-0", ROLE_AGENT, [(0, 0)])) as channel,
        ):
            control = control_pb2_grpc.RunControlStub(operator)
            agent = FakeAgent(channel, "agent-0", [0])
            agent.register()
            control.StartRun(control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id="ranges"), timeout=10)
            agent.prepare("ranges", config)
            (task,) = agent.poll(1, TRAIN)
            assert agent.runtime is not None
            yield Open(aggregator, agent, task, agent.runtime.layout)
            control.StopRun(control_pb2.StopRunRequest(run_id="ranges", reason="test over"), timeout=10)


def _fetch(open_task: Open, offset: int, length: int) -> tuple[grpc.StatusCode, str, bytes]:
    ref = open_task.task.model
    request = tensor_pb2.BlobRef(sha256=ref.sha256, total_bytes=ref.total_bytes, offset=offset, length=length)
    try:
        chunks = list(open_task.agent.stub.FetchBlob(request, timeout=30))  # the generated stub: protobuf parsing
    except grpc.RpcError as err:
        return err.code(), err.details() or "", b""
    assert chunks[0].WhichOneof("part") == "header" and chunks[0].header.sha256 == ref.sha256
    assert all(c.WhichOneof("part") == "data" for c in chunks[1:])
    return Code.OK, "", b"".join(c.data for c in chunks[1:])


def test_fetch_blob_serves_byte_ranges(open_task: Open) -> None:
    total = open_task.task.model.total_bytes
    assert total == open_task.layout.nbytes > fetch.SEGMENT_BYTES
    code, _, whole = _fetch(open_task, 0, 0)
    assert code == Code.OK and hashlib.sha256(whole).hexdigest() == open_task.task.model.sha256
    for offset, length in [(0, 1), (5, 3_000_001), (total - 7, 7), (total - 7, 0), (12_345_678, 0)]:
        code, details, data = _fetch(open_task, offset, length)
        assert code == Code.OK, details
        assert data == whole[offset : offset + length if length else total], (offset, length)


OUTSIDE = {
    "offset past the end": lambda total: (total + 1, 0),
    "length past the end": lambda total: (0, total + 1),
    "range across the end": lambda total: (total - 3, 4),
    "largest offset": lambda total: (2**64 - 1, 0),
    "both huge": lambda total: (2**63, 2**63 - 1),
}


@pytest.mark.parametrize("case", OUTSIDE)
def test_fetch_blob_refuses_a_range_outside_the_blob(open_task: Open, case: str) -> None:
    total = open_task.task.model.total_bytes
    offset, length = OUTSIDE[case](total)
    refused_before = metric(open_task.aggregator, "fairfl_requests_refused_total", reason="size")
    code, details, _ = _fetch(open_task, offset, length)
    assert code == Code.OUT_OF_RANGE, (case, code, details)
    assert f"of {total} bytes" in details and "offset + length <= total_bytes" in details
    assert metric(open_task.aggregator, "fairfl_requests_refused_total", reason="size") == refused_before + 1


def test_concurrent_range_streams_fetch_the_model(open_task: Open) -> None:
    ref = open_task.task.model
    opened: list[tuple[int, int]] = []

    def open_range(offset: int, length: int) -> Iterator[tensor_pb2.Chunk]:
        opened.append((offset, length))
        request = tensor_pb2.BlobRef(sha256=ref.sha256, total_bytes=ref.total_bytes, offset=offset, length=length)
        return open_task.agent.stub.FetchBlob(request, timeout=30)

    _, buffer = fetch.fetch_ranges(
        open_range,
        ref.total_bytes,
        ref.sha256,
        lambda h: open_task.layout.check_specs(list(h.tensors)),
        max_bytes=open_task.layout.nbytes,
        streams=3,
        segment_bytes=4 * 1024 * 1024,
    )
    assert len(opened) == 5 and sorted(o for o, _ in opened) == [i * 4 * 1024 * 1024 for i in range(5)]
    flat = torch.frombuffer(buffer, dtype=torch.float32)
    assert torch.equal(flat, open_task.agent._fetch(ref))  # the plain whole-blob fetch, parsed by protobuf


def test_result_digest_in_a_trailer_is_checked(open_task: Open) -> None:
    """Refused results leave the task open, so the correct one is accepted at the end."""
    assert open_task.agent.runtime is not None
    result: ClientResult = open_task.agent.runtime.run(open_task.task)
    result.agent_id = open_task.agent.agent_id
    chunks = list(encode_result(result, open_task.layout, sha256_in_trailer=True))
    assert chunks[-1].WhichOneof("part") == "trailer"
    wrong = federation_pb2.ResultChunk(trailer=federation_pb2.ResultTrailer(sha256="0" * 64))
    cases = {
        "wrong trailer": ([*chunks[:-1], wrong], Code.DATA_LOSS, "sha256"),
        "no trailer": (chunks[:-1], Code.INVALID_ARGUMENT, "without the sha256 trailer"),
        "data after the trailer": ([*chunks, chunks[1]], Code.INVALID_ARGUMENT, "after the sha256 trailer"),
        "float16 to a float32 run": (
            list(encode_result(result, open_task.layout.with_payload_dtype("float16"), sha256_in_trailer=True)),
            Code.INVALID_ARGUMENT,
            "dtype DTYPE_FLOAT16, expected DTYPE_FLOAT32",
        ),
    }
    for name, (stream, status, phrase) in cases.items():
        code, details, _ = call(open_task.agent.stub.SubmitResult, iter(stream))
        assert code == status and phrase in details, (name, code, details)
    code, details, reply = call(open_task.agent.stub.SubmitResult, iter(chunks))
    assert code == Code.OK and reply.accepted, details


# -- whole runs with a real agent: float32 against float16 and bfloat16 updates ----------------------------------------


@pytest.fixture(scope="module")
def final_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The global model after one round with each update dtype, one real agent process (its own fetch and submit)."""
    work = tmp_path_factory.mktemp("lossy")
    models: dict[str, torch.Tensor] = {}
    with pytest.MonkeyPatch.context() as mp, LocalCluster(work / "logs") as cluster:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
        mp.chdir(REPO)
        clustering = cluster.start_service("clustering", "clustering_service", [])  # the aggregator selects through it
        aggregator = cluster.start_service("aggregator", "aggregator_service", ["--clustering", clustering.address])
        cluster.start_agents(aggregator.address, 1, 1, "cpu", 1)
        with cluster.open_channel(aggregator.address) as channel:
            control = control_pb2_grpc.RunControlStub(channel)
            for dtype in ("float32", "float16", "bfloat16"):
                config = _config(f"lossy-{dtype}", dtype)
                request = control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id=config.name)
                control.StartRun(request, timeout=30)
                events = list(control.WatchRun(control_pb2.WatchRunRequest(run_id=config.name), timeout=120))
                status = events[-1].status
                assert status.state == control_pb2.RUN_STATE_COMPLETED, status.message
                (round_event,) = [e.round for e in events if e.HasField("round")]
                assert (round_event.results_accepted, round_event.results_rejected) == (1, 0)
                _, tensors = codec.receive_bundle(
                    control.FetchModel(control_pb2.GetRunRequest(run_id=config.name), timeout=30)
                )
                models[dtype] = torch.cat([t.reshape(-1) for _, t in tensors])
        agent_log = (work / "logs" / "agent-0.log").read_text()
        assert "Traceback" not in agent_log, agent_log[-2000:]
        # Each run's model and the trained one (evaluated) came as byte ranges on concurrent streams.
        segments = len(fetch.plan_segments(initial_model(_config("x"))[0].nbytes))
        fetches = metric(aggregator, "fairfl_grpc_server_handled_total", method="FetchBlob", code="OK")
        assert segments == 2 and fetches == 3 * 2 * segments
    return models


@pytest.mark.parametrize(
    ("dtype", "unit_roundoff", "tiny"), [("float16", 2.0**-11, 2.0**-24), ("bfloat16", 2.0**-8, 0)]
)
def test_lossy_updates_change_the_model_only_by_their_rounding(
    final_models: dict[str, torch.Tensor], dtype: str, unit_roundoff: float, tiny: float
) -> None:
    """One client, one FedAvg round: x1 = x0 + u, so the lossy run differs from the lossless one by u's rounding to
    the wire dtype, plus the float32 rounding of the two additions."""
    x0 = initial_model(_config("x0"))[1]
    x32, lossy = final_models["float32"], final_models[dtype]
    update = x32 - x0
    assert update.abs().max() > 0  # the round trained
    ulp = torch.finfo(torch.float32).eps * torch.maximum(x32.abs(), lossy.abs())
    bound = unit_roundoff * (update.abs() + ulp) + tiny + 2 * ulp
    gap = (lossy - x32).abs()
    assert (gap <= bound).all(), f"largest excess {float((gap - bound).max()):.3g}"
    assert (gap > 0).any(), "the update was not rounded: the run did not use the lossy dtype"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_lossy_run_in_process_rounds_updates_as_the_wire_does(
    final_models: dict[str, torch.Tensor], dtype: str
) -> None:
    """The in-process transport rounds payloads through transport.update_dtype too: the oracle of a lossy gRPC run."""
    config = _config(f"lossy-{dtype}", dtype)
    engine = RoundEngine(
        config.name,
        config,
        InProcessTransport(),
        LocalSelector(config.selection.method),
        LocalPrivacy(),
        lambda _: None,
    )
    summary = engine.run()
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    assert torch.equal(summary.final_params, final_models[dtype])
