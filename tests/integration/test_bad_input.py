"""Bad input at the Federation API: malformed, misaddressed, duplicate and late results are refused with a fitting
gRPC status and an actionable message, the round goes on, and the global model is exactly the oracle's.

The aggregator runs as a real OS process (selection and privacy accounting in-process). The test itself plays two
client agents: it registers them, polls their tasks, computes every correct result with the product's
`ClientRuntime`, and before (or after) submitting it sends the bad variants planned for that task. One run is driven
once per module; each case is then checked by its own test against what was observed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch

from aggregator_service.engine import RoundEngine, initial_model
from client_agent.trainer import ClientRuntime
from fairfl import codec, framing
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.launcher import LocalCluster
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalSelector
from fairfl.config import ExperimentConfig, experiment_from_dict, experiment_from_yaml
from fairfl.data import load_run_data
from fairfl.params import ParamLayout
from fairfl.protocol import EVALUATE, TRAIN, UPDATE, ClientResult, encode_result, encode_upload, parse_result_upload
from fairfl.tls import ROLE_AGENT
from fairfl.v1 import control_pb2, control_pb2_grpc, federation_pb2, federation_pb2_grpc, tensor_pb2

pytestmark = pytest.mark.integration

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "badinput"
Code = grpc.StatusCode
OK = Code.OK
RPC_TIMEOUT = 10.0
DRIVE_TIMEOUT_S = 45.0
AGENT_CLIENTS = {"agent-a": [0, 1], "agent-b": [2, 3]}

CONFIG = {
    "name": "bad-input",
    "seed": 3,
    "rounds": 3,
    "data": {"dataset": "synthetic", "num_clients": 4},
    "model": {"name": "mlp", "params": {"hidden": [8]}},
    # loss_telemetry: FedAvg's tasks then owe their losses, so the NaN-loss cases are refusals, not withheld values.
    "training": {"local_steps": 3, "batch_size": 16, "lr": 0.05, "loss_telemetry": True},
    "selection": {"method": "random", "clients_per_round": 2},
    "evaluation": {"every": 1},
    # The withheld evaluation result makes round 1 wait for this deadline once; everything else answers at once.
    "runtime": {"agents": 2, "round_timeout_s": 6, "register_timeout_s": 30, "device": "cpu"},
}


# -- bad results, built from the correct one -----------------------------------------------------------------------


@dataclass
class Ctx:
    """What a probe needs to forge a bad variant of one task's correct result."""

    task: federation_pb2.Task
    result: ClientResult
    layout: ParamLayout
    other_agent_id: str
    sibling_client: int  # another client hosted by the same agent

    def chunks(self, result: ClientResult | None = None, chunk_bytes: int = 256) -> list[federation_pb2.ResultChunk]:
        # Small chunks, so that several data messages follow the header even for this tiny model.
        return list(encode_result(result or self.result, self.layout, chunk_bytes=chunk_bytes))

    def with_update(self, update: torch.Tensor) -> list[federation_pb2.ResultChunk]:
        forged = dataclasses.replace(self.result, payloads={**self.result.payloads, UPDATE: update})
        return self.chunks(forged)

    def edited(self, edit: Callable[[federation_pb2.ResultHeader], None]) -> list[federation_pb2.ResultChunk]:
        chunks = self.chunks()
        edit(chunks[0].header)
        return chunks


def _header(chunks: list[federation_pb2.ResultChunk]) -> federation_pb2.ResultHeader:
    return chunks[0].header


def wrong_shape(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    def edit(h: federation_pb2.ResultHeader) -> None:
        spec = h.payloads[0].tensors[0]
        spec.shape[:] = list(reversed(spec.shape))  # same byte count, transposed layout

    return ctx.edited(edit)


def wrong_tensor_count(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    def edit(h: federation_pb2.ResultHeader) -> None:
        del h.payloads[0].tensors[-1]

    return ctx.edited(edit)


def wrong_dtype(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    """A consistent float64 update: specs, byte count and digest all agree, only the dtype is not the model's."""
    bundle = codec.encode_bundle(ctx.layout.split(ctx.result.payloads[UPDATE].double()))
    chunks = ctx.chunks()
    header = _header(chunks)
    del header.payloads[:]
    header.payloads.append(federation_pb2.Payload(kind=UPDATE, tensors=bundle.specs))
    header.total_bytes = bundle.total_bytes
    header.sha256 = bundle.sha256
    data = [federation_pb2.ResultChunk(data=piece) for piece in framing.iter_byte_chunks(bundle.buffers, 256)]
    return [chunks[0], *data]


def nan_update(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    update = ctx.result.payloads[UPDATE].clone()
    update[5] = math.nan
    return ctx.with_update(update)  # digest recomputed: only the values are bad


def inf_update(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    update = ctx.result.payloads[UPDATE].clone()
    update[-1] = math.inf
    return ctx.with_update(update)


def nan_loss(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    return ctx.edited(lambda h: setattr(h, "loss_after", math.nan))


def nan_bias_update(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    vector = torch.zeros(10, dtype=torch.float64)
    vector[2] = math.nan
    return ctx.edited(lambda h: h.bias_update.CopyFrom(codec.tensor_to_proto("bias_update", vector)))


def missing_update(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    return ctx.chunks(dataclasses.replace(ctx.result, payloads={}))


def corrupted(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    chunks = ctx.chunks()
    data = bytearray(chunks[1].data)
    data[7] ^= 0x01  # one flipped bit, declared digest unchanged
    chunks[1] = federation_pb2.ResultChunk(data=bytes(data))
    return chunks


def missing_sha256(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    # The payload itself is the correct one, so if the server wrongly takes it nothing downstream changes.
    return ctx.edited(lambda h: h.ClearField("sha256"))


def truncated(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    return ctx.chunks()[:-1]


def extra_bytes(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    return [*ctx.chunks(), federation_pb2.ResultChunk(data=b"\x00" * 8)]


def unknown_client(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    return ctx.edited(lambda h: setattr(h, "client_id", 99))


def other_client(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    return ctx.edited(lambda h: setattr(h, "client_id", ctx.sibling_client))


def other_agent(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    return ctx.edited(lambda h: setattr(h, "agent_id", ctx.other_agent_id))


def anonymous_agent(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    # A certificate may run many agents (both agents here share one): omitting agent_id must not pass as the client's.
    return ctx.edited(lambda h: h.ClearField("agent_id"))


def wrong_round(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    return ctx.edited(lambda h: setattr(h, "round", 7))


def wrong_phase(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    return ctx.edited(lambda h: setattr(h, "phase", federation_pb2.PHASE_TRAIN))


def unknown_task(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    # An id of a task that was never issued (what ids looked like before they became keyed MACs).
    return ctx.edited(lambda h: setattr(h, "task_id", f"{RUN_ID}/r9/p0/c{ctx.task.client_id}"))


def no_header(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    return ctx.chunks()[1:]


def empty_stream(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    return []


def second_header(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    chunks = ctx.chunks()
    return [*chunks[:2], chunks[0], *chunks[2:]]


def accuracy_out_of_range(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    return ctx.edited(lambda h: setattr(h, "test_accuracy", 150.0))


def nan_test_loss(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    return ctx.edited(lambda h: setattr(h, "test_loss", math.nan))


def evaluation_with_payload(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    return ctx.chunks(dataclasses.replace(ctx.result, payloads={UPDATE: torch.zeros(ctx.layout.numel)}))


def declares_payload_bytes(ctx: Ctx) -> list[federation_pb2.ResultChunk]:
    """An evaluation header in a SubmitResults batch that announces payload bytes (those must be streamed)."""
    return ctx.edited(lambda h: setattr(h, "total_bytes", ctx.layout.nbytes))


def _upload_parts(ctx: Ctx, result: ClientResult | None = None) -> tuple[federation_pb2.ResultHeader, bytes]:
    upload = federation_pb2.ResultUpload.FromString(encode_upload(result or ctx.result, ctx.layout).data)
    return upload.header, upload.data


def _upload(header: federation_pb2.ResultHeader, data: bytes) -> bytes:
    return federation_pb2.ResultUpload(header=header, data=data).SerializeToString()


def upload_corrupted(ctx: Ctx) -> bytes:
    header, data = _upload_parts(ctx)
    return _upload(header, data[:-1] + bytes([data[-1] ^ 0xFF]))


def upload_size_mismatch(ctx: Ctx) -> bytes:
    header, data = _upload_parts(ctx)
    header.total_bytes += 4
    return _upload(header, data)


def upload_with_trailer(ctx: Ctx) -> bytes:
    header, data = _upload_parts(ctx)
    header.sha256_in_trailer = True
    return _upload(header, data)


def upload_malformed(ctx: Ctx) -> bytes:
    return b"\x0a\x05abc"  # a header field announcing 5 bytes, cut after 3


def upload_nan_update(ctx: Ctx) -> bytes:
    update = ctx.result.payloads[UPDATE].clone()
    update[0] = float("nan")
    return encode_upload(dataclasses.replace(ctx.result, payloads={UPDATE: update}), ctx.layout).data


def upload_reordered(ctx: Ctx) -> bytes:
    """The correct result with its data field before its header: valid protobuf, so accepted like any other."""
    header, data = _upload_parts(ctx)
    raw = federation_pb2.ResultUpload(data=data).SerializeToString() + _upload(header, b"")
    assert framing.split_header_data(raw) is None  # not the layout the fast parser takes
    return raw


Probe = Callable[[Ctx], list[federation_pb2.ResultChunk]]
UploadProbe = Callable[[Ctx], bytes]


@dataclass
class Plan:
    before: list[tuple[str, Probe]] = field(default_factory=list)  # sent before the correct result
    duplicate: str = ""  # case name: resend the accepted result at once, while the phase is still open
    withhold: str = ""  # case name: send the correct result only after the round has closed
    # Sent with the correct result in one SubmitResults call (headers only), each answered on its own.
    batch: list[tuple[str, Probe]] = field(default_factory=list)
    oversized_batch: str = ""  # case name: a SubmitResults call of more headers than it may carry, before the rest
    # UploadResult calls (one message each) sent before the correct result, which then goes by UploadResult too,
    # encoded with its fields in the other order (valid protobuf the fast parser leaves to protobuf).
    upload: list[tuple[str, UploadProbe]] = field(default_factory=list)


# Keyed by (round, phase, position of the task among that phase's tasks as they were polled).
PLANS: dict[tuple[int, int, int], Plan] = {
    (1, TRAIN, 0): Plan(
        before=[
            ("wrong_shape", wrong_shape),
            ("wrong_tensor_count", wrong_tensor_count),
            ("wrong_dtype", wrong_dtype),
            ("nan_update", nan_update),
            ("inf_update", inf_update),
            ("nan_loss", nan_loss),
            ("corrupted_bytes", corrupted),
            ("truncated_stream", truncated),
            ("extra_bytes", extra_bytes),
            ("unknown_client", unknown_client),
            ("other_client", other_client),
            ("other_agent", other_agent),
            ("wrong_round", wrong_round),
            ("unknown_task", unknown_task),
            ("no_header", no_header),
            ("empty_stream", empty_stream),
            ("second_header", second_header),
        ],
        duplicate="duplicate",
    ),
    (1, TRAIN, 1): Plan(before=[("nan_bias_update", nan_bias_update), ("missing_update", missing_update)]),
    (1, EVALUATE, 0): Plan(
        before=[
            ("eval_accuracy_out_of_range", accuracy_out_of_range),
            ("eval_nan_test_loss", nan_test_loss),
            ("eval_with_payload", evaluation_with_payload),
            ("eval_wrong_phase", wrong_phase),
        ]
    ),
    (1, EVALUATE, 3): Plan(withhold="closed_round_evaluation"),
    (2, EVALUATE, 1): Plan(
        oversized_batch="batch_too_large",
        batch=[
            ("batch_nan_test_loss", nan_test_loss),
            ("batch_declares_payload", declares_payload_bytes),
            ("batch_unknown_task", unknown_task),
            ("batch_other_client", other_client),
        ],
    ),
    # Probes of checks that may be missing go last on their task: if one is wrongly accepted, it carried the correct
    # result, so the model and the other cases are unaffected.
    (2, TRAIN, 0): Plan(before=[("missing_sha256", missing_sha256)]),
    (2, TRAIN, 1): Plan(before=[("anonymous_agent", anonymous_agent)]),
    (3, TRAIN, 0): Plan(
        upload=[
            ("upload_corrupted", upload_corrupted),
            ("upload_size_mismatch", upload_size_mismatch),
            ("upload_with_trailer", upload_with_trailer),
            ("upload_malformed", upload_malformed),
            ("upload_nan_update", upload_nan_update),
        ]
    ),
}

# case -> (acceptable statuses, substrings the message must contain: "{task}" is the task id, "{client}" its client)
EXPECTED: dict[str, tuple[Code | tuple[Code, ...], list[str]]] = {
    "wrong_shape": (Code.INVALID_ARGUMENT, ["{task}", "'body.1.weight'", "shape [60, 8]", "expected [8, 60]"]),
    "wrong_tensor_count": (Code.INVALID_ARGUMENT, ["{task}", "expected 4 tensors", "got 3"]),
    "wrong_dtype": (Code.INVALID_ARGUMENT, ["{task}", "'body.1.weight'", "DTYPE_FLOAT64", "expected DTYPE_FLOAT32"]),
    "nan_update": (Code.INVALID_ARGUMENT, ["{task}", "PAYLOAD_KIND_UPDATE", "NaN"]),
    "inf_update": (Code.INVALID_ARGUMENT, ["{task}", "PAYLOAD_KIND_UPDATE", "infinite"]),
    "nan_loss": (Code.INVALID_ARGUMENT, ["{task}", "loss_after", "nan"]),
    "nan_bias_update": (Code.INVALID_ARGUMENT, ["{task}", "bias_update", "NaN"]),
    "missing_update": (Code.INVALID_ARGUMENT, ["{task}", "UPDATE payload"]),
    "corrupted_bytes": (Code.DATA_LOSS, ["{task}", "sha256"]),
    "missing_sha256": ((Code.INVALID_ARGUMENT, Code.DATA_LOSS), ["{task}", "sha256"]),
    "truncated_stream": (Code.INVALID_ARGUMENT, ["{task}", "stream ended after"]),
    "extra_bytes": (Code.INVALID_ARGUMENT, ["{task}", "header declared"]),
    "unknown_client": (Code.NOT_FOUND, ["unknown client id 99"]),
    "other_client": (Code.PERMISSION_DENIED, ["{task}", "belongs to client {client}"]),
    "other_agent": (Code.PERMISSION_DENIED, ["client {client}", "not by the submitting agent"]),
    "anonymous_agent": ((Code.PERMISSION_DENIED, Code.UNAUTHENTICATED), ["client {client}", "agent"]),
    "wrong_round": (Code.INVALID_ARGUMENT, ["round 7", "round 1"]),
    "unknown_task": (Code.NOT_FOUND, ["unknown task", f"{RUN_ID}/r9/p0/c"]),
    "no_header": (Code.INVALID_ARGUMENT, ["must start with a ResultHeader"]),
    "empty_stream": (Code.INVALID_ARGUMENT, ["must start with a ResultHeader"]),
    "second_header": (Code.INVALID_ARGUMENT, ["{task}", "second header"]),
    "duplicate": (Code.PERMISSION_DENIED, ["{task}", "already accepted", "replay"]),
    "eval_accuracy_out_of_range": (Code.INVALID_ARGUMENT, ["{task}", "test_accuracy", "150"]),
    "eval_nan_test_loss": (Code.INVALID_ARGUMENT, ["{task}", "test_loss", "nan"]),
    "eval_with_payload": (Code.INVALID_ARGUMENT, ["{task}", "evaluation result carries no tensor payload"]),
    "batch_too_large": (Code.INVALID_ARGUMENT, ["1025 results in one batch", "at most 1024"]),
    "batch_nan_test_loss": (Code.INVALID_ARGUMENT, ["{task}", "test_loss", "nan"]),
    "batch_declares_payload": (Code.INVALID_ARGUMENT, ["{task}", "payload bytes", "streamed with SubmitResult"]),
    "batch_unknown_task": (Code.NOT_FOUND, ["unknown task", f"{RUN_ID}/r9/p0/c"]),
    "batch_other_client": (Code.PERMISSION_DENIED, ["{task}", "belongs to client {client}"]),
    "eval_wrong_phase": (Code.INVALID_ARGUMENT, ["phase"]),
    "upload_corrupted": (Code.DATA_LOSS, ["{task}", "sha256"]),
    "upload_size_mismatch": (Code.INVALID_ARGUMENT, ["declares", "payload bytes", "carries"]),
    "upload_with_trailer": (Code.INVALID_ARGUMENT, ["no trailer", "sha256 in the header"]),
    "upload_malformed": (Code.INVALID_ARGUMENT, ["malformed ResultUpload"]),
    "upload_nan_update": (Code.INVALID_ARGUMENT, ["{task}", "PAYLOAD_KIND_UPDATE", "NaN"]),
    # a withheld result arriving after its round closed the task at the deadline is late
    "closed_round_evaluation": (Code.FAILED_PRECONDITION, ["{task}", "closed", "round 1 closed it at its deadline"]),
    # an accepted result sent again later is a replay, whatever round is running by then
    "closed_round_train": (Code.PERMISSION_DENIED, ["{task}", "closed", "already accepted"]),
    "after_run_end": (Code.PERMISSION_DENIED, ["{task}", "closed", "already accepted"]),
}


# -- the fake agents and the run they drive ------------------------------------------------------------------------


@dataclass
class Submission:
    case: str
    task: federation_pb2.Task
    header_task_id: str
    code: Code
    details: str
    task_open: bool  # the header's task was issued, not yet answered and within its phase
    phase_open: bool  # the phase of the task still waited for results (not all answered, deadline not passed)


@dataclass
class Observed:
    config: ExperimentConfig
    submissions: dict[str, Submission]
    valid: list[Submission]
    events: list[control_pb2.RunEvent]
    status: control_pb2.RunStatus
    final_params: torch.Tensor
    oracle_params: torch.Tensor
    oracle_rounds: list[control_pb2.RoundEvent]
    log_path: Path

    @property
    def rounds(self) -> list[control_pb2.RoundEvent]:
        return [e.round for e in self.events if e.HasField("round")]

    def log_tail(self) -> str:
        return self.log_path.read_text()[-3000:] if self.log_path.exists() else ""


class Driver:
    """Two fake agents in one thread: polls both, answers every task correctly, injects the planned bad results."""

    def __init__(self, channel: grpc.Channel, config: ExperimentConfig) -> None:
        self.stub = federation_pb2_grpc.FederationStub(channel)
        self.upload_result = channel.unary_unary(  # raw bytes, to send what a generated stub would not
            "/fairfl.v1.Federation/UploadResult",
            request_serializer=bytes,
            response_deserializer=federation_pb2.SubmitReply.FromString,
        )
        self.config = config
        self.agents: dict[str, str] = {}  # name -> agent id
        self.runtime: ClientRuntime | None = None
        self.models: dict[str, torch.Tensor] = {}
        self.open: dict[str, tuple[int, int]] = {}  # task id -> (round, phase) while the driver has not answered it
        self.seen: dict[tuple[int, int], int] = {}
        self.answered: dict[tuple[int, int], int] = {}  # accepted results per (round, phase)
        self.accepted_chunks: dict[tuple[int, int, int], tuple[federation_pb2.Task, list]] = {}
        self.withheld: list[tuple[str, federation_pb2.Task, list[federation_pb2.ResultChunk]]] = []
        self.submissions: dict[str, Submission] = {}
        self.valid: list[Submission] = []
        self.round_two_started = False

    def register(self) -> None:
        for name, clients in AGENT_CLIENTS.items():
            reply = self.stub.Register(
                federation_pb2.RegisterRequest(agent_name=name, client_ids=clients, device="cpu", version="test"),
                timeout=RPC_TIMEOUT,
            )
            self.agents[name] = reply.agent_id

    def prepare(self, run_id: str) -> None:
        """Fetch the run spec the way an agent does and build the client runtime before the first deadline runs."""
        deadline = time.monotonic() + RPC_TIMEOUT
        while True:
            try:
                spec = self.stub.GetRunSpec(federation_pb2.RunSpecRequest(run_id=run_id), timeout=RPC_TIMEOUT)
                break
            except grpc.RpcError as err:  # the engine thread publishes the spec right after StartRun returns
                if err.code() != Code.NOT_FOUND or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        config = experiment_from_yaml(spec.experiment_yaml)
        assert config == self.config
        data = load_run_data(config)
        self.runtime = ClientRuntime(config, data, list(range(data.num_clients)), torch.device("cpu"), self._fetch)

    def _fetch(self, ref: tensor_pb2.BlobRef) -> torch.Tensor:
        if ref.sha256 not in self.models:
            header, tensors = codec.receive_bundle(self.stub.FetchBlob(ref, timeout=RPC_TIMEOUT))
            assert header.sha256 == ref.sha256
            self.models[ref.sha256] = torch.cat([t.reshape(-1) for _, t in tensors])
        return self.models[ref.sha256]

    def drive(self, done: threading.Event, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError("the run did not finish in time")
            for name, agent_id in self.agents.items():
                reply = self.stub.PollTasks(
                    federation_pb2.PollRequest(agent_id=agent_id, max_tasks=16, wait_seconds=0.05),
                    timeout=RPC_TIMEOUT,
                )
                for task in reply.tasks:
                    self.handle(name, task)

    def submit(self, case: str, task: federation_pb2.Task, chunks: list[federation_pb2.ResultChunk]) -> Submission:
        header_task = chunks[0].header.task_id if chunks and chunks[0].HasField("header") else ""
        phase_size = self.config.selection.clients_per_round if task.phase == TRAIN else self.config.data.num_clients
        phase_open = self.answered.get((task.round, task.phase), 0) < phase_size and time.time() < task.deadline_unix
        send = lambda: self.stub.SubmitResult(iter(chunks), timeout=RPC_TIMEOUT)  # noqa: E731
        return self._sent(case, task, header_task, phase_open, send)

    def submit_upload(self, case: str, task: federation_pb2.Task, raw: bytes) -> Submission:
        """One UploadResult call with the serialised ResultUpload `raw`."""
        received = parse_result_upload(raw)
        header_task = "" if received.error else received.header.task_id
        phase_open = time.time() < task.deadline_unix
        return self._sent(case, task, header_task, phase_open, lambda: self.upload_result(raw, timeout=RPC_TIMEOUT))

    def _sent(
        self, case: str, task: federation_pb2.Task, header_task: str, phase_open: bool, call: Callable[[], object]
    ) -> Submission:
        """Make one result call and account for its answer (an accepted result answers its task)."""
        key = self.open.get(header_task)
        try:
            call()
            code, details = OK, ""
        except grpc.RpcError as err:
            code, details = err.code(), err.details() or ""
        if code == OK:
            self.open.pop(task.task_id, None)
            self.answered[(task.round, task.phase)] = self.answered.get((task.round, task.phase), 0) + 1
        return Submission(case, task, header_task, code, details, key is not None, phase_open)

    def submit_batch(
        self,
        cases: list[str],
        task: federation_pb2.Task,
        headers: list[federation_pb2.ResultHeader],
        whole_call: bool = False,
    ) -> list[Submission]:
        """One SubmitResults call: a Submission per header from its own status (or, for a call refused whole, one
        for the call)."""
        phase_open = time.time() < task.deadline_unix
        try:
            reply = self.stub.SubmitResults(federation_pb2.ResultBatch(results=headers), timeout=RPC_TIMEOUT)
        except grpc.RpcError as err:
            assert whole_call, f"SubmitResults refused whole: {err.code().name} {err.details()}"
            return [Submission(cases[0], task, task.task_id, err.code(), err.details() or "", True, phase_open)]
        assert not whole_call, "an oversized batch was answered"
        assert [s.task_id for s in reply.statuses] == [h.task_id for h in headers], "statuses not in request order"
        out = []
        for case, header, status in zip(cases, headers, reply.statuses, strict=True):
            code = next(c for c in Code if c.value[0] == status.code)
            key = self.open.get(header.task_id)
            if code == OK:
                self.open.pop(header.task_id, None)
                self.answered[(task.round, task.phase)] = self.answered.get((task.round, task.phase), 0) + 1
            out.append(Submission(case, task, header.task_id, code, status.message, key is not None, phase_open))
        return out

    def record(self, submission: Submission) -> None:
        assert submission.case not in self.submissions, f"case {submission.case} sent twice"
        self.submissions[submission.case] = submission

    def handle(self, agent_name: str, task: federation_pb2.Task) -> None:
        assert self.runtime is not None
        if task.round >= 2 and not self.round_two_started:
            self.round_two_started = True
            self.send_late()
        self.open[task.task_id] = (task.round, task.phase)
        position = self.seen.get((task.round, task.phase), 0)
        self.seen[(task.round, task.phase)] = position + 1
        plan = PLANS.get((task.round, task.phase, position), Plan())

        result = self.runtime.run(task)
        result.agent_id = self.agents[agent_name]
        other_agent = next(a for n, a in self.agents.items() if n != agent_name)
        sibling = next(c for c in AGENT_CLIENTS[agent_name] if c != task.client_id)
        ctx = Ctx(task, result, self.runtime.layout, other_agent, sibling)
        valid = ctx.chunks()

        for case, probe in plan.before:
            submission = self.submit(case, task, probe(ctx))
            self.record(submission)
            if submission.code == OK:  # a missing check took the (correct) probe: the task is answered
                return
        if plan.oversized_batch:
            headers = [_header(valid)] * 1025
            self.record(self.submit_batch([plan.oversized_batch], task, headers, whole_call=True)[0])
        if plan.batch:
            cases = [case for case, _ in plan.batch] + ["valid"]
            headers = [_header(probe(ctx)) for _, probe in plan.batch] + [_header(valid)]
            *probed, submission = self.submit_batch(cases, task, headers)
            for each in probed:
                self.record(each)
            self.valid.append(submission)
            return
        if plan.upload:
            for case, upload_probe in plan.upload:
                submission = self.submit_upload(case, task, upload_probe(ctx))
                self.record(submission)
                if submission.code == OK:
                    return
            self.valid.append(self.submit_upload("valid", task, upload_reordered(ctx)))
            return
        if plan.withhold:
            self.open.pop(task.task_id)  # never answered while its phase is open
            self.withheld.append((plan.withhold, task, valid))
            return
        submission = self.submit("valid", task, valid)
        self.valid.append(submission)
        if submission.code == OK:
            self.accepted_chunks[(task.round, task.phase, position)] = (task, valid)
        if plan.duplicate:
            self.record(self.submit(plan.duplicate, task, valid))

    def send_late(self) -> None:
        """Round 2 has begun, so round 1 is closed: its withheld evaluation and a resent training result arrive."""
        for case, task, chunks in self.withheld:
            self.record(self.submit(case, task, chunks))
        task, chunks = self.accepted_chunks[(1, TRAIN, 0)]
        self.record(self.submit("closed_round_train", task, chunks))


def run_oracle(config: ExperimentConfig) -> tuple[torch.Tensor, list[control_pb2.RoundEvent]]:
    events: list[control_pb2.RunEvent] = []
    engine = RoundEngine(
        RUN_ID, config, InProcessTransport(), LocalSelector(config.selection.method), LocalPrivacy(), events.append
    )
    summary = engine.run()
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    return summary.final_params, [e.round for e in events if e.HasField("round")]


def start_aggregator(cluster: LocalCluster) -> str:
    with pytest.MonkeyPatch.context() as mp:  # the child imports the repository's packages wherever pytest runs
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
        mp.chdir(REPO)
        clustering = cluster.start_service("clustering", "clustering_service", [])  # the aggregator selects through it
        args = ["--clustering", clustering.address, "--log-level", "INFO"]
        return cluster.start_service("aggregator", "aggregator_service", args).address


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    config = experiment_from_dict(CONFIG)
    oracle_params, oracle_rounds = run_oracle(config)
    logs = tmp_path_factory.mktemp("bad-input")
    cluster = LocalCluster(logs)
    try:
        address = start_aggregator(cluster)
        # mTLS like every launched process: the test drives runs as the operator and plays both agents with one
        # agent certificate (so "other agent" cases are refused by agent id, not by certificate).
        with (
            cluster.open_channel(address) as channel,
            cluster.open_channel(address, cluster.issue("driver", ROLE_AGENT)) as agent_channel,
        ):
            control = control_pb2_grpc.RunControlStub(channel)
            driver = Driver(agent_channel, config)
            driver.register()
            control.StartRun(
                control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id=RUN_ID), timeout=RPC_TIMEOUT
            )
            events: list[control_pb2.RunEvent] = []
            done = threading.Event()
            watch = control.WatchRun(control_pb2.WatchRunRequest(run_id=RUN_ID), timeout=DRIVE_TIMEOUT_S + 10)

            def follow() -> None:
                try:
                    events.extend(watch)
                finally:
                    done.set()

            watcher = threading.Thread(target=follow, name="watch", daemon=True)
            watcher.start()
            try:
                driver.prepare(RUN_ID)
                driver.drive(done, DRIVE_TIMEOUT_S)
            except BaseException:
                control.StopRun(control_pb2.StopRunRequest(run_id=RUN_ID, reason="test failed"), timeout=RPC_TIMEOUT)
                watch.cancel()
                raise
            finally:
                watcher.join(timeout=RPC_TIMEOUT)
            # After the run: the last round's first training result once more.
            last = max(k for k in driver.accepted_chunks if k[1] == TRAIN)
            task, chunks = driver.accepted_chunks[last]
            driver.record(driver.submit("after_run_end", task, chunks))
            status = control.GetRun(control_pb2.GetRunRequest(run_id=RUN_ID), timeout=RPC_TIMEOUT)
            _, tensors = codec.receive_bundle(
                control.FetchModel(control_pb2.GetRunRequest(run_id=RUN_ID), timeout=RPC_TIMEOUT)
            )
            final = torch.cat([t.reshape(-1) for _, t in tensors])
        yield Observed(
            config,
            driver.submissions,
            driver.valid,
            events,
            status,
            final,
            oracle_params,
            oracle_rounds,
            logs / "aggregator.log",
        )
    finally:
        cluster.close()  # terminates the aggregator, kills it after 5 s


# -- the tests -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(EXPECTED))
def test_bad_result_is_refused_with_fitting_status(observed: Observed, case: str) -> None:
    assert case in observed.submissions, f"case {case} was never sent (plan not reached)"
    sub = observed.submissions[case]
    codes, needles = EXPECTED[case]
    codes = codes if isinstance(codes, tuple) else (codes,)
    assert sub.code in codes, (
        f"{case}: got {sub.code.name} {sub.details!r}, expected {' or '.join(c.name for c in codes)}"
    )
    for needle in needles:
        text = needle.format(task=sub.task.task_id, client=sub.task.client_id)
        assert text in sub.details, f"{case}: message {sub.details!r} does not mention {text!r}"


def test_every_planned_case_has_an_expectation() -> None:
    planned = {case for plan in PLANS.values() for case, _ in plan.before + plan.batch + plan.upload}
    planned |= {p.oversized_batch for p in PLANS.values() if p.oversized_batch}
    planned |= {p.duplicate for p in PLANS.values() if p.duplicate} | {p.withhold for p in PLANS.values() if p.withhold}
    planned |= {"closed_round_train", "after_run_end"}
    assert planned == set(EXPECTED)


def test_rounds_go_on_and_every_correct_result_is_accepted(observed: Observed) -> None:
    assert observed.status.state == control_pb2.RUN_STATE_COMPLETED, (observed.status.message, observed.log_tail())
    refused = [(s.task.task_id, s.code.name, s.details) for s in observed.valid if s.code != OK]
    assert not refused, refused
    rounds = observed.rounds
    assert [r.round for r in rounds] == [1, 2, 3]
    for got, want in zip(rounds, observed.oracle_rounds, strict=True):
        assert list(got.selected) == list(want.selected)
        assert got.results_accepted == len(got.selected) == observed.config.selection.clients_per_round
        assert len(got.aggregation_weights) == len(got.selected), "the round was not aggregated"
        assert got.evaluated


def test_each_round_model_equals_the_oracle(observed: Observed) -> None:
    for got, want in zip(observed.rounds, observed.oracle_rounds, strict=True):
        assert got.model_sha256 == want.model_sha256, f"round {got.round} model differs from the in-process oracle"
        assert list(got.aggregation_weights) == pytest.approx(list(want.aggregation_weights), abs=1e-12)


def test_final_model_is_unchanged_by_rejected_results(observed: Observed) -> None:
    assert observed.final_params.shape == observed.oracle_params.shape
    assert float((observed.final_params - observed.oracle_params).abs().max()) <= 1e-6
    assert not torch.equal(observed.final_params, initial_model(observed.config)[1]), "training must have moved it"


def test_withheld_evaluation_is_missing_from_its_round_only(observed: Observed) -> None:
    late = observed.submissions["closed_round_evaluation"]
    first, *others = observed.rounds
    assert late.task.client_id not in [c.client_id for c in first.clients]
    assert first.fairness.evaluated_clients == 3 and first.fairness.missing_clients == 1
    oracle_first = {c.client_id: c.accuracy for c in observed.oracle_rounds[0].clients}
    assert {c.client_id: c.accuracy for c in first.clients} == pytest.approx(
        {k: v for k, v in oracle_first.items() if k != late.task.client_id}, abs=1e-9
    )
    for got, want in zip(others, observed.oracle_rounds[1:], strict=True):
        assert [c.client_id for c in got.clients] == [c.client_id for c in want.clients]
        assert [c.accuracy for c in got.clients] == pytest.approx([c.accuracy for c in want.clients], abs=1e-9)
        assert got.fairness.missing_clients == 0


def _train_submissions(observed: Observed, round_number: int) -> list[Submission]:
    return [
        s
        for s in observed.submissions.values()
        if s.task.round == round_number and s.task.phase == TRAIN and s.code != OK
    ]


def test_round_events_count_rejected_results(observed: Observed) -> None:
    """Refused training results are counted in their round's results_rejected: malformed or misaddressed ones for an
    open task, and duplicates of an accepted result that arrive while the round is still running."""
    duplicate = observed.submissions["duplicate"]
    assert duplicate.phase_open, "the duplicate must have been sent while the phase still waited for a result"
    for event in observed.rounds:
        after_close = [s for s in _train_submissions(observed, event.round) if "closed" in s.details]
        expected = sum(
            1
            for s in _train_submissions(observed, event.round)
            if (s.task_open and s not in after_close) or (s in after_close and s.phase_open)
        )
        assert event.results_rejected == expected, f"round {event.round}"
    assert observed.rounds[0].results_rejected >= 16  # the many malformed variants of round 1, and the duplicate


def test_no_result_is_counted_late_when_none_missed_its_deadline(observed: Observed) -> None:
    """Duplicates are rejections, not late results; every training result here arrived before its deadline."""
    assert all(event.results_late == 0 for event in observed.rounds)
