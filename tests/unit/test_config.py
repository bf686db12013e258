"""Experiment config: the default preset loads, every error names its field by dotted path, overrides, YAML
round trip."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from fairfl import strategy as strategies
from fairfl.config import (
    ConfigError,
    ExperimentConfig,
    TrainingConfig,
    experiment_from_dict,
    experiment_from_yaml,
    load_experiment,
)
from fairfl.protocol import ClientResult
from fairfl.schema import expect_mapping
from fairfl.strategy import AggregateOutcome, RoundContext, Strategy

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "experiments" / "quickstart.yaml"


def error_of(data: Any) -> str:
    with pytest.raises(ConfigError) as info:
        experiment_from_dict(data)
    return str(info.value)


# --- loading --------------------------------------------------------------------------------------------------------


def test_quickstart_preset_loads() -> None:
    cfg = load_experiment(QUICKSTART)
    assert cfg.name == "quickstart"
    assert cfg.seed == 0
    assert cfg.rounds == 200
    assert cfg.data.dataset == "fashion_mnist"
    assert cfg.data.num_clients == 100
    assert cfg.data.partition == "shards"
    assert cfg.data.shards_per_client == 2
    assert cfg.model.name == "mlp"
    assert cfg.model.params == {"hidden": [200, 200]}
    assert (cfg.training.local_steps, cfg.training.local_epochs) == (10, None)
    assert cfg.training.batch_size == 50
    assert cfg.training.lr == 0.1
    assert cfg.strategy.name == "fedavg"
    assert cfg.strategy.server_lr == 1.0
    assert cfg.selection.method == "random"
    assert cfg.selection.clients_per_round == 10
    assert cfg.evaluation.every == 20
    assert cfg.runtime.agents == 2
    assert cfg.runtime.round_timeout_s == 60.0
    assert isinstance(cfg.runtime.round_timeout_s, float)  # an int in YAML, coerced for a float field
    # Everything the preset leaves out keeps its default.
    assert cfg.runtime.min_completion == ExperimentConfig().runtime.min_completion
    assert cfg.output_dir == ExperimentConfig().output_dir


def test_empty_config_is_the_defaults() -> None:
    assert experiment_from_dict({}) == ExperimentConfig()
    assert experiment_from_dict(None) == ExperimentConfig()
    assert experiment_from_yaml("") == ExperimentConfig()
    assert experiment_from_dict({"training": None}) == ExperimentConfig()


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(str(missing))):
        load_experiment(missing)


# --- unknown keys ---------------------------------------------------------------------------------------------------


def test_unknown_top_level_key_lists_valid_fields() -> None:
    message = error_of({"trainin": {"lr": 0.1}})
    assert message.startswith("trainin: unknown field")
    assert "valid fields" in message
    for f in dataclasses.fields(ExperimentConfig):
        assert f.name in message


def test_unknown_nested_key_names_its_section_and_lists_valid_fields() -> None:
    message = error_of({"training": {"batchsize": 50}})
    assert message.startswith("training.batchsize: unknown field")
    for f in dataclasses.fields(TrainingConfig):
        assert f.name in message


@pytest.mark.parametrize("section", ["data", "model", "strategy", "selection", "evaluation", "runtime"])
def test_unknown_key_in_every_section(section: str) -> None:
    message = error_of({section: {"no_such_field": 1}})
    assert message.startswith(f"{section}.no_such_field: unknown field")


# --- types ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "path", "phrase"),
    [
        ({"training": {"batch_size": "50"}}, "training.batch_size", "expected an integer"),
        ({"training": {"batch_size": True}}, "training.batch_size", "expected an integer"),
        ({"training": {"batch_size": 50.0}}, "training.batch_size", "expected an integer"),
        ({"rounds": False}, "rounds", "expected an integer"),
        ({"training": {"local_steps": "10"}}, "training.local_steps", "expected an integer"),
        ({"training": {"lr": "0.1"}}, "training.lr", "expected a number"),
        ({"training": {"lr": True}}, "training.lr", "expected a number"),
        ({"data": {"download": "yes"}}, "data.download", "expected true or false"),
        ({"data": {"download": 1}}, "data.download", "expected true or false"),
        ({"name": 5}, "name", "expected a string"),
        ({"model": {"params": {"hidden": 200}}}, "model.params.hidden", "expected a list"),
        ({"model": {"params": {"hidden": [200, "x"]}}}, "model.params.hidden[1]", "expected an integer"),
        ({"model": {"params": [1]}}, "model.params", "expected a mapping"),
        ({"data": {"dataset": "synthetic", "params": {"alpha": "x"}}}, "data.params.alpha", "expected a number"),
        ({"strategy": {"params": [1, 2]}}, "strategy.params", "expected a mapping"),
        ({"strategy": {"params": {"server_momentum": "x"}}}, "strategy.params.server_momentum", "expected a number"),
        ({"training": 5}, "training", "expected a mapping"),
    ],
)
def test_wrong_type_names_the_field(data: dict[str, Any], path: str, phrase: str) -> None:
    message = error_of(data)
    assert message.startswith(f"{path}:"), message
    assert phrase in message


def test_numbers_yaml_1_1_reads_as_strings_are_numbers() -> None:
    # YAML 1.1 (PyYAML) reads 1e-3 (no dot) and 1.0e3 (no exponent sign) as strings, in files and in --set alike.
    text = "name: t\ntraining: {lr: 1e-1, momentum: 5e-1}\nstrategy: {server_lr: 1.0e0}\n"
    assert isinstance(yaml.safe_load(text)["training"]["lr"], str)
    config = experiment_from_yaml(text)
    assert (config.training.lr, config.training.momentum, config.strategy.server_lr) == (0.1, 0.5, 1.0)
    assert "expected a number, got '1e'" in error_of({"training": {"lr": "1e"}})  # not a number at all: still refused


def test_top_level_must_be_a_mapping() -> None:
    assert "expected a mapping" in error_of([1, 2])
    with pytest.raises(ConfigError, match="expected a mapping"):
        experiment_from_yaml("- a\n- b\n")


def test_integers_are_accepted_for_float_fields() -> None:
    cfg = experiment_from_dict({"training": {"lr": 1}, "runtime": {"min_completion": 1}})
    assert cfg.training.lr == 1.0 and isinstance(cfg.training.lr, float)
    assert isinstance(cfg.runtime.min_completion, float)


# --- ranges ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"training": {"lr": 0}}, "training.lr"),
        ({"training": {"lr": -0.1}}, "training.lr"),
        ({"training": {"lr": float("nan")}}, "training.lr"),
        ({"training": {"lr": float("inf")}}, "training.lr"),
        ({"training": {"batch_size": 0}}, "training.batch_size"),
        ({"training": {"local_steps": 0}}, "training.local_steps"),
        ({"training": {"lr_decay": 0}}, "training.lr_decay"),
        ({"training": {"lr_decay": 1.01}}, "training.lr_decay"),
        ({"training": {"momentum": 1.0}}, "training.momentum"),
        ({"training": {"weight_decay": -1e-4}}, "training.weight_decay"),
        ({"training": {"prox_mu": float("nan")}}, "training.prox_mu"),
        ({"runtime": {"min_completion": 1.5}}, "runtime.min_completion"),
        ({"runtime": {"min_completion": 0}}, "runtime.min_completion"),
        ({"runtime": {"round_timeout_s": float("inf")}}, "runtime.round_timeout_s"),
        ({"runtime": {"agents": 0}}, "runtime.agents"),
        ({"runtime": {"device": "tpu"}}, "runtime.device"),
        ({"data": {"num_clients": 0}}, "data.num_clients"),
        ({"data": {"alpha": 0}}, "data.alpha"),
        ({"data": {"test_per_client": 0}}, "data.test_per_client"),
        ({"model": {"params": {"hidden": [200, 0]}}}, "model.params.hidden[1]"),
        ({"data": {"dataset": "synthetic", "params": {"alpha": -1.0}}}, "data.params.alpha"),
        ({"selection": {"clients_per_round": 0}}, "selection.clients_per_round"),
        ({"evaluation": {"every": 0}}, "evaluation.every"),
        ({"strategy": {"server_lr": 0}}, "strategy.server_lr"),
        ({"strategy": {"params": {"server_momentum": 1.0}}}, "strategy.params.server_momentum"),
        ({"rounds": 0}, "rounds"),
        ({"seed": -1}, "seed"),
    ],
)
def test_value_out_of_range_names_the_field(data: dict[str, Any], path: str) -> None:
    message = error_of(data)
    assert message.startswith(f"{path}:"), message


def test_range_message_states_the_bound_and_the_value() -> None:
    assert error_of({"training": {"batch_size": 0}}) == "training.batch_size: must be >= 1, got 0"
    assert error_of({"runtime": {"min_completion": 1.5}}) == "runtime.min_completion: must be in (0, 1], got 1.5"
    assert "got 0" in error_of({"training": {"lr": 0}})


def test_boundary_values_are_accepted() -> None:
    cfg = experiment_from_dict(
        {
            "training": {"lr_decay": 1.0, "momentum": 0.0, "weight_decay": 0.0, "batch_size": 1},
            "runtime": {"min_completion": 1.0, "device": "cuda:1", "agents": 1},
            "data": {"num_clients": 1, "min_size": 0},
            "selection": {"clients_per_round": 1},
            "rounds": 1,
        }
    )
    assert cfg.runtime.device == "cuda:1"


def test_at_most_one_of_local_steps_and_local_epochs() -> None:
    message = error_of({"training": {"local_steps": 5, "local_epochs": 1}})
    assert message.startswith("training:")
    assert "local_steps" in message and "local_epochs" in message


@pytest.mark.parametrize("training", [{}, {"local_steps": None}, {"local_steps": None, "local_epochs": None}])
def test_local_budget_defaults_to_ten_steps(training: dict[str, Any]) -> None:
    assert experiment_from_dict({"training": training}).training.budget() == ("local_steps", 10)


def test_local_epochs_instead_of_steps() -> None:
    cfg = experiment_from_dict({"training": {"local_epochs": 2}})
    assert (cfg.training.local_steps, cfg.training.local_epochs) == (None, 2)
    assert cfg.training.budget() == ("local_epochs", 2)
    assert error_of({"training": {"local_steps": None, "local_epochs": 0}}).startswith("training.local_epochs:")


def test_clients_per_round_cannot_exceed_num_clients() -> None:
    message = error_of({"data": {"num_clients": 10}, "selection": {"clients_per_round": 11}})
    assert message.startswith("selection.clients_per_round:")
    assert "data.num_clients" in message
    assert experiment_from_dict({"data": {"num_clients": 10}, "selection": {"clients_per_round": 10}})


def test_agents_cannot_exceed_num_clients() -> None:
    message = error_of({"data": {"num_clients": 3}, "selection": {"clients_per_round": 3}, "runtime": {"agents": 4}})
    assert message.startswith("runtime.agents:")


@pytest.mark.parametrize(
    ("data", "path", "valid"),
    [
        ({"data": {"partition": "shard"}}, "data.partition", ["'iid'", "'shards'", "'dirichlet'"]),
        ({"data": {"dataset": "imagenet"}}, "data.dataset", ["fashion_mnist", "cifar10", "synthetic"]),
        ({"model": {"name": "resnet"}}, "model.name", ["mlp", "cnn", "logreg"]),
        ({"training": {"optimizer": "rmsprop"}}, "training.optimizer", ["'sgd'", "'adam'"]),
        ({"selection": {"method": "pow-d"}}, "selection.method", ["random", "full", "hics"]),
    ],
)
def test_invalid_choice_lists_the_valid_ones(data: dict[str, Any], path: str, valid: list[str]) -> None:
    message = error_of(data)
    assert message.startswith(f"{path}:"), message
    for option in valid:
        assert option in message


# --- strategies -----------------------------------------------------------------------------------------------------


def test_unknown_strategy_lists_available_ones() -> None:
    message = error_of({"strategy": {"name": "fedx"}})
    assert message.startswith("strategy.name:")
    assert "'fedx'" in message
    for name in strategies.STRATEGIES.names():
        assert name in message


def test_unknown_strategy_param_is_named() -> None:
    message = error_of({"strategy": {"params": {"foo": 1}}})
    assert message.startswith("strategy.params")
    assert "'foo'" in message
    assert "server_momentum" in message  # the valid parameters are listed


def test_strategy_params_are_validated_and_kept() -> None:
    cfg = experiment_from_dict({"strategy": {"name": "fedavg", "params": {"server_momentum": 0.9}}})
    assert cfg.strategy.params == {"server_momentum": 0.9}
    params = strategies.validate_strategy(cfg.strategy.name, cfg.strategy.params, "strategy")
    assert params.server_momentum == 0.9


@dataclasses.dataclass
class _CountParams:
    clusters: int = 2
    temperature: float = 1.0
    mode: str = "a"
    enabled: bool = False


class _CountStrategy(Strategy):
    name = "count_probe"
    Params = _CountParams

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        raise NotImplementedError


def test_integer_strategy_params_stay_integers() -> None:
    # Fails today: StrategyConfig.params is dict[str, float | int | str | bool] and _coerce tries the union's options
    # in order, so an integer from YAML matches `float` first and becomes 3.0; params_from_dict only converts for
    # float defaults, so an int-typed strategy parameter reaches the strategy as a float.
    strategies.register_strategy(_CountStrategy.name, _CountStrategy)
    try:
        cfg = experiment_from_yaml(
            "strategy:\n  name: count_probe\n  params: {clusters: 3, temperature: 2, mode: b, enabled: true}\n"
        )
        assert cfg.strategy.params["mode"] == "b"
        assert cfg.strategy.params["enabled"] is True
        assert cfg.strategy.params["temperature"] == 2
        assert type(cfg.strategy.params["clusters"]) is int
        params = strategies.validate_strategy(cfg.strategy.name, cfg.strategy.params, "strategy")
        assert type(params.clusters) is int
        assert type(params.temperature) is float
    finally:
        strategies.STRATEGIES.unregister(_CountStrategy.name)


# --- YAML and overrides ---------------------------------------------------------------------------------------------


def test_invalid_yaml_text_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        experiment_from_yaml("training: {lr: 0.1\n")


def test_invalid_yaml_file_is_a_config_error(tmp_path: Path) -> None:
    # Fails today: load_experiment calls yaml.safe_load itself without catching yaml.YAMLError, so a typo in an
    # experiment file escapes as yaml.parser.ParserError (and `fairfl run`, which catches ConfigError, crashes).
    path = tmp_path / "broken.yaml"
    path.write_text("training: {lr: 0.1\n")
    with pytest.raises(ConfigError, match="YAML"):
        load_experiment(path)


def test_overrides_apply_dotted_paths() -> None:
    base = load_experiment(QUICKSTART)
    cfg = load_experiment(QUICKSTART, {"training.lr": 0.05})
    assert cfg.training.lr == 0.05
    assert dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, lr=base.training.lr)) == base


def test_overrides_create_missing_sections_and_top_level_keys() -> None:
    cfg = load_experiment(
        QUICKSTART, {"rounds": 5, "strategy.params.server_momentum": 0.5, "runtime.min_completion": 0.8}
    )
    assert cfg.rounds == 5
    assert cfg.strategy.params == {"server_momentum": 0.5}
    assert cfg.runtime.min_completion == 0.8
    assert cfg.runtime.round_timeout_s == 60.0  # the rest of the section is kept


def test_overrides_are_validated_like_the_file() -> None:
    with pytest.raises(ConfigError, match=r"^training\.lr:"):
        load_experiment(QUICKSTART, {"training.lr": 0})
    with pytest.raises(ConfigError, match=r"^training\.batchsize: unknown field"):
        load_experiment(QUICKSTART, {"training.batchsize": 10})
    with pytest.raises(ConfigError, match=r"^selection\.clients_per_round:"):
        load_experiment(QUICKSTART, {"data.num_clients": 5})


def test_override_into_an_empty_section(tmp_path: Path) -> None:
    # `training:` with no children loads as None ("all defaults"); an override must create the section.
    path = tmp_path / "exp.yaml"
    path.write_text("rounds: 3\ntraining:\n")
    assert load_experiment(path).training == TrainingConfig()
    assert load_experiment(path, {"training.lr": 0.05}).training.lr == 0.05


def test_override_files_are_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "exp.yaml"
    text = QUICKSTART.read_text()
    path.write_text(text)
    load_experiment(path, {"training.lr": 0.05, "rounds": 1})
    assert path.read_text() == text


def test_to_yaml_roundtrip_of_the_preset() -> None:
    cfg = load_experiment(QUICKSTART)
    text = cfg.to_yaml()
    assert isinstance(yaml.safe_load(text), dict)
    again = experiment_from_yaml(text)
    assert again == cfg
    assert again.to_yaml() == text


def test_to_yaml_roundtrip_of_non_default_values(tmp_path: Path) -> None:
    cfg = experiment_from_dict(
        {
            "name": "custom",
            "seed": 7,
            "rounds": 3,
            "data": {
                "dataset": "synthetic",
                "root": str(tmp_path),
                "num_clients": 8,
                "partition": "dirichlet",
                "alpha": 0.1,
                "test_per_client": 20,
            },
            "model": {"name": "cnn", "params": {"channels": [4, 8], "hidden": 16}},
            "training": {"local_steps": None, "local_epochs": 2, "optimizer": "adam", "prox_mu": 0.01},
            "strategy": {"params": {"server_momentum": 0.9}, "server_lr": 0.5},
            "selection": {"method": "full", "clients_per_round": 8},
            "runtime": {"device": "cpu", "min_completion": 0.5, "agents": 4},
        }
    )
    again = experiment_from_yaml(cfg.to_yaml())
    assert again == cfg
    path = tmp_path / "saved.yaml"
    path.write_text(cfg.to_yaml())
    assert load_experiment(path) == cfg


def test_agent_placement_is_replicated_unless_clients_run_dp_sgd() -> None:
    assert experiment_from_dict({}).agent_placement() == "replicated"
    dp = {"privacy": {"enabled": True}, "strategy": {"name": "fedfair"}}
    assert experiment_from_dict(dp).agent_placement() == "partitioned"  # record-level DP: one host per client
    assert experiment_from_dict({"runtime": {"placement": "partitioned"}}).agent_placement() == "partitioned"
    with pytest.raises(ConfigError, match=r"runtime\.placement: replicated agents would share record-level DP"):
        experiment_from_dict({**dp, "runtime": {"placement": "replicated"}})
    with pytest.raises(ConfigError, match="placement"):
        experiment_from_dict({"runtime": {"placement": "everywhere"}})


# --- privacy: the accountant's sound range (issue #18) ----------------------------------------------------------------

DP = {"strategy": {"name": "fedfair"}}  # fedfair: a strategy with a DP procedure


def dp_error(**privacy: Any) -> str:
    return error_of({**DP, "privacy": {"enabled": True, **privacy}})


@pytest.mark.parametrize(
    ("privacy", "message"),
    [
        # The hostile tester: ε = 0 was reported and granted for σ = 1e-156; 1e-300 / 1e300 crashed the ledger.
        ({"noise_multiplier": 1.0e-156}, "privacy.noise_multiplier: must be in [0.3, 10000]"),
        ({"noise_multiplier": 1.0e-300}, "privacy.noise_multiplier: must be in [0.3, 10000]"),
        ({"noise_multiplier": 1.0e300}, "privacy.noise_multiplier: must be in [0.3, 10000]"),
        ({"loss_noise_multiplier": 1.0e-156}, "privacy.loss_noise_multiplier: must be in [0.3, 10000]"),
        ({"sample_rate": 1.0e-300}, "privacy.sample_rate: must be in [1e-06, 1]"),
        ({"delta": 1.0e-300}, "privacy.delta: must be in [1e-12, 0.01]"),
        ({"delta": 0.5}, "privacy.delta: must be in [1e-12, 0.01]"),
        ({"epsilon": 1.0e300}, "privacy.epsilon: must be in [0.001, 100]"),
        ({"orders": [2.0, 1.0e300]}, "privacy.orders[1]: must be at most 10000"),
        ({"orders": [2.0] * 257}, "privacy.orders: at most 256 orders"),
        # joint_batch accounts σ_eff = (σ⁻² + σ_l⁻²)^(-1/2): 0.3 and 0.3 give 0.21, below the range.
        ({"mode": "joint_batch", "noise_multiplier": 0.3, "loss_noise_multiplier": 0.3}, "privacy.noise_multiplier: "),
    ],
)
def test_privacy_outside_the_accountants_sound_range_names_the_field(privacy: dict[str, Any], message: str) -> None:
    error = dp_error(**privacy)
    assert error.startswith(message), error
    assert "the range the privacy accountant handles soundly" in error or "at most" in error


def test_privacy_cross_section_sound_range() -> None:
    many = {"data": {"num_clients": 10**7}, "selection": {"clients_per_round": 1}}
    error = error_of({**many, "privacy": {"enabled": True, "principal": "federation"}})
    assert error.startswith("selection.clients_per_round: client-level DP samples q = 1 / 10000000"), error
    error = error_of({**DP, "training": {"local_steps": 10**6 + 1}, "privacy": {"enabled": True}})
    assert error.startswith("training.local_steps: 1000001 DP-SGD steps a round exceed 1000000"), error


def test_privacy_sound_range_bounds_and_no_loss_release_are_accepted() -> None:
    cfg = experiment_from_dict(
        {
            "strategy": {"name": "fedavg"},
            "privacy": {
                "enabled": True,
                "noise_multiplier": 0.3,
                "loss_noise_multiplier": 0.0,  # 0: no loss release, nothing to account
                "sample_rate": 1e-6,
                "delta": 1e-12,
                "epsilon": 100.0,
                "orders": [1.5, 10000.0],
            },
        }
    )
    assert cfg.privacy.loss_noise_multiplier == 0.0
    assert experiment_from_dict({**DP, "privacy": {"enabled": True, "noise_multiplier": 1e4}}).privacy.enabled
    assert not experiment_from_dict({"privacy": {"noise_multiplier": 1e-156}}).privacy.enabled  # off: not checked


def test_expect_mapping_names_the_path_and_the_valid_fields() -> None:
    assert expect_mapping({"a": 1}, ("a", "b"), "x") == {"a": 1}
    with pytest.raises(ConfigError, match=r"^claims\[2\]: expected a mapping with fields a, b, got list$"):
        expect_mapping([1], ("a", "b"), "claims[2]")
    with pytest.raises(ConfigError, match=r"^runs\[0\]: unknown field 'c'; valid fields: a, b$"):
        expect_mapping({"a": 1, "c": 2}, ("a", "b"), "runs[0]")
