"""Property test: every RPC of every service, fed hostile numbers and random bytes (docs/security.md).

The privacy, clustering and aggregator services run as their own processes with mutual TLS (the aggregator's rate
limit off: this is about input, not flooding). For each method of Federation, RunControl, Privacy, Clustering and
grpc.health.v1, hypothesis builds requests from the method's protobuf descriptor, every field drawn from hostile
values (NaN, ±inf, negative, zero, subnormal, huge; extreme integers; unknown enum values; odd strings; nested
messages), sends them as raw bytes, or sends random bytes instead. Each call must answer within its deadline (no
hang) with anything but INTERNAL or UNKNOWN (no crash inside a handler), and a refusal must say why. Afterwards every
process is alive, no thread is left spinning (each process idles), the refusals were counted in
fairfl_requests_refused_total, and a run's privacy ledger that only refused calls touched is exactly as it was.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import yaml
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fairfl.compose.launcher import Child, LocalCluster
from fairfl.config import experiment_from_dict
from fairfl.rpc_channel import open_channel
from fairfl.tls import ROLE_AGENT
from fairfl.v1 import clustering_pb2, control_pb2, federation_pb2, federation_pb2_grpc, privacy_pb2, privacy_pb2_grpc
from tests.federation_support import metric, start_aggregator, start_service

pytestmark = pytest.mark.integration

Code = grpc.StatusCode
CALL_DEADLINE_S = 3.0  # a long poll waits 1 s less than its deadline
EXAMPLES = int(os.environ.get("FAIRFL_WIRE_EXAMPLES", "40"))
# Statuses that mean the server broke (a handler raised), hung, or died: never an answer to bad input.
BROKEN = {Code.INTERNAL, Code.UNKNOWN, Code.DEADLINE_EXCEEDED, Code.UNAVAILABLE}
LEDGER_RUN = "wire-ledger"  # a private run whose ledger the property calls aim at, with other ids
# Ids the services know, by field name (the fixture adds a registered agent's id), drawn most of the time so that
# hostile numbers reach the checks behind the lookups; other strings otherwise.
KNOWN_IDS: dict[str, list[str]] = {
    "run_id": ["", LEDGER_RUN, "wire-other"],
    "principal": ["", "0", "federation"],
    "agent_id": [],
}
ODD_STRINGS = ["", "0", "federation", "../../etc/passwd", "r" * 300, "\x00", "💥"]

SMALL_CONFIG = {
    "name": "wire",
    "seed": 3,
    "rounds": 2,
    "data": {"dataset": "synthetic", "num_clients": 2},
    "model": {"name": "mlp", "params": {"hidden": [8]}},
    "training": {"local_steps": 2, "batch_size": 16, "lr": 0.05},
    "selection": {"method": "random", "clients_per_round": 1},
    "runtime": {"agents": 1, "round_timeout_s": 5, "register_timeout_s": 2, "device": "cpu"},
    "privacy": {"enabled": True, "epsilon": 3.0, "noise_multiplier": 1.0, "sample_rate": 0.05},
}
experiment_from_dict(SMALL_CONFIG)  # the base every mutated config starts from is itself valid


# -- hostile values ----------------------------------------------------------------------------------------------------

HOSTILE_FLOATS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.sampled_from(
        [
            -1.0,
            0.0,
            -0.0,
            5e-324,
            1e-300,
            1e-156,
            1e300,
            1.7976931348623157e308,
        ]
    ),
    st.sampled_from([0.5, 1.0, 2.0, 1e-5, 3.0, 100.0]),  # plausible values, so deeper checks are reached too
    st.floats(allow_nan=True, allow_infinity=True),
)


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in (lo, hi, 0, 1, -1, hi // 2) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


INTEGERS: dict[int, st.SearchStrategy[int]] = {
    FieldDescriptor.TYPE_INT32: _ints(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: _ints(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: _ints(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: _ints(0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: _ints(0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: _ints(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: _ints(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: _ints(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: _ints(0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: _ints(0, 2**64 - 1),
}


def _hostile_config(data: st.DataObject) -> str:
    """The small valid config with one number replaced by a hostile one (its numbers come from the wire too)."""
    config = yaml.safe_load(yaml.safe_dump(SMALL_CONFIG))
    paths = [(section, key) for section, body in config.items() if isinstance(body, dict) for key in body]
    paths = [(s, k) for s, k in paths if isinstance(config[s][k], int | float) and not isinstance(config[s][k], bool)]
    paths += [("rounds",), ("seed",)]
    path = data.draw(st.sampled_from(paths))
    value = data.draw(st.one_of(HOSTILE_FLOATS, _ints(-(2**63), 2**64)))
    if len(path) == 1:
        config[path[0]] = value
    else:
        config[path[0]][path[1]] = value
    return yaml.safe_dump(config)


def _scalar(data: st.DataObject, fd: FieldDescriptor) -> object:
    if fd.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return data.draw(HOSTILE_FLOATS)
    if fd.type in INTEGERS:
        return data.draw(INTEGERS[fd.type])
    if fd.type == FieldDescriptor.TYPE_BOOL:
        return data.draw(st.booleans())
    if fd.type == FieldDescriptor.TYPE_ENUM:  # proto3 enums are open: unknown values arrive too
        return data.draw(st.one_of(st.sampled_from([v.number for v in fd.enum_type.values]), st.integers(-3, 99)))
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return data.draw(st.binary(max_size=48))
    if fd.name == "experiment_yaml":
        return _hostile_config(data) if data.draw(st.booleans()) else data.draw(st.text(max_size=64))
    known = KNOWN_IDS.get(fd.name)
    if known and data.draw(st.integers(0, 4)) > 0:
        return data.draw(st.sampled_from(tuple(known)))
    return data.draw(st.one_of(st.sampled_from(ODD_STRINGS), st.text(max_size=24)))


def hostile_message(data: st.DataObject, descriptor: Descriptor, depth: int = 0) -> object:
    """A message of `descriptor` with a random subset of its fields set to hostile values (nested up to 3 deep)."""
    message = message_factory.GetMessageClass(descriptor)()
    chosen_oneofs = {o.name: data.draw(st.sampled_from(list(o.fields))).name for o in descriptor.oneofs}
    for fd in descriptor.fields:
        if fd.containing_oneof is not None and chosen_oneofs[fd.containing_oneof.name] != fd.name:
            continue
        if data.draw(st.integers(0, 3)) == 0:  # most fields set, some left at their defaults
            continue
        nested = fd.type == FieldDescriptor.TYPE_MESSAGE
        if nested and depth >= 3:
            continue
        if fd.is_repeated and nested and fd.message_type.GetOptions().map_entry:  # e.g. a Struct's fields
            _fill_map(data, getattr(message, fd.name), fd.message_type, depth)
        elif fd.is_repeated:
            for _ in range(data.draw(st.integers(0, 3))):
                container = getattr(message, fd.name)
                if nested:
                    container.add().CopyFrom(hostile_message(data, fd.message_type, depth + 1))
                else:
                    _assign(lambda v, c=container: c.append(v), _scalar(data, fd))
        elif nested:
            getattr(message, fd.name).CopyFrom(hostile_message(data, fd.message_type, depth + 1))
        else:
            _assign(lambda v, m=message, name=fd.name: setattr(m, name, v), _scalar(data, fd))
    return message


def _fill_map(data: st.DataObject, container: Any, entry: Descriptor, depth: int) -> None:
    """Up to 3 entries of a map field with hostile keys and values (message values nested like any other)."""
    key_fd, value_fd = entry.fields_by_name["key"], entry.fields_by_name["value"]
    for _ in range(data.draw(st.integers(0, 3))):
        key = _scalar(data, key_fd)
        with contextlib.suppress(ValueError, TypeError, OverflowError):
            if value_fd.type == FieldDescriptor.TYPE_MESSAGE:
                container[key].CopyFrom(hostile_message(data, value_fd.message_type, depth + 1))
            else:
                container[key] = _scalar(data, value_fd)


def _assign(put: object, value: object) -> None:
    with contextlib.suppress(ValueError, TypeError, OverflowError):  # what protobuf cannot hold never reaches the wire
        put(value)  # type: ignore[operator]


def request_bytes(data: st.DataObject, method: MethodDescriptor) -> bytes:
    if data.draw(st.integers(0, 4)) == 0:
        return data.draw(st.binary(max_size=256))
    return hostile_message(data, method.input_type).SerializeToString()  # type: ignore[attr-defined]


# -- the sweep: each number of each request, alone, at each hostile value ------------------------------------------

SWEEP_FLOATS = [math.nan, math.inf, -math.inf, -1.0, 0.0, 5e-324, 1e-300, 1e300]
SIGNED = (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32)
SIGNED64 = (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64)
UNSIGNED64 = (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64)


def _sweep_values(fd: FieldDescriptor) -> list[object]:
    if fd.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return SWEEP_FLOATS
    if fd.type in SIGNED or fd.type == FieldDescriptor.TYPE_ENUM:
        return [-(2**31), -1, 0, 2**31 - 1]
    if fd.type in SIGNED64:
        return [-(2**63), -1, 0, 2**63 - 1]
    if fd.type in UNSIGNED64:
        return [0, 2**53 + 1, 2**63, 2**64 - 1]
    return [0, 2**31, 2**32 - 1]  # uint32, fixed32


def _numeric(fd: FieldDescriptor) -> bool:
    return fd.type not in (
        FieldDescriptor.TYPE_MESSAGE,
        FieldDescriptor.TYPE_STRING,
        FieldDescriptor.TYPE_BYTES,
        FieldDescriptor.TYPE_BOOL,
    )


def _plausible(fd: FieldDescriptor) -> object:
    """A value that passes the first checks, so the number under test is the one that is looked at."""
    if fd.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return 0.5
    if fd.type == FieldDescriptor.TYPE_ENUM:
        return ([v.number for v in fd.enum_type.values if v.number] or [0])[0]
    if fd.type == FieldDescriptor.TYPE_BOOL:
        return False
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return b""
    if fd.type == FieldDescriptor.TYPE_STRING:
        known = KNOWN_IDS.get(fd.name, [])
        return known[-1] if known and fd.name != "experiment_yaml" else ("" if fd.name == "experiment_yaml" else "x")
    return 1


def _is_map(fd: FieldDescriptor) -> bool:
    return fd.type == FieldDescriptor.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry


def _fields(descriptor: Descriptor) -> list[FieldDescriptor]:
    """The fields a plausible message sets: every field but the later members of a oneof, and no map (a plug-in's
    Struct parameters: their hostile numbers come from the property test's `_fill_map`)."""
    return [
        f
        for f in descriptor.fields
        if (f.containing_oneof is None or f is f.containing_oneof.fields[0]) and not _is_map(f)
    ]


def plausible_message(descriptor: Descriptor, depth: int = 0) -> Any:
    message = message_factory.GetMessageClass(descriptor)()
    for fd in _fields(descriptor):
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            if depth < 2:
                sub = plausible_message(fd.message_type, depth + 1)
                (getattr(message, fd.name).add() if fd.is_repeated else getattr(message, fd.name)).CopyFrom(sub)
        elif fd.is_repeated:
            getattr(message, fd.name).append(_plausible(fd))
        else:
            setattr(message, fd.name, _plausible(fd))
    return message


def _numeric_paths(descriptor: Descriptor, depth: int = 0) -> Iterator[list[FieldDescriptor]]:
    for fd in _fields(descriptor):
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            if depth < 2:
                yield from ([fd, *rest] for rest in _numeric_paths(fd.message_type, depth + 1))
        elif _numeric(fd):
            yield [fd]


def _set_path(message: Any, path: list[FieldDescriptor], value: object) -> None:
    for fd in path[:-1]:
        message = getattr(message, fd.name)[0] if fd.is_repeated else getattr(message, fd.name)
    leaf = path[-1]
    if leaf.is_repeated:
        getattr(message, leaf.name)[0] = value
    else:
        setattr(message, leaf.name, value)


def _config_with(path: tuple[str, ...], value: object) -> str:
    config = yaml.safe_load(yaml.safe_dump(SMALL_CONFIG))
    body = config
    for key in path[:-1]:
        body = body[key]
    body[path[-1]] = value
    return yaml.safe_dump(config)


def _config_paths() -> list[tuple[str, ...]]:
    paths: list[tuple[str, ...]] = []
    for key, body in SMALL_CONFIG.items():
        if isinstance(body, dict):
            paths += [(key, k) for k, v in body.items() if isinstance(v, int | float) and not isinstance(v, bool)]
        elif isinstance(body, int | float):
            paths.append((key,))
    return paths


def sweep_requests(method: MethodDescriptor) -> Iterator[tuple[str, bytes]]:
    """(label, request) for each numeric field of the method's request set alone to each hostile value; for StartRun
    also each number of an experiment config."""
    base = plausible_message(method.input_type)
    for path in _numeric_paths(method.input_type):
        for value in _sweep_values(path[-1]):
            request = type(base)()
            request.CopyFrom(base)
            with contextlib.suppress(ValueError, TypeError, OverflowError):  # what protobuf cannot hold
                _set_path(request, path, value)
                yield ".".join(f.name for f in path) + f"={value!r}", request.SerializeToString()
    if "experiment_yaml" in method.input_type.fields_by_name:
        for config_path in _config_paths():
            for value in [*SWEEP_FLOATS, -(2**63), 2**64]:
                request = type(base)()
                request.CopyFrom(base)
                request.experiment_yaml = _config_with(config_path, value)
                yield "experiment_yaml:" + ".".join(config_path) + f"={value!r}", request.SerializeToString()


# -- the services --------------------------------------------------------------------------------------------------


@dataclass
class Method:
    service: str  # full name, e.g. fairfl.v1.Privacy
    descriptor: MethodDescriptor
    process: str  # aggregator, privacy, clustering
    role: str  # the identity that may call it

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.descriptor.name}"

    def __str__(self) -> str:
        return f"{self.process}:{self.descriptor.name}"

    __repr__ = __str__


def _methods() -> list[Method]:
    found = []
    for module, service, process, role in [
        (federation_pb2, "Federation", "aggregator", "agent"),
        (control_pb2, "RunControl", "aggregator", "service"),
        (privacy_pb2, "Privacy", "privacy", "service"),
        (clustering_pb2, "Clustering", "clustering", "service"),
    ]:
        descriptor = module.DESCRIPTOR.services_by_name[service]
        found += [Method(descriptor.full_name, m, process, role) for m in descriptor.methods]
    health = health_pb2.DESCRIPTOR.services_by_name["Health"]
    for process in ("aggregator", "privacy", "clustering"):
        found += [Method(health.full_name, m, process, "service") for m in health.methods]
    return found


METHODS = _methods()


@dataclass
class Services:
    processes: dict[str, Child]
    channels: dict[tuple[str, str], grpc.Channel]  # (process, role) -> channel
    refused_before: dict[str, float]
    refused_calls: dict[str, int] = field(default_factory=dict)  # process -> calls answered with a refusal
    ledger_touched: bool = False  # an AuthorizeRound or RegisterBudget on LEDGER_RUN was accepted
    ledger_before: privacy_pb2.GetSpendReply | None = None

    def _repr_pretty_(self, printer: object, cycle: bool) -> None:  # hypothesis prints it with each failing example
        printer.text(f"Services({', '.join(self.processes)})")  # type: ignore[attr-defined]

    def refused(self, process: str) -> float:
        return metric(self.processes[process], "fairfl_requests_refused_total")


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    work = tmp_path_factory.mktemp("wire")
    with LocalCluster(work / "logs") as cluster:
        privacy = start_service(cluster, "privacy", "privacy_service", ["--db", str(work / "ledger.sqlite")])
        clustering = start_service(cluster, "clustering", "clustering_service")
        aggregator = start_aggregator(
            cluster, args=["--rate-limit", "0", "--privacy", privacy.address, "--clustering", clustering.address]
        )
        processes = {"aggregator": aggregator, "privacy": privacy, "clustering": clustering}
        agent = cluster.issue("wire-agent", ROLE_AGENT)
        channels = {}
        for name, child in processes.items():
            channels[(name, "service")] = cluster.open_channel(child.address)
            channels[(name, "agent")] = open_channel(child.address, agent)
        registered = federation_pb2_grpc.FederationStub(channels[("aggregator", "agent")]).Register(
            federation_pb2.RegisterRequest(agent_name="wire-agent", client_ids=[0, 1], device="cpu"), timeout=10
        )
        KNOWN_IDS["agent_id"].append(registered.agent_id)  # its polls and heartbeats reach the checks behind the lookup
        ledger = privacy_pb2_grpc.PrivacyStub(channels[("privacy", "service")])
        ledger.RegisterBudget(
            privacy_pb2.RegisterBudgetRequest(
                run_id=LEDGER_RUN,
                epsilon=3.0,
                delta=1e-5,
                accountant=privacy_pb2.ACCOUNTANT_RDP,
                principal_kind=privacy_pb2.PRINCIPAL_KIND_CLIENT,
            ),
            timeout=10,
        )
        event = privacy_pb2.PrivacyEvent(
            principal="0", mechanism=privacy_pb2.MECHANISM_GRADIENT, sample_rate=0.05, noise_multiplier=1.0, count=10
        )
        ledger.AuthorizeRound(privacy_pb2.AuthorizeRoundRequest(run_id=LEDGER_RUN, round=1, events=[event]), timeout=10)
        state = Services(processes, channels, {p: 0.0 for p in processes})
        state.refused_before = {p: state.refused(p) for p in processes}
        state.ledger_before = ledger.GetSpend(privacy_pb2.GetSpendRequest(run_id=LEDGER_RUN), timeout=10)
        yield state
        for channel in channels.values():
            channel.close()


def invoke(channel: grpc.Channel, method: Method, requests: list[bytes]) -> tuple[Code, str, bytes]:
    """Send raw request bytes: the status, details and (unary) response bytes; a server stream's first message is read,
    then the call is cancelled."""
    d = method.descriptor
    response = b""
    try:
        if not d.client_streaming and not d.server_streaming:
            response = channel.unary_unary(method.path)(requests[0], timeout=CALL_DEADLINE_S)
        elif d.client_streaming and not d.server_streaming:
            response = channel.stream_unary(method.path)(iter(requests), timeout=CALL_DEADLINE_S)
        else:
            call = (
                channel.stream_stream(method.path)(iter(requests), timeout=CALL_DEADLINE_S)
                if d.client_streaming
                else channel.unary_stream(method.path)(requests[0], timeout=CALL_DEADLINE_S)
            )
            next(call, None)  # the first answer (a watch goes on sending): enough to know the call was taken
            call.cancel()
    except grpc.RpcError as err:
        return err.code(), err.details() or "", b""
    return Code.OK, "", response


def answer_problem(services: Services, method: Method, requests: list[bytes], label: str = "") -> str:
    """Send one request; "" when it was answered properly (accepted, or refused with a status and a message), else
    what went wrong. Tracks refusals and accepted ledger writes; a run a hostile config started is stopped again."""
    started = time.monotonic()
    code, details, response = invoke(services.channels[(method.process, method.role)], method, requests)
    elapsed = time.monotonic() - started
    if code in BROKEN:
        return f"{method} {label} answered {code.name} after {elapsed:.1f}s: {details[:300]}"
    if code is Code.OK:
        services.ledger_touched |= _touches_ledger(method, requests[0])
        if method.descriptor.name == "StartRun":  # a config that is valid after all: stop the run it started
            run_id = control_pb2.RunStatus.FromString(response).run_id
            stop = services.channels[("aggregator", "service")].unary_unary("/fairfl.v1.RunControl/StopRun")
            stop(control_pb2.StopRunRequest(run_id=run_id, reason="wire test").SerializeToString(), timeout=10)
        return ""
    services.refused_calls[method.process] = services.refused_calls.get(method.process, 0) + 1
    return "" if details.strip() else f"{method} {label} refused with {code.name} and no message"


def _touches_ledger(method: Method, raw: bytes) -> bool:
    if method.service != "fairfl.v1.Privacy" or method.descriptor.name not in ("AuthorizeRound", "RegisterBudget"):
        return False
    request = message_factory.GetMessageClass(method.descriptor.input_type)()
    try:
        request.ParseFromString(raw)
    except Exception:  # random bytes: whatever the server made of them, it accepted them for some run
        return True
    return request.run_id == LEDGER_RUN


@pytest.mark.parametrize("method", METHODS, ids=str)
def test_every_number_of_every_rpc_is_checked(services: Services, method: Method) -> None:
    problems = [answer_problem(services, method, [raw], label) for label, raw in sweep_requests(method.descriptor)]
    problems = [p for p in problems if p]
    assert not problems, f"{len(problems)} hostile numbers not refused cleanly:\n" + "\n".join(problems[:20])


@pytest.mark.parametrize("method", METHODS, ids=str)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_rpc_refuses_hostile_input_cleanly(services: Services, method: Method, data: st.DataObject) -> None:
    count = data.draw(st.integers(1, 3)) if method.descriptor.client_streaming else 1
    problem = answer_problem(services, method, [request_bytes(data, method.descriptor) for _ in range(count)])
    assert not problem, problem


def _cpu_seconds(child: Child) -> float:
    with open(f"/proc/{child.process.pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_services_alive_idle_counted_and_ledger_untouched(services: Services) -> None:
    for name, child in services.processes.items():
        assert child.process.poll() is None, f"{name} died: see {child.log_path}"
    time.sleep(1.0)  # refused calls' handlers have returned; in-flight work (a started run failing) settles
    before = {name: _cpu_seconds(child) for name, child in services.processes.items()}
    time.sleep(2.0)
    for name, child in services.processes.items():
        busy = _cpu_seconds(child) - before[name]
        assert busy < 0.5, f"{name} used {busy:.2f} s of CPU in 2 s while idle: a thread spins"
    for name, calls in services.refused_calls.items():
        counted = services.refused(name) - services.refused_before[name]
        assert counted >= calls, f"{name}: {calls} calls refused but fairfl_requests_refused_total rose by {counted}"
    if not services.ledger_touched:
        ledger = privacy_pb2_grpc.PrivacyStub(services.channels[("privacy", "service")])
        after = ledger.GetSpend(privacy_pb2.GetSpendRequest(run_id=LEDGER_RUN), timeout=10)
        assert after == services.ledger_before, "a refused call changed the privacy ledger"
