"""Late and duplicate results: refused with FAILED_PRECONDITION and reported once in their round's event."""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import pytest
import torch

from aggregator_service.federation import FederationState, GrpcTransport, Rejected
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
    assert state.client_hosts[1] == [second.agent_id]
