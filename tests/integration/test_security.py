"""Transport security and client identity with real processes (docs/security.md).

An aggregator, a privacy and a clustering service run as OS processes speaking mutual TLS with certificates of one
ephemeral CA (fairfl.compose). The test plays two agents, A (clients 0-1) and B (clients 2-3), each with its own agent
certificate, and an operator with a service certificate. While round 1's training tasks are open it attacks: callers
without a certificate, with one from another CA, or in plaintext; B acting for A's client or agent id, and guessing A's
task id; agents calling the internal APIs; a service identity posing as an agent. Then A's correct result is accepted
once and its replays are refused. Every refusal must carry the expected status and message, be counted by reason, and
change nothing: the run's state and model stay as they were, B's attempts do not count against A's round, and the
finished run's model equals the in-process oracle's.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from aggregator_service.engine import RoundEngine
from fairfl import codec
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.launcher import Child, LocalCluster
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalSelector
from fairfl.config import experiment_from_dict
from fairfl.protocol import EVALUATE, TRAIN
from fairfl.rpc_channel import CHANNEL_OPTIONS, open_channel
from fairfl.rpc_security import TransportSecurity
from fairfl.tls import ROLE_AGENT, CertificateAuthority
from fairfl.v1 import (
    clustering_pb2,
    clustering_pb2_grpc,
    control_pb2,
    control_pb2_grpc,
    federation_pb2,
    federation_pb2_grpc,
    privacy_pb2,
    privacy_pb2_grpc,
)
from tests.federation_support import FakeAgent, call, metric, start_aggregator, start_service

pytestmark = pytest.mark.integration

torch.set_num_threads(1)

Code = grpc.StatusCode
RUN_ID = "security"
FEDERATION, CONTROL = "fairfl.v1.Federation", "fairfl.v1.RunControl"
CONFIG = experiment_from_dict(
    {
        "name": "security",
        "seed": 5,
        "rounds": 1,
        "data": {"dataset": "synthetic", "num_clients": 4},
        "model": {"name": "mlp", "params": {"hidden": [8]}},
        "training": {"local_steps": 2, "batch_size": 16, "lr": 0.05},
        "selection": {"method": "random", "clients_per_round": 4},
        "evaluation": {"every": 1},
        "runtime": {"agents": 2, "round_timeout_s": 60, "register_timeout_s": 30, "device": "cpu"},
    }
)
HANDSHAKE = ("no_certificate", "foreign_ca_certificate", "plaintext")

# case -> (status, substrings of the message)
EXPECTED: dict[str, tuple[Code, list[str]]] = {
    # Refused in the TLS handshake: no RPC exists yet, so grpcio can only report UNAVAILABLE to the caller.
    "no_certificate": (Code.UNAVAILABLE, []),
    "foreign_ca_certificate": (Code.UNAVAILABLE, []),
    "plaintext": (Code.UNAVAILABLE, []),
    # Valid certificates doing what their identity may not.
    "register_clients_of_another_certificate": (Code.PERMISSION_DENIED, ["agent certificate 'agent-b'", "not [0]"]),
    "service_identity_registers_as_agent": (
        Code.PERMISSION_DENIED,
        [f"{FEDERATION} accepts only agent identities", "service certificate 'operator'"],
    ),
    # A task B's certificate was not given is answered as one never issued (issue #18): the answer tells B nothing
    # about A's tasks (formerly PERMISSION_DENIED, which told a selected client's task from an unselected one).
    "result_under_another_agents_id": (Code.NOT_FOUND, ["unknown task", "it was never issued"]),
    "result_for_another_client": (Code.NOT_FOUND, ["unknown task", "it was never issued"]),
    "guessed_task_id": (Code.NOT_FOUND, ["unknown task", "it was never issued"]),
    "poll_another_agents_tasks": (Code.PERMISSION_DENIED, ["registered with another certificate", "poll tasks"]),
    "heartbeat_for_another_agent": (Code.PERMISSION_DENIED, ["registered with another certificate"]),
    "agent_stops_the_run": (Code.PERMISSION_DENIED, [f"{CONTROL} accepts only service identities", "'agent-a'"]),
    "agent_reads_the_run": (Code.PERMISSION_DENIED, [f"{CONTROL} accepts only service identities"]),
    "agent_reads_the_ledger": (Code.PERMISSION_DENIED, ["fairfl.v1.Privacy accepts only service identities"]),
    "agent_selects_clients": (Code.PERMISSION_DENIED, ["fairfl.v1.Clustering accepts only service identities"]),
    # An accepted result sent again, by its agent or by another (which was never given the task).
    "replay_by_its_agent": (Code.PERMISSION_DENIED, ["already accepted", "replay"]),
    "replay_by_another_agent": (Code.NOT_FOUND, ["unknown task", "it was never issued"]),
}


@dataclass
class Snapshot:
    state: int
    round: int
    model_sha256: str


@dataclass
class Observed:
    outcomes: dict[str, tuple[Code, str]]
    honest: dict[str, tuple[Code, str]]
    before: Snapshot
    after: Snapshot
    # SubmitResult calls the aggregator handled: before and after the handshake cases, and after B's forged one
    handled: tuple[float, float, float]
    events: list[control_pb2.RunEvent]
    oracle_rounds: list[control_pb2.RoundEvent]
    oracle_params: torch.Tensor
    final_params: torch.Tensor
    refused: dict[tuple[str, str, str], float]  # (process, service, reason) -> fairfl_requests_refused_total
    service_controls: dict[str, Code]  # the same internal calls by a service identity
    task_ids: list[str]  # of round 1's training tasks

    @property
    def rounds(self) -> list[control_pb2.RoundEvent]:
        return [e.round for e in self.events if e.HasField("round")]


def _oracle() -> tuple[torch.Tensor, list[control_pb2.RoundEvent]]:
    events: list[control_pb2.RunEvent] = []
    engine = RoundEngine(
        RUN_ID, CONFIG, InProcessTransport(), LocalSelector(CONFIG.selection.method), LocalPrivacy(), events.append
    )
    summary = engine.run()
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    return summary.final_params, [e.round for e in events if e.HasField("round")]


def _model(control: control_pb2_grpc.RunControlStub) -> tuple[str, torch.Tensor]:
    header, tensors = codec.receive_bundle(control.FetchModel(control_pb2.GetRunRequest(run_id=RUN_ID), timeout=10))
    return header.sha256, torch.cat([t.reshape(-1) for _, t in tensors])


def _snapshot(control: control_pb2_grpc.RunControlStub) -> Snapshot:
    status = control.GetRun(control_pb2.GetRunRequest(run_id=RUN_ID), timeout=10)
    return Snapshot(status.state, status.round, _model(control)[0])


def _as_agent(chunks: list[federation_pb2.ResultChunk], agent_id: str) -> list[federation_pb2.ResultChunk]:
    header = federation_pb2.ResultChunk()
    header.CopyFrom(chunks[0])
    header.header.agent_id = agent_id
    return [header, *chunks[1:]]


def _submit_with(address: str, credentials: grpc.ChannelCredentials | None, chunks: list) -> tuple[Code, str]:
    channel = (
        grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
        if credentials is not None
        else grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    )
    with channel:
        code, details, _ = call(federation_pb2_grpc.FederationStub(channel).SubmitResult, iter(chunks))
    return code, details


def _refusals(child: Child, service: str) -> dict[tuple[str, str, str], float]:
    reasons = ("role", "identity", "replay", "unknown", "rate_limited", "malformed", "unauthenticated")
    return {
        (child.name, service, r): metric(child, "fairfl_requests_refused_total", service=service, reason=r)
        for r in reasons
    }


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    oracle_params, oracle_rounds = _oracle()
    work = tmp_path_factory.mktemp("security")
    with LocalCluster(work / "logs") as cluster:
        assert cluster.security is not None, "the launcher must default to mutual TLS"
        aggregator = start_aggregator(cluster)
        privacy = start_service(cluster, "privacy", "privacy_service", ["--db", str(work / "ledger.sqlite")])
        clustering = start_service(cluster, "clustering", "clustering_service")
        address = aggregator.address
        sec_a = cluster.issue("agent-a", ROLE_AGENT, [(0, 1)])
        sec_b = cluster.issue("agent-b", ROLE_AGENT, [(2, 3)])
        assert sec_a is not None and sec_b is not None
        outcomes: dict[str, tuple[Code, str]] = {}
        honest: dict[str, tuple[Code, str]] = {}
        with (
            cluster.open_channel(address) as operator_channel,
            open_channel(address, sec_a) as channel_a,
            open_channel(address, sec_b) as channel_b,
            open_channel(privacy.address, sec_a) as privacy_a,
            open_channel(clustering.address, sec_a) as clustering_a,
            cluster.open_channel(privacy.address) as privacy_operator,
            cluster.open_channel(clustering.address) as clustering_operator,
        ):
            control = control_pb2_grpc.RunControlStub(operator_channel)
            a, b = FakeAgent(channel_a, "agent-a", [0, 1]), FakeAgent(channel_b, "agent-b", [2, 3])
            a.register()
            b.register()

            def record(case: str, outcome: tuple[Code, str, object] | tuple[Code, str]) -> None:
                outcomes[case] = (outcome[0], outcome[1])

            register = federation_pb2.RegisterRequest(agent_name="intruder", client_ids=[0], device="cpu")
            record("register_clients_of_another_certificate", call(b.stub.Register, register))
            record(
                "service_identity_registers_as_agent",
                call(federation_pb2_grpc.FederationStub(operator_channel).Register, register),
            )

            control.StartRun(control_pb2.StartRunRequest(experiment_yaml=CONFIG.to_yaml(), run_id=RUN_ID), timeout=10)
            events: list[control_pb2.RunEvent] = []
            watch = control.WatchRun(control_pb2.WatchRunRequest(run_id=RUN_ID), timeout=120)
            watcher = threading.Thread(target=lambda: events.extend(watch), daemon=True)
            watcher.start()
            a.prepare(RUN_ID, CONFIG)
            b.prepare(RUN_ID, CONFIG)
            train_a, train_b = a.poll(2, TRAIN), b.poll(2, TRAIN)
            (task0,) = [t for t in train_a if t.client_id == 0]
            chunks0 = a.result_chunks(task0)
            before = _snapshot(control)
            handled = ("fairfl_grpc_server_handled_total", {"service": FEDERATION, "method": "SubmitResult"})
            handled_before = metric(aggregator, handled[0], **handled[1])

            # -- callers the TLS handshake refuses
            assert cluster.security is not None
            ca_pem = cluster.security.ca_pem
            foreign = TransportSecurity.from_issued(
                CertificateAuthority.create().issue("agent-a", ROLE_AGENT, clients=[(0, 1)])
            )
            record("no_certificate", _submit_with(address, grpc.ssl_channel_credentials(ca_pem), chunks0))
            record(
                "foreign_ca_certificate",
                _submit_with(address, grpc.ssl_channel_credentials(ca_pem, foreign.key_pem, foreign.cert_pem), chunks0),
            )
            record("plaintext", _submit_with(address, None, chunks0))
            handled_after = metric(aggregator, handled[0], **handled[1])

            # -- B's valid certificate acting for A
            forged = _as_agent(chunks0, b.agent_id)
            record("result_under_another_agents_id", b.submit(chunks0))
            handled_forged = metric(aggregator, handled[0], **handled[1])
            record("result_for_another_client", b.submit(forged))
            guessed = _as_agent(chunks0, b.agent_id)
            guessed[0].header.task_id = f"{RUN_ID}/r1/p0/c0"  # what task ids used to be: run, round, phase, client
            record("guessed_task_id", b.submit(guessed))
            poll = federation_pb2.PollRequest(agent_id=a.agent_id, max_tasks=16, wait_seconds=0)
            record("poll_another_agents_tasks", call(b.stub.PollTasks, poll))
            record(
                "heartbeat_for_another_agent",
                call(b.stub.Heartbeat, federation_pb2.HeartbeatRequest(agent_id=a.agent_id)),
            )

            # -- an agent calling the internal APIs, and the same calls by a service identity
            agent_control = control_pb2_grpc.RunControlStub(channel_a)
            record("agent_stops_the_run", call(agent_control.StopRun, control_pb2.StopRunRequest(run_id=RUN_ID)))
            record("agent_reads_the_run", call(agent_control.GetRun, control_pb2.GetRunRequest(run_id=RUN_ID)))
            spend = privacy_pb2.GetSpendRequest(run_id=RUN_ID)
            select = clustering_pb2.SelectRequest(
                run_id=RUN_ID,
                round=1,
                num_to_select=1,
                candidates=[0, 1],
                sampler="random",
            )
            record("agent_reads_the_ledger", call(privacy_pb2_grpc.PrivacyStub(privacy_a).GetSpend, spend))
            record("agent_selects_clients", call(clustering_pb2_grpc.ClusteringStub(clustering_a).Select, select))
            service_controls = {
                "GetSpend": call(privacy_pb2_grpc.PrivacyStub(privacy_operator).GetSpend, spend)[0],
                "Select": call(clustering_pb2_grpc.ClusteringStub(clustering_operator).Select, select)[0],
            }
            after = _snapshot(control)

            # -- A's correct result, once; then its replays
            honest["client 0"] = a.submit(chunks0)
            record("replay_by_its_agent", a.submit(chunks0))
            record("replay_by_another_agent", b.submit(forged))

            # -- the rest of the run, answered honestly
            for agent, tasks in ((a, [t for t in train_a if t.client_id != 0]), (b, train_b)):
                for task in tasks:
                    honest[f"client {task.client_id}"] = agent.submit(agent.result_chunks(task))
            for agent in (a, b):
                for task in agent.poll(2, EVALUATE):
                    honest[f"evaluation {task.client_id}"] = agent.submit(agent.result_chunks(task))
            watcher.join(timeout=60)
            _, final_params = _model(control)
            refused = {
                **_refusals(aggregator, FEDERATION),
                **_refusals(aggregator, CONTROL),
                **_refusals(privacy, "fairfl.v1.Privacy"),
                **_refusals(clustering, "fairfl.v1.Clustering"),
            }
        yield Observed(
            outcomes,
            honest,
            before,
            after,
            (handled_before, handled_after, handled_forged),
            events,
            oracle_rounds,
            oracle_params,
            final_params,
            refused,
            service_controls,
            [t.task_id for t in train_a + train_b],
        )


@pytest.mark.parametrize("case", list(EXPECTED))
def test_refused_with_the_fitting_status(observed: Observed, case: str) -> None:
    code, needles = EXPECTED[case]
    got, details = observed.outcomes[case]
    assert got == code, f"{case}: {got.name} {details!r}, expected {code.name}"
    for needle in needles:
        assert needle in details, f"{case}: {details!r} lacks {needle!r}"


def test_another_sites_task_is_answered_as_one_never_issued(observed: Observed) -> None:
    """Task ids carry no structure to guess from, and B's answers for A's real task read as for an id nobody issued."""
    assert len(set(observed.task_ids)) == 4
    assert all(re.fullmatch(r"[0-9a-f]{32}", task_id) for task_id in observed.task_ids), observed.task_ids
    (task_id,) = {d.split("'")[1] for c, (_, d) in observed.outcomes.items() if c.startswith("result_")}
    answers = {
        case: (code, details.replace(task_id, "<id>").replace(f"{RUN_ID}/r1/p0/c0", "<id>"))
        for case, (code, details) in observed.outcomes.items()
        if case in ("result_under_another_agents_id", "result_for_another_client", "guessed_task_id")
    }
    assert len(set(answers.values())) == 1, answers


def test_handshake_refusals_never_reach_a_handler(observed: Observed) -> None:
    before, after, forged = observed.handled
    assert after == before, "a caller without a certificate of the deployment's CA got an RPC handled"
    assert forged == after + 1, "the counter must see a call that passed the handshake (B's forged result)"


def test_internal_apis_answer_service_identities(observed: Observed) -> None:
    """The role check is what refused the agents: the same calls by a service certificate get past it."""
    assert observed.service_controls == {"GetSpend": Code.NOT_FOUND, "Select": Code.OK}  # no such run in the ledger


def test_refusals_change_nothing(observed: Observed) -> None:
    assert observed.before == observed.after
    assert observed.before.state == control_pb2.RUN_STATE_RUNNING and observed.before.round == 0


def test_the_run_takes_exactly_the_honest_results(observed: Observed) -> None:
    refused = {k: v for k, v in observed.honest.items() if v[0] != Code.OK}
    assert not refused, refused
    status = [e.status for e in observed.events if e.HasField("status")][-1]
    assert status.state == control_pb2.RUN_STATE_COMPLETED, status.message
    (got,) = observed.rounds
    (want,) = observed.oracle_rounds
    assert got.results_accepted == 4 and list(got.selected) == list(want.selected)
    assert got.results_rejected == 1, "only A's own replay counts: B's attempts on A's task must not weigh on it"
    assert got.model_sha256 == want.model_sha256, "an attack changed the aggregated model"
    assert float((observed.final_params - observed.oracle_params).abs().max()) <= 1e-6


def test_refusals_are_counted_by_reason(observed: Observed) -> None:
    counts = {key: value for key, value in observed.refused.items() if value}
    assert counts == {
        ("aggregator", FEDERATION, "identity"): 3,  # register for A's client, poll and heartbeat as A
        # results for A's task under A's and B's agent id, a guessed task id, a replay of A's result
        ("aggregator", FEDERATION, "unknown"): 4,
        ("aggregator", FEDERATION, "role"): 1,  # the operator registering as an agent
        ("aggregator", FEDERATION, "replay"): 1,  # A's replay of its own result
        ("aggregator", CONTROL, "role"): 2,
        ("privacy", "fairfl.v1.Privacy", "role"): 1,
        ("clustering", "fairfl.v1.Clustering", "role"): 1,
    }


def test_rate_limits_are_per_caller(tmp_path: Path) -> None:
    """An aggregator allowing 3 calls at once and then 1 every 100 s (no refill however slow a loaded machine makes
    the calls): the fourth Register of one certificate is refused with RESOURCE_EXHAUSTED and counted; another
    certificate is not affected."""
    with LocalCluster(tmp_path / "logs") as cluster:
        limited = start_aggregator(cluster, "aggregator-limited", ["--rate-limit", "0.01", "--rate-burst", "3"])
        sec_a = cluster.issue("agent-a", ROLE_AGENT, [(0, 1)])
        sec_b = cluster.issue("agent-b", ROLE_AGENT, [(2, 3)])
        request = federation_pb2.RegisterRequest(agent_name="a", client_ids=[0, 1], device="cpu")
        with open_channel(limited.address, sec_a) as channel_a, open_channel(limited.address, sec_b) as channel_b:
            stub_a = federation_pb2_grpc.FederationStub(channel_a)
            codes = [call(stub_a.Register, request)[:2] for _ in range(4)]
            other = call(
                federation_pb2_grpc.FederationStub(channel_b).Register,
                federation_pb2.RegisterRequest(agent_name="b", client_ids=[2], device="cpu"),
            )
        assert [c for c, _ in codes] == [Code.OK] * 3 + [Code.RESOURCE_EXHAUSTED], codes
        assert "rate limit" in codes[-1][1] and "per caller" in codes[-1][1]
        assert other[0] == Code.OK
        assert metric(limited, "fairfl_requests_refused_total", service=FEDERATION, reason="rate_limited") == 1
