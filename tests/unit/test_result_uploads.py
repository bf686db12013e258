"""Results whose payloads fit in one message go in one UploadResult call: its framing and parsing (zero-copy for the
header-then-data layout, protobuf for any other encoding), and the agent's choice between UploadResult and a
SubmitResult stream, with its fallback against an aggregator without the call. (The aggregator's checks on uploads are
tested against a real aggregator process in tests/integration/test_bad_input.py.)"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import torch

import aggregator_service.federation.servicer as federation_module
import client_agent.uploads as uploads_module
from aggregator_service.federation.servicer import FederationServicer
from aggregator_service.federation.state import FederationState
from aggregator_service.federation.transport import GrpcTransport
from client_agent.agent import Agent
from client_agent.trainer import ClientRuntime
from fairfl import framing
from fairfl.protocol import TRAIN, UPDATE, ClientResult, encode_result, encode_upload, parse_result_upload
from fairfl.rpc_refusals import refuse
from fairfl.v1 import federation_pb2, federation_pb2_grpc
from tests.unit.test_dp_sgd import synthetic_runtime


def _result(runtime: ClientRuntime, task_id: str = "r/r1/p0/c0") -> ClientResult:
    update = torch.linspace(-1.0, 1.0, runtime.layout.numel)
    return ClientResult(
        task_id=task_id,
        run_id="r",
        round=1,
        client_id=0,
        phase=TRAIN,
        num_samples=400,
        loss_before=2.0,
        loss_after=1.5,
        metrics={"train_loss": 1.7},
        payloads={UPDATE: update},
        agent_id="agent",
    )


def test_an_upload_is_the_protobuf_message_with_the_payload_hash_in_its_header() -> None:
    runtime = synthetic_runtime()
    result = _result(runtime)
    raw = encode_upload(result, runtime.layout).data
    message = federation_pb2.ResultUpload.FromString(raw)
    assert message.SerializeToString() == raw  # byte for byte what protobuf writes
    payload = result.payloads[UPDATE].numpy().tobytes()
    assert message.data == payload
    assert message.header.total_bytes == len(payload) and not message.header.sha256_in_trailer
    assert message.header.sha256 == hashlib.sha256(payload).hexdigest()
    streamed = next(encode_result(result, runtime.layout)).header  # the same header a stream starts with
    assert message.header == streamed


def test_the_parser_views_the_payload_and_leaves_other_encodings_to_protobuf() -> None:
    header = federation_pb2.ResultHeader(task_id="t", total_bytes=3, sha256="a" * 64)
    canonical = federation_pb2.ResultUpload(header=header, data=b"xyz").SerializeToString()
    fast = parse_result_upload(canonical)
    assert isinstance(fast.data, memoryview) and fast.data.obj is canonical  # a view, not a copy
    assert (fast.header, bytes(fast.data), fast.ByteSize(), fast.error) == (header, b"xyz", len(canonical), "")

    reordered = (
        federation_pb2.ResultUpload(data=b"xyz").SerializeToString()
        + federation_pb2.ResultUpload(header=header).SerializeToString()
    )
    twice = canonical + federation_pb2.ResultUpload(data=b"new").SerializeToString()  # protobuf: the last data wins
    for raw, data in ((reordered, b"xyz"), (twice, b"new")):
        assert framing.split_header_data(raw) is None
        parsed = parse_result_upload(raw)
        assert (parsed.header, bytes(parsed.data), parsed.error) == (header, data, "")

    # Cut inside the header, an unfinished varint, an invalid tag, cut inside the data: refused with a reason.
    for garbage in (b"\x0a\x05abc", b"\x0a\xff", b"\xff\xff\xff", canonical[:-1]):
        assert parse_result_upload(garbage).error.startswith("malformed ResultUpload"), garbage


class _Aggregator(federation_pb2_grpc.FederationServicer):
    """Takes results as the aggregator would; with `uploads` False it lacks UploadResult, as an older one does."""

    def __init__(self, uploads: bool) -> None:
        self.uploads_on = uploads
        self.uploads: list[federation_pb2.ResultUpload] = []
        self.streams: list[list[federation_pb2.ResultChunk]] = []

    def UploadResult(self, request: federation_pb2.ResultUpload, context: grpc.ServicerContext):
        if not self.uploads_on:
            return super().UploadResult(request, context)  # UNIMPLEMENTED, as generated
        self.uploads.append(request)
        return federation_pb2.SubmitReply(accepted=True)

    def SubmitResult(self, request_iterator: Iterator[federation_pb2.ResultChunk], context: grpc.ServicerContext):
        self.streams.append(list(request_iterator))
        return federation_pb2.SubmitReply(accepted=True)


@contextlib.contextmanager
def _agent_of(aggregator: federation_pb2_grpc.FederationServicer) -> Iterator[Agent]:
    """An agent hosting client 0, talking to `aggregator` served on a loopback port; both closed afterwards."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    federation_pb2_grpc.add_FederationServicer_to_server(aggregator, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    agent = Agent(f"127.0.0.1:{port}", [0], device="cpu")
    try:
        yield agent
    finally:
        agent.stop.set()
        agent.channel.close()
        server.stop(None)


@pytest.fixture(params=[True, False], ids=["uploads", "no-uploads"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[_Aggregator, Agent]]:
    aggregator = _Aggregator(uploads=request.param)
    with _agent_of(aggregator) as agent:
        yield aggregator, agent


def test_small_results_go_in_one_upload_and_fall_back_to_streams(served: tuple[_Aggregator, Agent]) -> None:
    aggregator, agent = served
    runtime = synthetic_runtime()
    payload = _result(runtime).payloads[UPDATE].numpy().tobytes()
    for task_id in ("r/r1/p0/c0", "r/r1/p1/c0"):
        agent.uploads._hand_over(
            uploads_module._Submission(task_id, "train", len(payload)),
            agent.uploads._open,
            _result(runtime, task_id),
            runtime,
        )
    agent.uploads.finish()
    assert agent.uploads.tasks_done == 2 and not agent.uploads._in_flight
    if aggregator.uploads_on:
        assert sorted(u.header.task_id for u in aggregator.uploads) == ["r/r1/p0/c0", "r/r1/p1/c0"]  # in flight at once
        assert all(u.data == payload for u in aggregator.uploads)
        assert agent.uploads.uploading and aggregator.streams == []
    else:
        # UNIMPLEMENTED: the first result is streamed instead, and so is every later one (no upload tried again).
        assert not agent.uploads.uploading
        assert sorted(s[0].header.task_id for s in aggregator.streams) == ["r/r1/p0/c0", "r/r1/p1/c0"]
        for stream in aggregator.streams:
            assert stream[0].header.sha256_in_trailer
            assert b"".join(c.data for c in stream[1:-1]) == payload
            assert stream[-1].trailer.sha256 == hashlib.sha256(payload).hexdigest()


def test_results_too_big_for_one_message_are_streamed(
    served: tuple[_Aggregator, Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    aggregator, agent = served
    runtime = synthetic_runtime()
    monkeypatch.setattr(uploads_module, "UPLOAD_BYTES", runtime.layout.nbytes - 1)
    agent.uploads.submit(_result(runtime), runtime)
    assert aggregator.uploads == [] and len(aggregator.streams) == 1
    assert agent.uploads.uploading  # not a fallback: the aggregator was never asked


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """The parts of a grpc.ServicerContext the servicer uses; `principal` stands in for the caller's certificate."""

    def __init__(self, principal: str) -> None:
        self.principal = principal

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata  # the refusal's reason, as a real context sends it

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


@pytest.mark.parametrize("principal", ["", "f" * 64], ids=["plaintext", "mutual-tls"])
def test_an_upload_may_leave_out_its_sha256_only_over_mutual_tls(
    principal: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = synthetic_runtime()
    state = FederationState()
    transport = GrpcTransport(state)
    transport.start_run("r", runtime.config, runtime.layout)
    agent_id = state.register("agent-0", [0], "cpu", principal=principal).agent_id
    monkeypatch.setattr(federation_module.rpc_security, "principal", lambda context: context.principal)
    servicer = FederationServicer(state)
    task = federation_pb2.Task(task_id="r/r1/p0/c0", run_id="r", round=1, phase=TRAIN, client_id=0, deadline_unix=1e12)
    task.train.local_steps = 1
    outcome: list[object] = []
    phase = threading.Thread(target=lambda: outcome.append(transport.execute([task], timeout=30.0)))
    phase.start()
    (polled,) = state.poll(agent_id, 1, wait=10.0)
    result = dataclasses.replace(_result(runtime, polled.task_id), agent_id=agent_id)
    update = result.payloads[UPDATE]

    def upload(with_sha256: bool) -> None:
        raw = encode_upload(result, runtime.layout, with_sha256=with_sha256).data
        servicer.UploadResult(parse_result_upload(raw), _Context(principal))

    if not principal:  # plaintext: the digest is the only check on the bytes, so it is required
        with pytest.raises(_Aborted) as refused:
            upload(with_sha256=False)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "sha256" in refused.value.details
        upload(with_sha256=True)  # the task is still open: the correct upload gets in
    else:
        upload(with_sha256=False)
    phase.join(timeout=30.0)
    (done,) = outcome
    (accepted,) = done.results  # type: ignore[attr-defined]
    assert torch.equal(accepted.payloads[UPDATE], update)


class _BusyAggregator(_Aggregator):
    """Turns the first `busy` result calls away with RESOURCE_EXHAUSTED, as the aggregator's access guard does when
    the caller's share of calls is taken; takes the rest."""

    def __init__(self, busy: int, reason: str) -> None:
        super().__init__(uploads=True)
        self.busy = busy
        self.reason = reason
        self.calls = 0

    def UploadResult(self, request: federation_pb2.ResultUpload, context: grpc.ServicerContext):
        self.calls += 1
        if self.calls <= self.busy:
            refuse(context, "fairfl.v1.Federation", self.reason, grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        return super().UploadResult(request, context)


@pytest.mark.parametrize(("busy", "reason"), [(2, "concurrency"), (2, "rate_limited"), (99, "capacity"), (1, "size")])
def test_a_result_turned_away_as_busy_is_sent_again(busy: int, reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uploads_module, "BUSY_RETRY_PAUSES_S", (0.01, 0.01, 0.01))
    aggregator = _BusyAggregator(busy, reason)
    with _agent_of(aggregator) as agent:
        runtime = synthetic_runtime()
        result = _result(runtime)
        size = runtime.layout.nbytes
        agent.uploads._hand_over(
            uploads_module._Submission(result.task_id, "train", size), agent.uploads._open, result, runtime
        )
        agent.uploads.finish()
    if reason == "size":  # RESOURCE_EXHAUSTED, but not busy: sending the same again would not help
        assert aggregator.calls == 1 and aggregator.uploads == [] and agent.uploads.tasks_done == 0
    elif busy == 2:  # refused twice, accepted the third time: delivered once
        assert aggregator.calls == 3 and len(aggregator.uploads) == 1 and agent.uploads.tasks_done == 1
    else:  # still busy after every pause: given up on, as any other refusal (the round goes on without it)
        assert aggregator.calls == 4 and aggregator.uploads == [] and agent.uploads.tasks_done == 0
    assert not agent.uploads._in_flight


class _BusyPolls(federation_pb2_grpc.FederationServicer):
    """Registers the agent, turns its first polls away as busy, then stops it through its third poll."""

    def __init__(self, agent: list[Agent]) -> None:
        self.agent = agent
        self.registered = 0
        self.polls = 0

    def Register(self, request: federation_pb2.RegisterRequest, context: grpc.ServicerContext):
        self.registered += 1
        return federation_pb2.RegisterReply(agent_id=f"a{self.registered}", poll_wait_seconds=0.1)

    def Heartbeat(self, request: federation_pb2.HeartbeatRequest, context: grpc.ServicerContext):
        return federation_pb2.HeartbeatReply(known=True)

    def PollTasks(self, request: federation_pb2.PollRequest, context: grpc.ServicerContext):
        self.polls += 1
        if self.polls <= 2:
            refuse(context, "fairfl.v1.Federation", "concurrency", grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        self.agent[0].stop.set()
        return federation_pb2.PollReply()


def test_a_poll_turned_away_as_busy_is_asked_again_without_registering_again() -> None:
    holder: list[Agent] = []
    aggregator = _BusyPolls(holder)
    with _agent_of(aggregator) as agent:
        holder.append(agent)
        runner = threading.Thread(target=agent.run)
        runner.start()
        runner.join(15)
        assert not runner.is_alive()
    assert (aggregator.polls, aggregator.registered) == (3, 1)  # busy is no reason to register again
    assert agent.agent_id == "a1"
