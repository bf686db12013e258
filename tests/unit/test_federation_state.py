"""Late and duplicate results: refused with FAILED_PRECONDITION and reported once in their round's event."""

from __future__ import annotations

import contextlib
import math
import threading
import time

import grpc
import pytest
import torch

from aggregator_service.engine import PhaseOutcome
from aggregator_service.federation.admission import Rejected
from aggregator_service.federation.servicer import FederationServicer
from aggregator_service.federation.state import MAX_TASKS_PER_POLL, FederationState, RegistrationRefused
from aggregator_service.federation.transport import GrpcTransport
from fairfl.models import build_model
from fairfl.params import ParamLayout
from fairfl.protocol import TRAIN, UPDATE, ClientResult, encode_result
from fairfl.v1 import federation_pb2


def _setup() -> tuple[FederationState, GrpcTransport, ParamLayout, str]:
    state = FederationState()
    layout = ParamLayout.of(build_model("mlp", (4,), 3, hidden=(5,)))
    state.layout = layout
    agent = state.register("a", [0, 1], "cpu")
    return state, GrpcTransport(state), layout, agent.agent_id


def _submit(state: FederationState, layout: ParamLayout, task: federation_pb2.Task, agent_id: str) -> None:
    result = ClientResult(
        task_id=task.task_id,
        run_id="r",
        round=task.round,
        client_id=task.client_id,
        phase=TRAIN,
        num_samples=10,
        loss_before=1.0,
        loss_after=0.5,
        agent_id=agent_id,
    )
    result.payloads[UPDATE] = torch.zeros(layout.numel)
    header, *data = list(encode_result(result, layout))
    state.accept(header.header, (c.data for c in data))


def _task(client: int) -> federation_pb2.Task:
    return federation_pb2.Task(
        task_id=f"r/r1/p0/c{client}", run_id="r", round=1, phase=TRAIN, client_id=client, deadline_unix=1e12
    )


def test_result_after_the_deadline_is_late() -> None:
    state, transport, layout, agent_id = _setup()
    outcome = transport.execute([_task(0)], timeout=0.2)  # nobody answers: the phase closes at its deadline
    assert outcome.results == [] and outcome.missing == [0]
    with pytest.raises(Rejected) as refused:
        _submit(state, layout, _task(0), agent_id)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "closed it at its deadline" in str(refused.value)
    assert transport.refused_after_close(1) == (1, 0)
    assert transport.refused_after_close(1) == (0, 0)  # reported once


def test_second_copy_of_an_accepted_result_is_a_duplicate() -> None:
    state, transport, layout, agent_id = _setup()
    answered = threading.Event()

    def answer() -> None:
        for _ in range(100):
            tasks = state.poll(agent_id, 4, 0.05)
            if tasks:
                _submit(state, layout, tasks[0], agent_id)
                answered.set()
                return

    worker = threading.Thread(target=answer)
    worker.start()
    outcome = transport.execute([_task(1)], timeout=5.0)
    worker.join()
    assert answered.is_set() and [r.client_id for r in outcome.results] == [1]
    with pytest.raises(Rejected, match="already accepted"):
        _submit(state, layout, _task(1), agent_id)
    assert transport.refused_after_close(1) == (0, 1)
    assert state.counters["accepted"] == 1 and state.counters["duplicate"] == 1


def test_reregistering_agent_inherits_its_queued_tasks() -> None:
    state, transport, layout, old_id = _setup()
    results: list = []
    worker = threading.Thread(target=lambda: results.append(transport.execute([_task(0)], timeout=5.0)))
    worker.start()
    for _ in range(100):  # wait until the task is queued for the old registration
        with state.lock:
            if state.agents[old_id].queue:
                break
        threading.Event().wait(0.01)
    new = state.register("a", [0, 1], "cpu")  # the agent reconnected and registered again
    assert old_id not in state.agents, "an agent left without clients is forgotten"
    (task,) = state.poll(new.agent_id, 4, 1.0)
    _submit(state, layout, task, new.agent_id)
    worker.join()
    assert [r.client_id for r in results[0].results] == [0]


def _answer_all(state: FederationState, layout: ParamLayout, agent_id: str, count: int) -> threading.Thread:
    """An agent thread answering the first `count` tasks it polls, each on its own submitting thread."""

    def run() -> None:
        answered = 0
        submitters = []
        while answered < count:
            for task in state.poll(agent_id, 8, 0.05):
                submitter = threading.Thread(target=_submit_quietly, args=(state, layout, task, agent_id))
                submitter.start()
                submitters.append(submitter)
                answered += 1
        for submitter in submitters:
            submitter.join()

    worker = threading.Thread(target=run)
    worker.start()
    return worker


def _submit_quietly(state: FederationState, layout: ParamLayout, task: federation_pb2.Task, agent_id: str) -> None:
    with contextlib.suppress(Rejected):  # a result past the quorum is refused as late; the test counts what was folded
        _submit(state, layout, task, agent_id)


def test_streamed_results_are_folded_before_the_phase_closes_and_quorum_counts_folds_in_flight() -> None:
    state, transport, layout, agent_id = _setup()
    state.register("b", [2, 3], "cpu")  # clients 2 and 3 on a second agent that never answers
    folded: list[int] = []

    def slow_sink(result: ClientResult) -> None:
        time.sleep(0.3)  # a big update: other results arrive while this one is folded
        folded.append(result.client_id)

    worker = _answer_all(state, layout, agent_id, 2)
    outcome = transport.execute([_task(c) for c in range(4)], timeout=10.0, quorum=1, on_result=slow_sink)
    worker.join()
    # Quorum 1: the first accepted result closes the phase, the second is refused as late, and execute returned
    # only after the fold of the accepted one finished.
    assert len(folded) == 1 and [r.client_id for r in outcome.results] == folded
    assert state.counters["accepted"] == 1 and state.counters["late"] == 1


def test_a_failing_fold_fails_the_phase_at_once_not_at_its_deadline() -> None:
    state, transport, layout, agent_id = _setup()
    state.register("b", [2], "cpu")  # client 2 never answers: without the fix the phase waited for its deadline

    def broken_sink(result: ClientResult) -> None:
        raise MemoryError("no room for the accumulator")

    worker = _answer_all(state, layout, agent_id, 1)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="streaming aggregation failed: no room"):
        transport.execute([_task(0), _task(2)], timeout=30.0, on_result=broken_sink)
    worker.join()
    assert time.monotonic() - started < 5.0


# -- co-hosted clients (runtime.placement: replicated) ---------------------------------------------------------------


def test_shared_agents_cohost_clients_and_split_a_phase_evenly() -> None:
    state = FederationState()
    layout = ParamLayout.of(build_model("mlp", (4,), 3, hidden=(5,)))
    state.layout = layout
    a = state.register("agent-0", list(range(6)), "cpu", shared=True)
    b = state.register("agent-1", list(range(6)), "cpu", shared=True)
    assert set(state.agents) == {a.agent_id, b.agent_id}, "a shared registration does not take the clients over"
    assert state.live_clients() == list(range(6))
    transport = GrpcTransport(state)
    given: dict[str, list[int]] = {}

    def agent(agent_id: str) -> None:
        tasks = state.poll(agent_id, 16, 2.0)
        given[agent_id] = [t.client_id for t in tasks]
        for task in tasks:
            _submit(state, layout, task, agent_id)

    workers = [threading.Thread(target=agent, args=(aid,)) for aid in (a.agent_id, b.agent_id)]
    for w in workers:
        w.start()
    # Clients 0-4 all in one phase: the least-loaded host takes each, so the split is 3/2, not whatever one poll grabs.
    outcome = transport.execute([_task(c) for c in range(5)], timeout=5.0)
    for w in workers:
        w.join()
    assert sorted(r.client_id for r in outcome.results) == list(range(5))
    assert sorted(len(v) for v in given.values()) == [2, 3]
    assert sorted(given[a.agent_id] + given[b.agent_id]) == list(range(5))


def test_a_cohost_cannot_answer_a_task_given_to_another_agent() -> None:
    state = FederationState()
    layout = ParamLayout.of(build_model("mlp", (4,), 3, hidden=(5,)))
    state.layout = layout
    a = state.register("agent-0", [0], "cpu", shared=True)
    b = state.register("agent-1", [0], "cpu", shared=True)
    transport = GrpcTransport(state)
    worker = threading.Thread(target=lambda: transport.execute([_task(0)], timeout=1.0))
    worker.start()
    (task,) = state.poll(a.agent_id, 4, 2.0)  # ties go by name: agent-0
    with pytest.raises(Rejected, match="was given to agent") as refused:
        _submit(state, layout, task, b.agent_id)
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    _submit(state, layout, task, a.agent_id)
    worker.join()
    assert state.counters["accepted"] == 1


def test_a_reconnecting_shared_agent_replaces_its_old_registration_with_its_tasks() -> None:
    state = FederationState()
    layout = ParamLayout.of(build_model("mlp", (4,), 3, hidden=(5,)))
    state.layout = layout
    old = state.register("agent-0", [0, 1], "cpu", shared=True)
    other = state.register("agent-1", [0, 1], "cpu", shared=True)
    transport = GrpcTransport(state)
    results: list = []
    worker = threading.Thread(target=lambda: results.append(transport.execute([_task(0), _task(1)], timeout=5.0)))
    worker.start()
    (task,) = state.poll(old.agent_id, 4, 2.0)  # one task each; agent-0 takes its own and then reconnects
    new = state.register("agent-0", [0, 1], "cpu", shared=True)
    assert old.agent_id not in state.agents and other.agent_id in state.agents
    _submit(state, layout, task, new.agent_id)  # the task it was running is now answered under its new id
    for t in state.poll(other.agent_id, 4, 2.0):
        _submit(state, layout, t, other.agent_id)
    worker.join()
    assert sorted(r.client_id for r in results[0].results) == [0, 1]


def test_an_unshared_registration_still_takes_the_clients_over() -> None:
    state = FederationState()
    first = state.register("site-a", [0, 1], "cpu", shared=True)
    second = state.register("site-b", [1, 2], "cpu")  # not shared: client 1 moves to site-b
    assert state.agents[first.agent_id].client_ids == [0]
    assert list(state.client_hosts[1]) == [second.agent_id]


# -- hostile agents: registration churn, other sites' task ids, crashed agents (issue #18) ----------------------------

SITE_A, SITE_B = "a" * 64, "b" * 64  # certificate fingerprints of two sites


class _Aborted(Exception):
    pass


class _Context:
    """A servicer context of a plaintext server whose abort raises like grpc's."""

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata  # the refusal's reason, as a real context sends it

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)

    def time_remaining(self) -> float | None:
        return None


def _age(state: FederationState, seconds: float) -> None:
    """Every registration falls silent for `seconds` more (their order by last sight is unchanged)."""
    with state.lock:
        for agent in state.agents.values():
            agent.last_seen -= seconds


def _header(layout: ParamLayout, task: federation_pb2.Task, agent_id: str, loss_after: float = 0.5) -> tuple:
    result = ClientResult(
        task_id=task.task_id,
        run_id=task.run_id,
        round=task.round,
        client_id=task.client_id,
        phase=TRAIN,
        num_samples=10,
        loss_before=1.0,
        loss_after=loss_after,
        agent_id=agent_id,
    )
    result.payloads[UPDATE] = torch.zeros(layout.numel)
    header, *data = list(encode_result(result, layout))
    return header.header, [c.data for c in data]


def test_registration_churn_from_one_certificate_stays_bounded_and_register_stays_fast() -> None:
    """5,000 co-host registrations with distinct names from one certificate, going silent as they come (the hostile
    tester's 12.9k a minute): the agents and the client index stay bounded and Register does not slow down."""
    state = FederationState()
    clients = list(range(10))
    batch_seconds = []
    for batch in range(10):
        started = time.perf_counter()
        for i in range(500):
            state.register(f"churn-{batch}-{i}", clients, "cpu", principal=SITE_A, shared=True)
        batch_seconds.append(time.perf_counter() - started)
        _age(state, state.agent_timeout + 1)  # none of them heartbeats: no longer live, so each may be evicted
    cap = state.max_agents_per_identity
    assert len(state.agents) <= cap and len(state.identities[SITE_A]) == len(state.agents)
    assert sum(len(hosts) for hosts in state.client_hosts.values()) <= cap * len(clients)
    assert len(state.names) == len(state.agents)
    first, last = sorted(batch_seconds[:3])[1], sorted(batch_seconds[-3:])[1]  # medians: the machine is shared
    assert last < 3 * first + 0.02, f"Register slowed down from {first:.4f}s to {last:.4f}s per 500"


def test_a_certificate_holds_at_most_its_cap_of_live_registrations() -> None:
    state = FederationState(max_agents_per_identity=4)
    first = [state.register(f"a-{i}", [i], "cpu", principal=SITE_A, shared=True) for i in range(4)]
    with pytest.raises(RegistrationRefused, match=r"at most|\(4\)") as refused:
        state.register("a-4", [4], "cpu", principal=SITE_A, shared=True)
    assert "(4)" in str(refused.value)
    assert state.register("b-0", [9], "cpu", principal=SITE_B).agent_id in state.agents  # another site is unaffected
    again = state.register("a-1", [1], "cpu", principal=SITE_A, shared=True)  # a restart replaces its registration
    assert first[1].agent_id not in state.agents and len(state.identities[SITE_A]) == 4
    _age(state, state.agent_timeout + 1)
    state.touch(again.agent_id)  # the others fall silent: the least recently seen of them makes room
    newest = state.register("a-5", [5], "cpu", principal=SITE_A, shared=True)
    assert first[0].agent_id not in state.agents and newest.agent_id in state.agents
    assert len(state.identities[SITE_A]) == 4 and 0 not in state.client_hosts


def test_servicer_refuses_a_registration_beyond_the_cap_with_resource_exhausted() -> None:
    state = FederationState(max_agents_per_identity=1)
    servicer = FederationServicer(state)
    servicer.Register(federation_pb2.RegisterRequest(agent_name="a", client_ids=[0]), _Context())
    with pytest.raises(_Aborted) as refused:
        servicer.Register(federation_pb2.RegisterRequest(agent_name="b", client_ids=[1]), _Context())
    code, details = refused.value.args
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "(1)" in details


def test_a_long_silent_agent_is_forgotten_and_told_to_register_again() -> None:
    state = FederationState(heartbeat_interval=0.1, agent_timeout=0.5)
    gone = state.register("a", [0, 1], "cpu", shared=True)
    _age(state, state.agent_expiry + 1)  # a falls silent for good
    kept = state.register("b", [1, 2], "cpu", shared=True)  # any registration or contact expires the silent ones
    assert gone.agent_id not in state.agents and 0 not in state.client_hosts
    assert list(state.client_hosts[1]) == [kept.agent_id]
    assert state.touch(gone.agent_id) is None
    with pytest.raises(_Aborted) as refused:
        FederationServicer(state).PollTasks(
            federation_pb2.PollRequest(agent_id=gone.agent_id, max_tasks=1, wait_seconds=1.0), _Context()
        )
    assert refused.value.args[0] == grpc.StatusCode.UNAUTHENTICATED and "register again" in refused.value.args[1]


@pytest.mark.parametrize("wait", [math.nan, math.inf, -math.inf, -1.0])
def test_a_poll_with_a_wait_that_is_no_duration_is_refused_at_once(wait: float) -> None:
    state = FederationState()
    agent = state.register("a", [0], "cpu")
    started = time.monotonic()
    with pytest.raises(_Aborted) as refused:
        FederationServicer(state).PollTasks(
            federation_pb2.PollRequest(agent_id=agent.agent_id, max_tasks=1, wait_seconds=wait), _Context()
        )
    assert refused.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT and "wait_seconds" in refused.value.args[1]
    if not math.isinf(wait) or wait < 0:  # the state itself never spins on one either (inf: waits its longest)
        assert state.poll(agent.agent_id, 1, wait) == []
    assert time.monotonic() - started < 0.5 and state.long_polls == 0


def test_a_poll_takes_at_most_a_bounded_number_of_tasks() -> None:
    state = FederationState()
    agent = state.register("a", list(range(2000)), "cpu")
    transport = GrpcTransport(state)
    worker = threading.Thread(target=lambda: transport.execute([_task(c) for c in range(2000)], timeout=1.0))
    worker.start()
    tasks = state.poll(agent.agent_id, 2**32 - 1, 5.0)
    worker.join()
    assert len(tasks) == MAX_TASKS_PER_POLL


def test_a_task_of_another_certificate_is_answered_as_never_issued_and_counts_nowhere() -> None:
    state = FederationState()
    layout = ParamLayout.of(build_model("mlp", (4,), 3, hidden=(5,)))
    state.layout = layout
    site_a = state.register("site-a", [0], "cpu", principal=SITE_A)
    site_b = state.register("site-b", [1], "cpu", principal=SITE_B)
    servicer = FederationServicer(state)
    transport = GrpcTransport(state)
    outcomes: list[PhaseOutcome] = []
    worker = threading.Thread(target=lambda: outcomes.append(transport.execute([_task(0), _task(1)], timeout=30.0)))
    worker.start()
    (task_a,) = state.poll(site_a.agent_id, 4, 5.0)
    (task_b,) = state.poll(site_b.agent_id, 4, 5.0)

    def refusal(header: federation_pb2.ResultHeader, data: list, principal: str) -> tuple[grpc.StatusCode, str]:
        rejected = servicer._accept(header, data, principal)
        assert rejected is not None
        return rejected.code, str(rejected).replace(header.task_id, "<id>")

    never_issued = refusal(_header(layout, _task(0), site_b.agent_id)[0], [], SITE_B)  # an id nobody was given
    assert never_issued[0] == grpc.StatusCode.NOT_FOUND
    # Site B tries site A's real task: as its own agent, as A's agent, and with a bad payload; all answered alike.
    for agent_id in (site_b.agent_id, site_a.agent_id, ""):
        assert refusal(*_header(layout, task_a, agent_id), SITE_B) == never_issued
    assert refusal(*_header(layout, task_a, site_a.agent_id, loss_after=-1.0), SITE_B) == never_issued
    # Site A's own bad result counts with the round; B's own task is B's to answer.
    assert refusal(*_header(layout, task_a, site_a.agent_id, loss_after=-1.0), SITE_A)[0].name == "INVALID_ARGUMENT"
    assert servicer._accept(*_header(layout, task_a, site_a.agent_id), SITE_A) is None
    assert servicer._accept(*_header(layout, task_b, site_b.agent_id), SITE_B) is None
    worker.join()
    (outcome,) = outcomes
    assert [r.client_id for r in outcome.results] == [0, 1]
    assert outcome.rejected == 1, "another site's attempts counted against this round"
    # Closed now: a replay by its own site is one; by another site, it still does not exist.
    assert refusal(*_header(layout, task_a, site_a.agent_id), SITE_A)[0] == grpc.StatusCode.PERMISSION_DENIED
    assert refusal(*_header(layout, task_a, site_b.agent_id), SITE_B) == never_issued
    assert transport.refused_after_close(1) == (0, 1)  # A's replay only


def test_a_crashed_agents_taken_tasks_are_sent_again_to_its_new_registration() -> None:
    state = FederationState()
    layout = ParamLayout.of(build_model("mlp", (4,), 3, hidden=(5,)))
    state.layout = layout
    crashed = state.register("agent-1", [0, 1, 2], "cpu")
    outcomes: list[PhaseOutcome] = []
    phase = threading.Thread(
        target=lambda: outcomes.append(GrpcTransport(state).execute([_task(c) for c in range(3)], timeout=60.0))
    )
    started = time.monotonic()
    phase.start()
    taken = state.poll(crashed.agent_id, 2, 5.0)  # it took two tasks, then died while training them
    assert [t.client_id for t in taken] == [0, 1]
    restarted = state.register("agent-1", [0, 1, 2], "cpu")
    assert crashed.agent_id not in state.agents
    again = state.poll(restarted.agent_id, 8, 5.0)
    assert [t.task_id for t in again] == [t.task_id for t in taken] + [_task(2).task_id], "same tasks, same ids"
    for task in again:
        _submit(state, layout, task, restarted.agent_id)
    phase.join(10)
    assert time.monotonic() - started < 10.0, "the round waited for its deadline"
    assert [r.client_id for r in outcomes[0].results] == [0, 1, 2]


def test_a_task_answered_before_its_copy_is_polled_is_not_sent_again() -> None:
    state = FederationState()
    layout = ParamLayout.of(build_model("mlp", (4,), 3, hidden=(5,)))
    state.layout = layout
    old = state.register("agent-0", [0, 1], "cpu")
    phase = threading.Thread(target=lambda: GrpcTransport(state).execute([_task(0), _task(1)], timeout=60.0))
    phase.start()
    taken = state.poll(old.agent_id, 8, 5.0)
    new = state.register("agent-0", [0, 1], "cpu")  # reconnected while its results were still on their way
    _submit(state, layout, taken[0], new.agent_id)
    assert [t.client_id for t in state.poll(new.agent_id, 8, 5.0)] == [1], "client 0's answered task was re-sent"
    _submit(state, layout, taken[1], new.agent_id)
    phase.join(10)


def test_a_vanished_cohosts_tasks_go_to_a_live_cohost_before_the_deadline() -> None:
    state = FederationState(heartbeat_interval=0.05, agent_timeout=0.4)
    layout = ParamLayout.of(build_model("mlp", (4,), 3, hidden=(5,)))
    state.layout = layout
    crashed = state.register("agent-0", [0, 1], "cpu", shared=True)
    live = state.register("agent-1", [0, 1], "cpu", shared=True)
    outcomes: list[PhaseOutcome] = []
    phase = threading.Thread(
        target=lambda: outcomes.append(GrpcTransport(state).execute([_task(0), _task(1)], timeout=60.0))
    )
    started = time.monotonic()
    phase.start()
    (lost,) = state.poll(crashed.agent_id, 8, 5.0)  # agent-0 takes client 0's task (ties by name) and dies
    answered = []
    while len(answered) < 2 and time.monotonic() - started < 10.0:
        for task in state.poll(live.agent_id, 8, 0.1):  # polling keeps agent-1 live
            _submit(state, layout, task, live.agent_id)
            answered.append(task.task_id)
    phase.join(10)
    assert lost.task_id in answered and time.monotonic() - started < 5.0
    assert [r.client_id for r in outcomes[0].results] == [0, 1]
