"""Property test: malformed result streams and tensors thrown at a real aggregator process (docs/security.md).

An aggregator runs as its own process (mutual TLS, rate limit off: this is about input validation). The test is the
agent hosting clients 0-1, starts a one-round run, takes the open training task and computes its correct result with
the product's trainer. Hypothesis then mutates that result in every way a hostile or broken client could: flipped,
dropped, duplicated, reordered, truncated, empty or extra chunks; wrong sizes, digests, tensor names, dtypes, shapes
and payload kinds; NaN and infinite values with a correct digest; bad losses, metrics and signature vectors; wrong
identities; misplaced or missing headers. Each must be refused with its fitting status and a message, within the call
deadline (no hang). Since a refused result leaves the task open, the correct result is accepted afterwards only if no
malformed one was; the process must still be alive, and every refusal counted in fairfl_requests_refused_total.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fairfl import codec
from fairfl.compose.launcher import Child, LocalCluster
from fairfl.config import experiment_from_dict
from fairfl.params import ParamLayout
from fairfl.protocol import TRAIN, UPDATE, ClientResult, encode_result
from fairfl.rpc import CHUNK_BYTES, MAX_MESSAGE_BYTES
from fairfl.rpc_channel import open_channel
from fairfl.tls import ROLE_AGENT
from fairfl.v1 import common_pb2, control_pb2, control_pb2_grpc, federation_pb2, tensor_pb2
from tests.federation_support import FakeAgent, metric, start_aggregator

pytestmark = pytest.mark.integration

torch.set_num_threads(1)

Code = grpc.StatusCode
RUN_ID = "hostile"
FEDERATION = "fairfl.v1.Federation"
CONFIG = experiment_from_dict(
    {
        "name": "hostile",
        "seed": 11,
        "rounds": 1,
        "data": {"dataset": "synthetic", "num_clients": 2},
        "model": {"name": "mlp", "params": {"hidden": [8]}},
        # loss_telemetry: FedAvg's tasks then owe their losses (a missing one is a malformed result).
        "training": {"local_steps": 2, "batch_size": 16, "lr": 0.05, "loss_telemetry": True},
        "selection": {"method": "random", "clients_per_round": 1},
        "runtime": {"agents": 1, "round_timeout_s": 300, "register_timeout_s": 30, "device": "cpu"},
    }
)
Chunks = list[federation_pb2.ResultChunk]


@dataclass
class Target:
    """The aggregator, the agent, the open task and its correct result."""

    aggregator: Child
    agent: FakeAgent
    task: federation_pb2.Task
    result: ClientResult
    layout: ParamLayout
    refused_before: float
    sent: list[str]  # cases submitted by the property test (each must be counted as one refusal)

    def chunks(self, result: ClientResult | None = None, chunk_bytes: int = 256) -> Chunks:
        return list(encode_result(result or self.result, self.layout, chunk_bytes=chunk_bytes))

    def refused(self) -> float:
        return metric(self.aggregator, "fairfl_requests_refused_total", service=FEDERATION)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    work = tmp_path_factory.mktemp("hostile")
    with LocalCluster(work / "logs") as cluster:
        aggregator = start_aggregator(cluster, args=["--rate-limit", "0"])
        with (
            cluster.open_channel(aggregator.address) as operator,
            open_channel(aggregator.address, cluster.issue("agent-0", ROLE_AGENT, [(0, 1)])) as channel,
        ):
            control = control_pb2_grpc.RunControlStub(operator)
            agent = FakeAgent(channel, "agent-0", [0, 1])
            agent.register()
            control.StartRun(control_pb2.StartRunRequest(experiment_yaml=CONFIG.to_yaml(), run_id=RUN_ID), timeout=10)
            agent.prepare(RUN_ID, CONFIG)
            (task,) = agent.poll(1, TRAIN)
            assert agent.runtime is not None
            result = agent.runtime.run(task)
            result.agent_id = agent.agent_id
            yield Target(aggregator, agent, task, result, agent.runtime.layout, 0.0, [])
            control.StopRun(control_pb2.StopRunRequest(run_id=RUN_ID, reason="test over"), timeout=10)


@pytest.fixture(scope="module")
def counted(target: Target) -> Target:
    target.refused_before = target.refused()
    return target


# -- mutations: each returns the hostile stream and the statuses that fit it ---------------------------------------

Mutation = Callable[[st.DataObject, Target, Chunks], tuple[Chunks, tuple[Code, ...]]]
INVALID = (Code.INVALID_ARGUMENT,)
CORRUPT = (Code.DATA_LOSS,)
F32 = tensor_pb2.DTYPE_FLOAT32


def _data(chunks: Chunks) -> list[int]:
    return list(range(1, len(chunks)))


def _header(chunks: Chunks) -> tuple[federation_pb2.ResultHeader, Chunks]:
    """A mutable copy of the header and the stream with it."""
    first = federation_pb2.ResultChunk()
    first.CopyFrom(chunks[0])
    return first.header, [first, *chunks[1:]]


def flip_bit(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    i = data.draw(st.sampled_from(_data(chunks)))
    raw = bytearray(chunks[i].data)
    raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    return [*chunks[:i], federation_pb2.ResultChunk(data=bytes(raw)), *chunks[i + 1 :]], CORRUPT


def swap_chunks(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    i, j = data.draw(st.lists(st.sampled_from(_data(chunks)), min_size=2, max_size=2, unique=True))
    if chunks[i].data == chunks[j].data:  # identical pieces: swapping them is no change
        j = next(k for k in _data(chunks) if chunks[k].data != chunks[i].data)
    out = list(chunks)
    out[i], out[j] = out[j], out[i]
    return out, CORRUPT  # same bytes in another order: only the digest can tell


def drop_chunk(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    i = data.draw(st.sampled_from(_data(chunks)))
    return [*chunks[:i], *chunks[i + 1 :]], INVALID


def duplicate_chunk(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    i = data.draw(st.sampled_from(_data(chunks)))
    at = data.draw(st.integers(1, len(chunks)))
    return [*chunks[:at], chunks[i], *chunks[at:]], INVALID


def truncate_tail(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    last = chunks[-1].data
    cut = data.draw(st.integers(1, len(last)))
    tail = [federation_pb2.ResultChunk(data=last[:-cut])] if cut < len(last) else []
    return [*chunks[:-1], *tail], INVALID


def extra_data(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    extra = data.draw(st.binary(min_size=1, max_size=64))
    return [*chunks, federation_pb2.ResultChunk(data=extra)], INVALID


def empty_chunk(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    at = data.draw(st.integers(1, len(chunks)))
    return [*chunks[:at], federation_pb2.ResultChunk(data=b""), *chunks[at:]], INVALID


def random_data(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    pieces = data.draw(st.lists(st.binary(max_size=3000), max_size=4))
    return [chunks[0], *(federation_pb2.ResultChunk(data=p) for p in pieces)], (Code.INVALID_ARGUMENT, Code.DATA_LOSS)


def total_bytes(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    header, out = _header(chunks)
    header.total_bytes = data.draw(st.integers(0, 2**64 - 1).filter(lambda n: n != header.total_bytes))
    return out, INVALID


def other_sha256(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    header, out = _header(chunks)
    header.sha256 = data.draw(
        st.text("0123456789abcdef", min_size=64, max_size=64).filter(lambda h: h != header.sha256)
    )
    return out, CORRUPT


def garbage_sha256(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    header, out = _header(chunks)
    header.sha256 = data.draw(st.text(max_size=80).filter(lambda h: not re.fullmatch("[0-9a-f]{64}", h)))
    return out, INVALID


def tensor_shape(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    header, out = _header(chunks)
    spec = header.payloads[0].tensors[data.draw(st.integers(0, len(t.layout.names) - 1))]
    shape = data.draw(st.lists(st.integers(-3, 1000), max_size=4).filter(lambda s: s != list(spec.shape)))
    spec.shape[:] = shape
    return out, INVALID


def tensor_dtype(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    header, out = _header(chunks)
    spec = header.payloads[0].tensors[data.draw(st.integers(0, len(t.layout.names) - 1))]
    spec.dtype = data.draw(st.integers(0, 40).filter(lambda d: d != F32))  # unknown values included
    return out, INVALID


def tensor_name(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    header, out = _header(chunks)
    spec = header.payloads[0].tensors[data.draw(st.integers(0, len(t.layout.names) - 1))]
    spec.name = data.draw(st.text(max_size=40).filter(lambda n: n != spec.name))
    return out, INVALID


def tensor_count(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    header, out = _header(chunks)
    tensors = header.payloads[0].tensors
    i = data.draw(st.integers(0, len(tensors) - 1))
    if data.draw(st.booleans()):
        del tensors[i]
    else:
        tensors.add().CopyFrom(tensors[i])
    return out, INVALID


def payload_kind(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    header, out = _header(chunks)
    if data.draw(st.booleans()):
        header.payloads[0].kind = data.draw(st.integers(0, 12).filter(lambda k: k != UPDATE))
    else:
        header.payloads.add().CopyFrom(header.payloads[0])
    return out, INVALID


def non_finite(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    """NaN and infinities in the update, with a correct size and digest: only the values are bad."""
    update = t.result.payloads[UPDATE].clone()
    positions = data.draw(st.lists(st.integers(0, update.numel() - 1), min_size=1, max_size=5))
    values = data.draw(st.lists(st.sampled_from([math.nan, math.inf, -math.inf]), min_size=1, max_size=1))
    update[positions] = values[0]
    forged = dataclasses.replace(t.result, payloads={UPDATE: update})
    return t.chunks(forged, chunk_bytes=data.draw(st.integers(16, 2048))), INVALID


def losses(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    header, out = _header(chunks)
    name = data.draw(st.sampled_from(["loss_before", "loss_after", "num_samples"]))
    if name == "num_samples":
        header.num_samples = 0  # uint64 on the wire: zero is the only count below one
    else:
        bad = st.sampled_from([math.nan, math.inf, -math.inf]) | st.floats(max_value=-1e-9, allow_infinity=False)
        setattr(header, name, data.draw(bad))
    return out, INVALID


def metrics(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    header, out = _header(chunks)
    how = data.draw(st.sampled_from(["non_finite", "duplicate", "too_many"]))
    if how == "non_finite":
        header.metrics.add(name="train_loss_x", value=data.draw(st.sampled_from([math.nan, math.inf, -math.inf])))
    elif how == "duplicate":
        header.metrics.add(name=header.metrics[0].name, value=1.0)
    else:
        header.metrics.extend(common_pb2.Metric(name=f"m{i}", value=0.0) for i in range(65))
    return out, INVALID


def signature(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    header, out = _header(chunks)
    field = data.draw(st.sampled_from(["bias_update", "activation"]))
    how = data.draw(st.sampled_from(["nan", "matrix", "integer", "short_data", "huge_shape"]))
    vector = torch.ones(10, dtype=torch.float64)
    if how == "nan":
        vector[data.draw(st.integers(0, 9))] = math.nan
    message = codec.tensor_to_proto(field, vector.reshape(2, 5) if how == "matrix" else vector)
    if how == "integer":
        message = codec.tensor_to_proto(field, torch.arange(10, dtype=torch.int32))
    elif how == "short_data":
        message.data = message.data[: data.draw(st.integers(0, len(message.data) - 1))]
    elif how == "huge_shape":
        message.spec.shape[:] = [data.draw(st.integers(1 << 17, 1 << 40))]
    getattr(header, field).CopyFrom(message)
    return out, INVALID


def identity(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    header, out = _header(chunks)
    which = data.draw(st.sampled_from(["run_id", "round", "phase", "client_id", "task_id", "agent_id"]))
    if which == "run_id":
        header.run_id = data.draw(st.text(max_size=30).filter(lambda r: r != RUN_ID))
        return out, INVALID
    if which == "round":
        header.round = data.draw(st.integers(0, 2**32 - 1).filter(lambda r: r != t.task.round))
        return out, INVALID
    if which == "phase":
        header.phase = data.draw(st.integers(0, 9).filter(lambda p: p != t.task.phase))
        return out, INVALID
    if which == "client_id":
        header.client_id = data.draw(st.integers(0, 2**32 - 1).filter(lambda c: c != t.task.client_id))
        return out, (Code.PERMISSION_DENIED, Code.NOT_FOUND)
    if which == "task_id":
        header.task_id = data.draw(st.text(max_size=60).filter(lambda i: i != t.task.task_id))
        return out, (Code.NOT_FOUND,)
    header.agent_id = data.draw(st.text(max_size=40).filter(lambda a: a != t.agent.agent_id))
    return out, (Code.PERMISSION_DENIED,)


def misplaced_header(data: st.DataObject, t: Target, chunks: Chunks) -> tuple[Chunks, tuple[Code, ...]]:
    how = data.draw(st.sampled_from(["second", "missing", "empty_stream"]))
    if how == "second":
        at = data.draw(st.integers(1, len(chunks)))
        return [*chunks[:at], chunks[0], *chunks[at:]], INVALID
    return (chunks[1:] if how == "missing" else []), INVALID


MUTATIONS: dict[str, Mutation] = {
    f.__name__: f
    for f in (
        flip_bit,
        swap_chunks,
        drop_chunk,
        duplicate_chunk,
        truncate_tail,
        extra_data,
        empty_chunk,
        random_data,
        total_bytes,
        other_sha256,
        garbage_sha256,
        tensor_shape,
        tensor_dtype,
        tensor_name,
        tensor_count,
        payload_kind,
        non_finite,
        losses,
        metrics,
        signature,
        identity,
        misplaced_header,
    )
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
@settings(
    max_examples=8,  # per kind of mutation: about 170 streams in all
    deadline=None,
    database=None,
    derandomize=True,  # the same streams on every run, so CI is reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_malformed_streams_are_refused(counted: Target, name: str, data: st.DataObject) -> None:
    base = counted.chunks(chunk_bytes=data.draw(st.integers(16, 1024)))
    chunks, fitting = MUTATIONS[name](data, counted, base)
    counted.sent.append(name)
    code, details = counted.agent.submit(chunks)
    assert code in fitting, f"{name}: {code.name} {details!r}, expected {' or '.join(c.name for c in fitting)}"
    assert details, f"{name}: refused without a message"


def test_oversized_messages_are_refused(counted: Target) -> None:
    chunks = counted.chunks()
    over_limit = federation_pb2.ResultChunk(data=bytes(MAX_MESSAGE_BYTES + 1024))
    code, details = counted.agent.submit([chunks[0], over_limit])
    assert code == Code.RESOURCE_EXHAUSTED, (code, details)  # gRPC's own receive limit; no handler code involved
    over_chunk = federation_pb2.ResultChunk(data=bytes(CHUNK_BYTES + 1))
    code, details = counted.agent.submit([chunks[0], over_chunk])
    counted.sent.append("over_chunk")
    assert code == Code.INVALID_ARGUMENT and f"chunks carry 1..{CHUNK_BYTES} bytes" in details, (code, details)
    header, huge = _header(chunks)
    header.total_bytes = 1 << 40  # would be a 1 TiB buffer if it were allocated before the check
    code, details = counted.agent.submit(huge)
    counted.sent.append("huge_total")
    assert code == Code.INVALID_ARGUMENT and "the model needs" in details, (code, details)


def test_the_correct_result_is_still_accepted_and_every_refusal_counted(counted: Target) -> None:
    """Last: no malformed stream was accepted (the task is still open), the process lives, refusals were counted."""
    assert set(MUTATIONS) <= set(counted.sent), "every kind of mutation was tried"
    assert counted.aggregator.process.poll() is None, "the aggregator died"
    code, details = counted.agent.submit(counted.chunks())
    assert code == Code.OK, (code, details)
    # The over-limit message of test_oversized_messages_are_refused is refused by gRPC itself. The handler, already
    # reading the header before it, then sees either a cancelled call (not counted) or a stream that ended early
    # (counted as a size refusal), depending on which gRPC settles first: a race, so that one may count.
    assert counted.refused() - counted.refused_before in (len(counted.sent), len(counted.sent) + 1)
