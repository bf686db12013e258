"""Results without payloads travel in SubmitResults batches: what an agent sends, how it counts each answer, and how it
falls back to one stream each against an aggregator without the call. (The aggregator's side, each result accepted
or refused on its own, is tested against a real aggregator process in tests/integration/test_bad_input.py.)"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from client_agent.agent import Agent
from fairfl.protocol import EVALUATE, ClientResult
from fairfl.v1 import federation_pb2, federation_pb2_grpc
from tests.unit.test_dp_sgd import synthetic_runtime

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class _Aggregator(federation_pb2_grpc.FederationServicer):
    """Answers result calls as the aggregator would (task ids containing "bad" are refused); with `batches` False it
    lacks SubmitResults, as an older aggregator does."""

    def __init__(self, batches: bool) -> None:
        self.batches = batches
        self.batch_calls: list[list[federation_pb2.ResultHeader]] = []
        self.streams: list[list[federation_pb2.ResultChunk]] = []

    def SubmitResults(self, request: federation_pb2.ResultBatch, context: grpc.ServicerContext):
        if not self.batches:
            return super().SubmitResults(request, context)  # UNIMPLEMENTED, as generated
        self.batch_calls.append(list(request.results))
        refused = grpc.StatusCode.INVALID_ARGUMENT
        return federation_pb2.ResultBatchReply(
            statuses=[
                federation_pb2.ResultStatus(task_id=h.task_id, code=refused.value[0], message="test_loss is nan")
                if "bad" in h.task_id
                else federation_pb2.ResultStatus(task_id=h.task_id, code=grpc.StatusCode.OK.value[0])
                for h in request.results
            ]
        )

    def SubmitResult(self, request_iterator: Iterator[federation_pb2.ResultChunk], context: grpc.ServicerContext):
        self.streams.append(list(request_iterator))
        return federation_pb2.SubmitReply(accepted=True)


@pytest.fixture(params=[True, False], ids=["batches", "no-batches"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[_Aggregator, Agent]]:
    aggregator = _Aggregator(batches=request.param)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    federation_pb2_grpc.add_FederationServicer_to_server(aggregator, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    agent = Agent(f"127.0.0.1:{port}", [0, 1, 2], device="cpu")
    try:
        yield aggregator, agent
    finally:
        agent.channel.close()
        server.stop(None)


def _evaluation(task_id: str, client: int) -> ClientResult:
    return ClientResult(
        task_id=task_id,
        run_id="r",
        round=1,
        client_id=client,
        phase=EVALUATE,
        num_samples=20,
        test_accuracy=75.0,
        test_loss=0.5,
        agent_id="agent",
    )


def test_results_without_payloads_go_in_one_call_and_each_answer_counts_on_its_own(
    served: tuple[_Aggregator, Agent],
) -> None:
    aggregator, agent = served
    runtime = synthetic_runtime()
    for client, task_id in enumerate(["r/r1/p0/c0", "r/r1/p0/c1-bad", "r/r1/p0/c2"]):
        agent.uploads._batch.append(("evaluate", _evaluation(task_id, client), runtime))
    agent.uploads.flush_batch()
    assert agent.uploads._batch == []
    agent.uploads.finish()

    if aggregator.batches:
        (call,) = aggregator.batch_calls  # one call for the three results
        assert [h.task_id for h in call] == ["r/r1/p0/c0", "r/r1/p0/c1-bad", "r/r1/p0/c2"]
        assert all(h.total_bytes == 0 and h.sha256 == EMPTY_SHA256 and not h.sha256_in_trailer for h in call)
        assert [h.test_accuracy for h in call] == [75.0] * 3
        assert agent.uploads.tasks_done == 2  # the refused one is not counted done
        assert agent.uploads.batching and aggregator.streams == []
    else:
        # UNIMPLEMENTED: the same headers, one stream each, and no batches from then on.
        assert not agent.uploads.batching
        assert [[c.header.task_id for c in s] for s in aggregator.streams] == [
            ["r/r1/p0/c0"],
            ["r/r1/p0/c1-bad"],
            ["r/r1/p0/c2"],
        ]
        assert agent.uploads.tasks_done == 3
    assert not agent.uploads._in_flight


def test_a_full_batch_is_handed_over_before_the_poll_batch_ends(
    served: tuple[_Aggregator, Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    import client_agent.uploads as uploads_module

    aggregator, agent = served
    monkeypatch.setattr(uploads_module, "BATCH_RESULTS", 2)
    runtime = synthetic_runtime()
    monkeypatch.setattr(agent, "_runtime", lambda run_id: runtime)
    monkeypatch.setattr(runtime, "run", lambda task: _evaluation(task.task_id, task.client_id))
    for client in range(3):
        agent._handle(federation_pb2.Task(task_id=f"r/r1/p0/c{client}", run_id="r", phase=EVALUATE, client_id=client))
    assert [r.task_id for _, r, _ in agent.uploads._batch] == ["r/r1/p0/c2"]  # the first two were handed over
    agent.uploads.flush_batch()
    agent.uploads.finish()
    assert agent.uploads.tasks_done == 3
    if aggregator.batches:
        assert sorted(len(call) for call in aggregator.batch_calls) == [1, 2]  # two calls in flight at once
