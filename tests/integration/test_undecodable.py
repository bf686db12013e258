"""Uniform refusals (docs/security.md, "Refusals change nothing and are counted") with real processes speaking mutual
TLS: an aggregator, a privacy and a clustering service.

Bytes that are no message of the method, sent to every method of every service (raw calls without serializers), are
refused with INVALID_ARGUMENT naming the method, never gRPC's INTERNAL, and counted under `malformed`. A 5 MiB message
is RESOURCE_EXHAUSTED and counted under `size`; one over gRPC core's own 8 MiB limit is RESOURCE_EXHAUSTED too, refused
before any handler (not counted). Handlers' own refusals (an unknown run, blob or ledger entry: NOT_FOUND) are counted
once each: under their reason when they went through refuse(), else under their status code.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from fairfl.compose.launcher import Child, LocalCluster
from fairfl.rpc import CORE_MESSAGE_BYTES, MAX_MESSAGE_BYTES
from fairfl.rpc_channel import open_channel
from fairfl.tls import ROLE_AGENT
from fairfl.v1 import (
    clustering_pb2,
    control_pb2,
    control_pb2_grpc,
    federation_pb2,
    federation_pb2_grpc,
    privacy_pb2,
    privacy_pb2_grpc,
    tensor_pb2,
)
from tests.federation_support import metric, start_aggregator, start_service

pytestmark = pytest.mark.integration

Code = grpc.StatusCode
FEDERATION = federation_pb2.DESCRIPTOR.services_by_name["Federation"]
CONTROL = control_pb2.DESCRIPTOR.services_by_name["RunControl"]
PRIVACY = privacy_pb2.DESCRIPTOR.services_by_name["Privacy"]
CLUSTERING = clustering_pb2.DESCRIPTOR.services_by_name["Clustering"]
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
# Methods whose deserializer reports an unreadable message to the handler, which refuses it in its own words.
OWN_WORDS = {"/fairfl.v1.Federation/UploadResult": "malformed ResultUpload"}


@dataclass
class Target:
    """A service on a process, and a channel whose identity may call it."""

    process: Child
    service: ServiceDescriptor
    channel: grpc.Channel


def _garbage(seed: int) -> bytes:
    """Random bytes no protobuf parser accepts: they start with field 1 of wire type 7, which does not exist."""
    return b"\x0f" + random.Random(seed).randbytes(48)


def _raw_call(channel: grpc.Channel, service: ServiceDescriptor, method: str, payload: bytes) -> tuple[Code, str]:
    """Send `payload` as the request of `method` as it is (no serializer), in the method's call shape."""
    shape = service.methods_by_name[method]
    path = f"/{service.full_name}/{method}"
    try:
        if shape.client_streaming and shape.server_streaming:
            list(channel.stream_stream(path)(iter([payload]), timeout=10))
        elif shape.client_streaming:
            channel.stream_unary(path)(iter([payload]), timeout=10)
        elif shape.server_streaming:
            list(channel.unary_stream(path)(payload, timeout=10))
        else:
            channel.unary_unary(path)(payload, timeout=10)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return Code.OK, ""


def _refused(target: Target, reason: str | None = None) -> float:
    labels = {"service": target.service.full_name} | ({"reason": reason} if reason else {})
    return metric(target.process, "fairfl_requests_refused_total", **labels)


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Target]]:
    work = tmp_path_factory.mktemp("undecodable")
    with LocalCluster(work / "logs") as cluster:
        aggregator = start_aggregator(cluster)
        privacy = start_service(cluster, "privacy", "privacy_service", ["--db", str(work / "ledger.sqlite")])
        clustering = start_service(cluster, "clustering", "clustering_service")
        agent = cluster.issue("agent", ROLE_AGENT, [(0, 1)])
        with (
            open_channel(aggregator.address, agent) as agent_channel,
            cluster.open_channel(aggregator.address) as operator_channel,
            cluster.open_channel(privacy.address) as privacy_channel,
            cluster.open_channel(clustering.address) as clustering_channel,
        ):
            yield {
                "Federation": Target(aggregator, FEDERATION, agent_channel),
                "RunControl": Target(aggregator, CONTROL, operator_channel),
                "Health": Target(aggregator, HEALTH, agent_channel),
                "ServerReflection": Target(aggregator, REFLECTION, agent_channel),
                "Privacy": Target(privacy, PRIVACY, privacy_channel),
                "Clustering": Target(clustering, CLUSTERING, clustering_channel),
            }


@pytest.mark.parametrize("name", ["Federation", "RunControl", "Health", "ServerReflection", "Privacy", "Clustering"])
def test_unreadable_messages_are_invalid_argument_naming_the_method(targets: dict[str, Target], name: str) -> None:
    target = targets[name]
    before = _refused(target, "malformed"), _refused(target)
    methods = [m.name for m in target.service.methods]
    outcomes = {m: _raw_call(target.channel, target.service, m, _garbage(i)) for i, m in enumerate(methods)}
    for method, (code, details) in outcomes.items():
        assert code == Code.INVALID_ARGUMENT, f"{method}: {code.name} {details!r}"
        path = f"/{target.service.full_name}/{method}"
        assert OWN_WORDS.get(path, path) in details, details
    assert (_refused(target, "malformed") - before[0], _refused(target) - before[1]) == (len(methods), len(methods))


def test_oversized_messages_are_resource_exhausted_and_counted(targets: dict[str, Target]) -> None:
    federation, privacy = targets["Federation"], targets["Privacy"]
    big = random.Random(1).randbytes(5 * 1024 * 1024)
    assert MAX_MESSAGE_BYTES < len(big) < CORE_MESSAGE_BYTES
    before = _refused(federation, "size"), _refused(privacy, "size")
    for target, method in ((federation, "Register"), (federation, "SubmitResult"), (privacy, "GetSpend")):
        code, details = _raw_call(target.channel, target.service, method, big)
        assert code == Code.RESOURCE_EXHAUSTED, f"{method}: {code.name} {details!r}"
        assert f"exceeds the limit of {MAX_MESSAGE_BYTES} bytes" in details
    assert (_refused(federation, "size") - before[0], _refused(privacy, "size") - before[1]) == (2, 1)
    # Over gRPC core's own limit the message never reaches the guard: still RESOURCE_EXHAUSTED, not counted.
    huge = bytes(CORE_MESSAGE_BYTES + 1)
    assert _raw_call(federation.channel, federation.service, "Register", huge)[0] == Code.RESOURCE_EXHAUSTED
    assert _refused(federation, "size") - before[0] == 2


def test_handler_refusals_are_counted_once_under_their_code(targets: dict[str, Target]) -> None:
    federation, control, privacy = targets["Federation"], targets["RunControl"], targets["Privacy"]
    before = {name: _refused(t) for name, t in (("f", federation), ("c", control), ("p", privacy))}
    not_found = _refused(privacy, "not_found")
    agent = federation_pb2_grpc.FederationStub(federation.channel)
    calls = {
        "FetchBlob": lambda: list(agent.FetchBlob(tensor_pb2.BlobRef(sha256="0" * 64), timeout=10)),
        "GetRunSpec": lambda: agent.GetRunSpec(federation_pb2.RunSpecRequest(run_id="no-such-run"), timeout=10),
        "GetRun": lambda: control_pb2_grpc.RunControlStub(control.channel).GetRun(
            control_pb2.GetRunRequest(run_id="no-such-run"), timeout=10
        ),
        "GetSpend": lambda: privacy_pb2_grpc.PrivacyStub(privacy.channel).GetSpend(
            privacy_pb2.GetSpendRequest(run_id="no-such-run"), timeout=10
        ),
    }
    for method, call in calls.items():
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == Code.NOT_FOUND, f"{method}: {refused.value.details()}"
    after = {name: _refused(t) for name, t in (("f", federation), ("c", control), ("p", privacy))}
    assert {name: after[name] - before[name] for name in before} == {"f": 2, "c": 1, "p": 1}
    assert _refused(privacy, "not_found") - not_found == 1, "the ledger's own NOT_FOUND abort, under its code"
