"""Site admission (aggregator_service.federation.site_check): for a run whose data is at the sites, every field of
what an agent reports of its data is checked against the run's declared signature, a misfit is refused with
FAILED_PRECONDITION naming the site and the field, agents registered before the run are checked when it starts, and
the aggregator's side of such a run opens no data: the engine runs it to the end with every data loader poisoned."""

from __future__ import annotations

import logging
import threading
from typing import Any, ClassVar

import grpc
import pytest
import torch

import fairfl.data
import fairfl.data.datasets
import fairfl.data.federated
import fairfl.data.run
from aggregator_service.engine import RoundEngine
from aggregator_service.federation.servicer import FederationServicer
from aggregator_service.federation.site_check import (
    ClientCounts,
    SiteRefused,
    SiteReport,
    SiteRun,
    check_site,
    site_label,
    site_run_of,
)
from aggregator_service.federation.state import FederationState
from aggregator_service.federation.transport import GrpcTransport
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalSelector
from fairfl.config import ExperimentConfig, experiment_from_dict
from fairfl.data import DataProvider, DataRequest, DataSignature, FederatedData
from fairfl.protocol import EVALUATE, TRAIN, UPDATE, ClientResult, encode_result
from fairfl.rpc_refusals import REFUSAL_KEY
from fairfl.v1 import control_pb2, federation_pb2

HERE = __name__
IMAGES = DataSignature((1, 28, 28), 10)
TABLE = DataSignature((3,), 3, ("age", "bmi", "bp"))


class DataOpened(AssertionError):
    """The aggregator's side touched data it must never open."""


class SiteImages(DataProvider):
    """A run's data at the sites: only the signature is known here; asking for the clients' data is a failure."""

    at_sites: ClassVar[bool] = True

    def signature(self, params: Any) -> DataSignature:
        return DataSignature((1, 4, 4), 3)

    def clients(self, params: Any, request: DataRequest) -> FederatedData:
        raise DataOpened("the data of a run at the sites was asked for on the aggregator's side")


class CentralImages(SiteImages):
    at_sites: ClassVar[bool] = False


def _config(dataset: str = f"{HERE}:SiteImages") -> ExperimentConfig:
    return experiment_from_dict(
        {
            "name": "sites",
            "rounds": 2,
            "data": {"dataset": dataset, "num_clients": 4},
            "model": {"name": "mlp", "params": {"hidden": [8]}},
            "training": {"local_steps": 1, "batch_size": 4, "lr": 0.1},
            "selection": {"method": "random", "clients_per_round": 2},
            "evaluation": {"every": 1},
            "runtime": {"agents": 1, "register_timeout_s": 20, "round_timeout_s": 20},
        }
    )


def _started_run(run_id: str, dataset: str = f"{HERE}:SiteImages") -> tuple[FederationState, GrpcTransport]:
    """A fresh federation state whose gRPC transport has started run `run_id` of _config(dataset)."""
    state = FederationState()
    transport = GrpcTransport(state)
    config = _config(dataset)
    layout = RoundEngine(run_id, config, transport, LocalSelector("random"), LocalPrivacy(), lambda e: None).layout
    transport.start_run(run_id, config, layout)
    return state, transport


def _report(
    shape: tuple[int, ...] = (1, 28, 28),
    classes: int = 10,
    names: tuple[str, ...] = (),
    clients: dict[int, tuple[int, int]] | None = None,
) -> SiteReport:
    counts = {0: (50, 10), 1: (40, 8)} if clients is None else clients
    return SiteReport(shape, classes, names, {c: ClientCounts(*n) for c, n in counts.items()})


def _refusal(signature: DataSignature, report: SiteReport, clients: tuple[int, ...] = (0, 1)) -> SiteRefused:
    with pytest.raises(SiteRefused) as refused:
        check_site(SiteRun("r1", "site", signature), "'hospital-b'", report, list(clients))
    return refused.value


# --- the check, field by field ----------------------------------------------------------------------------------------


def test_a_fitting_site_is_admitted_even_with_fewer_classes() -> None:
    check_site(SiteRun("r1", "site", IMAGES), "'a'", _report(), [0, 1])
    check_site(SiteRun("r1", "site", IMAGES), "'a'", _report(classes=4), [0, 1])  # non-IID: a subset of the labels
    check_site(SiteRun("r1", "site", IMAGES), "'a'", _report(classes=1), [0, 1])  # one label only
    check_site(SiteRun("r1", "site", TABLE), "'a'", _report((3,), 3, ("age", "bmi", "bp")), [0, 1])
    check_site(SiteRun("r1", "site", TABLE), "'a'", _report((3,), 2), [0, 1])  # names: compared when both give them
    unnamed = DataSignature((3,), 3)
    check_site(SiteRun("r1", "site", unnamed), "'a'", _report((3,), 3, ("x", "y", "z")), [0, 1])


def test_input_shape_mismatch_names_the_site_field_and_both_shapes() -> None:
    refused = _refusal(IMAGES, _report(shape=(64,)))
    assert refused.reason == "data_signature"
    assert str(refused) == (
        "site 'hospital-b' refused for run r1: data_signature.input_shape is [64], the run expects [1, 28, 28] "
        "(784 features)"
    )


def test_same_feature_count_in_another_shape_says_how_to_reshape() -> None:
    refused = _refusal(IMAGES, _report(shape=(784,)))
    assert str(refused) == (
        "site 'hospital-b' refused for run r1: data_signature.input_shape is [784], the run expects [1, 28, 28] "
        "(784 features); the same 784 features in another shape: give the agent's --data `shape=1x28x28`"
    )


def test_missing_signature_says_to_start_the_agent_with_data() -> None:
    refused = _refusal(IMAGES, SiteReport())
    assert refused.reason == "no_data_signature"
    assert str(refused) == (
        "site 'hospital-b' refused for run r1: the agent reports no data_signature, and the run's data "
        "(data.dataset 'site') is at the sites; start the agent with `--data SPEC` (env FAIRFL_DATA) naming this "
        "site's data"
    )


def test_feature_names_are_compared_when_both_sides_give_them() -> None:
    wrong = _refusal(TABLE, _report((3,), 3, ("age", "weight", "bp")))
    assert str(wrong) == (
        "site 'hospital-b' refused for run r1: data_signature.feature_names[1] is 'weight', the run expects 'bmi'"
    )
    swapped = _refusal(TABLE, _report((3,), 3, ("bmi", "age", "bp")))
    assert str(swapped).endswith(
        "data_signature.feature_names[0] is 'bmi', the run expects 'age'; the same names in another order: order "
        "the site's columns as the run's"
    )
    counted = _refusal(TABLE, _report((3,), 3, ("age", "bmi")))
    assert str(counted).endswith("data_signature.feature_names has 2 names for 3 features")
    assert counted.reason == "data_signature"


def test_more_classes_than_the_run_or_none_are_refused() -> None:
    more = _refusal(IMAGES, _report(classes=12))
    assert str(more) == (
        "site 'hospital-b' refused for run r1: data_signature.num_classes is 12, the run expects at most 10 "
        "(labels 0..9)"
    )
    none = _refusal(IMAGES, _report(classes=0))
    assert str(none).endswith("data_signature.num_classes is 0: the site reports no classes; the run has 10")


@pytest.mark.parametrize(
    ("clients", "registered", "says"),
    [
        ({0: (5, 1), 1: (5, 1), 7: (5, 1)}, (0, 1), "client_data names client 7, which the agent does not register "
         "(client_ids 0-1); report sample counts of registered clients only"),
        ({0: (5, 1)}, (0, 1, 2), "client_data has no entry for client 1 (and 1 more): every registered client "
         "reports its sample counts"),
        ({0: (5, 1), 1: (0, 3)}, (0, 1), "client_data: client 1 has num_train 0: a client without training samples "
         "cannot train; give it data or leave it out of the agent's --clients"),
    ],
)  # fmt: skip
def test_client_data_must_cover_exactly_the_registered_clients_with_training_samples(
    clients: dict[int, tuple[int, int]], registered: tuple[int, ...], says: str
) -> None:
    refused = _refusal(IMAGES, _report(clients=clients), registered)
    assert refused.reason == "client_data"
    assert str(refused) == f"site 'hospital-b' refused for run r1: {says}"


def test_a_client_listed_twice_is_refused() -> None:
    request = federation_pb2.RegisterRequest(
        agent_name="a",
        client_ids=[0, 1],
        data_signature=federation_pb2.DataSignature(input_shape=[1, 28, 28], num_classes=10),
        client_data=[
            federation_pb2.ClientData(client_id=0, num_train=5, num_test=1),
            federation_pb2.ClientData(client_id=1, num_train=5, num_test=1),
            federation_pb2.ClientData(client_id=0, num_train=9, num_test=1),
        ],
    )
    report = SiteReport.of(request)
    assert report.clients[0] == ClientCounts(5, 1) and report.repeated == (0,)
    assert str(_refusal(IMAGES, report)).endswith("client_data lists client 0 more than once")


def test_report_from_a_request_and_site_labels() -> None:
    request = federation_pb2.RegisterRequest(
        agent_name="hospital-b",
        client_ids=[3, 4],
        data_signature=federation_pb2.DataSignature(input_shape=[3], num_classes=3, feature_names=["a", "b", "c"]),
        client_data=[federation_pb2.ClientData(client_id=3, num_train=7, num_test=2)],
    )
    report = SiteReport.of(request)
    assert report.given and report.input_shape == (3,) and report.feature_names == ("a", "b", "c")
    assert report.train_samples == 7
    assert report.describe() == "input_shape [3], num_classes 3, 3 feature names"
    assert not SiteReport.of(federation_pb2.RegisterRequest(agent_name="x", client_ids=[0])).given
    assert site_label("hospital-b") == "'hospital-b'"
    assert site_label("hospital-b", "site-b") == "'hospital-b' (certificate 'site-b')"
    assert site_label("", None) == "(unnamed agent)"


def test_only_a_plug_in_declaring_at_sites_makes_a_site_run() -> None:
    run = site_run_of("r1", _config())
    assert run == SiteRun("r1", f"{HERE}:SiteImages", DataSignature((1, 4, 4), 3))
    assert site_run_of("r1", _config(f"{HERE}:CentralImages")) is None
    assert site_run_of("r1", _config("synthetic")) is None


# --- registration through the servicer, and the run's start -------------------------------------------------------


class _Aborted(Exception):
    pass


class _Context:
    """A plaintext server's servicer context whose abort raises like grpc's."""

    trailing: tuple[tuple[str, str], ...] = ()

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


def _register(
    servicer: FederationServicer,
    name: str,
    clients: list[int],
    shape: tuple[int, ...] = (1, 4, 4),
    classes: int = 3,
    signature: bool = True,
) -> tuple[str, _Context]:
    request = federation_pb2.RegisterRequest(agent_name=name, client_ids=clients, device="cpu")
    if signature:
        request.data_signature.CopyFrom(federation_pb2.DataSignature(input_shape=shape, num_classes=classes))
        request.client_data.extend(federation_pb2.ClientData(client_id=c, num_train=20, num_test=5) for c in clients)
    context = _Context()
    return servicer.Register(request, context).agent_id, context  # type: ignore[arg-type]


def test_register_refuses_a_misfit_with_failed_precondition_during_a_site_run(caplog: pytest.LogCaptureFixture) -> None:
    state, transport = _started_run("r1")
    servicer = FederationServicer(state)
    with caplog.at_level(logging.INFO, logger="aggregator_service.federation.servicer"):
        _register(servicer, "hospital-a", [0, 1])
    assert "site 'hospital-a': 2 clients, 40 train samples, signature input_shape [1, 4, 4], num_classes 3" in (
        caplog.text
    )
    with pytest.raises(_Aborted) as refused:
        _register(servicer, "hospital-b", [2, 3], shape=(16,))
    code, details = refused.value.args
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details == (
        "site 'hospital-b' refused for run r1: data_signature.input_shape is [16], the run expects [1, 4, 4] "
        "(16 features); the same 16 features in another shape: give the agent's --data `shape=1x4x4`"
    )
    context = _Context()
    with pytest.raises(_Aborted) as unsigned:
        servicer.Register(
            federation_pb2.RegisterRequest(agent_name="plain", client_ids=[2, 3]),
            context,  # type: ignore[arg-type]
        )
    assert "start the agent with `--data SPEC`" in unsigned.value.args[1]
    assert context.trailing == ((REFUSAL_KEY, "no_data_signature"),)  # counted under a bounded reason
    assert state.live_clients() == [0, 1]  # the refused sites host nothing
    with state.lock:
        agent = next(iter(state.agents.values()))
    assert agent.site.clients[1] == ClientCounts(20, 5)  # per-client sample counts kept on the record
    transport.end_run("r1")
    _register(servicer, "plain", [2, 3], signature=False)  # no site run any more: no check
    assert state.live_clients() == [0, 1, 2, 3]


def test_agents_registered_before_a_site_run_are_checked_when_it_starts(caplog: pytest.LogCaptureFixture) -> None:
    state = FederationState()
    servicer = FederationServicer(state)
    transport = GrpcTransport(state)
    good, _ = _register(servicer, "good", [0, 1])
    bad, _ = _register(servicer, "bad", [2], classes=5)
    plain, _ = _register(servicer, "plain", [3], signature=False)
    config = _config()
    layout = RoundEngine("r1", config, transport, LocalSelector("random"), LocalPrivacy(), lambda e: None).layout
    with caplog.at_level(logging.INFO, logger="aggregator_service.federation.transport"):
        transport.start_run("r1", config, layout)
    assert state.live_clients() == [0, 1]
    assert state.touch(good) is not None and state.touch(bad) is None and state.touch(plain) is None
    assert "site 'bad' refused for run r1: data_signature.num_classes is 5, the run expects at most 3" in caplog.text
    assert "its registration is dropped" in caplog.text
    assert "1 sites with 2 clients and 40 train samples registered so far" in caplog.text
    with pytest.raises(_Aborted):  # the dropped agent registers again: refused now
        _register(servicer, "bad", [2], classes=5)


def test_a_refused_reregistration_drops_the_agents_earlier_registration() -> None:
    state, _transport = _started_run("r1")  # kept: the run stays started
    servicer = FederationServicer(state)
    first, _ = _register(servicer, "site", [0, 1])
    with pytest.raises(_Aborted):  # the same agent came back with other data
        _register(servicer, "site", [0, 1], shape=(1, 5, 5))
    assert state.touch(first) is None and state.live_clients() == []


def test_a_site_run_that_is_not_the_checked_one_ending_keeps_the_check() -> None:
    state, transport = _started_run("r2")
    transport.end_run("r1")  # an earlier run's engine finishing late
    assert state.site_run is not None and state.site_run.run_id == "r2"
    transport.end_run("r2")
    assert state.site_run is None


def test_a_site_run_goes_on_without_the_clients_of_a_refused_site(caplog: pytest.LogCaptureFixture) -> None:
    state, transport = _started_run("r1")
    servicer = FederationServicer(state)
    _register(servicer, "good", [0, 1])
    with pytest.raises(_Aborted):
        _register(servicer, "bad", [2, 3], shape=(2, 2))
    with caplog.at_level(logging.WARNING, logger="aggregator_service.federation.transport"):
        transport.wait_for_clients(4, 1.0, threading.Event())  # returns at the timeout: it does not fail
    assert (
        "run r1: 2 of 4 clients registered within 1s; going on without clients 2-3; refused sites: 'bad' "
        "(data_signature)"
    ) in caplog.text


def test_a_run_without_site_data_still_needs_all_its_clients() -> None:
    state, transport = _started_run("r1", dataset="synthetic")
    servicer = FederationServicer(state)
    _register(servicer, "plain", [0, 1], signature=False)
    with pytest.raises(TimeoutError, match=r"^only 2 of 4 clients registered within 0s; start more client agents"):
        transport.wait_for_clients(4, 0.3, threading.Event())


# --- the aggregator's side of a site run opens no data ---------------------------------------------------------------


def _site_agent(state: FederationState, layout: Any, agent_id: str, stop: threading.Event) -> None:
    """An agent answering every task with a zero update (TRAIN) or a fixed accuracy (EVALUATE), as its site's data
    would let it; it reads no data, and neither may anything else in this process."""
    while not stop.is_set():
        for task in state.poll(agent_id, 16, 0.05):
            result = ClientResult(
                task_id=task.task_id,
                run_id=task.run_id,
                round=task.round,
                client_id=task.client_id,
                phase=task.phase,
                num_samples=20,
                loss_before=1.0,
                loss_after=0.5,
                metrics={"train_loss": 0.5} if task.phase == TRAIN else {},
                agent_id=agent_id,
            )
            if task.phase == TRAIN:
                result.payloads[UPDATE] = torch.zeros(layout.numel)
            elif task.phase == EVALUATE:
                result.test_accuracy, result.test_loss = 50.0 + task.client_id, 0.7
            header, *data = list(encode_result(result, layout))
            state.accept(header.header, (c.data for c in data))


def test_a_site_run_completes_on_the_aggregator_side_without_opening_any_data(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def poisoned(*args: object, **kwargs: object) -> None:
        raise DataOpened("a data loader was called on the aggregator's side of a site run")

    for module, name in [
        (fairfl.data, "load_run_data"),
        (fairfl.data.run, "load_run_data"),
        (fairfl.data.run, "build_federated"),
        (fairfl.data.federated, "build_federated"),
        (fairfl.data, "load_dataset"),
        (fairfl.data.datasets, "load_dataset"),
    ]:
        monkeypatch.setattr(module, name, poisoned)
    state = FederationState()
    servicer = FederationServicer(state)
    events: list[control_pb2.RunEvent] = []
    engine = RoundEngine("r1", _config(), GrpcTransport(state), LocalSelector("random"), LocalPrivacy(), events.append)
    stop = threading.Event()
    agents = []
    for name, clients in (("site-a", [0, 1]), ("site-b", [2, 3])):
        agent_id, _ = _register(servicer, name, clients)
        agents.append(threading.Thread(target=_site_agent, args=(state, engine.layout, agent_id, stop), daemon=True))
    for thread in agents:
        thread.start()
    try:
        with caplog.at_level(logging.INFO, logger="aggregator_service.engine"):
            summary = engine.run()
    finally:
        stop.set()
        for thread in agents:
            thread.join(5)
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    rounds = [e.round for e in events if e.HasField("round")]
    assert [r.round for r in rounds] == [1, 2] and all(r.fairness.evaluated_clients == 4 for r in rounds)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run r1 round ")]
    assert len(lines) == 2
    assert lines[0].startswith("run r1 round 1/2: 2 selected, 2 accepted, 0 rejected, 0 late; ")
    assert "; accuracy mean 51.50% worst-5% 50.00% over 4 clients; train loss 0.5000; " in lines[0]
    assert lines[1].startswith("run r1 round 2/2: ") and "ε" not in lines[1]  # ε only for DP runs
