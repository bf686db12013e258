"""A user's sampler named by module:attr (defined here, outside the package): it selects through the in-process path
and inside the clustering servicer (resolved there through the registry), identically; and every way such a plug-in
can be wrong fails at config load, naming the config field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest

from aggregator_service.engine import RoundEngine
from aggregator_service.selection import SelectionContext, select_request
from clustering_service.servicer import ClusteringServicer
from fairfl import codec
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalSelector
from fairfl.config import ConfigError, ExperimentConfig, experiment_from_dict
from fairfl.sampling import SAMPLERS, InvalidInput, RunState, Sampler, SelectionInput, SelectionOutput
from fairfl.schema import ConfigError as SchemaConfigError
from fairfl.v1 import clustering_pb2, control_pb2

HERE = __name__  # the module a user's config names (as pytest imported this file)


@dataclass(frozen=True)
class BiasNormParams:
    largest: bool = True  # the clients whose last bias update is largest (else smallest)
    min_norm: float = 0.0

    def validate(self, path: str) -> None:
        if self.min_norm < 0:
            raise SchemaConfigError(f"{path}.min_norm: must be >= 0, got {self.min_norm}")


class BiasNormSampler(Sampler):
    """Picks the K candidates with the largest (or smallest) norm of their last reported bias update; clients that
    never reported count as 0. Reads the stored signatures through RunState, as HiCS-FL does."""

    Params = BiasNormParams
    client_signatures = frozenset({"bias_update"})

    @classmethod
    def validate_run(cls, params: BiasNormParams, cfg: ExperimentConfig) -> None:
        if not params.largest and cfg.selection.clients_per_round == cfg.data.num_clients:
            raise SchemaConfigError("selection.params.largest: with every client selected the order is meaningless")

    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        bias, _, _ = state.gather("bias_update", request.candidates)
        norms = np.linalg.norm(bias, axis=1)
        norms = np.where(norms >= request.params.min_norm, norms, 0.0)
        key = -norms if request.params.largest else norms
        order = np.lexsort((request.candidates, key))[: request.num_to_select]  # ties: lower id
        return SelectionOutput(selected=tuple(request.candidates[order].tolist()))


class ActivationSampler(BiasNormSampler):
    """Declares a need the round engine cannot meet for samplers (activation signatures)."""

    client_signatures = frozenset({"activation"})


class NotASampler:
    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        return SelectionOutput(selected=())


def _config(method: str, params: dict[str, Any] | None = None, **over: Any) -> ExperimentConfig:
    cfg: dict[str, Any] = {
        "name": "user-sampler",
        "seed": 3,
        "rounds": 3,
        "data": {"dataset": "synthetic", "num_clients": 8},
        "model": {"name": "mlp", "params": {"hidden": [8]}},
        "training": {"local_steps": 2, "batch_size": 16, "lr": 0.05},
        "selection": {"method": method, "clients_per_round": 3, "params": params or {}},
        "evaluation": {"every": 100},
        "runtime": {"agents": 1},
        **over,
    }
    return experiment_from_dict(cfg)


def _signatures(n: int) -> list[clustering_pb2.ClientSignature]:
    rng = np.random.default_rng(0)
    return [
        clustering_pb2.ClientSignature(
            client_id=c,
            round=1,
            num_samples=10 + c,
            bias_update=codec.tensor_to_proto("bias_update", rng.standard_normal(4) * (c + 1)),
        )
        for c in range(n)
    ]


def test_a_user_sampler_selects_in_process_and_in_the_clustering_servicer_identically() -> None:
    ref = f"{HERE}:BiasNormSampler"
    config = _config(ref, {"largest": False, "min_norm": 0.5})
    params = config.selection.sampler_params()
    assert config.selection.sampler_class() is BiasNormSampler and params == BiasNormParams(False, 0.5)
    context = SelectionContext("run", 2, [7, 1, 5, 3, 0, 6], 3, seed=1, params=params)

    local = LocalSelector(ref)
    local.report_signatures("run", _signatures(8))
    in_process = local.select(context)

    servicer = ClusteringServicer()
    servicer.ReportSignatures(clustering_pb2.ReportSignaturesRequest(run_id="run", signatures=_signatures(8)), None)
    request = select_request(ref, context)
    assert request.sampler == ref and dict(request.sampler_params) == {"largest": False, "min_norm": 0.5}
    reply = servicer.Select(request, None)

    assert tuple(reply.selected) == in_process.selected and len(in_process.selected) == 3
    norms = {c: np.linalg.norm(s.bias_update) for c, s in local.store.run("run").signatures().items()}
    eligible = {c: (v if v >= 0.5 else 0.0) for c, v in norms.items() if c in context.candidates}
    assert list(in_process.selected) == sorted(sorted(eligible, key=lambda c: (eligible[c], c))[:3])


def test_a_user_sampler_runs_a_round_engine_and_gets_its_declared_signatures() -> None:
    config = _config(f"{HERE}:BiasNormSampler")
    selector = LocalSelector(config.selection.method)
    events: list[control_pb2.RunEvent] = []
    engine = RoundEngine("run", config, InProcessTransport(), selector, LocalPrivacy(), events.append)
    assert engine.selection.wants_bias_update  # from client_signatures, not from the sampler's name
    assert engine.run().state == control_pb2.RUN_STATE_COMPLETED
    rounds = [e.round for e in events if e.HasField("round")]
    assert len(rounds) == 3 and all(len(r.selected) == 3 for r in rounds)
    assert len(selector.store.run("run")) >= 3  # trained clients' bias updates reached the sampler's RunState


def test_a_user_sampler_can_be_registered_by_name_in_this_process() -> None:
    SAMPLERS.register("bias_norm_test", BiasNormSampler)
    try:
        assert _config("bias_norm_test").selection.sampler_class() is BiasNormSampler
        assert "bias_norm_test" in SAMPLERS.names()
    finally:
        SAMPLERS.unregister("bias_norm_test")


@pytest.mark.parametrize(
    ("method", "params", "over", "match"),
    [
        # not importable
        ("no_such_package.samplers:Mine", {}, {}, "selection.method: cannot import module 'no_such_package.samplers'"),
        (f"{HERE}:Missing", {}, {}, f"selection.method: module '{HERE}' has no attribute 'Missing'"),
        ("no_such_sampler", {}, {}, "selection.method: unknown sampler 'no_such_sampler'"),
        # wrong type
        (f"{HERE}:NotASampler", {}, {}, "selection.method: .* is not a sampler: expected a subclass"),
        ("fairfl.sampling:Sampler", {}, {}, "selection.method: .* is not a sampler: Sampler does not implement select"),
        # bad parameter
        (f"{HERE}:BiasNormSampler", {"largest": "yes"}, {}, "selection.params.largest: expected true or false"),
        (f"{HERE}:BiasNormSampler", {"min_norm": -1}, {}, "selection.params.min_norm: must be >= 0"),
        (f"{HERE}:BiasNormSampler", {"temperature": 1}, {}, "selection.params: unknown parameter 'temperature'"),
        # a cross-section rule the sampler declares
        (
            f"{HERE}:BiasNormSampler",
            {"largest": False},
            {"data": {"dataset": "synthetic", "num_clients": 3}},
            "selection.params.largest: with every client selected",
        ),
        # declared needs the run cannot meet
        (f"{HERE}:ActivationSampler", {}, {}, r"selection.method: .* needs client signatures \['activation'\]"),
        (
            f"{HERE}:BiasNormSampler",
            {},
            {"privacy": {"enabled": True, "sample_rate": 0.1}},
            "selection.method: .* is not a uniform sampler",
        ),
    ],
)
def test_each_way_a_sampler_plug_in_is_wrong_names_the_config_field(
    method: str, params: dict[str, Any], over: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        _config(method, params, **over)


def test_the_servicer_refuses_a_user_sampler_it_cannot_use_naming_the_field() -> None:
    class Context:
        def set_trailing_metadata(self, metadata: Any) -> None:
            pass

        def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise InvalidInput(f"{code.name}: {details}")

    base = {"run_id": "r", "num_to_select": 1, "candidates": [1, 2]}
    with pytest.raises(InvalidInput, match=r"INVALID_ARGUMENT: .*sampler: .*is not a sampler"):
        ClusteringServicer().Select(clustering_pb2.SelectRequest(sampler=f"{HERE}:NotASampler", **base), Context())
    request = clustering_pb2.SelectRequest(sampler=f"{HERE}:BiasNormSampler", **base)
    request.sampler_params.update({"min_norm": -2})
    with pytest.raises(InvalidInput, match=r"INVALID_ARGUMENT: .*sampler_params\.min_norm: must be >= 0"):
        ClusteringServicer().Select(request, Context())
