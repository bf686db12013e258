"""Client agent: dials out to the aggregator, hosts many logical clients, and trains them on its device.

The loop is register → long-poll tasks → fetch the model by sha256 (cached) → run the local procedure → stream the
result back. Any connection failure leads to a re-registration with exponential backoff, so an agent survives
aggregator restarts and network blips without losing its clients.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import logging
import os
import random
import socket
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from client_agent.dp_sgd import DpPolicy, PolicyRefusal
from client_agent.faults import DropPlan
from client_agent.trainer import ClientRuntime, load_run_data, resolve_device
from fairfl import __version__, codec, telemetry, tls
from fairfl.config import experiment_from_yaml
from fairfl.privacy import RANDOMNESS, RANDOMNESS_ENV, check_randomness
from fairfl.protocol import ClientResult, encode_result, encode_upload
from fairfl.rpc import (
    CHUNK_BYTES,
    INLINE_BLOB_BYTES,
    SHORT_DEADLINE,
    TRANSFER_DEADLINE,
    TransportSecurity,
    add_transport_arguments,
    configure_logging,
    open_channel,
    refused_as_busy,
    transport_from_args,
)
from fairfl.v1 import federation_pb2, federation_pb2_grpc, tensor_pb2

log = logging.getLogger(__name__)

FEDERATION = federation_pb2.DESCRIPTOR.services_by_name["Federation"].full_name
MODEL_CACHE_SIZE = 4
# Results streamed while the next tasks run: at most this many, and past the first, at most this many payload bytes
# (small results, evaluations above all, would otherwise wait a round trip each; big ones hold memory).
MAX_RESULTS_IN_FLIGHT = 8
IN_FLIGHT_BYTES = 64 * 1024 * 1024
# Results without payload bytes (evaluations) go in one SubmitResults call per poll batch, at most this many a call:
# a stream each cost more than the evaluation itself (~2 ms of CPU on agent and aggregator for a 0.7 ms evaluation).
BATCH_RESULTS = 256
MAX_TASKS_PER_POLL = 64
# Results with at most this many payload bytes go in one UploadResult call (header and bytes in one message, below
# gRPC's 4 MiB default limit): a stream costs a thread and a round trip per message on both sides, ~1 ms of CPU and
# several of latency for the default preset's 800 KB update. Bigger ones are streamed in chunks.
UPLOAD_BYTES = CHUNK_BYTES
STOP_GRACE_S = 10.0  # how long a stopping agent waits for its last result to be answered
# A result call refused as busy was turned away at the door (the caller's share of calls, the server's capacity or the
# rate limit: fairfl.rpc.refused_as_busy, docs/security.md) and nothing of it was read: it is sent again after these
# pauses.
BUSY_RETRY_PAUSES_S = (0.05, 0.2, 0.8, 2.0)
FETCH_STREAMS = codec.FETCH_STREAMS  # concurrent FetchBlob range streams for one large model


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


def parse_client_ids(text: str) -> list[int]:
    """'0-49' or '0-9,20,30-39' → sorted unique ids: the range syntax of agent certificates (fairfl.tls); raises
    ValueError."""
    if not text.strip():
        raise ValueError("no client ids given")
    ranges = tls.parse_ranges(text)
    return np.unique(np.concatenate([np.arange(lo, hi + 1) for lo, hi in ranges])).tolist()


class Agent:
    def __init__(
        self,
        aggregator: str,
        client_ids: list[int],
        device: str = "auto",
        name: str = "",
        dp_policy: DpPolicy | None = None,
        dp_randomness: str = "secure",
        security: TransportSecurity | None = None,
        faults: DropPlan | None = None,
        shared: bool = False,
    ) -> None:
        self.client_ids = client_ids
        self.shared = shared  # co-hosts its clients with other agents (simulations: runtime.placement replicated)
        self.faults = faults  # tests only: clients that drop out of each round
        # The DP releases of the newest round with their tasks: a task sent again (the aggregator restarted and
        # re-runs the round it had authorised) gets the same release back instead of fresh noise
        # (docs/reliability.md). Only that round can come again, so older releases (whole updates) are dropped.
        self.released: dict[int, tuple[bytes, ClientResult]] = {}
        self.released_round = 0
        self.dp_policy = dp_policy or DpPolicy()  # the weakest DP this agent's owner accepts
        self.dp_randomness = check_randomness(dp_randomness)
        self.device = resolve_device(device)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.channel = open_channel(aggregator, security)  # mTLS as this agent's certificate, unless --insecure
        self.tls = security is not None
        self.stub = federation_pb2_grpc.FederationStub(self.channel)
        # The bulk calls with data chunks as raw bytes, same wire format: FetchBlob's are read as views of the
        # received messages, SubmitResult's serialised once from the tensor memory (codec.chunk_parser, codec.Framed).
        self._fetch_blob = self.channel.unary_stream(
            f"/{FEDERATION}/FetchBlob",
            request_serializer=tensor_pb2.BlobRef.SerializeToString,
            response_deserializer=codec.chunk_parser(tensor_pb2.Chunk),
        )
        self._submit_result = self.channel.stream_unary(
            f"/{FEDERATION}/SubmitResult",
            request_serializer=codec.serialize,
            response_deserializer=federation_pb2.SubmitReply.FromString,
        )
        self._upload_result = self.channel.unary_unary(
            f"/{FEDERATION}/UploadResult",
            request_serializer=codec.serialize,
            response_deserializer=federation_pb2.SubmitReply.FromString,
        )
        self._submit_results = self.stub.SubmitResults
        self.batching = True  # SubmitResults for results without payloads (off against an aggregator without it)
        self.uploading = True  # UploadResult for payloads up to UPLOAD_BYTES (off against an aggregator without it)
        self._batch: list[tuple[str, ClientResult, ClientRuntime]] = []  # (phase, result, runtime) not yet sent
        self.agent_id = ""
        self.runtimes: dict[str, ClientRuntime] = {}
        self.models: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.stop = threading.Event()
        self.tasks_done = 0
        # Results being streamed while the next tasks train, oldest first; one thread encodes them and opens their
        # calls in order (~2 ms for the default preset's 800 KB), off the training thread.
        self._in_flight: deque[_Submission] = deque()
        self._submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="submit")
        telemetry.AGENT_CLIENTS.set(len(client_ids))

    # -- connection ---------------------------------------------------------------------------------------------

    def _register(self) -> None:
        backoff = 0.1
        while not self.stop.is_set():
            try:
                reply = self.stub.Register(
                    federation_pb2.RegisterRequest(
                        agent_name=self.name,
                        client_ids=self.client_ids,
                        device=str(self.device),
                        version=__version__,
                        shared=self.shared,
                    ),
                    timeout=SHORT_DEADLINE,
                    wait_for_ready=True,
                )
                self.agent_id = reply.agent_id
                telemetry.AGENT_REGISTRATIONS.inc()
                self.heartbeat_interval = reply.heartbeat_interval_seconds or 5.0
                self.poll_wait = reply.poll_wait_seconds or 10.0
                log.info("registered as %s with %d clients on %s", self.agent_id[:8], len(self.client_ids), self.device)
                return
            except grpc.RpcError as err:
                # Jittered: agents cut off by one aggregator restart must not all come back in lockstep.
                pause = backoff * random.uniform(0.5, 1.0)
                log.warning("register failed (%s); retrying in %.1fs", err.code().name, pause)
                self.stop.wait(pause)
                backoff = min(backoff * 2, 10.0)

    def _heartbeats(self) -> None:
        # Until the first registration tells the interval, look often: the aggregator may expect one soon.
        while not self.stop.wait(getattr(self, "heartbeat_interval", 0.2)):
            if not self.agent_id:
                continue
            sent_for = self.agent_id
            try:
                reply = self.stub.Heartbeat(federation_pb2.HeartbeatRequest(agent_id=sent_for), timeout=SHORT_DEADLINE)
                if not reply.known and self.agent_id == sent_for:  # a late answer must not undo a newer registration
                    self.agent_id = ""  # the poll loop re-registers
            except grpc.RpcError:
                pass  # the poll loop handles reconnection

    def run(self) -> None:
        threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True).start()
        while not self.stop.is_set():
            if not self.agent_id:
                self._register()
                continue
            self._finish_submissions()  # a batch's results are answered before asking for more work
            polled = time.monotonic()
            try:
                reply = self.stub.PollTasks(
                    federation_pb2.PollRequest(
                        agent_id=self.agent_id,
                        max_tasks=MAX_TASKS_PER_POLL,
                        wait_seconds=self.poll_wait,
                        inline_blob_bytes=INLINE_BLOB_BYTES,
                        cached_sha256=list(self.models),
                    ),
                    timeout=self.poll_wait + SHORT_DEADLINE,
                )
            except grpc.RpcError as err:
                if refused_as_busy(err):  # over this certificate's share of calls: still registered, ask again soon
                    log.info("poll refused as busy (%s); polling again shortly", err.details())
                    self.stop.wait(random.uniform(0.2, 1.0))
                    continue
                # The aggregator restarted or is unreachable: register again (its clients resume with this agent).
                log.warning("poll failed (%s: %s); re-registering", err.code().name, err.details())
                self.agent_id = ""
                self.stop.wait(random.uniform(0.1, 0.5))
                continue
            if not reply.tasks and time.monotonic() - polled < self.poll_wait / 2:
                self.stop.wait(random.uniform(0.2, 1.0))  # answered at once: the aggregator has no worker to spare
            if reply.blobs and reply.tasks:
                self._take_inline(reply.tasks[0].run_id, reply.blobs)
            for task in reply.tasks:
                if self.stop.is_set():
                    break
                self._handle(task)
            self._flush_batch()
        self._finish_submissions(timeout=STOP_GRACE_S)  # stopping: inside a pod's termination grace period
        self._submitter.shutdown(wait=False, cancel_futures=True)

    # -- tasks --------------------------------------------------------------------------------------------------

    def _runtime(self, run_id: str) -> ClientRuntime:
        runtime = self.runtimes.get(run_id)
        if runtime is None:
            spec = self.stub.GetRunSpec(federation_pb2.RunSpecRequest(run_id=run_id), timeout=SHORT_DEADLINE)
            config = experiment_from_yaml(spec.experiment_yaml)
            data = load_run_data(config)
            hosted = [c for c in self.client_ids if c < data.num_clients]
            runtime = ClientRuntime(
                config, data, hosted, self.device, self._fetch_model, self.dp_policy, self.dp_randomness
            )
            self.runtimes = {run_id: runtime}  # one run at a time: drop older runs' data
            self.models.clear()
            self.released.clear()
            self.released_round = 0
            log.info("prepared run %s: %d local clients", run_id, len(hosted))
        return runtime

    def _take_inline(self, run_id: str, blobs: Iterable[federation_pb2.InlineBlob]) -> None:
        """Cache the models a poll reply carried, checked as a fetch checks them; one that fails is left to
        FetchBlob (the task fetches it and fails there if it is really bad)."""
        try:
            runtime = self._runtime(run_id)
        except (grpc.RpcError, ValueError) as err:  # the task itself reports this
            log.warning("run %s not prepared for inline models: %s", run_id, err)
            return
        for blob in blobs:
            sha256, total = blob.header.sha256, blob.header.total_bytes
            if sha256 in self.models:
                continue
            parts = [tensor_pb2.Chunk(header=blob.header), tensor_pb2.Chunk(data=blob.data)]
            self._make_room()
            try:
                if self.tls:  # one message over mutual TLS: its bytes are authenticated already (docs/security.md)
                    self.models[sha256] = _inline_model(blob, runtime)
                else:
                    self.models[sha256] = self._receive_model(lambda _o, _l, p=parts: iter(p), total, sha256, runtime)
            except codec.CodecError as err:
                log.warning("inline model %s… refused (%s); fetching it instead", sha256[:12], err)
                continue
            telemetry.AGENT_MODEL_FETCHES.labels("inline").inc()

    def _receive_model(
        self, open_range: codec.RangeOpener, total_bytes: int, sha256: str, runtime: ClientRuntime
    ) -> torch.Tensor:
        """A model's payload (a large one as byte ranges on concurrent streams, hashed as it lands), checked against
        its sha256 and the run's layout (codec.fetch_ranges)."""
        _, buffer = codec.fetch_ranges(
            open_range,
            total_bytes,
            sha256,
            lambda header: runtime.layout.check_specs(list(header.tensors)),
            max_bytes=runtime.layout.nbytes,
            streams=FETCH_STREAMS,
        )
        telemetry.AGENT_RECEIVED_BYTES.inc(len(buffer))
        return torch.frombuffer(buffer, dtype=torch.float32) if len(buffer) else torch.empty(0)

    def _make_room(self) -> None:
        """Evict the least recently used models past the cache size, before a receive: their buffers can be reused."""
        while len(self.models) >= MODEL_CACHE_SIZE:
            self.models.popitem(last=False)

    def _fetch_model(self, ref: tensor_pb2.BlobRef) -> torch.Tensor:
        cached = self.models.get(ref.sha256)
        if cached is not None:
            self.models.move_to_end(ref.sha256)
            telemetry.AGENT_MODEL_FETCHES.labels("hit").inc()
            return cached
        telemetry.AGENT_MODEL_FETCHES.labels("miss").inc()

        def open_range(offset: int, length: int) -> Iterator[tensor_pb2.Chunk]:
            request = tensor_pb2.BlobRef(sha256=ref.sha256, total_bytes=ref.total_bytes, offset=offset, length=length)
            return self._fetch_blob(request, timeout=TRANSFER_DEADLINE)  # the call itself: a failed fetch cancels it

        self._make_room()
        runtime = next(iter(self.runtimes.values()))
        for pause in (*BUSY_RETRY_PAUSES_S, None):
            try:
                flat = self._receive_model(open_range, ref.total_bytes, ref.sha256, runtime)
                break
            except grpc.RpcError as err:  # a fetch refused as busy read nothing: fetch again after a pause
                if pause is None or not refused_as_busy(err):
                    raise
                log.info("model fetch refused as busy (%s); fetching again in %.2fs", err.details(), pause)
                time.sleep(pause)
        self.models[ref.sha256] = flat
        return flat

    def _result(self, runtime: ClientRuntime, task: federation_pb2.Task) -> ClientResult:
        if not (task.WhichOneof("config") == "train" and task.train.HasField("dp")):
            return runtime.run(task)
        if self.shared and self.dp_randomness != "task":
            # The same-release guarantee below holds per agent: a re-sent task may reach another co-host, which would
            # draw fresh noise: a second release the ledger never counted.
            raise PolicyRefusal(
                "this agent co-hosts its clients (--shared-clients) and draws DP noise from the OS: a task re-sent "
                "after an aggregator restart could reach another host and release fresh noise; host DP clients on one "
                "agent each (runtime.placement: partitioned) or use --dp-randomness task for simulations"
            )
        same = federation_pb2.Task()
        same.CopyFrom(task)
        same.ClearField("deadline_unix")  # a re-sent task differs only in its deadline
        key = same.SerializeToString(deterministic=True)
        if task.round > self.released_round:
            self.released.clear()
            self.released_round = task.round
        released = self.released.get(task.client_id)
        if released is not None and released[0] == key:
            log.info("task %s was answered before: sending the same DP release again", task.task_id)
            return released[1]
        result = runtime.run(task)
        self.released[task.client_id] = (key, result)
        return result

    def _handle(self, task: federation_pb2.Task) -> None:
        phase = _PHASES.get(task.phase, "other")
        started = time.perf_counter()
        try:
            runtime = self._runtime(task.run_id)
            if self.faults is not None and task.client_id in self.faults.dropped(sorted(runtime.clients), task.round):
                log.info("fault injection: client %d drops out of round %d", task.client_id, task.round)
                return
            result = self._result(runtime, task)
        except PolicyRefusal as err:  # nothing is computed or sent; the round closes without this client
            log.error("task %s refused by this agent's privacy policy: %s", task.task_id, err)
            telemetry.AGENT_TASKS.labels(phase, "failed").inc()
            return
        except Exception:  # a failing task must not kill the agent; the round closes at its deadline
            log.exception("task %s failed", task.task_id)
            telemetry.AGENT_TASKS.labels(phase, "failed").inc()
            return
        telemetry.AGENT_TASK_DURATION.labels(phase).observe(time.perf_counter() - started)
        result.agent_id = self.agent_id
        if self.batching and not result.payloads:
            self._batch.append((phase, result, runtime))
            if len(self._batch) >= BATCH_RESULTS:
                self._flush_batch()
            return
        # Encoded and streamed by the submitting thread while the next task trains: the device is not idle for the
        # upload (h3's profile: 8 ms per 800 KB result, ~40% of a task of the default preset).
        size = sum(t.numel() * t.element_size() for t in result.payloads.values())
        self._hand_over(_Submission(task.task_id, phase, size), self._open, result, runtime)

    def _flush_batch(self) -> None:
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
        if self._fits_upload(result, runtime):
            submission.upload = (result, runtime)
        return self.submit_async(result, runtime)

    def _open_batch(self, submission: _Submission, batch: list[tuple[str, ClientResult, ClientRuntime]]) -> grpc.Future:
        """On the submitting thread: the results' headers (each with the sha256 of its empty payload) in one call."""
        if submission.abandoned:
            raise RuntimeError("the agent stopped before the results were sent")
        submission.headers = [next(encode_result(result, runtime.layout)).header for _, result, runtime in batch]
        return self._submit_results.future(
            federation_pb2.ResultBatch(results=submission.headers), timeout=TRANSFER_DEADLINE
        )

    def _finish_submissions(self, timeout: float | None = None) -> None:
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

    def _fits_upload(self, result: ClientResult, runtime: ClientRuntime) -> bool:
        """Whether `result` goes in one UploadResult call (its payload bytes, in the run's wire dtype, fit one)."""
        layout = runtime.layout.with_payload_dtype(runtime.config.transport.update_dtype)
        return self.uploading and 0 < layout.payload_nbytes * len(result.payloads) <= UPLOAD_BYTES

    def submit_async(self, result: ClientResult, runtime: ClientRuntime) -> grpc.Future:
        """Start sending one result to the aggregator, its payloads in the run's transport.update_dtype: one
        UploadResult call when they fit in one message (the sha256 in the header), else a SubmitResult stream with the
        sha256 in a trailer (hashed while it streams). The call's result() raises grpc.RpcError when it is refused.
        Raises codec.CodecError at once when a payload cannot be sent in that dtype (float16 overflow)."""
        layout = runtime.layout.with_payload_dtype(runtime.config.transport.update_dtype)
        if self._fits_upload(result, runtime):
            upload = encode_upload(result, layout, with_sha256=not self.tls)  # TLS authenticates the one message
            telemetry.AGENT_SENT_BYTES.inc(upload.ByteSize())
            return self._upload_result.future(upload, timeout=TRANSFER_DEADLINE)
        chunks = encode_result(result, layout, sha256_in_trailer=True, framed=True)
        first = next(chunks)  # casts and checks the payloads before the call opens
        return self._submit_result.future(_counted(itertools.chain([first], chunks)), timeout=TRANSFER_DEADLINE)

    def submit(self, result: ClientResult, runtime: ClientRuntime) -> None:
        """submit_async, waiting for the aggregator's answer."""
        self.submit_async(result, runtime).result()


def _inline_model(blob: federation_pb2.InlineBlob, runtime: ClientRuntime) -> torch.Tensor:
    """An inline model checked for its size, digest format and the run's layout, not hashed again (its reply came over
    mutual TLS); copied out of the reply, which it outlives."""
    header = blob.header
    codec.check_sha256(header.sha256)  # the cache key
    if header.total_bytes != len(blob.data) or header.total_bytes != runtime.layout.nbytes:
        raise codec.CodecError(
            f"inline model declares {header.total_bytes} bytes, carries {len(blob.data)}; the run's model has "
            f"{runtime.layout.nbytes}",
            "size",
        )
    runtime.layout.check_specs(list(header.tensors))
    telemetry.AGENT_RECEIVED_BYTES.inc(len(blob.data))
    return torch.frombuffer(bytearray(blob.data), dtype=torch.float32)


def _status_name(code: int) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), f"status {code}")


_PHASES = {
    federation_pb2.PHASE_TRAIN: "train",
    federation_pb2.PHASE_PROBE: "probe",
    federation_pb2.PHASE_EVALUATE: "evaluate",
}


def _counted(
    chunks: Iterable[federation_pb2.ResultChunk | codec.Framed],
) -> Iterator[federation_pb2.ResultChunk | codec.Framed]:
    for chunk in chunks:
        telemetry.AGENT_SENT_BYTES.inc(chunk.ByteSize())
        yield chunk


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="client_agent", description="FairFL client agent")
    parser.add_argument("--aggregator", default=os.environ.get("FAIRFL_AGGREGATOR_ADDRESS", "127.0.0.1:50051"))
    parser.add_argument(
        "--clients", default=os.environ.get("FAIRFL_CLIENTS", ""), help="logical client ids, e.g. 0-49 or 0-9,20"
    )
    parser.add_argument(
        "--clients-per-agent",
        type=int,
        default=int(os.environ.get("FAIRFL_CLIENTS_PER_AGENT", "0")),
        help="derive the range from the pod ordinal (StatefulSet): ordinal*N .. ordinal*N+N-1",
    )
    parser.add_argument(
        "--shared-clients",
        action="store_true",
        default=os.environ.get("FAIRFL_SHARED_CLIENTS", "") == "1",
        help="co-host the client ids with other agents that say so (simulations: every agent holds the whole "
        "federated dataset; each task goes to the least-loaded host); env FAIRFL_SHARED_CLIENTS=1",
    )
    parser.add_argument("--device", default=os.environ.get("FAIRFL_DEVICE", "auto"))
    parser.add_argument("--threads", type=int, default=int(os.environ.get("FAIRFL_THREADS", "1")))
    parser.add_argument("--name", default=os.environ.get("FAIRFL_AGENT_NAME", ""))
    parser.add_argument("--log-level", default=os.environ.get("FAIRFL_LOG_LEVEL", "INFO"))
    parser.add_argument(
        "--dp-randomness",
        choices=RANDOMNESS,
        default=os.environ.get(RANDOMNESS_ENV, "secure"),
        help="DP sampling and noise from the OS (secure, default) or from the task seed (task: reproducible "
        f"simulations only; the server knows the seed); env {RANDOMNESS_ENV}",
    )
    DpPolicy.add_arguments(parser)
    DropPlan.add_arguments(parser)
    telemetry.add_metrics_arguments(parser)
    add_transport_arguments(parser, server=False)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    security = transport_from_args(parser, args)
    if args.clients_per_agent and not args.clients:
        ordinal = int(socket.gethostname().rsplit("-", 1)[-1])
        args.clients = f"{ordinal * args.clients_per_agent}-{(ordinal + 1) * args.clients_per_agent - 1}"
    try:
        client_ids = parse_client_ids(args.clients)
        policy = DpPolicy.from_args(args)
        faults = DropPlan.from_args(args)
    except ValueError as err:
        parser.error(str(err))
    torch.set_num_threads(max(1, args.threads))
    try:
        metrics = telemetry.start_from_args(args, "agent")
    except OSError as err:
        log.error("cannot start the client agent: %s", err)
        return 1
    if metrics is not None:  # launchers read the metrics port from this line
        print(telemetry.announcement(None, metrics), flush=True)
    agent = Agent(
        args.aggregator,
        client_ids,
        args.device,
        args.name,
        policy,
        args.dp_randomness,
        security,
        faults,
        shared=args.shared_clients,
    )

    import signal

    def _stop(signum: int, _frame: object) -> None:
        agent.stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
