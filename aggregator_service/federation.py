"""The gRPC transport: agents register, long-poll for tasks, fetch models by sha256 and stream results back.

`GrpcTransport` is the engine's side (dispatch a phase, wait for quorum or deadline); `FederationServicer` is the
thin RPC layer over the same state. Every result is checked before it can reach a strategy: the task must be open
and assigned to the submitting client on the submitting agent, the payload must match the model layout, be finite
and hash to the declared sha256. A refused result leaves the round and the model untouched.

Identity (docs/security.md): on an mTLS aggregator every agent id is bound at registration to the certificate that
registered it (its fingerprint; "" on a plaintext aggregator), so polling, heartbeats and results for an agent id are
accepted only from that certificate, and an agent certificate that names its clients may register only those.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import grpc
import torch

from aggregator_service.blobs import BlobStore
from aggregator_service.engine import ClientTransport, PhaseOutcome, ResultSink
from fairfl import __version__, codec, rpc, telemetry, tls
from fairfl.config import ExperimentConfig
from fairfl.params import ParamLayout
from fairfl.protocol import (
    ClientResult,
    ReceivedUpload,
    ResultAssembler,
    ResultPart,
    check_against_task,
    check_result,
    parse_result_chunk,
    parse_result_upload,
)
from fairfl.rpc import CHUNK_BYTES, INLINE_BLOB_BYTES
from fairfl.v1 import federation_pb2, federation_pb2_grpc, tensor_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = "fairfl.v1.Federation"
HEARTBEAT_INTERVAL_S = 5.0
AGENT_TIMEOUT_S = 30.0  # an agent silent this long no longer counts as available
MAX_POLL_WAIT_S = 30.0
CLOSED_TASK_MEMORY = 200_000
MAX_CLIENTS_PER_AGENT = 1_000_000
MAX_NAME_CHARS = 256
MAX_CACHED_LISTED = 64  # digests of a PollRequest.cached_sha256 read (an agent caches a few models)
MAX_BATCH_RESULTS = 1024  # results in one SubmitResults call (the 4 MiB message limit bounds their size)


class Rejected(Exception):
    """A result refused with a gRPC status; counted, and the round goes on."""

    def __init__(
        self, code: grpc.StatusCode, message: str, late: bool = False, reason: str = "", cause: str = "malformed"
    ) -> None:
        super().__init__(message)
        self.code = code
        self.late = late
        self.reason = reason or code.name.lower()  # bounded metric label: "late", "duplicate" or the status code
        self.cause = cause  # fairfl_requests_refused_total's reason: a fixed word (see fairfl.telemetry)


@dataclass
class _Agent:
    agent_id: str
    name: str
    client_ids: list[int]
    device: str
    last_seen: float
    queue: deque[federation_pb2.Task] = field(default_factory=deque)
    principal: str = ""  # fingerprint of the certificate that registered it ("" on a plaintext aggregator)
    shared: bool = False  # co-hosts its clients with other shared agents (RegisterRequest.shared)


@dataclass
class _Batch:
    """The tasks of one phase, waiting for their results."""

    pending: dict[str, federation_pb2.Task]
    wanted: int  # results that close the phase (its quorum, or every task)
    results: dict[int, ClientResult] = field(default_factory=dict)
    rejected: int = 0
    sink: ResultSink | None = None  # streaming aggregation: accepted results go here as they arrive
    folding: int = 0  # accepted results inside `sink` right now (they count toward `wanted`)
    error: BaseException | None = None  # a sink failure: the phase fails with it
    closing: bool = False  # the phase stopped taking results and waits for the folds in flight

    def settled(self) -> bool:
        """Whether the phase's waiter has something to act on: every task answered, the quorum reached (folds in flight
        count), a failure, or the last fold of a closing phase done. Results are announced only then, so a phase's
        waiter (and the long polls sharing the condition) wake once per phase, not once per result."""
        if self.error is not None:
            return True
        if self.closing:
            return self.folding == 0
        return not self.pending or len(self.results) + self.folding >= self.wanted


class FederationState:
    """Registered agents, task queues, open phases and the blob store; shared by the servicer and the transport."""

    def __init__(
        self,
        heartbeat_interval: float = HEARTBEAT_INTERVAL_S,
        agent_timeout: float = AGENT_TIMEOUT_S,
        max_long_polls: int = 1 << 30,
    ) -> None:
        if not 0 < heartbeat_interval < agent_timeout:
            raise ValueError(
                f"agent timeout ({agent_timeout}s) must exceed the heartbeat interval ({heartbeat_interval}s) > 0"
            )
        self.lock = threading.Condition()
        # Liveness (docs/reliability.md): agents heartbeat this often; one silent for agent_timeout has vanished,
        # its clients are no candidates and its open tasks close without waiting for the deadline.
        self.heartbeat_interval = heartbeat_interval
        self.agent_timeout = agent_timeout
        # Every waiting poll holds a server worker: beyond this many a poll answers at once, so results, heartbeats
        # and run control always find a free worker.
        self.max_long_polls = max_long_polls
        self.long_polls = 0
        self.agents: dict[str, _Agent] = {}
        self.client_hosts: dict[int, list[str]] = {}  # client id -> ids of the agents hosting it
        self.assigned: dict[str, str] = {}  # open task id -> the agent it was given to (the one to answer it)
        self.blobs = BlobStore()
        self.run_id: str | None = None
        self.run_yaml: dict[str, str] = {}
        self.layout: ParamLayout | None = None
        self.open_tasks: dict[str, _Batch] = {}
        # task id -> (round, accepted); tells a late result (closed at its deadline) from a duplicate
        self.closed_tasks: OrderedDict[str, tuple[int, bool]] = OrderedDict()
        self.refused_after_close: Counter[tuple[int, str]] = Counter()  # (round, "late" | "duplicate") -> count
        self.counters = {"rejected": 0, "late": 0, "duplicate": 0, "accepted": 0}

    # -- agents -------------------------------------------------------------------------------------------------

    def register(
        self, name: str, client_ids: list[int], device: str, principal: str = "", shared: bool = False
    ) -> _Agent:
        with self.lock:
            agent = _Agent(
                uuid.uuid4().hex,
                name,
                sorted(set(client_ids)),
                device,
                time.monotonic(),
                principal=principal,
                shared=shared,
            )
            taken = set(agent.client_ids)
            for old in [a for a in self.agents.values() if taken & set(a.client_ids)]:
                if shared and old.shared and old.name != name:
                    continue  # co-hosts: both keep the clients
                # A re-registering agent takes its clients back, with the tasks already queued for them and those it
                # was running, so a reconnect does not cost the round its deadline.
                old.client_ids = [c for c in old.client_ids if c not in taken]
                agent.queue.extend(t for t in old.queue if t.client_id in taken)
                old.queue = deque(t for t in old.queue if t.client_id not in taken)
                for task_id, holder in self.assigned.items():
                    task = self._task(task_id)
                    if holder == old.agent_id and task is not None and task.client_id in taken:
                        self.assigned[task_id] = agent.agent_id
                for cid in taken:
                    hosts = self.client_hosts.get(cid, [])
                    if old.agent_id in hosts:
                        hosts.remove(old.agent_id)
                if not old.client_ids:
                    del self.agents[old.agent_id]
            for cid in agent.client_ids:
                self.client_hosts.setdefault(cid, []).append(agent.agent_id)
            self.agents[agent.agent_id] = agent
            self.lock.notify_all()
            return agent

    def _task(self, task_id: str) -> federation_pb2.Task | None:
        """An open task (caller holds the lock)."""
        batch = self.open_tasks.get(task_id)
        return batch.pending.get(task_id) if batch is not None else None

    def _live(self, agent: _Agent, now: float) -> bool:
        return now - agent.last_seen < self.agent_timeout

    def hosts(self, client_id: int) -> list[_Agent]:
        """The agents registered for `client_id` (caller holds the lock)."""
        return [self.agents[aid] for aid in self.client_hosts.get(client_id, ()) if aid in self.agents]

    def touch(self, agent_id: str) -> _Agent | None:
        with self.lock:
            agent = self.agents.get(agent_id)
            if agent is not None:
                agent.last_seen = time.monotonic()
            return agent

    def live_clients(self) -> list[int]:
        now = time.monotonic()
        with self.lock:
            return sorted(cid for cid in self.client_hosts if any(self._live(a, now) for a in self.hosts(cid)))

    def live_agents(self) -> int:
        now = time.monotonic()
        with self.lock:
            return sum(1 for a in self.agents.values() if self._live(a, now))

    def vanished(self, task_id: str, now: float) -> bool:
        """The agent given the task deregistered or fell silent (caller holds the lock)."""
        agent = self.agents.get(self.assigned.get(task_id, ""))
        return agent is None or not self._live(agent, now)

    def dispatch(self, tasks: list[federation_pb2.Task]) -> list[federation_pb2.Task]:
        """Queue each task with the least-loaded live host of its client (ties: by name, so the same agents get the
        same tasks again after a restart); returns the tasks no agent hosts. Caller holds the lock."""
        now = time.monotonic()
        load = {aid: len(a.queue) for aid, a in self.agents.items()}
        unhosted = []
        for task in tasks:
            hosts = self.hosts(task.client_id)
            live = [a for a in hosts if self._live(a, now)]
            if not hosts:
                unhosted.append(task)
                continue
            agent = min(live or hosts, key=lambda a: (load[a.agent_id], a.name, a.agent_id))
            load[agent.agent_id] += 1
            agent.queue.append(task)
            self.assigned[task.task_id] = agent.agent_id
        return unhosted

    def wake(self) -> None:
        """Wake every waiter (a phase, a wait for clients) so it rechecks its stop event now."""
        with self.lock:
            self.lock.notify_all()

    def poll(self, agent_id: str, max_tasks: int, wait: float) -> list[federation_pb2.Task]:
        with self.lock:
            if self.long_polls >= self.max_long_polls:
                wait = 0.0  # no worker to spare for waiting: answer now (the agent backs off briefly)
            self.long_polls += 1
            try:
                return self._poll(agent_id, max_tasks, time.monotonic() + min(max(wait, 0.0), MAX_POLL_WAIT_S))
            finally:
                self.long_polls -= 1

    def _poll(self, agent_id: str, max_tasks: int, deadline: float) -> list[federation_pb2.Task]:
        with self.lock:
            while True:
                agent = self.agents.get(agent_id)
                if agent is None:
                    return []
                agent.last_seen = time.monotonic()
                now_unix = time.time()
                while agent.queue and agent.queue[0].deadline_unix < now_unix:
                    agent.queue.popleft()  # expired before anyone picked it up
                if agent.queue:
                    take = max(1, max_tasks)
                    return [agent.queue.popleft() for _ in range(min(take, len(agent.queue)))]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self.lock.wait(remaining)

    # -- results ------------------------------------------------------------------------------------------------

    def owner_principal(self, agent_id: str) -> str | None:
        """The certificate fingerprint `agent_id` is bound to; None for an unknown agent."""
        with self.lock:
            agent = self.agents.get(agent_id)
            return None if agent is None else agent.principal

    def accept(
        self,
        header: federation_pb2.ResultHeader,
        data: Iterable[bytes],
        principal: str = "",
        sha256_optional: bool = False,
    ) -> None:
        """Validate a result stream and file it with its phase; raises Rejected with the status to return.

        `principal` is the submitting certificate's fingerprint ("" on a plaintext aggregator); `sha256_optional`:
        the header may omit the payload's sha256 (ResultAssembler)."""
        with self.lock:
            batch = self.open_tasks.get(header.task_id)
            task = batch.pending.get(header.task_id) if batch else None
            layout = self.layout
            if task is None or batch is None:
                closed = self.closed_tasks.get(header.task_id)
                if closed is None:
                    raise Rejected(
                        grpc.StatusCode.NOT_FOUND,
                        f"unknown task {header.task_id[:200]!r}: it was never issued",
                        cause="unknown",
                    )
                round_number, accepted = closed
                kind = "duplicate" if accepted else "late"
                self.counters[kind] += 1
                self.refused_after_close[(round_number, kind)] += 1
                if accepted:  # a replay: whoever sends it, a result counts once
                    raise Rejected(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"task {header.task_id} is closed: its result was already accepted; results are accepted "
                        "once (replay refused)",
                        late=True,
                        reason=kind,
                        cause="replay",
                    )
                raise Rejected(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"task {header.task_id} is closed: round {round_number} closed it at its deadline before the "
                    "result arrived",
                    late=True,
                    reason=kind,
                    cause="late",
                )
            hosts = self.client_hosts.get(header.client_id)
            if not hosts:
                raise Rejected(
                    grpc.StatusCode.NOT_FOUND,
                    f"unknown client id {header.client_id}: no agent registered it",
                    cause="unknown",
                )
            if header.client_id != task.client_id:
                raise Rejected(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"task {task.task_id} belongs to client {task.client_id}, not {header.client_id}",
                    cause="identity",
                )
            if header.agent_id not in hosts:  # an empty agent id is no excuse: task ids are guessable
                raise Rejected(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"client {header.client_id} is hosted by agent {hosts[0][:8]}…"
                    f"{f' (and {len(hosts) - 1} more)' if len(hosts) > 1 else ''}, not by the submitting agent "
                    f"{header.agent_id[:8] or '(none given)'}",
                    cause="identity",
                )
            given = self.assigned.get(header.task_id, "")
            if header.agent_id != given:  # a co-host of the client, but the task went to another agent
                raise Rejected(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"task {header.task_id} was given to agent {given[:8]}…, not to the submitting agent "
                    f"{header.agent_id[:8]}… (both host client {header.client_id})",
                    cause="identity",
                )
            if self.agents[given].principal != principal:  # agent ids are secrets only until a log line leaks one
                raise Rejected(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"client {header.client_id}'s agent {given[:8]}… registered with another certificate than the "
                    "one submitting this result",
                    cause="identity",
                )
            if (header.run_id, header.round, header.phase) != (task.run_id, task.round, task.phase):
                raise Rejected(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"result says run {header.run_id[:200]!r} round {header.round} phase {header.phase}; the task is "
                    f"run {task.run_id!r} round {task.round} phase {task.phase}",
                    cause="mismatch",
                )
        assert layout is not None
        try:
            assembler = ResultAssembler(header, layout, sha256_optional)
            for piece in data:
                assembler.add(piece)
            result = assembler.finish()
            check_result(result)
            check_against_task(result, task)
        except codec.CodecError as err:
            code = grpc.StatusCode.DATA_LOSS if err.reason == "integrity" else grpc.StatusCode.INVALID_ARGUMENT
            raise Rejected(code, f"result for task {header.task_id} refused: {err}", cause=err.reason) from err
        with self.lock:
            batch = self.open_tasks.get(header.task_id)
            closed = self.closed_tasks.get(header.task_id)
            open_now = batch is not None and header.task_id in batch.pending
            if not open_now and closed is not None and closed[1]:  # sent twice at once: the other copy got in
                self.counters["duplicate"] += 1
                self.refused_after_close[(header.round, "duplicate")] += 1
                raise Rejected(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"task {header.task_id}: its result was accepted while this copy arrived (replay refused)",
                    late=True,
                    reason="duplicate",
                    cause="replay",
                )
            # Closed while we were receiving, or its phase already has its quorum (the waiting phase has not woken
            # to close it yet): a phase never takes more than its first k results.
            if batch is None or not open_now or len(batch.results) + batch.folding >= batch.wanted:
                self.counters["late"] += 1
                self.refused_after_close[(header.round, "late")] += 1
                raise Rejected(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"task {header.task_id} closed while its result was arriving",
                    late=True,
                    reason="late",
                    cause="late",
                )
            del batch.pending[header.task_id]
            del self.open_tasks[header.task_id]
            self.assigned.pop(header.task_id, None)
            self._remember_closed(header.task_id, header.round, accepted=True)
            self.counters["accepted"] += 1
            if batch.sink is None:
                batch.results[result.client_id] = result
                if batch.settled():
                    self.lock.notify_all()
                return
            if batch.error is not None:  # the phase already failed: its aggregate is void, nothing to fold into
                return
            batch.folding += 1
        # Folded outside the lock (a big update takes a while) but before the phase can close: execute() waits for
        # `folding` to drain, so every accepted result is in the aggregate and none arrives after it was formed.
        folded = False
        try:
            batch.sink(result)
            folded = True
        except Exception as err:  # not the client's fault (it was accepted): the phase fails with it
            log.exception("folding the result of task %s failed", header.task_id)
            batch.error = err
        finally:
            with self.lock:
                batch.folding -= 1
                if folded and batch.error is None:
                    batch.results[result.client_id] = result
                if batch.settled():
                    self.lock.notify_all()

    def count_rejection(self, task_id: str) -> None:
        """Count a refused result for a still-open task with its phase (closed tasks are counted in accept)."""
        with self.lock:
            self.counters["rejected"] += 1
            batch = self.open_tasks.get(task_id)
            if batch is not None:
                batch.rejected += 1

    def drain_refused_after_close(self, round_number: int) -> tuple[int, int]:
        """Late and duplicate results of `round_number` refused so far; each is reported once."""
        with self.lock:
            late = self.refused_after_close.pop((round_number, "late"), 0)
            duplicate = self.refused_after_close.pop((round_number, "duplicate"), 0)
            return late, duplicate

    def _remember_closed(self, task_id: str, round_number: int, accepted: bool) -> None:
        self.closed_tasks[task_id] = (round_number, accepted)
        while len(self.closed_tasks) > CLOSED_TASK_MEMORY:
            self.closed_tasks.popitem(last=False)


class GrpcTransport(ClientTransport):
    def __init__(self, state: FederationState) -> None:
        self.state = state
        self.stop = threading.Event()  # the run's stop event (from wait_for_clients): phases end as soon as it is set

    def start_run(self, run_id: str, config: ExperimentConfig, layout: ParamLayout) -> None:
        with self.state.lock:
            self.state.run_id = run_id
            self.state.run_yaml[run_id] = config.to_yaml()
            self.state.layout = layout.with_payload_dtype(config.transport.update_dtype)  # what results travel in

    def wait_for_clients(self, num_clients: int, timeout: float, stop: threading.Event) -> None:
        self.stop = stop
        deadline = time.monotonic() + timeout
        while len([c for c in self.state.live_clients() if c < num_clients]) < num_clients:
            if stop.is_set():
                from aggregator_service.engine import RunStopped

                raise RunStopped("stopped while waiting for clients")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(self.state.live_clients())} of {num_clients} clients registered within {timeout:.0f}s; "
                    "start more client agents or lower data.num_clients"
                )
            with self.state.lock:
                self.state.lock.wait(0.2)

    def available_clients(self) -> list[int]:
        return self.state.live_clients()

    def publish(self, flat: torch.Tensor) -> tensor_pb2.BlobRef:
        assert self.state.layout is not None
        return self.state.blobs.put(self.state.layout, flat)

    def execute(
        self,
        tasks: list[federation_pb2.Task],
        timeout: float,
        quorum: int | None = None,
        on_result: ResultSink | None = None,
    ) -> PhaseOutcome:
        state = self.state
        batch = _Batch(
            pending={t.task_id: t for t in tasks}, wanted=len(tasks) if quorum is None else quorum, sink=on_result
        )
        deadline = time.monotonic() + timeout
        check_every = min(1.0, state.agent_timeout / 4)  # how soon a vanished agent's tasks close
        with state.lock:
            for task in state.dispatch(tasks):
                del batch.pending[task.task_id]
            for task_id in batch.pending:
                state.open_tasks[task_id] = batch
            state.lock.notify_all()
            while (
                batch.pending
                and len(batch.results) + batch.folding < batch.wanted
                and batch.error is None
                and not self.stop.is_set()
            ):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                state.lock.wait(min(remaining, check_every))
                now = time.monotonic()
                if batch.pending and all(state.vanished(task_id, now) for task_id in batch.pending):
                    # Nobody left who could answer: close now; those clients may come back in a later round.
                    gone = sorted(t.client_id for t in batch.pending.values())
                    log.info("phase closes early: clients %s vanished mid-round (agent silent or gone)", gone[:20])
                    break
            for task_id in list(batch.pending):  # close the phase: anything still pending is now late
                state.open_tasks.pop(task_id, None)
                state.assigned.pop(task_id, None)
                state._remember_closed(task_id, batch.pending[task_id].round, accepted=False)
            for agent in state.agents.values():  # tasks nobody picked up are withdrawn
                agent.queue = deque(t for t in agent.queue if t.task_id not in batch.pending)
            batch.closing = True
            while batch.folding:  # accepted results still being folded in: the aggregate must hold them all
                state.lock.wait()
            if batch.error is not None:
                raise RuntimeError(f"streaming aggregation failed: {batch.error}") from batch.error
            results = [batch.results[c] for c in sorted(batch.results)]
        done = {r.client_id for r in results}
        missing = sorted({t.client_id for t in tasks} - done)
        if missing:
            log.warning("phase closed without results from clients %s", missing[:20])
        return PhaseOutcome(results, missing, rejected=batch.rejected)

    def refused_after_close(self, round_number: int) -> tuple[int, int]:
        return self.state.drain_refused_after_close(round_number)

    def end_run(self, run_id: str) -> None:
        with self.state.lock:
            self.state.blobs.clear()


class FederationServicer(federation_pb2_grpc.FederationServicer):
    def __init__(self, state: FederationState) -> None:
        self.state = state
        self.framed = False  # FetchBlob sends codec.Framed data chunks (registered by add_federation_servicer)

    def _bound(self, context: grpc.ServicerContext, agent_id: str, action: str) -> None:
        """Abort unless `agent_id` was registered by the caller's certificate (any caller on a plaintext server)."""
        bound_to = self.state.owner_principal(agent_id)
        if bound_to is not None and bound_to != rpc.principal(context):
            rpc.refuse(
                context,
                SERVICE_NAME,
                "identity",
                grpc.StatusCode.PERMISSION_DENIED,
                f"agent {agent_id[:8]}… was registered with another certificate; {action} only with your own agent id",
            )

    def Register(self, request: federation_pb2.RegisterRequest, context: grpc.ServicerContext):
        if not request.client_ids:
            rpc.refuse(
                context, SERVICE_NAME, "malformed", grpc.StatusCode.INVALID_ARGUMENT, "register at least one client id"
            )
        if len(request.client_ids) > MAX_CLIENTS_PER_AGENT or len(request.agent_name) > MAX_NAME_CHARS:
            rpc.refuse(
                context,
                SERVICE_NAME,
                "size",
                grpc.StatusCode.INVALID_ARGUMENT,
                f"an agent registers at most {MAX_CLIENTS_PER_AGENT} client ids with a name of at most "
                f"{MAX_NAME_CHARS} characters",
            )
        identity = rpc.caller(context)
        if identity is not None:
            refused = identity.unauthorized(list(request.client_ids))
            if refused:
                rpc.refuse(
                    context,
                    SERVICE_NAME,
                    "identity",
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{identity.describe()} may host clients {identity.clients and tls.format_ranges(identity.clients)}"
                    f", not {refused}",
                )
        agent = self.state.register(
            request.agent_name,
            list(request.client_ids),
            request.device[:MAX_NAME_CHARS],
            principal=identity.fingerprint if identity is not None else "",
            shared=request.shared,
        )
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
        self._bound(context, request.agent_id, "poll tasks")
        if self.state.touch(request.agent_id) is None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"agent {request.agent_id[:64]!r} is not registered (the aggregator may have restarted); "
                "register again",
            )
        wait = request.wait_seconds
        remaining = context.time_remaining()
        if remaining is not None:
            wait = min(wait, max(remaining - 1.0, 0.0))
        tasks = self.state.poll(request.agent_id, request.max_tasks, wait)
        return federation_pb2.PollReply(tasks=tasks, blobs=self._inline_blobs(request, tasks))

    def _inline_blobs(
        self, request: federation_pb2.PollRequest, tasks: list[federation_pb2.Task]
    ) -> list[federation_pb2.InlineBlob]:
        """The models of `tasks` the agent does not hold, while they fit in INLINE_BLOB_BYTES (fairfl.rpc)."""
        limit = min(request.inline_blob_bytes, INLINE_BLOB_BYTES)
        held = set(request.cached_sha256[:MAX_CACHED_LISTED])
        blobs: list[federation_pb2.InlineBlob] = []
        for sha256 in dict.fromkeys(t.model.sha256 for t in tasks if t.HasField("model")):
            entry = None if sha256 in held else self.state.blobs.get(sha256)
            if entry is None or entry[0].total_bytes > limit:
                continue
            bundle = entry[0]
            limit -= bundle.total_bytes
            blobs.append(federation_pb2.InlineBlob(header=bundle.header, data=b"".join(bundle.buffers)))
        return blobs

    def GetRunSpec(self, request: federation_pb2.RunSpecRequest, context: grpc.ServicerContext):
        text = self.state.run_yaml.get(request.run_id)
        if text is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"run {request.run_id!r} is unknown to this aggregator")
        return federation_pb2.RunSpec(run_id=request.run_id, experiment_yaml=text)

    def FetchBlob(self, request: tensor_pb2.BlobRef, context: grpc.ServicerContext) -> Iterator[tensor_pb2.Chunk]:
        entry = self.state.blobs.get(request.sha256)
        if entry is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND, f"blob {request.sha256[:16]}… is not held (it belongs to a finished round)"
            )
        bundle = entry[0]
        # A byte range, so an agent can fetch a large blob on concurrent streams (codec.fetch_ranges).
        offset, length = request.offset, request.length
        total = bundle.total_bytes
        if offset > total or offset + length > total:
            rpc.refuse(
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
            rpc.refuse(
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

        rejected = self._accept(header, data(), rpc.principal(context))
        if rejected is not None:
            rpc.refuse(context, SERVICE_NAME, rejected.cause, rejected.code, str(rejected))
        return federation_pb2.SubmitReply(accepted=True)

    def UploadResult(self, request: ReceivedUpload, context: grpc.ServicerContext):
        if request.error:
            rpc.refuse(context, SERVICE_NAME, "malformed", grpc.StatusCode.INVALID_ARGUMENT, request.error)
        header = request.header
        problem = ""
        if header.sha256_in_trailer:
            problem = "an UploadResult has no trailer: put the payload's sha256 in the header"
        elif header.total_bytes != len(request.data):
            declared, carried = header.total_bytes, len(request.data)
            problem = f"the header declares {declared} payload bytes but the upload carries {carried}"
        data: list[ResultPart] = [request.data] if len(request.data) else []
        principal = rpc.principal(context)
        # One message over mutual TLS: every byte is authenticated already, so the sha256 may be left out (a digest
        # computed from the very bytes it travels with adds nothing); over plaintext it is required.
        rejected = self._accept(header, data, principal, malformed=problem, sha256_optional=bool(principal))
        if rejected is not None:
            rpc.refuse(context, SERVICE_NAME, rejected.cause, rejected.code, str(rejected))
        return federation_pb2.SubmitReply(accepted=True)

    def SubmitResults(self, request: federation_pb2.ResultBatch, context: grpc.ServicerContext):
        if len(request.results) > MAX_BATCH_RESULTS:
            rpc.refuse(
                context,
                SERVICE_NAME,
                "size",
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.results)} results in one batch; at most {MAX_BATCH_RESULTS}",
            )
        principal = rpc.principal(context)
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
                self.state.count_rejection(header.task_id)
            if rejected.reason == "late":
                telemetry.RESULTS_LATE.inc()
            else:
                telemetry.RESULTS_REJECTED.labels(rejected.reason).inc()
            log.info("rejected result for %s: %s", header.task_id[:200], rejected)
            return rejected
        telemetry.RESULTS_ACCEPTED.inc()
        return None


class _Registration:
    """Stands in for a grpc.Server to collect the method handlers generated code registers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers.update(handlers)


def add_federation_servicer(servicer: FederationServicer, server: grpc.Server) -> None:
    """Register the Federation service as federation_pb2_grpc.add_FederationServicer_to_server does, except that the
    bulk methods handle data chunks as raw bytes: FetchBlob serialises each straight from the blob's memory and
    SubmitResult and UploadResult read them as views of the received message (codec.Framed, codec.chunk_parser,
    protocol.parse_result_upload). The wire format is the same protobuf."""
    generated = _Registration()
    federation_pb2_grpc.add_FederationServicer_to_server(servicer, generated)
    handlers = dict(generated.handlers)
    servicer.framed = True
    handlers["FetchBlob"] = grpc.unary_stream_rpc_method_handler(
        servicer.FetchBlob,
        request_deserializer=tensor_pb2.BlobRef.FromString,
        response_serializer=codec.serialize,
    )
    handlers["SubmitResult"] = grpc.stream_unary_rpc_method_handler(
        servicer.SubmitResult,
        request_deserializer=parse_result_chunk,
        response_serializer=federation_pb2.SubmitReply.SerializeToString,
    )
    handlers["UploadResult"] = grpc.unary_unary_rpc_method_handler(
        servicer.UploadResult,
        request_deserializer=parse_result_upload,
        response_serializer=federation_pb2.SubmitReply.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


__all__ = [
    "SERVICE_NAME",
    "FederationServicer",
    "FederationState",
    "GrpcTransport",
    "__version__",
    "add_federation_servicer",
]
