"""An agent whose environment cannot load a run's plug-in says so once, in one line, and fails that run's tasks
without a traceback or re-reading the run spec (the aggregator closes them at their deadline)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import yaml

from client_agent.agent import Agent, RunUnusable
from fairfl.v1 import federation_pb2, federation_pb2_grpc

SPEC = {
    "name": "unusable",
    "rounds": 2,
    "data": {"dataset": "synthetic", "num_clients": 4},
    "model": {"name": "a_module_no_agent_has:factory"},
    "selection": {"clients_per_round": 2},
}


class _SpecOnly(federation_pb2_grpc.FederationServicer):
    def __init__(self) -> None:
        self.spec_calls = 0

    def GetRunSpec(
        self, request: federation_pb2.RunSpecRequest, context: grpc.ServicerContext
    ) -> federation_pb2.RunSpec:
        self.spec_calls += 1
        return federation_pb2.RunSpec(run_id=request.run_id, experiment_yaml=yaml.safe_dump(SPEC))


@pytest.fixture
def agent_and_aggregator() -> Iterator[tuple[Agent, _SpecOnly]]:
    aggregator = _SpecOnly()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    federation_pb2_grpc.add_FederationServicer_to_server(aggregator, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    agent = Agent(f"127.0.0.1:{port}", [0, 1], device="cpu")
    try:
        yield agent, aggregator
    finally:
        agent.stop.set()
        agent.channel.close()
        server.stop(None)


def test_a_run_naming_a_plug_in_the_agent_cannot_import_is_refused_once(
    agent_and_aggregator: tuple[Agent, _SpecOnly], caplog: pytest.LogCaptureFixture
) -> None:
    agent, aggregator = agent_and_aggregator
    with (
        caplog.at_level(logging.ERROR, logger="client_agent.agent"),
        pytest.raises(RunUnusable, match=r"^model\.name: "),
    ):
        agent._runtime("r1")
    for round_number in (1, 2):  # every task of the run: failed quietly, the spec not fetched again
        agent._handle(federation_pb2.Task(task_id=f"t{round_number}", run_id="r1", client_id=0, phase=1))
    assert aggregator.spec_calls == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "cannot run on this agent" in errors[0].getMessage()
    assert "a_module_no_agent_has" in errors[0].getMessage() and errors[0].exc_info is None
