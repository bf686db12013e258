"""The fairfl.v1.Federation servicer: the thin RPC layer over FederationState. Agents register, long-poll for tasks,
fetch models by sha256 and send results back; every refusal is counted (fairfl.rpc_refusals.refuse) and every
result goes through FederationState.accept (aggregator_service.federation.admission). A registration whose site data
does not fit the active run is refused with FAILED_PRECONDITION (aggregator_service.federation.site_check).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator

import grpc

from aggregator_service.federation.admission import Rejected
from aggregator_service.federation.site_check import SiteRefused, SiteReport, site_label
from aggregator_service.federation.state import MAX_POLL_WAIT_S, FederationState, RegistrationRefused
from fairfl import codec, framing, rpc_security, telemetry, tls
from fairfl.framing import CHUNK_BYTES
from fairfl.protocol import ReceivedUpload, ResultPart
from fairfl.rpc import INLINE_BLOB_BYTES
from fairfl.rpc_refusals import refuse
from fairfl.v1 import federation_pb2, federation_pb2_grpc, tensor_pb2

log = logging.getLogger(__name__)


SERVICE_NAME = "fairfl.v1.Federation"
MAX_CLIENTS_PER_AGENT = 1_000_000
MAX_NAME_CHARS = 256
MAX_CACHED_LISTED = 64  # digests of a PollRequest.cached_sha256 read (an agent caches a few models)
MAX_BATCH_RESULTS = 1024  # results in one SubmitResults call (the 4 MiB message limit bounds their size)


def _inline_blob(bundle: codec.EncodedBundle) -> federation_pb2.InlineBlob:
    return federation_pb2.InlineBlob(header=bundle.header, data=b"".join(bundle.buffers))


def framed_poll_reply(tasks: list[federation_pb2.Task], bundles: list[codec.EncodedBundle]) -> framing.Framed:
    """The serialised PollReply{tasks, blobs: InlineBlob{header, data} per bundle}, as protobuf writes it, with each
    model's bytes copied once from its blob (a message built with protobuf copies them four times: joined, into the
    InlineBlob, into the reply, serialised)."""
    parts = [federation_pb2.PollReply(tasks=tasks).SerializeToString()]
    for bundle in bundles:
        inline = framing.header_data_parts(bundle.header.SerializeToString(), bundle.buffers)  # an InlineBlob
        parts += framing.length_delimited_parts(_POLL_REPLY_BLOBS_FIELD, inline)
    return framing.Framed(b"".join(parts))


_POLL_REPLY_BLOBS_FIELD = federation_pb2.PollReply.DESCRIPTOR.fields_by_name["blobs"].number


class FederationServicer(federation_pb2_grpc.FederationServicer):
    def __init__(self, state: FederationState) -> None:
        self.state = state
        self.framed = False  # FetchBlob sends framing.Framed data chunks (registered by add_federation_servicer)

    def _bound(self, context: grpc.ServicerContext, agent_id: str, action: str) -> None:
        """Abort unless `agent_id` was registered by the caller's certificate (any caller on a plaintext server)."""
        bound_to = self.state.owner_principal(agent_id)
        if bound_to is not None and bound_to != rpc_security.principal(context):
            refuse(
                context,
                SERVICE_NAME,
                "identity",
                grpc.StatusCode.PERMISSION_DENIED,
                f"agent {agent_id[:8]}… was registered with another certificate; {action} only with your own agent id",
            )

    def Register(self, request: federation_pb2.RegisterRequest, context: grpc.ServicerContext):
        if not request.client_ids:
            refuse(
                context, SERVICE_NAME, "malformed", grpc.StatusCode.INVALID_ARGUMENT, "register at least one client id"
            )
        if len(request.client_ids) > MAX_CLIENTS_PER_AGENT or len(request.agent_name) > MAX_NAME_CHARS:
            refuse(
                context,
                SERVICE_NAME,
                "size",
                grpc.StatusCode.INVALID_ARGUMENT,
                f"an agent registers at most {MAX_CLIENTS_PER_AGENT} client ids with a name of at most "
                f"{MAX_NAME_CHARS} characters",
            )
        identity = rpc_security.caller(context)
        if identity is not None:
            refused = identity.unauthorized(list(request.client_ids))
            if refused:
                refuse(
                    context,
                    SERVICE_NAME,
                    "identity",
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{identity.describe()} may host clients {identity.clients and tls.format_ranges(identity.clients)}"
                    f", not {refused}",
                )
        site = SiteReport.of(request)
        label = site_label(request.agent_name, identity.name if identity is not None else None)
        try:
            agent = self.state.register(
                request.agent_name,
                list(request.client_ids),
                request.device[:MAX_NAME_CHARS],
                principal=identity.fingerprint if identity is not None else "",
                shared=request.shared,
                site=site,
                label=label,
            )
        except RegistrationRefused as full:
            refuse(context, SERVICE_NAME, "resource_exhausted", grpc.StatusCode.RESOURCE_EXHAUSTED, str(full))
        except SiteRefused as misfit:
            log.warning("%s", misfit)
            refuse(context, SERVICE_NAME, misfit.reason, grpc.StatusCode.FAILED_PRECONDITION, str(misfit))
        if site.given:  # an agent serving its own data (--data): what it holds, in one line
            log.info(
                "site %s: %d clients, %d train samples, signature %s (agent %s, %s)",
                label,
                len(site.clients),
                site.train_samples,
                site.describe(),
                agent.agent_id[:8],
                request.device[:MAX_NAME_CHARS],
            )
        else:
            log.info(
                "agent %s (%s, %s) registered %d clients%s",
                agent.agent_id[:8],
                request.agent_name,
                request.device[:MAX_NAME_CHARS],
                len(agent.client_ids),
                f" as {identity.describe()}" if identity is not None else "",
            )
        return federation_pb2.RegisterReply(
            agent_id=agent.agent_id,
            heartbeat_interval_seconds=self.state.heartbeat_interval,
            poll_wait_seconds=10.0,
        )

    def Heartbeat(self, request: federation_pb2.HeartbeatRequest, context: grpc.ServicerContext):
        self._bound(context, request.agent_id, "send heartbeats")
        return federation_pb2.HeartbeatReply(known=self.state.touch(request.agent_id) is not None)

    def PollTasks(self, request: federation_pb2.PollRequest, context: grpc.ServicerContext):
        wait = request.wait_seconds
        if not (math.isfinite(wait) and wait >= 0):  # NaN would make the wait loop spin instead of sleep
            refuse(
                context,
                SERVICE_NAME,
                "malformed",
                grpc.StatusCode.INVALID_ARGUMENT,
                f"wait_seconds must be a finite number >= 0 (longer than {MAX_POLL_WAIT_S:g} waits "
                f"{MAX_POLL_WAIT_S:g}), got {wait}",
            )
        self._bound(context, request.agent_id, "poll tasks")
        if self.state.touch(request.agent_id) is None:
            refuse(
                context,
                SERVICE_NAME,
                "identity",
                grpc.StatusCode.UNAUTHENTICATED,
                f"agent {request.agent_id[:64]!r} is not registered (the aggregator may have restarted, or forgot "
                "the agent after a long silence); register again",
            )
        remaining = context.time_remaining()
        if remaining is not None:
            wait = min(wait, max(remaining - 1.0, 0.0))
        tasks = self.state.poll(request.agent_id, request.max_tasks, wait)
        if self.framed:  # serialised by hand: the models' bytes copied once, straight from the blobs' memory
            return framed_poll_reply(tasks, self._inline_bundles(request, tasks))
        return federation_pb2.PollReply(tasks=tasks, blobs=self._inline_blobs(request, tasks))

    def _inline_bundles(
        self, request: federation_pb2.PollRequest, tasks: list[federation_pb2.Task]
    ) -> list[codec.EncodedBundle]:
        """The models of `tasks` the agent does not hold, while they fit in INLINE_BLOB_BYTES (fairfl.rpc)."""
        limit = min(request.inline_blob_bytes, INLINE_BLOB_BYTES)
        held = set(request.cached_sha256[:MAX_CACHED_LISTED])
        bundles: list[codec.EncodedBundle] = []
        for sha256 in dict.fromkeys(t.model.sha256 for t in tasks if t.HasField("model")):
            entry = None if sha256 in held else self.state.blobs.get(sha256)
            if entry is None or entry[0].total_bytes > limit:
                continue
            limit -= entry[0].total_bytes
            bundles.append(entry[0])
        return bundles

    def _inline_blobs(
        self, request: federation_pb2.PollRequest, tasks: list[federation_pb2.Task]
    ) -> list[federation_pb2.InlineBlob]:
        """The InlineBlob messages of _inline_bundles."""
        return [_inline_blob(b) for b in self._inline_bundles(request, tasks)]

    def GetRunSpec(self, request: federation_pb2.RunSpecRequest, context: grpc.ServicerContext):
        text = self.state.run_yaml.get(request.run_id)
        if text is None:
            refuse(
                context,
                SERVICE_NAME,
                "unknown",
                grpc.StatusCode.NOT_FOUND,
                f"run {request.run_id[:200]!r} is unknown to this aggregator",
            )
        return federation_pb2.RunSpec(run_id=request.run_id, experiment_yaml=text)

    def FetchBlob(self, request: tensor_pb2.BlobRef, context: grpc.ServicerContext) -> Iterator[tensor_pb2.Chunk]:
        entry = self.state.blobs.get(request.sha256)
        if entry is None:
            refuse(
                context,
                SERVICE_NAME,
                "unknown",
                grpc.StatusCode.NOT_FOUND,
                f"blob {request.sha256[:16]!r}… is not held (it belongs to a finished round)",
            )
        bundle = entry[0]
        # A byte range, so an agent can fetch a large blob on concurrent streams (fairfl.fetch.fetch_ranges).
        offset, length = request.offset, request.length
        total = bundle.total_bytes
        if offset > total or offset + length > total:
            refuse(
                context,
                SERVICE_NAME,
                "size",
                grpc.StatusCode.OUT_OF_RANGE,
                f"range offset {offset} length {length} is outside blob {request.sha256[:16]}… of {total} bytes; "
                "ask for offset + length <= total_bytes (length 0 = to the end)",
            )
        yield from bundle.chunks(CHUNK_BYTES, offset, length or total - offset, framed=self.framed)

    def SubmitResult(self, request_iterator: Iterator[federation_pb2.ResultChunk], context: grpc.ServicerContext):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("part") != "header":
            refuse(
                context,
                SERVICE_NAME,
                "malformed",
                grpc.StatusCode.INVALID_ARGUMENT,
                "a result stream must start with a ResultHeader",
            )
        header = first.header

        def data() -> Iterator[ResultPart]:
            for chunk in request_iterator:
                part = chunk.WhichOneof("part")
                if part == "data":
                    yield chunk.data
                elif part == "trailer":
                    yield chunk.trailer
                elif part == "header":
                    raise codec.CodecError("a second header arrived inside the result stream")
                else:
                    raise codec.CodecError("an empty ResultChunk arrived inside the result stream")

        rejected = self._accept(header, data(), rpc_security.principal(context))
        if rejected is not None:
            refuse(context, SERVICE_NAME, rejected.cause, rejected.code, str(rejected))
        return federation_pb2.SubmitReply(accepted=True)

    def UploadResult(self, request: ReceivedUpload, context: grpc.ServicerContext):
        if request.error:
            refuse(context, SERVICE_NAME, "malformed", grpc.StatusCode.INVALID_ARGUMENT, request.error)
        header = request.header
        problem = ""
        if header.sha256_in_trailer:
            problem = "an UploadResult has no trailer: put the payload's sha256 in the header"
        elif header.total_bytes != len(request.data):
            declared, carried = header.total_bytes, len(request.data)
            problem = f"the header declares {declared} payload bytes but the upload carries {carried}"
        data: list[ResultPart] = [request.data] if len(request.data) else []
        principal = rpc_security.principal(context)
        # One message over mutual TLS: every byte is authenticated already, so the sha256 may be left out (a digest
        # computed from the very bytes it travels with adds nothing); over plaintext it is required.
        rejected = self._accept(header, data, principal, malformed=problem, sha256_optional=bool(principal))
        if rejected is not None:
            refuse(context, SERVICE_NAME, rejected.cause, rejected.code, str(rejected))
        return federation_pb2.SubmitReply(accepted=True)

    def SubmitResults(self, request: federation_pb2.ResultBatch, context: grpc.ServicerContext):
        if len(request.results) > MAX_BATCH_RESULTS:
            refuse(
                context,
                SERVICE_NAME,
                "size",
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.results)} results in one batch; at most {MAX_BATCH_RESULTS}",
            )
        principal = rpc_security.principal(context)
        statuses = []
        for header in request.results:
            rejected = self._accept(header, (), principal, header_only=True)
            if rejected is None:
                statuses.append(federation_pb2.ResultStatus(task_id=header.task_id, code=grpc.StatusCode.OK.value[0]))
                continue
            telemetry.REQUESTS_REFUSED.labels(SERVICE_NAME, rejected.cause).inc()
            statuses.append(
                federation_pb2.ResultStatus(task_id=header.task_id, code=rejected.code.value[0], message=str(rejected))
            )
        return federation_pb2.ResultBatchReply(statuses=statuses)

    def _accept(
        self,
        header: federation_pb2.ResultHeader,
        data: Iterable[ResultPart],
        principal: str,
        header_only: bool = False,
        malformed: str = "",
        sha256_optional: bool = False,
    ) -> Rejected | None:
        """FederationState.accept, counted: None when the result got in, else the refusal (its status and reason).
        `header_only`: the result must carry no payload (SubmitResults), refused before any buffer is allocated;
        `malformed`: what the call found wrong with the result's framing already (refused and counted as such)."""
        try:
            if malformed:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"result for task {header.task_id[:200]}: {malformed}")
            if header_only and (header.total_bytes or header.payloads or header.sha256_in_trailer):
                raise Rejected(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"result for task {header.task_id[:200]} declares payload bytes or a sha256 trailer: results "
                    "with payloads are streamed with SubmitResult",
                )
            self.state.accept(header, data, principal, sha256_optional)
        except Rejected as rejected:
            if not rejected.late:
                self.state.count_rejection(header.task_id, principal)
            if rejected.reason == "late":
                telemetry.RESULTS_LATE.inc()
            else:
                telemetry.RESULTS_REJECTED.labels(rejected.reason).inc()
            log.info("rejected result for %s: %s", header.task_id[:200], rejected)
            return rejected
        telemetry.RESULTS_ACCEPTED.inc()
        return None
