"""The federation's state: registered agents, their task queues, the open phases waiting for results, and the blob
store; shared by the servicer (fairfl.v1.Federation) and the engine's transport.

Identity (docs/security.md): on an mTLS aggregator every agent id is bound at registration to the certificate that
registered it (its fingerprint; "" on a plaintext aggregator), so polling, heartbeats and results for an agent id are
accepted only from that certificate, and an agent certificate that names its clients may register only those.

Registrations are bounded (docs/reliability.md): one silent for `agent_expiry` is forgotten, and each certificate
holds at most `max_agents_per_identity` (its least recently seen one that is no longer live makes room). A result is
filed with its phase only after the checks of aggregator_service.federation.admission.

Site data (aggregator_service.federation.site_check): while a run whose data is at the sites is active, a registration
whose reported data does not fit the run is refused, and those registered before it started are checked when it
starts (a misfit is dropped; it is refused when it registers again). Each agent keeps what it reported: its data's
signature and its clients' sample counts.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import grpc

from aggregator_service.blobs import BlobStore
from aggregator_service.engine import ResultSink
from aggregator_service.federation.admission import Rejected, addressed_task, checked_result
from aggregator_service.federation.site_check import SiteRefused, SiteReport, SiteRun, check_site
from fairfl.params import ParamLayout
from fairfl.protocol import ClientResult
from fairfl.v1 import federation_pb2

log = logging.getLogger(__name__)


HEARTBEAT_INTERVAL_S = 5.0
AGENT_TIMEOUT_S = 30.0  # an agent silent this long no longer counts as available
AGENT_EXPIRY_FACTOR = 10  # an agent silent this many agent timeouts is forgotten (it registers again when it returns)
MAX_AGENTS_PER_IDENTITY = 1024  # registrations one certificate holds (a StatefulSet's agents share one)
MAX_POLL_WAIT_S = 30.0
MAX_TASKS_PER_POLL = 1024  # tasks in one poll reply (well below the 4 MiB message limit)
CLOSED_TASK_MEMORY = 200_000
SITE_REFUSALS_KEPT = 32  # sites refused during the active run, named when the run goes on without their clients


class RegistrationRefused(Exception):
    """A certificate holds as many live registrations as it may (RESOURCE_EXHAUSTED)."""


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
    # Open tasks given to it, queued or taken (being trained), in dispatch order: what a crash of it leaves undone.
    tasks: dict[str, None] = field(default_factory=dict)
    site: SiteReport = field(default_factory=SiteReport)  # its data's signature and clients' sample counts, as reported
    label: str = ""  # how messages name it: agent name, and certificate name under mutual TLS (site_check.site_label)


class _Closed(NamedTuple):
    round: int
    accepted: bool
    principal: str | None  # the certificate it was given to (None: its agent was forgotten; nobody may answer)


@dataclass
class Batch:
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
        max_agents_per_identity: int = MAX_AGENTS_PER_IDENTITY,
        agent_expiry: float | None = None,
    ) -> None:
        if not 0 < heartbeat_interval < agent_timeout:
            raise ValueError(
                f"agent timeout ({agent_timeout}s) must exceed the heartbeat interval ({heartbeat_interval}s) > 0"
            )
        self.lock = threading.Condition()
        # Liveness (docs/reliability.md): agents heartbeat this often; one silent for agent_timeout has vanished,
        # its clients are no candidates and its open tasks go to a live co-host or close without waiting for the
        # deadline; one silent for agent_expiry is forgotten.
        self.heartbeat_interval = heartbeat_interval
        self.agent_timeout = agent_timeout
        self.agent_expiry = max(agent_timeout, agent_expiry or AGENT_EXPIRY_FACTOR * agent_timeout)
        self.max_agents_per_identity = max_agents_per_identity
        # Every waiting poll holds a server worker: beyond this many a poll answers at once, so results, heartbeats
        # and run control always find a free worker.
        self.max_long_polls = max_long_polls
        self.long_polls = 0
        self.shutting_down = False  # the server is stopping: long polls answer now instead of holding a worker
        # Least recently seen first (touching an agent moves it to the end): expiry and eviction look at the front.
        self.agents: OrderedDict[str, _Agent] = OrderedDict()
        self.identities: dict[str, OrderedDict[str, None]] = {}  # principal -> its agent ids, least recently seen first
        self.names: dict[tuple[str, str], str] = {}  # (principal, agent name) -> agent id
        # client id -> ids of the agents hosting it: one unshared agent, or any number of shared ones
        self.client_hosts: dict[int, dict[str, None]] = {}
        self.assigned: dict[str, str] = {}  # open task id -> the agent it was given to (the one to answer it)
        self.blobs = BlobStore()
        self.run_id: str | None = None
        self.site_run: SiteRun | None = None  # the active run's data is at the sites: registrations are checked
        self.site_refusals: OrderedDict[str, str] = OrderedDict()  # site label -> reason, the latest ones
        self.run_yaml: dict[str, str] = {}
        self.layout: ParamLayout | None = None
        self.open_tasks: dict[str, Batch] = {}
        # task id -> round, accepted, owner; tells a late result (closed at its deadline) from a duplicate
        self.closed_tasks: OrderedDict[str, _Closed] = OrderedDict()
        self.refused_after_close: Counter[tuple[int, str]] = Counter()  # (round, "late" | "duplicate") -> count
        self.counters = {"rejected": 0, "late": 0, "duplicate": 0, "accepted": 0}

    # -- agents -------------------------------------------------------------------------------------------------

    def register(
        self,
        name: str,
        client_ids: list[int],
        device: str,
        principal: str = "",
        shared: bool = False,
        site: SiteReport | None = None,
        label: str = "",
    ) -> _Agent:
        """A new registration. It replaces the one of the same name and certificate (an agent that reconnected or
        restarted) and takes its clients from the agents that host them exclusively, with their open tasks: those
        still queued, and those they had taken, re-sent (a crashed agent lost them). Raises RegistrationRefused when
        the certificate holds its maximum of live registrations, and SiteRefused when the active run's data is at the
        sites and `site` (what the agent reports of its data; `label` names it) does not fit the run: the
        registration it would replace is dropped then too (that agent's data is no longer what it was)."""
        site = site or SiteReport()
        label = label or repr(name)
        with self.lock:
            now = time.monotonic()
            self._expire(now)
            replaced = self.agents.get(self.names.get((principal, name), ""))
            if self.site_run is not None:
                try:
                    check_site(self.site_run, label, site, client_ids)
                except SiteRefused as misfit:
                    self._note_refusal(label, misfit)
                    if replaced is not None:
                        self._forget(replaced)
                    raise
            self._make_room(principal, replaced, now)
            agent = _Agent(
                uuid.uuid4().hex,
                name,
                sorted(set(client_ids)),
                device,
                now,
                principal=principal,
                shared=shared,
                site=site,
                label=label,
            )
            taken = set(agent.client_ids)
            for old in self._displaced(agent, taken, replaced):
                self._move_tasks(old, agent, taken)
                self._release(old, taken, forget=old is replaced)
            self.agents[agent.agent_id] = agent
            self.identities.setdefault(principal, OrderedDict())[agent.agent_id] = None
            self.names[(principal, name)] = agent.agent_id
            for cid in agent.client_ids:
                self.client_hosts.setdefault(cid, {})[agent.agent_id] = None
            self.lock.notify_all()
            return agent

    def admit_sites(self, run: SiteRun | None) -> list[SiteRefused]:
        """Make `run` the one registrations are checked against (None: no check) and drop the registered agents whose
        data does not fit it; their refusals, to report (they are refused again when they register again)."""
        with self.lock:
            self.site_run = run
            self.site_refusals.clear()
            if run is None:
                return []
            refused = []
            for agent in list(self.agents.values()):
                # Only the clients it still hosts (a later registration may have taken some of them over).
                kept = {c: agent.site.clients[c] for c in agent.client_ids if c in agent.site.clients}
                try:
                    check_site(run, agent.label, replace(agent.site, clients=kept), agent.client_ids)
                except SiteRefused as misfit:
                    refused.append(misfit)
                    self._note_refusal(agent.label, misfit)
                    self._forget(agent)
            if refused:
                self.lock.notify_all()
            return refused

    def _note_refusal(self, label: str, misfit: SiteRefused) -> None:
        self.site_refusals[label] = misfit.reason
        self.site_refusals.move_to_end(label)
        while len(self.site_refusals) > SITE_REFUSALS_KEPT:
            self.site_refusals.popitem(last=False)

    def refused_sites(self) -> list[tuple[str, str]]:
        """(site label, refusal reason) of the sites refused since the active site run started, oldest first."""
        with self.lock:
            return list(self.site_refusals.items())

    def end_sites(self, run_id: str) -> None:
        """Registrations are no longer checked against `run_id` (it ended); a later run's check stays."""
        with self.lock:
            if self.site_run is not None and self.site_run.run_id == run_id:
                self.site_run = None

    def site_clients(self) -> dict[int, tuple[str, int, int]]:
        """Each hosted client's (site label, num_train, num_test) as its first host reported them (0, 0 when it
        reported none)."""
        with self.lock:
            out: dict[int, tuple[str, int, int]] = {}
            for cid, hosts in self.client_hosts.items():
                agent = self.agents[next(iter(hosts))]
                counts = agent.site.clients.get(cid)
                out[cid] = (agent.label, counts.num_train, counts.num_test) if counts else (agent.label, 0, 0)
            return out

    def _expire(self, now: float) -> None:
        """Forget agents silent for agent_expiry (caller holds the lock); amortised O(1): only the front is read."""
        while self.agents:
            oldest = next(iter(self.agents.values()))
            if now - oldest.last_seen < self.agent_expiry:
                return
            log.info(
                "agent %s (%s) silent for %.0fs: forgotten", oldest.agent_id[:8], oldest.name, now - oldest.last_seen
            )
            self._forget(oldest)

    def _make_room(self, principal: str, replaced: _Agent | None, now: float) -> None:
        """Make room for one more registration of `principal`: evict its least recently seen one if that is no longer
        live, else refuse (caller holds the lock)."""
        mine = self.identities.get(principal)
        if replaced is not None or mine is None or len(mine) < self.max_agents_per_identity:
            return
        oldest = self.agents[next(iter(mine))]
        if self._live(oldest, now):  # the least recently seen is live, so all are
            raise RegistrationRefused(
                f"this certificate already holds {len(mine)} live agent registrations, the most one certificate may "
                f"hold ({self.max_agents_per_identity}); register again once one has been silent for "
                f"{self.agent_timeout:g}s, or give agents their own certificates"
            )
        log.info("agent %s (%s) evicted: its certificate registered a new agent", oldest.agent_id[:8], oldest.name)
        self._forget(oldest)

    def _displaced(self, agent: _Agent, taken: set[int], replaced: _Agent | None) -> list[_Agent]:
        """The registrations that lose clients to `agent`: the one it replaces, and the hosts of its clients unless
        both are shared (co-hosts keep them). Found through client_hosts, not by scanning the agents."""
        found: dict[str, _Agent] = {} if replaced is None else {replaced.agent_id: replaced}
        for cid in taken:
            hosts = self.client_hosts.get(cid)
            if not hosts:
                continue
            first = self.agents[next(iter(hosts))]
            if agent.shared and first.shared:
                continue  # a shared client has only shared hosts (an unshared host holds its clients alone)
            found.update((aid, self.agents[aid]) for aid in hosts)
        return list(found.values())

    def _move_tasks(self, old: _Agent, new: _Agent, clients: set[int]) -> None:
        """`old`'s open tasks of `clients` go to `new`: the ones it had taken first (re-sent: they may have died with
        its process), then those still queued, in their order (caller holds the lock)."""
        queued = [t for t in old.queue if t.client_id in clients]
        if queued:
            old.queue = deque(t for t in old.queue if t.client_id not in clients)
        waiting = {t.task_id for t in queued}
        for task_id in list(old.tasks):
            task = self.open_task(task_id)
            if task is None or task.client_id not in clients:
                continue
            del old.tasks[task_id]
            if task_id not in waiting:
                new.queue.append(task)
            new.tasks[task_id] = None
            self.assigned[task_id] = new.agent_id
        new.queue.extend(queued)

    def _release(self, old: _Agent, taken: set[int], forget: bool) -> None:
        """`old` no longer hosts `taken`; it is forgotten when it is replaced or hosts nothing any more."""
        lost = [c for c in old.client_ids if c in taken]
        if forget or len(lost) == len(old.client_ids):
            self._forget(old)
            return
        old.client_ids = [c for c in old.client_ids if c not in taken]
        for cid in lost:
            self._unhost(cid, old.agent_id)

    def _forget(self, agent: _Agent) -> None:
        """Drop every trace of a registration but the tasks assigned to it: they count as vanished (caller holds the
        lock)."""
        del self.agents[agent.agent_id]
        mine = self.identities[agent.principal]
        del mine[agent.agent_id]
        if not mine:
            del self.identities[agent.principal]
        if self.names.get((agent.principal, agent.name)) == agent.agent_id:
            del self.names[(agent.principal, agent.name)]
        for cid in agent.client_ids:
            self._unhost(cid, agent.agent_id)
        agent.queue.clear()
        agent.tasks.clear()

    def _unhost(self, client_id: int, agent_id: str) -> None:
        hosts = self.client_hosts.get(client_id)
        if hosts is not None:
            hosts.pop(agent_id, None)
            if not hosts:
                del self.client_hosts[client_id]

    def _seen(self, agent: _Agent, now: float) -> None:
        agent.last_seen = now
        self.agents.move_to_end(agent.agent_id)
        self.identities[agent.principal].move_to_end(agent.agent_id)

    def open_task(self, task_id: str) -> federation_pb2.Task | None:
        """An open task (caller holds the lock)."""
        batch = self.open_tasks.get(task_id)
        return batch.pending.get(task_id) if batch is not None else None

    def _live(self, agent: _Agent, now: float) -> bool:
        return now - agent.last_seen < self.agent_timeout

    def hosts(self, client_id: int) -> list[_Agent]:
        """The agents registered for `client_id` (caller holds the lock)."""
        return [self.agents[aid] for aid in self.client_hosts.get(client_id, ())]

    def touch(self, agent_id: str) -> _Agent | None:
        """The agent, seen now; None when it is unknown or was forgotten (it must register again)."""
        with self.lock:
            now = time.monotonic()
            self._expire(now)
            agent = self.agents.get(agent_id)
            if agent is not None:
                self._seen(agent, now)
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

    def owner(self, task_id: str) -> str | None:
        """The certificate an open task was given to (its agent's); None when no agent holds it (caller holds the
        lock)."""
        agent = self.agents.get(self.assigned.get(task_id, ""))
        return None if agent is None else agent.principal

    def _give(self, task: federation_pb2.Task, agent: _Agent) -> None:
        agent.queue.append(task)
        agent.tasks[task.task_id] = None
        self.assigned[task.task_id] = agent.agent_id

    def _take_back(self, task_id: str) -> _Agent | None:
        """Unassign a task that closed; its agent, if it still exists (caller holds the lock)."""
        agent = self.agents.get(self.assigned.pop(task_id, ""))
        if agent is not None:
            agent.tasks.pop(task_id, None)
        return agent

    @staticmethod
    def _load(agent: _Agent) -> tuple[int, str, str]:
        """Least-loaded first; ties by name, so the same agents get the same tasks again after a restart."""
        return len(agent.queue), agent.name, agent.agent_id

    def dispatch(self, tasks: list[federation_pb2.Task]) -> list[federation_pb2.Task]:
        """Queue each task with the least-loaded live host of its client; returns the tasks no agent hosts. Caller
        holds the lock."""
        now = time.monotonic()
        unhosted = []
        for task in tasks:
            hosts = self.hosts(task.client_id)
            if not hosts:
                unhosted.append(task)
                continue
            live = [a for a in hosts if self._live(a, now)]
            self._give(task, min(live or hosts, key=self._load))
        return unhosted

    def resend_vanished(self, batch: Batch, now: float) -> None:
        """Give each pending task of `batch` whose agent vanished (silent, or gone) to a live co-host of its client,
        when there is one, so the phase need not wait for its deadline (caller holds the lock)."""
        moved: dict[str, set[str]] = {}  # vanished agent -> its tasks given to others
        resent = 0
        for task_id, task in batch.pending.items():
            holder = self.agents.get(self.assigned.get(task_id, ""))
            if holder is not None and self._live(holder, now):
                continue
            live = [a for a in self.hosts(task.client_id) if self._live(a, now)]
            if not live:
                continue
            if holder is not None:
                holder.tasks.pop(task_id, None)
                moved.setdefault(holder.agent_id, set()).add(task_id)
            target = min(live, key=self._load)
            self._give(task, target)
            resent += 1
            log.info("task of client %d re-sent to agent %s: its agent vanished", task.client_id, target.agent_id[:8])
        for agent_id, task_ids in moved.items():
            holder = self.agents[agent_id]
            holder.queue = deque(t for t in holder.queue if t.task_id not in task_ids)
        if resent:
            self.lock.notify_all()  # the co-hosts' long polls

    def close_pending(self, batch: Batch) -> None:
        """Close a phase's unanswered tasks: results for them are late from now on, and queued ones are withdrawn
        (caller holds the lock)."""
        holders: dict[str, _Agent] = {}
        for task_id, task in batch.pending.items():
            self.open_tasks.pop(task_id, None)
            self._remember_closed(task_id, task.round, accepted=False, principal=self.owner(task_id))
            holder = self._take_back(task_id)
            if holder is not None and holder.queue:
                holders[holder.agent_id] = holder
        for holder in holders.values():
            holder.queue = deque(t for t in holder.queue if t.task_id not in batch.pending)

    def wake(self) -> None:
        """Wake every waiter (a phase, a wait for clients) so it rechecks its stop event now."""
        with self.lock:
            self.lock.notify_all()

    def shut_down(self) -> None:
        """The server is stopping: every waiting long poll returns now, so its worker is free for the drain (a
        poll would otherwise hold the process up to its wait, MAX_POLL_WAIT_S)."""
        with self.lock:
            self.shutting_down = True
            self.lock.notify_all()

    def poll(self, agent_id: str, max_tasks: int, wait: float) -> list[federation_pb2.Task]:
        """Up to `max_tasks` (at most MAX_TASKS_PER_POLL) queued tasks, waiting up to `wait` seconds (at most
        MAX_POLL_WAIT_S; NaN or less than 0: none) for the first."""
        wait = min(wait, MAX_POLL_WAIT_S) if wait > 0 else 0.0  # NaN compares false: no wait, never a spin
        with self.lock:
            if self.long_polls >= self.max_long_polls:
                wait = 0.0  # no worker to spare for waiting: answer now (the agent backs off briefly)
            self.long_polls += 1
            try:
                return self._poll(agent_id, min(max(1, max_tasks), MAX_TASKS_PER_POLL), time.monotonic() + wait)
            finally:
                self.long_polls -= 1

    def _poll(self, agent_id: str, take: int, deadline: float) -> list[federation_pb2.Task]:
        with self.lock:
            while True:
                agent = self.agents.get(agent_id)
                if agent is None:
                    return []
                now = time.monotonic()
                self._seen(agent, now)
                tasks = self._next_tasks(agent, take)
                if tasks:
                    return tasks
                remaining = deadline - now
                if remaining <= 0 or self.shutting_down:
                    return []
                self.lock.wait(remaining)

    def _next_tasks(self, agent: _Agent, take: int) -> list[federation_pb2.Task]:
        """Pop up to `take` tasks still due from the agent (caller holds the lock)."""
        now_unix = time.time()
        tasks: list[federation_pb2.Task] = []
        while agent.queue and len(tasks) < take:
            task = agent.queue.popleft()
            # Expired before anyone picked it up, or answered or given to another agent since it was queued.
            if task.deadline_unix >= now_unix and self.assigned.get(task.task_id) == agent.agent_id:
                tasks.append(task)
        return tasks

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
            task = addressed_task(self, header, principal)
            layout = self.layout
        assert layout is not None
        result = checked_result(header, data, layout, task, sha256_optional)
        batch = self._file(header, result, principal)
        if batch is not None:
            self._fold(batch, header.task_id, result)

    def _file(self, header: federation_pb2.ResultHeader, result: ClientResult, principal: str) -> Batch | None:
        """File a checked result with its phase, unless the task closed meanwhile (raises Rejected); returns the batch
        when the result must still be folded into its sink."""
        with self.lock:
            batch = self.open_tasks.get(header.task_id)
            closed = self.closed_tasks.get(header.task_id)
            open_now = batch is not None and header.task_id in batch.pending
            if not open_now and closed is not None and closed.accepted:  # sent twice at once: the other copy got in
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
            self._take_back(header.task_id)
            self._remember_closed(header.task_id, header.round, accepted=True, principal=principal)
            self.counters["accepted"] += 1
            if batch.sink is None:
                batch.results[result.client_id] = result
                if batch.settled():
                    self.lock.notify_all()
                return None
            if batch.error is not None:  # the phase already failed: its aggregate is void, nothing to fold into
                return None
            batch.folding += 1
            return batch

    def _fold(self, batch: Batch, task_id: str, result: ClientResult) -> None:
        """Fold an accepted result outside the lock (a big update takes a while) but before the phase can close:
        execute() waits for `folding` to drain, so every accepted result is in the aggregate and none arrives after
        it was formed."""
        assert batch.sink is not None
        folded = False
        try:
            batch.sink(result)
            folded = True
        except Exception as err:  # not the client's fault (it was accepted): the phase fails with it
            log.exception("folding the result of task %s failed", task_id)
            batch.error = err
        finally:
            with self.lock:
                batch.folding -= 1
                if folded and batch.error is None:
                    batch.results[result.client_id] = result
                if batch.settled():
                    self.lock.notify_all()

    def count_rejection(self, task_id: str, principal: str = "") -> None:
        """Count a refused result; with its still-open task's phase only when the task's own certificate sent it
        (another site's attempts must not weigh on this round; closed tasks are counted in accept)."""
        with self.lock:
            self.counters["rejected"] += 1
            batch = self.open_tasks.get(task_id)
            if batch is not None and self.owner(task_id) == principal:
                batch.rejected += 1

    def drain_refused_after_close(self, round_number: int) -> tuple[int, int]:
        """Late and duplicate results of `round_number` refused so far; each is reported once."""
        with self.lock:
            late = self.refused_after_close.pop((round_number, "late"), 0)
            duplicate = self.refused_after_close.pop((round_number, "duplicate"), 0)
            return late, duplicate

    def _remember_closed(self, task_id: str, round_number: int, accepted: bool, principal: str | None) -> None:
        self.closed_tasks[task_id] = _Closed(round_number, accepted, principal)
        while len(self.closed_tasks) > CLOSED_TASK_MEMORY:
            self.closed_tasks.popitem(last=False)
