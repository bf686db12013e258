"""Certificates and identities (fairfl.tls), `fairfl certs`, the transport options, the rate limiter, the access
guard's concurrency and idle limits and the payload limits of fairfl.codec. The end-to-end checks with real processes
are in tests/integration/test_security.py, test_fair_share.py and test_undecodable.py."""

from __future__ import annotations

import argparse
import ipaddress
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client_agent.agent import parse_client_ids
from fairfl import codec, telemetry, tls
from fairfl.compose import cli
from fairfl.rpc import CHUNK_BYTES
from fairfl.rpc_channel import open_channel
from fairfl.rpc_guard import AccessPolicy, IdleWatch, InFlight, RateLimiter, ServerLimits, server_limits
from fairfl.rpc_refusals import refuse
from fairfl.rpc_security import TransportSecurity, add_transport_arguments, security_from_args
from fairfl.rpc_server import start_server
from fairfl.v1 import tensor_pb2


@pytest.fixture(scope="module")
def ca() -> tls.CertificateAuthority:
    return tls.CertificateAuthority.create()


def _sans(pem: bytes) -> tuple[set[str], set[str], set[str]]:
    ext = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return (
        set(ext.get_values_for_type(x509.DNSName)),
        {str(ip) for ip in ext.get_values_for_type(x509.IPAddress)},
        set(ext.get_values_for_type(x509.UniformResourceIdentifier)),
    )


def test_identity_carries_name_role_and_clients(ca: tls.CertificateAuthority) -> None:
    issued = ca.issue("site-a", tls.ROLE_AGENT, clients=[(0, 49), (60, 60)])
    identity = tls.identity_of(issued.cert_pem)
    assert (identity.name, identity.role, identity.clients) == ("site-a", "agent", ((0, 49), (60, 60)))
    assert identity.unauthorized([0, 49, 60]) == []
    assert identity.unauthorized([50, 3, 61, 50]) == [50, 61]
    assert "agent certificate 'site-a'" in identity.describe()
    anyone = tls.identity_of(ca.issue("agent", tls.ROLE_AGENT).cert_pem)
    assert anyone.clients is None and anyone.unauthorized([0, 10**9]) == []


def test_service_certificates_name_their_hosts_and_agents_none(ca: tls.CertificateAuthority) -> None:
    dns, ips, uris = _sans(ca.issue("aggregator", tls.ROLE_SERVICE, ["localhost", "127.0.0.1", "::1"]).cert_pem)
    assert dns == {"localhost"} and ips == {"127.0.0.1", str(ipaddress.ip_address("::1"))} and not uris
    usage = (
        x509.load_pem_x509_certificate(ca.issue("agent", tls.ROLE_AGENT).cert_pem)
        .extensions.get_extension_for_class(x509.ExtendedKeyUsage)
        .value
    )
    assert list(usage) == [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH], "an agent certificate cannot serve TLS"


def test_issue_refuses_what_is_no_fairfl_identity(ca: tls.CertificateAuthority) -> None:
    with pytest.raises(tls.TlsError, match="unknown role 'admin'"):
        ca.issue("x", "admin")
    with pytest.raises(tls.TlsError, match="only agent certificates"):
        ca.issue("aggregator", tls.ROLE_SERVICE, clients=[(0, 1)])


@pytest.mark.parametrize("text", ["", "a-b", "5-3", "1,,2", "-4", "3-"])
def test_client_ranges_are_parsed_strictly(text: str) -> None:
    with pytest.raises(tls.TlsError, match="bad client range"):
        tls.parse_ranges(text)
    if text:  # an agent's --clients takes the same syntax as its certificate
        with pytest.raises(ValueError, match="bad client range"):
            parse_client_ids(text)


def test_agent_client_ids_are_the_certificate_ranges_expanded() -> None:
    assert parse_client_ids("4-6, 0,5") == [0, 4, 5, 6]
    with pytest.raises(ValueError, match="no client ids"):
        parse_client_ids(" ")


def test_k8s_names_cover_the_services_and_stateful_pods() -> None:
    names = tls.k8s_hosts("aggregator", "ml", "corp.local")
    assert "fairfl-aggregator" in names and "fairfl-aggregator.ml.svc.corp.local" in names
    assert "fairfl-aggregator-0.fairfl-aggregator.ml.svc.corp.local" in names
    assert not any(n.startswith("fairfl-clustering-0") for n in tls.k8s_hosts("clustering"))


def test_fairfl_certs_writes_one_secret_directory_per_identity(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "certs"
    assert cli.main(["certs", str(out), "--host", "fl.example.org", "--agent", "site-a=0-9", "--agent", "spare"]) == 0
    printed = capsys.readouterr().out
    for name in ("aggregator", "clustering", "privacy", "site-a", "spare"):
        assert f"create secret generic fairfl-tls-{name} --from-file={out / name}" in printed
    assert "fairfl-tls-operator" not in printed, "the operator identity stays with the operator"
    ca_pem = (out / "ca" / "ca.crt").read_bytes()
    for name in ("aggregator", "clustering", "privacy", "operator", "site-a", "spare"):
        files = sorted(p.name for p in (out / name).iterdir())
        assert files == ["ca.crt", "tls.crt", "tls.key"], name
        assert (out / name / "ca.crt").read_bytes() == ca_pem
        assert stat.S_IMODE((out / name / "tls.key").stat().st_mode) == 0o600
        TransportSecurity.from_dir(out / name)  # loads as a process's TLS material
    assert stat.S_IMODE((out / "ca" / "ca.key").stat().st_mode) == 0o600
    dns, ips, _ = _sans((out / "aggregator" / "tls.crt").read_bytes())
    assert {"fl.example.org", "fairfl-aggregator", "fairfl-aggregator.fairfl.svc.cluster.local"} <= dns
    assert "127.0.0.1" in ips
    site = TransportSecurity.from_dir(out / "site-a").identity
    assert (site.role, site.clients) == ("agent", ((0, 9),))
    assert TransportSecurity.from_dir(out / "spare").identity.clients is None
    assert TransportSecurity.from_dir(out / "operator").identity.role == "service"

    # Existing identities are kept unless --force; the CA is reused, so old and new identities trust each other.
    assert cli.main(["certs", str(out), "--agent", "site-a=0-9"]) == 2
    assert "already holds certificates for site-a; pass --force" in capsys.readouterr().err
    aggregator_cert = (out / "aggregator" / "tls.crt").read_bytes()
    assert cli.main(["certs", str(out), "--agent", "site-b=10-19"]) == 0  # a new site joins the deployment
    printed = capsys.readouterr().out
    assert (
        "site-b" in printed and "Kept as they were: aggregator, clustering, operator, privacy, site-a, spare" in printed
    )
    assert (out / "aggregator" / "tls.crt").read_bytes() == aggregator_cert  # kept, not re-issued
    assert (out / "site-b" / "ca.crt").read_bytes() == ca_pem
    assert TransportSecurity.from_dir(out / "site-b").identity.clients == ((10, 19),)
    assert cli.main(["certs", str(out), "--force"]) == 0
    assert (out / "ca" / "ca.crt").read_bytes() == ca_pem
    assert (out / "agent" / "ca.crt").read_bytes() == ca_pem


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--agent", "aggregator"], "other than a service's"),
        (["--agent", "a=9-1"], "start > end"),
        (["--days", "0"], "--days"),
    ],
)
def test_fairfl_certs_refuses_bad_options(
    tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str], message: str
) -> None:
    assert cli.main(["certs", str(tmp_path / "c"), *argv]) == 2
    assert message in capsys.readouterr().err


def _transport_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_transport_arguments(parser)
    return parser.parse_args(argv)


def test_plaintext_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FAIRFL_TLS_DIR", raising=False)
    monkeypatch.delenv("FAIRFL_INSECURE", raising=False)
    with pytest.raises(ValueError, match=r"no TLS material: pass --tls-dir DIR .*fairfl certs.* or --insecure"):
        security_from_args(_transport_args())
    assert security_from_args(_transport_args("--insecure")) is None
    monkeypatch.setenv("FAIRFL_INSECURE", "1")
    assert security_from_args(_transport_args()) is None
    with pytest.raises(ValueError, match="not both"):
        security_from_args(_transport_args("--tls-dir", str(tmp_path)))
    monkeypatch.delenv("FAIRFL_INSECURE")
    (tmp_path / "tls.crt").write_text("x")
    with pytest.raises(ValueError, match=r"lacks .*ca\.crt.*tls\.key"):
        security_from_args(_transport_args("--tls-dir", str(tmp_path)))


def test_tls_dir_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ca) -> None:
    ca.issue("privacy", tls.ROLE_SERVICE, ["localhost"]).write(tmp_path)
    monkeypatch.setenv("FAIRFL_TLS_DIR", str(tmp_path))
    security = security_from_args(_transport_args())
    assert security is not None and security.identity.name == "privacy"


def test_rate_limiter_allows_a_burst_then_the_rate_per_caller() -> None:
    limiter = RateLimiter(rate=2.0, burst=3)
    assert [limiter.allow("a", now=0.0) for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("b", now=0.0), "callers have their own buckets"
    assert not limiter.allow("a", now=0.4)  # 0.8 tokens regained
    assert limiter.allow("a", now=0.6) and not limiter.allow("a", now=0.6)
    assert [limiter.allow("a", now=100.0) for _ in range(4)] == [True, True, True, False], "refills up to the burst"


def test_rate_limiter_forgets_the_least_recent_callers() -> None:
    limiter = RateLimiter(rate=1.0, burst=1, max_callers=3)
    for key in "abcd":
        limiter.allow(key, now=0.0)
    assert list(limiter.buckets) == ["b", "c", "d"]


def test_payload_receiver_refuses_empty_and_oversized_chunks() -> None:
    receiver = codec.PayloadReceiver(10, "0" * 64, max_bytes=10, max_chunk_bytes=4)
    with pytest.raises(codec.CodecError, match=r"chunks carry 1\.\.4 bytes") as empty:
        receiver.add(b"")
    assert empty.value.reason == "size"
    with pytest.raises(codec.CodecError, match=r"chunks carry 1\.\.4 bytes"):
        receiver.add(b"12345")
    receiver.add(b"1234")
    assert receiver.received == 4
    assert codec.PayloadReceiver(1, "0" * 64).max_chunk_bytes == CHUNK_BYTES


def test_codec_errors_name_their_reason() -> None:
    receiver = codec.PayloadReceiver(4, "0" * 64)
    receiver.add(b"abcd")
    with pytest.raises(codec.CodecError) as digest:
        receiver.finish()
    assert digest.value.reason == "integrity"
    with pytest.raises(codec.CodecError) as size:
        codec.PayloadReceiver(11, "0" * 64, max_bytes=10)
    assert size.value.reason == "size"
    assert codec.CodecError("x").reason == "malformed"


class _Aborted(Exception):
    pass


class _PlaintextContext:
    """A servicer context of a plaintext server: no peer certificate; abort raises like grpc's."""

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata  # the refusal's reason, as a real context sends it

    def abort(self, code: object, details: str) -> None:
        raise _Aborted(code, details)


def test_registering_no_client_is_refused_and_counted() -> None:
    import grpc

    from aggregator_service.federation.servicer import FederationServicer
    from aggregator_service.federation.state import FederationState
    from fairfl import telemetry
    from fairfl.v1 import federation_pb2

    def refused() -> float:
        return sum(
            s.value
            for m in telemetry.REQUESTS_REFUSED.collect()
            for s in m.samples
            if s.name.endswith("_total") and s.labels == {"service": "fairfl.v1.Federation", "reason": "malformed"}
        )

    before = refused()
    state = FederationState()
    with pytest.raises(_Aborted) as aborted:
        FederationServicer(state).Register(federation_pb2.RegisterRequest(agent_name="a"), _PlaintextContext())
    assert aborted.value.args == (grpc.StatusCode.INVALID_ARGUMENT, "register at least one client id")
    assert refused() == before + 1 and not state.agents


# -- the access guard's limits (fairfl.rpc_guard) ----------------------------------------------------------------------


def test_server_limits_leave_room_for_other_callers_and_for_refusals() -> None:
    assert server_limits(64) == ServerLimits(workers=64, reserved=4, total=60, per_caller=30)  # the aggregator
    assert server_limits(32) == ServerLimits(workers=32, reserved=2, total=30, per_caller=15)  # privacy, clustering
    assert server_limits(4) == ServerLimits(workers=4, reserved=1, total=3, per_caller=2)
    for workers in range(3, 300):
        limits = server_limits(workers)
        assert 1 <= limits.per_caller < limits.total < workers, limits
    assert server_limits(64, AccessPolicy(max_in_flight=59)).per_caller == 59
    for bad in (60, 64, -1):
        with pytest.raises(ValueError, match=r"--max-in-flight must be at least 1 and below 60 \(the 64 worker"):
            server_limits(64, AccessPolicy(max_in_flight=bad))
    for timeout in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--idle-timeout must be a positive number"):
            server_limits(64, AccessPolicy(idle_timeout=timeout))


def test_in_flight_caps_each_caller_and_all_callers() -> None:
    slots = InFlight(per_caller=2, total=3)
    assert [slots.enter("a") for _ in range(3)] == ["", "", "concurrency"]
    assert slots.enter("b") == ""
    assert slots.enter("c") == "capacity", "all slots are taken: another caller is refused too"
    slots.leave("a")
    assert slots.enter("c") == ""
    for key in ("a", "b", "c", "never-entered"):
        slots.leave(key)
    assert (slots.count, slots.running) == ({}, 0), "the table keeps only callers with calls running"


class _WatchedCall:
    """What IdleWatch reads of a call: its deadline while its handler waits, and whether it expired."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.expired = False
        self.expired_at = threading.Event()

    def expire(self, now: float) -> None:
        self.expired = True
        self.expired_at.set()


def test_idle_watch_expires_only_calls_waiting_past_their_deadline() -> None:
    watch = IdleWatch(0.2)
    try:
        waiting, busy, later = _WatchedCall(0.0), _WatchedCall(0.0), _WatchedCall(0.0)
        for call in (waiting, busy, later):
            watch.add(call)  # type: ignore[arg-type]
        started = time.monotonic()
        waiting.deadline = started + 0.2
        assert waiting.expired_at.wait(2.0)
        assert 0.15 <= time.monotonic() - started < 1.0
        later.deadline = time.monotonic() + 0.2  # starts waiting while the watch sleeps: still found in time
        assert later.expired_at.wait(2.0)
        assert not busy.expired, "a call whose handler is not waiting for a message is never cancelled"
    finally:
        watch.close()
    watch.thread.join(1.0)
    assert not watch.thread.is_alive()


# -- the access guard on a real server: refusals, idle calls, health ------------------------------------------------

Req, Rep = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
GUARD = "test.Guard"


def _guard_service(server: grpc.Server) -> list[str]:
    def unary(request: Req, context: grpc.ServicerContext) -> Rep:
        if request.service == "missing":
            context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
        if request.service == "forged":
            refuse(context, GUARD, "identity", grpc.StatusCode.PERMISSION_DENIED, "not yours")
        return Rep(status=Rep.SERVING)

    def upload(requests: Iterator[Req], context: grpc.ServicerContext) -> Rep:
        return Rep(status=Rep.SERVING if sum(1 for _ in requests) else Rep.NOT_SERVING)

    def download(request: Req, context: grpc.ServicerContext) -> Iterator[tensor_pb2.Chunk]:
        for _ in range(64):  # 64 MiB: far more than HTTP/2 flow control lets out before the caller reads
            yield tensor_pb2.Chunk(data=bytes(1024 * 1024))

    codec_ = {"request_deserializer": Req.FromString, "response_serializer": Rep.SerializeToString}
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, **codec_),
        "Upload": grpc.stream_unary_rpc_method_handler(upload, **codec_),
        "Download": grpc.unary_stream_rpc_method_handler(
            download, request_deserializer=Req.FromString, response_serializer=tensor_pb2.Chunk.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(GUARD, handlers)])
    return [GUARD]


def _refused(reason: str, service: str = GUARD) -> float:
    return sum(
        s.value
        for m in telemetry.REQUESTS_REFUSED.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.labels == {"service": service, "reason": reason}
    )


def _code(call: object, *args: object) -> tuple[grpc.StatusCode, str]:
    try:
        call(*args, timeout=5)  # type: ignore[operator]
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def test_guard_refuses_unreadable_messages_and_counts_every_refusal_once() -> None:
    running = start_server("127.0.0.1:0", _guard_service, max_workers=4)
    before = {r: _refused(r) for r in ("malformed", "size", "not_found", "identity", "permission_denied")}
    try:
        with open_channel(f"127.0.0.1:{running.port}") as channel:
            raw = channel.unary_unary(f"/{GUARD}/Unary")  # no serializers: the bytes travel as they are
            upload = channel.stream_unary(f"/{GUARD}/Upload")
            garbage = b"\x0f" + bytes(range(40))  # field 1 with wire type 7: no protobuf parser accepts it
            assert _code(raw, garbage) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"/{GUARD}/Unary: a request message could not be parsed as this method's request",
            )
            assert _code(upload, iter([Req().SerializeToString(), garbage]))[0] == grpc.StatusCode.INVALID_ARGUMENT
            code, details = _code(raw, bytes(5 * 1024 * 1024))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "exceeds the limit of 4194304 bytes" in details
            assert _code(raw, bytes(9 * 1024 * 1024))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED  # gRPC core's limit
            assert _code(raw, Req(service="missing").SerializeToString())[0] == grpc.StatusCode.NOT_FOUND
            assert _code(raw, Req(service="forged").SerializeToString())[0] == grpc.StatusCode.PERMISSION_DENIED
            assert _code(raw, Req().SerializeToString())[0] == grpc.StatusCode.OK
    finally:
        running.stop(0)
    counted = {r: _refused(r) - before[r] for r in before}
    # the handler's own abort under its code; refuse()'s under its reason, not again under its code
    assert counted == {"malformed": 2, "size": 1, "not_found": 1, "identity": 1, "permission_denied": 0}


def test_guard_caps_a_caller_cancels_idle_calls_and_keeps_health_answering() -> None:
    """4 workers: 3 calls at once in all, 2 per caller (on plaintext, per address: everything here is one caller)."""
    running = start_server("127.0.0.1:0", _guard_service, max_workers=4, policy=AccessPolicy(idle_timeout=0.5))
    release = threading.Event()

    def silent() -> Iterator[bytes]:
        release.wait()
        yield from ()

    def first_done(calls: list[grpc.Future]) -> list[grpc.Future]:
        deadline = time.monotonic() + 5
        while not any(c.done() for c in calls) and time.monotonic() < deadline:
            time.sleep(0.01)
        return [c for c in calls if c.done()]

    idle_before, busy_before = _refused("idle"), _refused("concurrency")
    try:
        with open_channel(f"127.0.0.1:{running.port}") as channel:
            upload = channel.stream_unary(f"/{GUARD}/Upload")
            started = time.monotonic()
            streams = [upload.future(silent(), timeout=10) for _ in range(3)]
            (refused,) = first_done(streams)
            assert refused.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "at most 2 calls (streams included) at a time per caller" in refused.exception().details()
            held = [s for s in streams if s is not refused]
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(3):
                t = time.monotonic()
                assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == Rep.SERVING
                assert time.monotonic() - t < 1.0
            assert not any(s.done() for s in held), "the two calls within the caller's share are still waiting"
            for call in held:
                err = call.exception(timeout=5)
                assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
                assert "no message from the caller for 0.5 s" in err.details()
            assert time.monotonic() - started >= 0.45
            assert running.guard is not None
            deadline = time.monotonic() + 5  # the handlers end a moment after their callers got the status
            while running.guard.calls.running and time.monotonic() < deadline:
                time.sleep(0.01)
            assert (running.guard.calls.running, running.guard.calls.count) == (0, {}), "no call holds a thread"
            # a unary method called as a stream that never sends its request must not hold a thread either
            unary_as_stream = channel.stream_unary(f"/{GUARD}/Unary").future(silent(), timeout=10)
            assert unary_as_stream.exception(timeout=5).code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert _code(channel.unary_unary(f"/{GUARD}/Unary"), Req().SerializeToString())[0] == grpc.StatusCode.OK
    finally:
        release.set()
        running.stop(0)
    assert (_refused("idle") - idle_before, _refused("concurrency") - busy_before) == (3, 1)
    assert running.guard is not None
    running.guard.idle.thread.join(2.0)
    assert not running.guard.idle.thread.is_alive(), "the idle watch ends with its server"


def test_guard_cancels_a_stream_whose_caller_stops_reading_and_caps_health_watches() -> None:
    """A caller that reads one message of a download and then nothing holds the handler in gRPC's send (flow control):
    the idle watch cancels it and frees its slot. A health Watch holds a thread while open: one per caller."""
    running = start_server("127.0.0.1:0", _guard_service, max_workers=8, policy=AccessPolicy(idle_timeout=0.5))
    idle_before = _refused("idle")
    try:
        with open_channel(f"127.0.0.1:{running.port}") as channel:
            download = channel.unary_stream(f"/{GUARD}/Download")(Req().SerializeToString(), timeout=30)
            assert len(tensor_pb2.Chunk.FromString(next(download)).data) == 1024 * 1024  # then it reads no more
            assert running.guard is not None
            deadline = time.monotonic() + 10
            while running.guard.calls.running and time.monotonic() < deadline:
                time.sleep(0.02)
            assert running.guard.calls.running == 0, "the stalled download still holds its thread"
            assert _refused("idle") - idle_before == 1
            with pytest.raises(grpc.RpcError) as cancelled:
                for _ in download:  # what the caller finds when it reads again: the call was ended
                    pass
            assert cancelled.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "read no response for 0.5 s" in (cancelled.value.details() or "")

            health = health_pb2_grpc.HealthStub(channel)
            first = health.Watch(health_pb2.HealthCheckRequest(), timeout=10)
            assert next(first).status == Rep.SERVING
            code, details = _code(lambda **kw: next(health.Watch(health_pb2.HealthCheckRequest(), **kw)))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "health watch per caller" in details
            first.cancel()
    finally:
        running.stop(0)
