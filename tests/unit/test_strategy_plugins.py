"""User strategies as plug-ins (issue #19): a strategy defined here, outside the package, named by `module:attr`, runs a
round in-process with its own client-side procedure; every way a strategy plug-in can be wrong (not importable, wrong
type, missing capability, bad parameter) fails when the config is loaded, naming the config field."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from aggregator_service.engine import RoundEngine
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalSelector
from fairfl.config import ConfigError, ExperimentConfig, experiment_from_dict
from fairfl.plugins import reference_of
from fairfl.procedure import LocalProcedure, LocalState
from fairfl.protocol import TRAIN, UPDATE, ClientResult
from fairfl.schema import ConfigError as SchemaConfigError
from fairfl.strategy import (
    STRATEGIES,
    AggregateOutcome,
    PhasePlan,
    RoundContext,
    Strategy,
    build_strategy,
    load_strategy,
    train_results,
)
from fairfl.v1 import control_pb2, federation_pb2

# --- a user's plug-ins -----------------------------------------------------------------------------------------------


@dataclass
class ScaleParams:
    factor: float = 1.0

    def validate(self, path: str) -> None:
        if not self.factor > 0:
            raise SchemaConfigError(f"{path}.factor: must be > 0, got {self.factor}")


class UpdateNorm(LocalProcedure):
    """Client side: reports the norm of the client's update, times a factor the strategy sends each round."""

    Params = ScaleParams

    def finish(self, state: LocalState, result: ClientResult) -> None:
        assert state.update is not None
        result.metrics["update_norm"] = float(torch.linalg.vector_norm(state.update)) * self.params.factor


@dataclass
class TrimmedMeanParams:
    trim: int = 1  # updates dropped at each end of every coordinate
    norm_factor: float = 2.0

    def validate(self, path: str) -> None:
        if self.trim < 0:
            raise SchemaConfigError(f"{path}.trim: must be >= 0, got {self.trim}")


class TrimmedMean(Strategy):
    """Coordinate-wise trimmed mean of the updates, with a client procedure the base `configure` attaches."""

    name = "trimmed_mean"
    Params = TrimmedMeanParams
    reads_client_losses = False
    client_procedure = UpdateNorm

    def procedure_params(self, ctx: RoundContext) -> Any:
        return ScaleParams(factor=self.params.norm_factor)

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        results = train_results(phases)
        stacked = torch.stack([r.payloads[UPDATE] for r in results])
        trim = min(self.params.trim, (len(results) - 1) // 2)
        kept = stacked.sort(dim=0).values[trim : len(results) - trim]
        norms = [r.metrics["update_norm"] for r in results]
        return AggregateOutcome(
            params=ctx.params + self.server_lr * kept.mean(dim=0),
            weights={r.client_id: 1.0 / len(results) for r in results},
            metrics={"trimmed": float(trim), "mean_update_norm": sum(norms) / len(norms)},
        )


class NoDp(TrimmedMean):
    client_procedure = None  # privacy_principals stays empty: no DP procedure


class OwnPsi(TrimmedMean):
    """Reports a metric named psi itself: it wins over the engine's Ψ telemetry of the same name."""

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        outcome = super().aggregate(ctx, phases)
        outcome.metrics["psi"] = -1.0
        return outcome


class NeedsFullSelection(NoDp):
    required_selection = "full"


class Unfinished(Strategy):  # aggregate left abstract
    pass


class NotAStrategy:
    Params = TrimmedMeanParams


class BadProcedure(NoDp):
    client_procedure = NotAStrategy  # type: ignore[assignment]  # not a LocalProcedure


class UnknownProcedure(NoDp):
    client_procedure = "no_such_procedure_xyz"


class TwoPhases(NoDp):
    """Plans a second exchange but declares max_phases = 1 (the default)."""

    def configure(self, ctx: RoundContext, phase_index: int, prior: Sequence[list[ClientResult]]) -> PhasePlan | None:
        if phase_index < 2:
            return PhasePlan(phase=TRAIN, train=ctx.train_config)
        return None


def ref(obj: Any) -> str:
    return reference_of(obj)


def config(strategy: dict[str, Any], **sections: Any) -> ExperimentConfig:
    raw: dict[str, Any] = {
        "name": "plugins",
        "seed": 5,
        "rounds": 2,
        "data": {"dataset": "synthetic", "num_clients": 5},
        "model": {"name": "logreg"},
        "training": {"local_steps": 2, "batch_size": 8, "lr": 0.1},
        "selection": {"clients_per_round": 3},
        "strategy": strategy,
        "evaluation": {"every": 2},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return experiment_from_dict(raw)


def error(strategy: dict[str, Any], **sections: Any) -> str:
    with pytest.raises(ConfigError) as err:
        config(strategy, **sections)
    return str(err.value)


def run(cfg: ExperimentConfig) -> tuple[control_pb2.RunStatus | Any, list[control_pb2.RoundEvent]]:
    events: list[control_pb2.RunEvent] = []
    engine = RoundEngine(
        "plugin", cfg, InProcessTransport(), LocalSelector(cfg.selection.method), LocalPrivacy(), events.append
    )
    return engine.run(), [e.round for e in events if e.HasField("round")]


# --- a user strategy runs ------------------------------------------------------------------------------------------


def test_user_strategy_by_module_attr_runs_rounds_with_its_client_procedure() -> None:
    cfg = config({"name": ref(TrimmedMean), "params": {"trim": 1, "norm_factor": 2.0}})
    summary, rounds = run(cfg)
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    assert len(rounds) == 2 and bool(torch.isfinite(summary.final_params).all())
    for event in rounds:
        metrics = {m.name: m.value for m in event.strategy_metrics}
        assert metrics["trimmed"] == 1.0
        # The procedure ran on every client: the strategy read what its finish() added to each result.
        assert metrics["mean_update_norm"] > 0 and math.isfinite(metrics["mean_update_norm"])


def test_the_engine_reports_psi_for_a_user_strategy_when_the_losses_are_measured() -> None:
    """Ψ telemetry is the engine's: a user strategy gets it without code, once training.loss_telemetry measures F_i
    (TrimmedMean reads none, so its clients skip the loss passes otherwise)."""
    _, plain = run(config({"name": ref(TrimmedMean)}))
    assert all(not {"psi", "psi_before", "psi_noisy"} & {m.name for m in e.strategy_metrics} for e in plain)
    summary, measured = run(config({"name": ref(TrimmedMean)}, training={"loss_telemetry": True}))
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    for event in measured:
        metrics = {m.name: m.value for m in event.strategy_metrics}
        assert metrics["psi"] > 0 and metrics["psi_before"] > 0 and metrics["trimmed"] == 1.0
    _, own = run(config({"name": ref(OwnPsi)}, training={"loss_telemetry": True}))
    for event in own:
        names = [m.name for m in event.strategy_metrics]
        assert names.count("psi") == 1 and "psi_before" in names
        assert {m.name: m.value for m in event.strategy_metrics}["psi"] == -1.0


def test_the_base_configure_attaches_the_client_procedure_with_its_params() -> None:
    strategy = build_strategy(ref(TrimmedMean), {"norm_factor": 3.0}, 1.0)
    train = federation_pb2.LocalTrainingConfig(lr=0.1)
    ctx = RoundContext("r", 1, torch.zeros(2), [0], train, lambda t: None)  # type: ignore[arg-type,return-value]
    plan = strategy.configure(ctx, 0, [])
    assert plan is not None and plan.train is not None
    (spec,) = plan.train.procedures
    assert spec.ref == ref(UpdateNorm) and dict(spec.params)["factor"] == 3.0
    assert not train.procedures  # the run's config is copied, never changed


def test_registered_name_resolves_like_a_built_in() -> None:
    STRATEGIES.register("trimmed_mean_test", TrimmedMean)
    try:
        assert config({"name": "trimmed_mean_test"}).strategy.name == "trimmed_mean_test"
        assert "trimmed_mean_test" in error({"name": "no_such_strategy"})  # listed among the available ones
    finally:
        STRATEGIES.unregister("trimmed_mean_test")


def test_every_built_in_is_an_entry_point_with_sound_capabilities() -> None:
    names = STRATEGIES.names()
    for name in ("fedavg", "fedprox", "fedfair", "qffl", "fedeba", "fedeba_plus", "cluster2", "equitable", "fairfed"):
        assert name in names
        assert load_strategy(name).name == name
    assert load_strategy("fedavg").privacy_principals == {"client", "federation"}
    assert load_strategy("fedeba_plus").privacy_principals == frozenset()
    assert load_strategy("cluster2").required_selection == "clustered_sampling"


def test_more_phases_than_declared_fail_the_run_naming_the_strategy() -> None:
    summary, _ = run(config({"name": ref(TwoPhases)}))
    assert summary.state == control_pb2.RUN_STATE_FAILED
    assert "max_phases = 1" in summary.message


# --- every way a strategy plug-in can be wrong fails at config load, naming the field ------------------------------


def test_not_importable_module_names_the_field() -> None:
    message = error({"name": "no_such_package_xyz.strategies:Mine"})
    assert message.startswith("strategy.name:") and "cannot import module 'no_such_package_xyz.strategies'" in message


def test_missing_attribute_names_the_field() -> None:
    message = error({"name": f"{__name__}:NoSuchStrategy"})
    assert message.startswith("strategy.name:") and "has no attribute 'NoSuchStrategy'" in message


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        (NotAStrategy, "expected a subclass of fairfl.strategy.Strategy"),
        (ref, "expected a subclass of fairfl.strategy.Strategy"),  # a function
        (Unfinished, "is abstract (implement aggregate)"),
        (BadProcedure, "client_procedure"),
    ],
    ids=["class", "function", "abstract", "procedure"],
)
def test_wrong_type_names_the_field(target: Any, reason: str) -> None:
    message = error({"name": ref(target)})
    assert message.startswith("strategy.name:") and "is not a strategy" in message and reason in message


@pytest.mark.parametrize(
    ("params", "field", "reason"),
    [
        ({"trim": "two"}, "strategy.params.trim", "expected an integer"),
        ({"trim": -1}, "strategy.params.trim", "must be >= 0"),
        ({"trimm": 1}, "strategy.params", "unknown parameter 'trimm'; valid parameters: trim, norm_factor"),
    ],
)
def test_bad_params_name_the_field(params: dict[str, Any], field: str, reason: str) -> None:
    message = error({"name": ref(TrimmedMean), "params": params})
    assert message.startswith(f"{field}:") and reason in message


def test_an_unknown_client_procedure_is_refused() -> None:
    message = error({"name": ref(UnknownProcedure)})
    assert message.startswith("strategy.name:") and "unknown local procedure 'no_such_procedure_xyz'" in message


def test_no_dp_procedure_is_refused_under_privacy() -> None:
    message = error({"name": ref(NoDp)}, privacy={"enabled": True})
    assert message.startswith("strategy.name:") and "has no DP procedure" in message
    assert "fedavg" in message  # the installed strategies that have one are listed


def test_a_client_procedure_is_refused_under_record_level_dp() -> None:
    class_with_dp = type("ProcedureWithDp", (TrimmedMean,), {"privacy_principals": frozenset({"client"})})
    STRATEGIES.register("procedure_with_dp_test", class_with_dp)
    try:
        message = error({"name": "procedure_with_dp_test"}, privacy={"enabled": True})
    finally:
        STRATEGIES.unregister("procedure_with_dp_test")
    assert message.startswith("strategy.name:") and "DP-SGD tasks refuse" in message


def test_required_selection_is_checked() -> None:
    message = error({"name": ref(NeedsFullSelection)})
    assert message.startswith("selection.method:") and "needs full" in message and "'random'" in message
    assert config({"name": ref(NeedsFullSelection)}, selection={"method": "full"}).strategy.name


def test_loss_release_capability_under_dp() -> None:
    message = error({"name": "qffl"}, privacy={"enabled": True, "loss_noise_multiplier": 0.0})
    assert message.startswith("privacy.loss_noise_multiplier: strategy qffl uses the clients' losses")


def test_validate_run_hook_names_the_field() -> None:
    message = error(
        {"name": "fedavg", "params": {"server_momentum": 0.5}},
        privacy={"enabled": True, "principal": "federation"},
        selection={"clients_per_round": 5},
    )
    assert message == "strategy.params.server_momentum: must be 0 with privacy.principal federation"


# --- layering: the aggregator reaches the privacy ledger only through the gate composition gives it -----------------


def test_an_aggregator_without_a_privacy_service_refuses_dp_runs() -> None:
    from aggregator_service.peers import NoLedger

    gate = NoLedger()
    gate.start("r", config({"name": "fedavg"}))  # non-private: nothing to account
    assert gate.authorize_round("r", 1, config({"name": "fedavg"}), [0, 1], 5) == 0.0
    with pytest.raises(ConfigError, match=r"^privacy.enabled: this aggregator has no privacy service"):
        gate.start("r", config({"name": "fedavg"}, privacy={"enabled": True}))


def test_the_aggregator_imports_no_privacy_service_code() -> None:
    import subprocess
    import sys

    code = (
        "import sys, aggregator_service.engine, aggregator_service.peers, aggregator_service.dp, "
        "aggregator_service.checkpoint, aggregator_service.server\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'privacy_service'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@dataclass
class ListParams:
    keep: list[int] = field(default_factory=lambda: [0])
    per_client: dict[str, float] = field(default_factory=dict)


class ListKnobs(NoDp):
    Params = ListParams


def test_params_of_any_declared_type_reach_the_strategy_and_are_checked() -> None:
    cfg = config({"name": ref(ListKnobs), "params": {"keep": [1, 2], "per_client": {"3": 0.5}}})
    assert cfg.strategy.params == {"keep": [1, 2], "per_client": {"3": 0.5}}
    assert "strategy.params.keep[1]: expected an integer, got 'x'" in error(
        {"name": ref(ListKnobs), "params": {"keep": [1, "x"]}}
    )
