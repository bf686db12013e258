"""Model plug-ins: factories by `module:attr` and by registered name, their parameters, the head helper, and every way
a model plug-in can be wrong failing at config load with an error naming the field."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from fairfl.config import ConfigError, ExperimentConfig, experiment_from_dict
from fairfl.data import DataSignature, run_signature
from fairfl.models import (
    MODELS,
    FairFLModel,
    HeadError,
    build_model,
    build_run_model,
    model_head,
    require_signatures,
)
from fairfl.params import flatten_parameters

HERE = __name__  # module:attr references work however pytest imported this file


# --- plug-ins defined outside the package ---------------------------------------------------------------------------


@dataclass
class TinyParams:
    width: int = 8
    dropout: float = 0.0

    def validate(self, path: str) -> None:
        if self.width < 1:
            raise ConfigError(f"{path}.width: must be >= 1, got {self.width}")


def tiny_net(signature: DataSignature, width: int = 8, dropout: float = 0.0) -> nn.Module:
    """A user's model: any nn.Module, here a Sequential ending in its output nn.Linear."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(signature.num_features, width),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(width, signature.num_classes),
    )


tiny_net.Params = TinyParams  # type: ignore[attr-defined]


def undeclared_net(signature: DataSignature, depth: int, width: int = 4) -> nn.Module:
    """No Params: its keyword arguments are the parameters (depth is required)."""
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(signature.num_features, width)]
    for _ in range(depth - 1):
        layers += [nn.ReLU(), nn.Linear(width, width)]
    return nn.Sequential(*layers, nn.Linear(width, signature.num_classes))


class ModuleFactory(nn.Module):
    """A module class is a factory too: ModuleFactory(signature, **params)."""

    def __init__(self, signature: DataSignature, hidden: int = 6) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(signature.num_features, hidden), nn.Tanh())
        self.out = nn.Linear(hidden, signature.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


NOT_A_FACTORY = 42


def no_signature_argument() -> nn.Module:
    return nn.Linear(1, 2)


def returns_a_dict(signature: DataSignature) -> dict[str, Any]:
    return {"not": "a module"}


def config(model: dict[str, Any], **top: Any) -> ExperimentConfig:
    return experiment_from_dict(
        {
            "data": {"dataset": "synthetic", "num_clients": 4},
            "model": model,
            "selection": {"clients_per_round": 2},
            "runtime": {"agents": 1},
            **top,
        }
    )


def error_of(model: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        config(model)
    return str(info.value)


# --- factories ------------------------------------------------------------------------------------------------------


def test_factory_by_module_attr_builds_with_its_declared_params() -> None:
    cfg = config({"name": f"{HERE}:tiny_net", "params": {"width": 5}})
    model = build_run_model(cfg)
    assert isinstance(model, nn.Sequential)
    assert model[1].in_features == 60 and model[1].out_features == 5 and model[-1].out_features == 10
    assert model(torch.randn(3, 60)).shape == (3, 10)
    # Built from the run seed: every process (aggregator, agents) gets the same initial model.
    assert torch.equal(flatten_parameters(model), flatten_parameters(build_run_model(cfg)))
    other = config({"name": f"{HERE}:tiny_net", "params": {"width": 5}}, seed=1)
    assert not torch.equal(flatten_parameters(model), flatten_parameters(build_run_model(other)))


def test_factory_without_params_is_checked_against_its_keyword_arguments() -> None:
    model = build_run_model(config({"name": f"{HERE}:undeclared_net", "params": {"depth": 2}}))
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 3
    assert error_of({"name": f"{HERE}:undeclared_net", "params": {"depth": 2, "heads": 4}}).startswith(
        "model.params: unknown parameter 'heads'; valid parameters: depth, width"
    )
    assert error_of({"name": f"{HERE}:undeclared_net"}).startswith("model.params.depth: required")


def test_module_class_is_a_factory() -> None:
    model = build_run_model(config({"name": f"{HERE}:ModuleFactory", "params": {"hidden": 3}}))
    assert isinstance(model, ModuleFactory) and model.out.in_features == 3


def test_factory_by_registered_name() -> None:
    MODELS.register("tiny_test_net", tiny_net)
    try:
        cfg = config({"name": "tiny_test_net", "params": {"width": 7}})
        assert build_run_model(cfg)[1].out_features == 7
        assert MODELS.name_of(tiny_net) == "tiny_test_net"
    finally:
        MODELS.unregister("tiny_test_net")
    assert error_of({"name": "tiny_test_net"}).startswith("model.name: unknown model 'tiny_test_net'")


def test_builtins_are_entry_points_and_build_exactly_as_before() -> None:
    import fairfl.models as models

    assert {"mlp", "cnn", "logreg"} <= set(MODELS.names())
    assert MODELS.load("mlp", "model.name") is models.mlp
    cfg = config({"name": "mlp", "params": {"hidden": [12, 7]}}, seed=5)
    torch.manual_seed(5)
    legacy = models._build_mlp((60,), 10, (12, 7))  # what build_global_model built from model.hidden
    assert torch.equal(flatten_parameters(build_run_model(cfg)), flatten_parameters(legacy))
    default = config({"name": "mlp"})
    assert default.model.params == {} and build_run_model(default).body[1].out_features == 200


def test_signature_comes_from_the_dataset_plugin() -> None:
    assert run_signature(config({"name": "logreg"})) == DataSignature((60,), 10)
    cnn = build_run_model(config({"name": "cnn"}), DataSignature((1, 28, 28), 10))
    assert sum(p.numel() for p in cnn.parameters()) == 582_026


# --- errors, each naming the field ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "start", "reason"),
    [
        ({"name": "no_such_pkg_xyz.models:net"}, "model.name:", "cannot import module 'no_such_pkg_xyz.models'"),
        ({"name": f"{HERE}:no_such_factory"}, "model.name:", "has no attribute 'no_such_factory'"),
        ({"name": f"{HERE}:NOT_A_FACTORY"}, "model.name:", "is not a model: expected a callable factory"),
        ({"name": f"{HERE}:no_signature_argument"}, "model.name:", "data signature as its first positional argument"),
        ({"name": "resnet"}, "model.name:", "unknown model 'resnet'; available: cnn, logreg, mlp"),
        ({"name": f"{HERE}:tiny_net", "params": {"depth": 2}}, "model.params:", "unknown parameter 'depth'"),
        ({"name": f"{HERE}:tiny_net", "params": {"width": "wide"}}, "model.params.width:", "expected an integer"),
        ({"name": f"{HERE}:tiny_net", "params": {"width": 0}}, "model.params.width:", "must be >= 1"),
        ({"name": "cnn", "params": {"channels": [8]}}, "model.params.channels:", "expected 2 conv widths"),
        ({"name": "mlp", "params": {"hidden": []}}, "model.params.hidden:", "at least one hidden width"),
        ({"name": "logreg", "params": {"hidden": [4]}}, "model.params:", "valid parameters: none"),
        # the old key is refused with where it went, not ignored
        ({"name": "mlp", "hidden": [4]}, "model.hidden:", "moved to model.params.hidden"),
    ],
)
def test_bad_model_plugin_fails_at_config_load_naming_the_field(model: dict[str, Any], start: str, reason: str) -> None:
    message = error_of(model)
    assert message.startswith(start), message
    assert reason in message, message


def test_factory_returning_no_module_fails_before_round_one() -> None:
    cfg = config({"name": f"{HERE}:returns_a_dict"})
    with pytest.raises(ConfigError, match=r"^model\.name: .*returned dict, expected a torch\.nn\.Module"):
        build_run_model(cfg)


def test_factory_refusing_the_signature_names_the_field() -> None:
    cfg = config({"name": "cnn"})  # synthetic is flat (60,): no image for two convolutions
    with pytest.raises(ConfigError, match=r"^model\.name: 'cnn' cannot build a model for DataSignature"):
        build_run_model(cfg)


def test_build_model_outside_a_config() -> None:
    assert isinstance(build_model("logreg", (60,), 10), FairFLModel)
    assert isinstance(build_model(f"{HERE}:tiny_net", (4,), 3, width=2), nn.Sequential)
    with pytest.raises(ValueError, match="unknown argument 'depth'; valid arguments: width, dropout"):
        build_model(f"{HERE}:tiny_net", (4,), 3, depth=2)


# --- the head helper ------------------------------------------------------------------------------------------------


def test_head_of_a_sequential_is_its_last_linear() -> None:
    torch.manual_seed(0)
    model = tiny_net(DataSignature((2, 3), 4), width=5)
    head = model_head(model)
    assert head.classifier is model[-1] and not head.declared
    assert head.feature_dim == 5 and head.bias_name == "4.bias"
    x = torch.randn(6, 2, 3, requires_grad=True)
    features = head.features(x)
    torch.testing.assert_close(features, model[:-1](x), rtol=0, atol=0)
    torch.testing.assert_close(head.classifier(features), model(x), rtol=0, atol=0)
    features.sum().backward()  # the features stay in the autograd graph (Equitable-FL trains through them)
    assert x.grad is not None and model[1].weight.grad is not None
    assert len(model[-1]._forward_pre_hooks) == 0, "the capture hook must be removed"


def test_head_of_a_module_class_follows_the_forward() -> None:
    model = ModuleFactory(DataSignature((3,), 2), hidden=4)
    head = model_head(model)
    x = torch.randn(5, 3)
    assert head.classifier is model.out and head.bias_name == "out.bias"
    torch.testing.assert_close(head.features(x), model.body(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["mlp", "cnn", "logreg"])
def test_head_of_fairfl_model_is_its_declared_hook(name: str) -> None:
    shape = (1, 28, 28) if name == "cnn" else (1, 8, 8)
    model = build_model(name, shape, 10)
    head = model_head(model, "HiCS-FL bias signatures", need_bias=True)
    assert head.declared and head.classifier is model.classifier
    assert head.bias_name == "classifier.bias" and head.feature_dim == model.feature_dim
    x = torch.randn(3, math.prod(shape))
    assert torch.equal(head.features(x), model.features(x))


def test_features_submodule_is_not_a_declared_hook() -> None:
    class VggLike(nn.Module):  # torchvision's VGG: `features` is the conv trunk, `classifier` a Sequential
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU())
            self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(2 * 4 * 4, 6), nn.ReLU(), nn.Linear(6, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.classifier(self.features(x))

    model = VggLike()
    head = model_head(model)
    assert not head.declared and head.classifier is model.classifier[3]
    assert head.features(torch.randn(2, 1, 6, 6)).shape == (2, 6)


def test_model_without_linear_head_is_a_clear_error() -> None:
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    with pytest.raises(HeadError, match=r"^model\.name: strategy equitable's activation signatures needs") as info:
        model_head(model, "strategy equitable's activation signatures")
    assert "Sequential has no nn.Linear" in str(info.value)
    assert isinstance(info.value, ConfigError)


def test_output_layer_without_bias_fails_only_when_the_bias_is_needed() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3, bias=False))
    assert model_head(model).feature_dim == 4
    with pytest.raises(HeadError, match=r"^model\.name: .*no trainable bias.*HiCS-FL needs it"):
        model_head(model, "HiCS-FL", need_bias=True)


def test_last_linear_not_in_the_forward_is_reported() -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(3, 2))
            self.spare = nn.Linear(2, 2)  # registered last, never called

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    with pytest.raises(HeadError, match=r"never called its last nn\.Linear"):
        model_head(Unused()).features(torch.randn(1, 3))


def test_required_signatures_are_checked_before_round_one() -> None:
    signature = DataSignature((4,), 3)
    good = tiny_net(signature)
    require_signatures(good, signature, {"bias_update": "selection.method hics", "activation": "strategy equitable"})
    no_bias = nn.Sequential(nn.Linear(4, 3, bias=False))
    require_signatures(no_bias, signature, {"activation": "strategy equitable"})
    with pytest.raises(HeadError, match=r"^model\.name: .*no trainable bias.*selection\.method hics needs it"):
        require_signatures(no_bias, signature, {"bias_update": "selection.method hics"})

    class SequenceHead(nn.Module):  # the output layer sees (batch, tokens, dim): no single feature vector
        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Linear(2, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(x.reshape(x.shape[0], 2, 2)).mean(1)

    with pytest.raises(HeadError, match=r"one penultimate feature vector per sample.*\(1, 2, 2\)"):
        require_signatures(SequenceHead(), signature, {"activation": "strategy equitable"})


def no_bias_model(signature: DataSignature) -> nn.Module:
    """An output layer without a bias: it can give no HiCS-FL signature."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(signature.input_shape), signature.num_classes, bias=False))


def test_a_run_whose_sampler_needs_a_signature_the_model_cannot_give_fails_before_round_1() -> None:
    from aggregator_service.engine import RoundEngine, signature_needs

    config = experiment_from_dict(
        {
            "data": {"dataset": "synthetic", "num_clients": 6},
            "model": {"name": f"{HERE}:no_bias_model"},
            "selection": {"method": "hics", "clients_per_round": 2},
        }
    )
    assert signature_needs(config) == {"bias_update": "selection.method hics"}
    with pytest.raises(HeadError, match=r"^model\.name: .*no trainable bias.*selection\.method hics needs it"):
        RoundEngine("r", config, None, None, None, lambda _e: None)  # type: ignore[arg-type]
