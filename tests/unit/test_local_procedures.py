"""The client-side local-procedure hook (fairfl.procedure): a user's LocalProcedure, named by `module:attr` or a
registered name, travels on a TRAIN task and changes the local training as it declares; a procedure that cannot be
imported, is not a LocalProcedure, or gets bad parameters fails with an error naming the field."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from client_agent.pieces import DpSgd, builtin_pieces
from client_agent.trainer import ClientRuntime
from fairfl.config import ConfigError, experiment_from_dict
from fairfl.data import load_run_data
from fairfl.plugins import PluginError
from fairfl.procedure import PROCEDURES, LocalProcedure, LocalState, attach_procedure, register_procedure
from fairfl.protocol import TRAIN, UPDATE, ClientResult
from fairfl.v1 import federation_pb2


class ScaleGradient(LocalProcedure):
    """Multiplies every gradient by `scale` and reports how many steps it scaled and the mean batch loss it saw."""

    @dataclass(frozen=True)
    class Params:
        scale: float = 1.0
        metric: str = "scaled_steps"

        def validate(self, path: str) -> None:
            if not self.scale >= 0:
                raise ConfigError(f"{path}.scale: must be >= 0, got {self.scale}")

    def begin(self, state: LocalState) -> None:
        self.steps = 0
        self.losses = 0.0

    def after_backward(self, state: LocalState) -> None:
        for p in state.params:
            p.grad.mul_(self.params.scale)
        self.steps += 1
        assert state.loss is not None
        self.losses += float(state.loss.detach())

    def finish(self, state: LocalState, result: ClientResult) -> None:
        result.metrics[self.params.metric] = float(self.steps)
        result.metrics["seen_loss"] = self.losses / max(self.steps, 1)


class AddsToObjective(LocalProcedure):
    """objective(): a zero term on the loss; after_step(): counts steps (the hooks run in the loop's order)."""

    def begin(self, state: LocalState) -> None:
        self.calls: list[str] = []

    def objective(self, state: LocalState, loss: torch.Tensor) -> torch.Tensor:
        self.calls.append("objective")
        return loss + 0.0 * loss

    def after_step(self, state: LocalState) -> None:
        self.calls.append("after_step")

    def finish(self, state: LocalState, result: ClientResult) -> None:
        result.metrics["hook_calls"] = float(len(self.calls))


class HalveFromStepOne(LocalProcedure):
    def step_lr(self, state: LocalState, loss: torch.Tensor) -> float | None:
        return state.base_lr / 2 if state.step == 1 else None


NotAProcedure = object()

SCALE = f"{__name__}:ScaleGradient"


def _runtime() -> ClientRuntime:
    config = experiment_from_dict(
        {
            "seed": 3,
            "data": {"dataset": "synthetic", "num_clients": 3},
            "model": {"name": "logreg"},
            "selection": {"clients_per_round": 2},
        }
    )
    runtime = ClientRuntime(config, load_run_data(config), [0], torch.device("cpu"), lambda ref: x0)
    x0 = torch.cat([p.detach().reshape(-1) for p in runtime.model.parameters()]).clone()
    return runtime


def _task(lr: float = 0.05, steps: int = 5) -> federation_pb2.Task:
    task = federation_pb2.Task(task_id="t", run_id="r", round=1, phase=TRAIN, client_id=0, seed=5)
    task.model.sha256 = "x0"
    task.train.local_steps = steps
    task.train.batch_size = 8
    task.train.lr = lr
    return task


def test_user_procedure_by_module_attr_scales_the_gradient_and_adds_a_metric() -> None:
    runtime = _runtime()
    plain = runtime.run(_task(lr=0.1))
    task = _task(lr=0.05)
    attach_procedure(task.train, SCALE, {"scale": 2.0, "metric": "my_steps"})
    assert task.train.procedures[0].ref == SCALE
    scaled = runtime.run(task)
    # Plain SGD: lr·(2g) is (2·lr)·g, so doubling every gradient trains as doubling the step size.
    assert torch.allclose(scaled.payloads[UPDATE], plain.payloads[UPDATE], rtol=1e-6, atol=1e-9)
    assert scaled.metrics["my_steps"] == 5.0
    assert scaled.metrics["seen_loss"] == pytest.approx(scaled.metrics["train_loss"], rel=1e-6)
    frozen = _task()
    attach_procedure(frozen.train, ScaleGradient, ScaleGradient.Params(scale=0.0))  # the class, not a string
    assert frozen.train.procedures[0].ref == SCALE  # named across processes by its module:qualname
    assert not runtime.run(frozen).payloads[UPDATE].any()  # zero gradients: the model does not move


def test_procedures_compose_after_the_builtin_pieces_and_keep_training_bit_equal() -> None:
    runtime = _runtime()
    task = _task()
    task.train.prox_mu = 0.1
    task.train.fair_step.fair_lambda = 0.5
    base = runtime.run(task)
    attach_procedure(task.train, f"{__name__}:AddsToObjective")
    attach_procedure(task.train, SCALE)  # scale 1: gradients unchanged
    both = runtime.run(task)
    assert torch.equal(both.payloads[UPDATE], base.payloads[UPDATE])
    assert both.metrics["lr"] == base.metrics["lr"]
    assert both.metrics["hook_calls"] == 10.0 and both.metrics["scaled_steps"] == 5.0


def test_registered_name_resolves() -> None:
    register_procedure("test-scale-gradient", ScaleGradient)
    try:
        task = _task()
        attach_procedure(task.train, "test-scale-gradient", {"scale": 0.0})
        assert not _runtime().run(task).payloads[UPDATE].any()
    finally:
        PROCEDURES.unregister("test-scale-gradient")


@pytest.mark.parametrize(
    ("ref", "match"),
    [
        (
            "no_such_module_for_fairfl:Proc",
            r"train\.procedures\[0\]\.ref: cannot import module 'no_such_module_for_fairfl'",
        ),
        (f"{__name__}:Missing", r"train\.procedures\[0\]\.ref: module .* has no attribute 'Missing'"),
        (f"{__name__}:NotAProcedure", r"train\.procedures\[0\]\.ref: .* is not a local procedure"),
        ("no-such-procedure", r"train\.procedures\[0\]\.ref: unknown local procedure 'no-such-procedure'"),
    ],
)
def test_a_task_naming_a_procedure_the_agent_cannot_load_fails_clearly(ref: str, match: str) -> None:
    runtime = _runtime()
    task = _task()
    task.train.procedures.add(ref=ref)
    with pytest.raises(PluginError, match=match):
        runtime.run(task)
    with pytest.raises(PluginError, match=match.replace(r"train\.procedures\[0\]\.ref", r"strategy\.client_procedure")):
        attach_procedure(_task().train, ref)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"scale": "big"}, r"strategy\.client_procedure\.params\.scale"),
        (
            {"sclae": 2.0},
            r"strategy\.client_procedure\.params: unknown parameter 'sclae'; valid parameters: scale, metric",
        ),
        ({"scale": -1.0}, r"strategy\.client_procedure\.params\.scale: must be >= 0"),
        (ScaleGradient.Params(scale=-1.0), r"strategy\.client_procedure\.params\.scale: must be >= 0"),
        (AddsToObjective.Params(), r"expected ScaleGradient\.Params or a mapping"),
    ],
)
def test_bad_procedure_params_are_refused_when_attached(params: object, match: str) -> None:
    task = _task()
    with pytest.raises(ConfigError, match=match):  # PluginError is a ConfigError: one kind of error for configs
        attach_procedure(task.train, SCALE, params)
    assert not task.train.procedures  # nothing half-attached


def test_bad_procedure_params_on_the_wire_fail_the_task() -> None:
    task = _task()
    spec = task.train.procedures.add(ref=SCALE)
    spec.params.update({"scale": -3.0})
    with pytest.raises(ConfigError, match=r"train\.procedures\[0\]\.params\.scale: must be >= 0"):
        _runtime().run(task)
    spec.params.Clear()
    spec.params.update({"bogus": 1})
    with pytest.raises(PluginError, match=r"train\.procedures\[0\]\.params: unknown parameter 'bogus'"):
        _runtime().run(task)


def test_dp_sgd_tasks_refuse_procedures() -> None:
    task = _task()
    task.train.dp.sample_rate = 0.5
    task.train.dp.noise_multiplier = 1.0
    task.train.dp.clip_norm = 1.0
    attach_procedure(task.train, SCALE)
    with pytest.raises(ValueError, match=r"train\.procedures: DP-SGD tasks cannot run local procedures"):
        _runtime().run(task)


def _dp_task() -> federation_pb2.Task:
    task = _task()
    task.train.dp.sample_rate = 0.5
    task.train.dp.noise_multiplier = 1.0
    task.train.dp.clip_norm = 1.0
    return task


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: setattr(c, "local_epochs", 1), "DP-SGD needs local_steps"),
        (lambda c: setattr(c.dp, "sample_rate", 1.5), "invalid DP-SGD settings: sample_rate=1.5"),
        (lambda c: setattr(c.dp, "noise_multiplier", 0.0), "invalid DP-SGD settings"),
        (lambda c: setattr(c.dp, "clip_norm", 0.0), "invalid DP-SGD settings"),
        (lambda c: setattr(c.alignment, "alpha", 0.5), "cannot also release alignment steps"),
        (lambda c: setattr(c, "record_first_step", True), "cannot also release"),
        (lambda c: setattr(c, "want_bias_update", True), "cannot also release"),
        (lambda c: setattr(c, "want_activation", True), "cannot also release"),
        (lambda c: c.procedures.add(ref="no.such.module:Thing"), r"cannot run local procedures \(no\.such"),
    ],
)
def test_dp_sgd_tasks_refuse_what_would_release_more(change: Callable[[Any], Any], message: str) -> None:
    task = _dp_task()
    change(task.train)
    with pytest.raises(ValueError, match=message):
        _runtime().run(task)


def test_a_dp_sgd_task_is_one_piece_of_the_loop_that_releases_only_noisy_values() -> None:
    task = _dp_task()
    task.train.prox_mu = 0.1  # folded into DpSgd's per-sample gradients: no ProximalTerm or FairStep beside it
    task.train.fair_step.global_loss = 1.0
    task.train.dp.fair_lambda = 0.5
    task.train.dp.loss_noise_multiplier = 1.0
    task.train.dp.loss_clip = 2.0
    runtime = _runtime()
    pieces = builtin_pieces(task.train, runtime.model, runtime.layout, lambda ref: None, "task")
    assert [type(p) for p in pieces] == [DpSgd]
    private = runtime.run(task)
    assert math.isnan(private.loss_before) and math.isnan(private.loss_after) and math.isfinite(private.noisy_loss)
    assert list(private.metrics) == ["loss_clip", "local_steps", "lr"]  # no noiseless training loss or accuracy
    task.train.dp.plaintext_telemetry = True  # opted-in experiment telemetry: the noiseless losses, no accuracy
    telemetry = runtime.run(task)
    assert math.isfinite(telemetry.loss_before) and math.isfinite(telemetry.loss_after)
    assert list(telemetry.metrics) == ["loss_clip", "train_loss", "local_steps", "lr"]
    assert torch.equal(telemetry.payloads[UPDATE], private.payloads[UPDATE])  # 'task' randomness: same draws


def test_a_step_size_hook_sets_the_lr_until_changed_and_the_lr_metric_is_the_mean() -> None:
    runtime = _runtime()
    assert runtime.run(_task(lr=0.1, steps=4)).metrics["lr"] == 0.1
    task = _task(lr=0.1, steps=4)
    attach_procedure(task.train, f"{__name__}:HalveFromStepOne")
    # Steps 0..3 run at 0.1, then 0.05 from step 1 on (a step size is kept until a hook changes it).
    assert math.isclose(runtime.run(task).metrics["lr"], (0.1 + 0.05 * 3) / 4)


def test_features_of_a_model_without_a_declared_head_are_its_last_linear_input() -> None:
    """A plain nn.Module (no features/classifier): the penultimate features come from one model(x) pass."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    params = list(model.parameters())
    x = torch.randn(4, 6)
    state = LocalState(
        config=federation_pb2.LocalTrainingConfig(),
        model=model,
        params=params,
        optimizer=torch.optim.SGD(params, lr=0.1),
        x0=torch.cat([p.detach().reshape(-1) for p in params]),
        x_train=x,
        y_train=torch.zeros(4, dtype=torch.long),
        device=torch.device("cpu"),
        steps=1,
        batch_size=4,
        base_lr=0.1,
        lr=0.1,
        seed=0,
    )
    features, logits = state.forward_with_features(x)
    assert torch.equal(features, torch.relu(model[0](x)))
    assert torch.equal(logits, model(x))
    assert state.head.feature_dim == 5 and not state.head.declared


def test_a_class_only_this_process_can_name_is_attached_by_its_registered_name_or_refused() -> None:
    class Local(LocalProcedure):
        pass

    with pytest.raises(PluginError, match=r"strategy\.client_procedure: .* cannot be named across processes"):
        attach_procedure(_task().train, Local)
    register_procedure("test-local-procedure", Local)
    try:
        task = _task()
        attach_procedure(task.train, Local)
        assert task.train.procedures[0].ref == "test-local-procedure"
    finally:
        PROCEDURES.unregister("test-local-procedure")
