"""Model files (fairfl/model_file.py): a run's model as safetensors that reproduces the run's model sha256, loads into
a freshly built model with the documented two lines, and refuses to load when altered. Also what writes them: the
engine's end of run (beside the checkpoint) and `fairfl model export`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from aggregator_service.engine import RoundEngine
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalSelector
from fairfl.compose.model_cmd import ModelCommandError, export_checkpoint
from fairfl.config import ExperimentConfig, experiment_from_dict
from fairfl.data.signature import DataSignature
from fairfl.model_file import (
    ModelFileError,
    ModelMetadata,
    build_model_from_file,
    flat_from_tensors,
    load_model_file,
    model_sha256,
    save_model,
    save_run_model,
)
from fairfl.models import build_model, build_run_model
from fairfl.params import ParamLayout, flatten_parameters
from fairfl.protocol import EVALUATE
from fairfl.v1 import control_pb2

SIGNATURE = DataSignature((1, 6, 6), 4)
# Five hidden layers: parameter names body.1 ... body.11, whose sorted order (safetensors stores tensors sorted) is not
# the model's, so the flat model can only be put back together through tensor_order.
HIDDEN = [5, 5, 5, 5, 5]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("mlp", SIGNATURE.input_shape, SIGNATURE.num_classes, hidden=HIDDEN)


def _metadata(**overrides: Any) -> ModelMetadata:
    fields: dict[str, Any] = {
        "run_id": "run-7",
        "round": 12,
        "model_name": "mlp",
        "model_params": {"hidden": HIDDEN},
        "data_signature": SIGNATURE,
    }
    return ModelMetadata(**{**fields, **overrides})


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, torch.nn.Module, ParamLayout, torch.Tensor]:
    model = _model(seed=1)
    layout, flat = ParamLayout.of(model), flatten_parameters(model)
    path = tmp_path / "model.safetensors"
    save_model(path, layout, flat, _metadata())
    return path, model, layout, flat


def test_the_file_holds_one_tensor_per_parameter_and_reproduces_the_engines_sha256(saved: Any) -> None:
    path, model, layout, flat = saved
    tensors, metadata = load_model_file(path)
    assert list(tensors) != list(layout.names)  # stored sorted: the order comes from the metadata
    assert metadata.tensor_order == layout.names
    for name, param in model.named_parameters():
        assert tensors[name].dtype == torch.float32
        assert torch.equal(tensors[name], param.detach())
    # The digest the engine publishes the model under (RoundEvent.model_sha256, results.json's final_model_sha256).
    engine_sha = layout.encode(flat).sha256
    assert metadata.sha256 == engine_sha == model_sha256(flat_from_tensors(tensors, metadata.tensor_order))
    assert (metadata.run_id, metadata.round, metadata.model_name) == ("run-7", 12, "mlp")
    assert metadata.model_params == {"hidden": HIDDEN} and metadata.data_signature == SIGNATURE
    with safe_open(str(path), framework="pt") as handle:
        raw = handle.metadata()
    assert raw["fairfl_format"] == "1" and raw["sha256"] == engine_sha and raw["round"] == "12"
    assert json.loads(raw["model"]) == {"name": "mlp", "params": {"hidden": HIDDEN}}
    assert json.loads(raw["data_signature"]) == {"input_shape": [1, 6, 6], "num_classes": 4, "feature_names": None}
    assert json.loads(raw["tensor_order"]) == list(layout.names)
    assert [p.name for p in path.parent.iterdir()] == ["model.safetensors"]  # the temporary file is gone


def test_the_two_documented_lines_load_it_into_a_fresh_model(saved: Any) -> None:
    path, model, _, _ = saved
    x = torch.randn(7, 36)
    expected = model(x)
    fresh = _model(seed=99)  # the user's own copy of the architecture, initialised differently
    assert not torch.equal(fresh(x), expected)
    fresh.load_state_dict(load_file(path))  # strict: the built-in models have parameters only, no buffers
    assert torch.equal(fresh(x), expected)
    rebuilt = build_model_from_file(path)  # from the metadata alone
    assert not rebuilt.training
    assert torch.equal(rebuilt(x), expected)


def test_rebuilding_leaves_the_callers_random_stream_alone(saved: Any) -> None:
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    build_model_from_file(saved[0])
    assert torch.equal(torch.rand(3), want)


def test_signature_feature_names_and_a_cnn_round_trip(tmp_path: Path) -> None:
    signature = DataSignature((3,), 2, ("age", "height", "weight"))
    torch.manual_seed(0)
    model = build_model("logreg", signature.input_shape, 2)
    path = tmp_path / "logreg.safetensors"
    save_model(
        path,
        ParamLayout.of(model),
        flatten_parameters(model),
        _metadata(model_name="logreg", model_params={}, data_signature=signature),
    )
    assert load_model_file(path)[1].data_signature == signature
    torch.manual_seed(0)
    cnn = build_model("cnn", (1, 12, 12), 3, channels=(2, 3), hidden=8, kernel_size=3)
    path = tmp_path / "cnn.safetensors"
    params = {"channels": [2, 3], "hidden": 8, "kernel_size": 3}
    save_model(
        path,
        ParamLayout.of(cnn),
        flatten_parameters(cnn),
        _metadata(model_name="cnn", model_params=params, data_signature=DataSignature((1, 12, 12), 3)),
    )
    x = torch.randn(2, 1, 12, 12)
    assert torch.equal(build_model_from_file(path)(x), cnn(x))


def _one_line(err: pytest.ExceptionInfo[ModelFileError]) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_changed_weight_is_refused(saved: Any) -> None:
    path = saved[0]
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + 20] ^= 0x40  # one bit of one weight
    path.write_bytes(bytes(data))
    load_file(path)  # still a valid safetensors file
    with pytest.raises(ModelFileError) as err:
        load_model_file(path)
    assert "sha256" in _one_line(err) and "altered or corrupted" in str(err.value)
    with pytest.raises(ModelFileError):
        build_model_from_file(path)


def test_a_changed_sha256_or_a_tensor_swapped_in_is_refused(saved: Any, tmp_path: Path) -> None:
    path, _, layout, _ = saved
    tensors, _ = load_model_file(path)
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
    forged = tmp_path / "forged.safetensors"
    save_file(tensors, str(forged), metadata={**meta, "sha256": "0" * 64})
    with pytest.raises(ModelFileError, match="its metadata says 0000"):
        load_model_file(forged)
    name = layout.names[0]
    save_file({**tensors, name: tensors[name] + 1}, str(forged), metadata=meta)
    with pytest.raises(ModelFileError, match="sha256"):
        load_model_file(forged)
    save_file({k: v for k, v in tensors.items() if k != name}, str(forged), metadata=meta)
    with pytest.raises(ModelFileError, match="tensor_order"):
        load_model_file(forged)


def test_files_that_are_not_fairfl_models_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no such model file") as err:
        load_model_file(tmp_path / "missing.safetensors")
    _one_line(err)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ModelFileError, match="not a readable safetensors file") as err:
        load_model_file(garbage)
    _one_line(err)
    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, str(plain))
    with pytest.raises(ModelFileError, match="not a FairFL model file") as err:
        load_model_file(plain)
    _one_line(err)
    later = tmp_path / "later.safetensors"
    save_file({"w": torch.zeros(2)}, str(later), metadata={"fairfl_format": "2"})
    with pytest.raises(ModelFileError, match="format '2'"):
        load_model_file(later)


def test_an_unexpected_model_is_not_written(tmp_path: Path) -> None:
    model = _model(seed=1)
    path = tmp_path / "model.safetensors"
    with pytest.raises(ModelFileError, match="expected 1111"):
        save_model(path, ParamLayout.of(model), flatten_parameters(model), _metadata(sha256="1" * 64))
    assert not path.exists() and not list(tmp_path.iterdir())


def test_a_model_factory_that_is_not_there_is_named(saved: Any, tmp_path: Path) -> None:
    _, _, layout, flat = saved
    other = tmp_path / "other.safetensors"
    save_model(other, layout, flat, _metadata(model_name="nowhere_pkg.models:net"))
    load_model_file(other)  # the weights are fine
    with pytest.raises(ModelFileError, match=r"cannot rebuild model 'nowhere_pkg\.models:net'") as err:
        build_model_from_file(other)
    _one_line(err)


# --- what writes them -------------------------------------------------------------------------------------------------

RUN = "model-file"


def _config(**overrides: Any) -> ExperimentConfig:
    base: dict[str, Any] = {
        "name": "model-file",
        "seed": 4,
        "rounds": 3,
        "data": {"dataset": "synthetic", "num_clients": 6},
        "model": {"name": "mlp", "params": {"hidden": [8]}},
        "training": {"local_steps": 2, "batch_size": 10, "lr": 0.1},
        "selection": {"clients_per_round": 3},
        "evaluation": {"every": 1},
        **overrides,
    }
    return experiment_from_dict(base)


def _engine(config: ExperimentConfig, events: list[control_pb2.RunEvent], directory: Path) -> RoundEngine:
    from aggregator_service.checkpoint import RunCheckpointer

    engine = RoundEngine(RUN, config, InProcessTransport(), LocalSelector("random"), LocalPrivacy(), events.append)
    engine.checkpointer = RunCheckpointer(directory, RUN, config)
    engine.checkpointer.start_fresh(engine)
    return engine


def _rounds(events: list[control_pb2.RunEvent]) -> list[control_pb2.RoundEvent]:
    return [e.round for e in events if e.HasField("round")]


def test_an_ended_run_leaves_its_model_beside_its_checkpoint_and_export_gives_the_same(tmp_path: Path) -> None:
    config = _config()
    events: list[control_pb2.RunEvent] = []
    directory = tmp_path / RUN
    summary = _engine(config, events, directory).run()
    assert summary.state == control_pb2.RUN_STATE_COMPLETED
    final = _rounds(events)[-1]
    tensors, metadata = load_model_file(directory / "model.safetensors")
    assert metadata.sha256 == final.model_sha256 and (metadata.run_id, metadata.round) == (RUN, 3)
    assert metadata.data_signature == DataSignature((60,), 10)  # the synthetic dataset's declaration
    assert torch.equal(flat_from_tensors(tensors, metadata.tensor_order), summary.final_params)
    for given in (directory, directory / "checkpoint.pb"):  # the run directory, or the file
        out = tmp_path / "exported.safetensors"
        exported = export_checkpoint(given, out)
        assert exported.sha256 == final.model_sha256 and exported.round == 3
        again, _ = load_model_file(out)
        assert all(torch.equal(again[name], tensors[name]) for name in tensors)
    x = torch.randn(4, 60)
    reference = build_run_model(config)
    reference.load_state_dict(load_file(directory / "model.safetensors"))
    assert torch.equal(build_model_from_file(out)(x), reference(x))


def test_a_run_stopped_after_aggregating_keeps_its_last_reported_model(tmp_path: Path) -> None:
    """Stopped during round 2's evaluation (its model aggregated, never reported): the run's model, in its summary,
    its checkpoint and its model file, is round 1's, the one results.json names as final."""
    config = _config()
    events: list[control_pb2.RunEvent] = []
    engine = _engine(config, events, tmp_path / RUN)
    execute = engine.transport.execute

    def stop_in_evaluation(tasks: list[Any], timeout: float, *args: Any, **kwargs: Any) -> Any:
        if tasks and tasks[0].round == 2 and tasks[0].phase == EVALUATE:
            engine.stop.set()
        return execute(tasks, timeout, *args, **kwargs)

    engine.transport.execute = stop_in_evaluation  # type: ignore[method-assign]
    summary = engine.run()
    assert summary.state == control_pb2.RUN_STATE_STOPPED
    rounds = _rounds(events)
    assert [r.round for r in rounds] == [1]
    assert model_sha256(summary.final_params) == rounds[-1].model_sha256
    _, metadata = load_model_file(tmp_path / RUN / "model.safetensors")
    assert (metadata.round, metadata.sha256) == (1, rounds[-1].model_sha256)
    assert export_checkpoint(tmp_path / RUN, tmp_path / "out.safetensors").sha256 == rounds[-1].model_sha256


def test_export_refuses_what_is_not_a_usable_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ModelCommandError, match=r"holds no checkpoint\.pb"):
        export_checkpoint(tmp_path, tmp_path / "out.safetensors")
    with pytest.raises(ModelCommandError, match="no such file"):
        export_checkpoint(tmp_path / "nothing.pb", tmp_path / "out.safetensors")
    broken = tmp_path / "checkpoint.pb"
    broken.write_bytes(b"\xff\xff\xff not a checkpoint")
    with pytest.raises(ModelCommandError, match="not a checkpoint") as err:
        export_checkpoint(broken, tmp_path / "out.safetensors")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out.safetensors").exists()


def test_export_refuses_a_checkpoint_model_that_is_not_its_rounds(tmp_path: Path) -> None:
    from aggregator_service.checkpoint import read_checkpoint
    from fairfl import codec

    events: list[control_pb2.RunEvent] = []
    directory = tmp_path / RUN
    _engine(_config(rounds=1), events, directory).run()
    path = directory / "checkpoint.pb"
    ckpt, _ = read_checkpoint(path)
    model = codec.tensor_from_proto(ckpt.model).clone()
    model[0] += 1.0
    ckpt.model.CopyFrom(codec.tensor_to_proto("model", model))
    path.write_bytes(ckpt.SerializeToString())
    with pytest.raises(ModelCommandError, match="expected") as err:
        export_checkpoint(directory, tmp_path / "out.safetensors")
    assert _rounds(events)[-1].model_sha256 in str(err.value)


def test_save_run_model_takes_the_runs_metadata(tmp_path: Path) -> None:
    config = _config()
    model = build_run_model(config)
    path = tmp_path / "m.safetensors"
    written = save_run_model(path, config, "r1", 0, ParamLayout.of(model), flatten_parameters(model))
    assert (written.model_name, written.model_params, written.round) == ("mlp", {"hidden": [8]}, 0)
    assert os.path.getsize(path) > 4 * ParamLayout.of(model).numel


# --- fetching from RunControl (a scripted aggregator) ----------------------------------------------------------------


class ScriptedControl:
    """RunControl as a running aggregator answers it: FetchModel streams `models` one call after another, GetRun
    answers `statuses` one call after another (the last ones repeat)."""

    def __init__(self, layout: ParamLayout, models: list[torch.Tensor], statuses: list[control_pb2.RunStatus]) -> None:
        self.layout, self.models, self.statuses = layout, models, statuses
        self.fetches = 0
        self.gets = 0

    def FetchModel(self, request: Any, timeout: float) -> Any:
        flat = self.models[min(self.fetches, len(self.models) - 1)]
        self.fetches += 1
        return self.layout.encode(flat).chunks()

    def GetRun(self, request: Any, timeout: float) -> control_pb2.RunStatus:
        status = self.statuses[min(self.gets, len(self.statuses) - 1)]
        self.gets += 1
        return status


class ScriptedTarget:
    def __init__(self, control: ScriptedControl) -> None:
        self.stub = control

    def control(self) -> Any:
        from contextlib import nullcontext

        return nullcontext(self.stub)

    def rpc_error(self, err: Any, run_id: str = "") -> Any:  # pragma: no cover - no call fails here
        raise AssertionError(err)


def _status(config: ExperimentConfig | None, round_number: int, sha: str, state: int) -> control_pb2.RunStatus:
    return control_pb2.RunStatus(
        run_id=RUN,
        state=state,
        round=round_number,
        model_sha256=sha,
        experiment_yaml=config.to_yaml() if config is not None else "",
    )


def test_fetch_waits_for_a_round_aggregated_but_not_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fairfl.compose import model_cmd

    monkeypatch.setattr(model_cmd, "POLL_S", 0.0)
    config = _config()
    model = build_run_model(config)
    layout = ParamLayout.of(model)
    round1, round2 = flatten_parameters(model), flatten_parameters(model) + 0.5
    running = control_pb2.RUN_STATE_RUNNING
    control = ScriptedControl(
        layout,
        [round2, round2],  # the engine holds round 2's aggregate while round 2's evaluation is out
        [
            _status(config, 1, model_sha256(round1), running),  # GetRun before the fetch
            _status(config, 1, model_sha256(round1), running),  # after it: round 2 not reported yet
            _status(config, 1, model_sha256(round1), running),  # still evaluating
            _status(config, 2, model_sha256(round2), running),  # reported
        ],
    )
    out = tmp_path / "fetched.safetensors"
    metadata = model_cmd.fetch_to_file(ScriptedTarget(control), RUN, out)
    assert (metadata.round, metadata.sha256) == (2, model_sha256(round2)) and control.fetches == 2
    assert "waiting for round 2" in capsys.readouterr().err
    assert load_model_file(out)[1].sha256 == model_sha256(round2)


def test_fetch_refuses_a_model_that_is_not_the_ended_runs(tmp_path: Path) -> None:
    from fairfl.compose import model_cmd

    config = _config()
    model = build_run_model(config)
    flat = flatten_parameters(model)
    ended = _status(config, 3, model_sha256(flat + 1), control_pb2.RUN_STATE_COMPLETED)
    control = ScriptedControl(ParamLayout.of(model), [flat], [ended])
    with pytest.raises(ModelCommandError, match="ended with model"):
        model_cmd.fetch_to_file(ScriptedTarget(control), RUN, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_fetch_takes_the_config_from_the_option_when_the_aggregator_sends_none(tmp_path: Path) -> None:
    import yaml

    from fairfl.compose import model_cmd

    config = _config()
    model = build_run_model(config)
    flat = flatten_parameters(model)
    ended = _status(None, 3, model_sha256(flat), control_pb2.RUN_STATE_COMPLETED)
    control = ScriptedControl(ParamLayout.of(model), [flat], [ended])
    with pytest.raises(ModelCommandError, match="pass --config"):
        model_cmd.fetch_to_file(ScriptedTarget(control), RUN, tmp_path / "x.safetensors")
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    metadata = model_cmd.fetch_to_file(ScriptedTarget(control), RUN, tmp_path / "x.safetensors", str(path))
    assert (metadata.round, metadata.model_params) == (3, {"hidden": [8]})


def test_the_end_of_fairfl_run_warns_instead_of_writing_another_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fairfl.compose.model_cmd import MODEL_FILE_NAME, save_final_model

    config = _config()
    events: list[control_pb2.RunEvent] = []
    engine = _engine(config, events, tmp_path / RUN)
    engine.run()
    rounds = _rounds(events)
    path = tmp_path / MODEL_FILE_NAME
    assert save_final_model(path, config, RUN, [], engine=engine) is None  # no round completed: no model
    assert save_final_model(path, config, RUN, rounds, engine=engine) == path
    assert load_model_file(path)[1].sha256 == rounds[-1].model_sha256
    path.unlink()
    assert save_final_model(path, config, RUN, rounds[:1], engine=engine) is None  # not round 1's model
    assert "model.safetensors not written" in capsys.readouterr().err and not path.exists()


def test_the_parser_knows_the_model_files_name() -> None:
    from fairfl.compose.model_cmd import MODEL_FILE_NAME
    from fairfl.model_file import MODEL_FILE_NAME as NAME

    assert MODEL_FILE_NAME == NAME
