"""The client agent's result upload pipeline: results are encoded and sent on a thread of their own while the next
tasks train, several in flight at once (bounded in count and bytes), answered in order.

A result without payload bytes (an evaluation) waits for the poll batch's one SubmitResults call; one whose payloads
fit one message goes in an UploadResult call; bigger ones are streamed with SubmitResult, the sha256 in a trailer.
An aggregator that lacks the newer calls gets the older ones from then on, and a call turned away as busy is sent
again after a pause.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from client_agent.trainer import ClientRuntime
from fairfl import codec, framing, telemetry
from fairfl.framing import CHUNK_BYTES
from fairfl.params import ParamLayout
from fairfl.protocol import ClientResult, encode_result, encode_upload
from fairfl.rpc import TRANSFER_DEADLINE
from fairfl.rpc_refusals import refused_as_busy
from fairfl.v1 import federation_pb2, federation_pb2_grpc

log = logging.getLogger(__name__)

FEDERATION = federation_pb2.DESCRIPTOR.services_by_name["Federation"].full_name


# Results streamed while the next tasks run: at most this many, and past the first, at most this many payload bytes
# (small results, evaluations above all, would otherwise wait a round trip each; big ones hold memory).
MAX_RESULTS_IN_FLIGHT = 8
IN_FLIGHT_BYTES = 64 * 1024 * 1024

# Results without payload bytes (evaluations) go in one SubmitResults call per poll batch, at most this many a call:
# a stream each cost more than the evaluation itself (~2 ms of CPU on agent and aggregator for a 0.7 ms evaluation).
BATCH_RESULTS = 256

# Results with at most this many payload bytes go in one UploadResult call (header and bytes in one message, below
# gRPC's 4 MiB default limit): a stream costs a thread and a round trip per message on both sides, ~1 ms of CPU and
# several of latency for the default preset's 800 KB update. Bigger ones are streamed in chunks.
UPLOAD_BYTES = CHUNK_BYTES

# A result call refused as busy was turned away at the door (the caller's share of calls, the server's capacity or the
# rate limit: fairfl.rpc_refusals.refused_as_busy, docs/security.md) and nothing of it was read: it is sent again after
# these pauses.
BUSY_RETRY_PAUSES_S = (0.05, 0.2, 0.8, 2.0)


@dataclass
class _Submission:
    """Results handed to the submitting thread; `opened` ends with their call (or the encoding error): one result's
    UploadResult call or SubmitResult stream, or a SubmitResults call for several without payloads (`batch`: their task
    ids and phases)."""

    task_id: str
    phase: str
    payload_bytes: int
    opened: Future[grpc.Future] = field(default_factory=Future)
    abandoned: bool = False  # the agent stopped waiting: a call not opened yet is not opened at all
    batch: list[tuple[str, str]] = field(default_factory=list)
    headers: list[federation_pb2.ResultHeader] = field(default_factory=list)  # a batch's, once encoded
    # A result sent in one UploadResult call: kept to stream it instead if the aggregator lacks that call.
    upload: tuple[ClientResult, ClientRuntime] | None = None
    reopen: Callable[[], Future[grpc.Future]] | None = None  # opens the same call again (after a busy refusal)
    retries: int = 0


class ResultUploader:
    """Sends an agent's results to the aggregator over its channel (see the module's docstring)."""

    def __init__(self, channel: grpc.Channel, stub: federation_pb2_grpc.FederationStub, tls: bool) -> None:
        self.tls = tls  # over mutual TLS an UploadResult may leave out its sha256 (docs/security.md)
        # The bulk calls with data chunks as raw bytes, same wire format: SubmitResult's serialised once from the
        # tensor memory (fairfl.framing).
        self._submit_result = channel.stream_unary(
            f"/{FEDERATION}/SubmitResult",
            request_serializer=framing.serialize,
            response_deserializer=federation_pb2.SubmitReply.FromString,
        )
        self._upload_result = channel.unary_unary(
            f"/{FEDERATION}/UploadResult",
            request_serializer=framing.serialize,
            response_deserializer=federation_pb2.SubmitReply.FromString,
        )
        self._submit_results = stub.SubmitResults
        self.batching = True  # SubmitResults for results without payloads (off against an aggregator without it)
        self.uploading = True  # UploadResult for payloads up to UPLOAD_BYTES (off against an aggregator without it)
        self._batch: list[tuple[str, ClientResult, ClientRuntime]] = []  # (phase, result, runtime) not yet sent
        self.tasks_done = 0
        # Results being streamed while the next tasks train, oldest first; one thread encodes them and opens their
        # calls in order (~2 ms for the default preset's 800 KB), off the training thread.
        self._in_flight: deque[_Submission] = deque()
        self._submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="submit")
        # The last runtime's layout in its wire dtype and one payload's bytes in it: the same for every result of a run.
        self._wire: tuple[ParamLayout, str, ParamLayout, int] | None = None

    def send(self, task_id: str, phase: str, result: ClientResult, runtime: ClientRuntime) -> None:
        """Send the result of task `task_id`: collected for the next SubmitResults call when it has no payload, else
        handed to the submitting thread."""
        if self.batching and not result.payloads:
            self._batch.append((phase, result, runtime))
            if len(self._batch) >= BATCH_RESULTS:
                self.flush_batch()
            return
        # Encoded and streamed by the submitting thread while the next task trains: the device is not idle for the
        # upload (h3's profile: 8 ms per 800 KB result, ~40% of a task of the default preset).
        size = sum(t.numel() * t.element_size() for t in result.payloads.values())
        self._hand_over(_Submission(task_id, phase, size), self._open, result, runtime)

    def flush_batch(self) -> None:
        """Hand the results without payloads collected so far to the submitting thread as one SubmitResults call."""
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        entries = [(result.task_id, phase) for phase, result, _ in batch]
        self._hand_over(_Submission(f"{len(batch)} results", "batch", 0, batch=entries), self._open_batch, batch)

    def _hand_over(self, submission: _Submission, opener: Callable[..., grpc.Future], *args: object) -> None:
        """Queue `opener(submission, *args)` on the submitting thread, once the results in flight leave room."""
        while self._in_flight and (
            len(self._in_flight) >= MAX_RESULTS_IN_FLIGHT
            or sum(s.payload_bytes for s in self._in_flight) + submission.payload_bytes > IN_FLIGHT_BYTES
        ):
            self._finish_oldest()
        submission.reopen = functools.partial(self._submitter.submit, opener, submission, *args)
        submission.opened = submission.reopen()
        self._in_flight.append(submission)

    def _retry_busy(self, submission: _Submission, err: grpc.RpcError) -> bool:
        """Send a result again that the aggregator turned away as busy (refused before it was read), after a pause;
        False for any other refusal and once the pauses are used up. It is the next in flight to be answered."""
        if not refused_as_busy(err) or submission.retries >= len(BUSY_RETRY_PAUSES_S):
            return False
        assert submission.reopen is not None
        pause = BUSY_RETRY_PAUSES_S[submission.retries]
        submission.retries += 1
        log.info(
            "result for %s refused as busy (%s); sending it again in %.2fs", submission.task_id, err.details(), pause
        )
        time.sleep(pause)
        submission.opened = submission.reopen()
        self._in_flight.appendleft(submission)
        return True

    def _open(self, submission: _Submission, result: ClientResult, runtime: ClientRuntime) -> grpc.Future:
        """On the submitting thread: encode the result and open its call."""
        if submission.abandoned:
            raise RuntimeError("the agent stopped before the result was sent")
        call, uploaded = self._start(result, runtime)
        if uploaded:
            submission.upload = (result, runtime)
        return call

    def _open_batch(self, submission: _Submission, batch: list[tuple[str, ClientResult, ClientRuntime]]) -> grpc.Future:
        """On the submitting thread: the results' headers (each with the sha256 of its empty payload) in one call."""
        if submission.abandoned:
            raise RuntimeError("the agent stopped before the results were sent")
        submission.headers = [next(encode_result(result, runtime.layout)).header for _, result, runtime in batch]
        return self._submit_results.future(
            federation_pb2.ResultBatch(results=submission.headers), timeout=TRANSFER_DEADLINE
        )

    def finish(self, timeout: float | None = None) -> None:
        """Wait (at most `timeout` seconds in all) for every result in flight and account for the answers."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._in_flight:
            self._finish_oldest(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _finish_oldest(self, timeout: float | None = None) -> None:
        """Wait (at most `timeout` seconds) for the oldest result in flight and account for the aggregator's answer."""
        submission = self._in_flight.popleft()
        deadline = None if timeout is None else time.monotonic() + timeout
        call: grpc.Future | None = None
        phases = [phase for _, phase in submission.batch] or [submission.phase]
        try:
            call = submission.opened.result(timeout=timeout)
            reply = call.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            if submission.batch:
                self._account_batch(submission, reply.statuses)
                return
            self.tasks_done += 1
            telemetry.AGENT_TASKS.labels(submission.phase, "submitted").inc()
        except grpc.RpcError as err:
            if submission.batch and err.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._unbatch(submission)
                return
            if submission.upload is not None and err.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._restream(submission)
                return
            if self._retry_busy(submission, err):
                return
            log.warning("result for %s refused: %s %s", submission.task_id, err.code().name, err.details())
            for phase in phases:
                telemetry.AGENT_TASKS.labels(phase, "refused").inc()
        except codec.CodecError as err:  # nothing was sent; the round closes without this client
            log.error("result for %s not sent: %s", submission.task_id, err)
            for phase in phases:
                telemetry.AGENT_TASKS.labels(phase, "failed").inc()
        except Exception as err:  # cancelled, or still streaming at shutdown: the round goes on without it
            submission.abandoned = True
            if call is not None:
                call.cancel()
            log.error("result for %s not delivered: %s", submission.task_id, type(err).__name__)
            for phase in phases:
                telemetry.AGENT_TASKS.labels(phase, "failed").inc()

    def _account_batch(self, submission: _Submission, statuses: Iterable[federation_pb2.ResultStatus]) -> None:
        """Count a SubmitResults answer result by result, as separate calls would have been."""
        answered = {status.task_id: status for status in statuses}
        for task_id, phase in submission.batch:
            status = answered.get(task_id)
            if status is not None and status.code == grpc.StatusCode.OK.value[0]:
                self.tasks_done += 1
                telemetry.AGENT_TASKS.labels(phase, "submitted").inc()
                continue
            why = f"{_status_name(status.code)} {status.message}" if status is not None else "not in the answer"
            log.warning("result for %s refused: %s", task_id, why)
            telemetry.AGENT_TASKS.labels(phase, "refused").inc()

    def _unbatch(self, submission: _Submission) -> None:
        """An aggregator without SubmitResults: send the batch's results one stream each, and no batches from now on."""
        log.warning("the aggregator does not implement SubmitResults; sending results without payloads one by one")
        self.batching = False
        for header, (task_id, phase) in zip(submission.headers, submission.batch, strict=True):
            try:
                self._submit_result(iter([federation_pb2.ResultChunk(header=header)]), timeout=TRANSFER_DEADLINE)
            except grpc.RpcError as err:
                log.warning("result for %s refused: %s %s", task_id, err.code().name, err.details())
                telemetry.AGENT_TASKS.labels(phase, "refused").inc()
                continue
            self.tasks_done += 1
            telemetry.AGENT_TASKS.labels(phase, "submitted").inc()

    def _restream(self, submission: _Submission) -> None:
        """An aggregator without UploadResult: stream this result with SubmitResult, and every one from now on."""
        log.warning("the aggregator does not implement UploadResult; streaming every result with SubmitResult")
        self.uploading = False
        assert submission.upload is not None
        try:
            self.submit(*submission.upload)
        except grpc.RpcError as err:
            log.warning("result for %s refused: %s %s", submission.task_id, err.code().name, err.details())
            telemetry.AGENT_TASKS.labels(submission.phase, "refused").inc()
            return
        self.tasks_done += 1
        telemetry.AGENT_TASKS.labels(submission.phase, "submitted").inc()

    def _wire_layout(self, runtime: ClientRuntime) -> tuple[ParamLayout, int]:
        """The run's layout with payloads in its transport.update_dtype, and one payload's bytes in that dtype."""
        dtype = runtime.config.transport.update_dtype
        wire = self._wire
        if wire is None or wire[0] is not runtime.layout or wire[1] != dtype:
            layout = runtime.layout.with_payload_dtype(dtype)
            wire = self._wire = (runtime.layout, dtype, layout, layout.payload_nbytes)
        return wire[2], wire[3]

    def _start(self, result: ClientResult, runtime: ClientRuntime) -> tuple[grpc.Future, bool]:
        """submit_async's call, and whether it is one UploadResult call (else a SubmitResult stream)."""
        layout, payload_nbytes = self._wire_layout(runtime)
        # One UploadResult call when the payload bytes, in the run's wire dtype, fit one message.
        if self.uploading and 0 < payload_nbytes * len(result.payloads) <= UPLOAD_BYTES:
            upload = encode_upload(result, layout, with_sha256=not self.tls)  # TLS authenticates the one message
            telemetry.AGENT_SENT_BYTES.inc(upload.ByteSize())
            return self._upload_result.future(upload, timeout=TRANSFER_DEADLINE), True
        chunks = encode_result(result, layout, sha256_in_trailer=True, framed=True)
        first = next(chunks)  # casts and checks the payloads before the call opens
        call = self._submit_result.future(_counted(itertools.chain([first], chunks)), timeout=TRANSFER_DEADLINE)
        return call, False

    def submit_async(self, result: ClientResult, runtime: ClientRuntime) -> grpc.Future:
        """Start sending one result to the aggregator, its payloads in the run's transport.update_dtype: one
        UploadResult call when they fit in one message (the sha256 in the header), else a SubmitResult stream with the
        sha256 in a trailer (hashed while it streams). The call's result() raises grpc.RpcError when it is refused.
        Raises codec.CodecError at once when a payload cannot be sent in that dtype (float16 overflow)."""
        return self._start(result, runtime)[0]

    def submit(self, result: ClientResult, runtime: ClientRuntime) -> None:
        """submit_async, waiting for the aggregator's answer."""
        self.submit_async(result, runtime).result()

    def close(self) -> None:
        """Stop the submitting thread (results not opened yet are dropped)."""
        self._submitter.shutdown(wait=False, cancel_futures=True)


def _status_name(code: int) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), f"status {code}")


def _counted(
    chunks: Iterable[federation_pb2.ResultChunk | framing.Framed],
) -> Iterator[federation_pb2.ResultChunk | framing.Framed]:
    for chunk in chunks:
        telemetry.AGENT_SENT_BYTES.inc(chunk.ByteSize())
        yield chunk
