"""`fairfl model export|fetch`: write a run's model as a safetensors file (fairfl.model_file), and the hook that writes
`<out>/model.safetensors` at the end of `fairfl run`.

- `fairfl model export CHECKPOINT --out FILE`: the model of an aggregator checkpoint (a run directory under the
  aggregator's --checkpoint-dir, or its checkpoint.pb), cross-checked against the run's round log when it is there.
- `fairfl model fetch RUN --out FILE --aggregator ADDR [--tls-dir DIR | --insecure]`: the model of a run on a running
  aggregator (RunControl.FetchModel, its sha256 verified), with the run's config from GetRun for the metadata.

Exit codes: 0 written, 1 the aggregator cannot be reached, 2 anything else (a missing or corrupt checkpoint, an
unknown run, a model that is not the run's): one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from fairfl.rpc_security import add_transport_arguments, security_from_args
from fairfl.v1 import control_pb2, tensor_pb2

if TYPE_CHECKING:  # torch and what needs it are imported where used: registering the parser must stay cheap
    import torch

    from fairfl.config import ExperimentConfig
    from fairfl.model_file import ModelMetadata
    from fairfl.params import ParamLayout

MODEL_FILE_NAME = "model.safetensors"  # = fairfl.model_file.MODEL_FILE_NAME (importing it would import torch)
EXIT_OK, EXIT_UNREACHABLE, EXIT_ERROR = 0, 1, 2
FETCH_TIMEOUT_S = 600.0  # one FetchModel stream (large models on slow links)
SETTLE_S = 600.0  # how long a fetch from a running run waits for a round between aggregation and its report
POLL_S = 0.5
TERMINAL = {control_pb2.RUN_STATE_COMPLETED, control_pb2.RUN_STATE_STOPPED, control_pb2.RUN_STATE_FAILED}


class ModelCommandError(Exception):
    """One line for stderr and the exit code it ends with."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


# --- FetchModel ---------------------------------------------------------------------------------------------------


def fetch_model(control: Any, run_id: str, timeout: float = FETCH_TIMEOUT_S) -> tuple[ParamLayout, torch.Tensor, str]:
    """A run's current global model from RunControl.FetchModel: its layout (the header's tensor specs), the flat
    float32 vector and its sha256, which the stream's header declares and is checked against the bytes received
    (codec.CodecError when they differ). grpc.RpcError passes through."""
    import torch

    from fairfl import codec
    from fairfl.params import ParamLayout

    header, tensors = codec.receive_bundle(
        control.FetchModel(control_pb2.GetRunRequest(run_id=run_id), timeout=timeout)
    )
    for spec in header.tensors:
        if spec.dtype != tensor_pb2.DTYPE_FLOAT32:
            raise codec.CodecError(f"tensor {spec.name!r} arrived as {codec.dtype_name(spec.dtype)}, not float32")
    layout = ParamLayout(tuple(s.name for s in header.tensors), tuple(tuple(s.shape) for s in header.tensors))
    flat = torch.cat([t.reshape(-1) for _, t in tensors]) if tensors else torch.zeros(0)  # a copy: the buffer is pooled
    return layout, flat, header.sha256


# --- the end of `fairfl run` --------------------------------------------------------------------------------------


def save_final_model(
    path: Path,
    config: ExperimentConfig,
    run_id: str,
    rounds: Sequence[control_pb2.RoundEvent],
    engine: Any = None,
    control: Any = None,
) -> Path | None:
    """Write the final model of a run `fairfl run` drove to `path` (its results directory's model.safetensors):
    the in-process `engine`'s, or fetched over `control` (a RunControlStub, while the services are still up). It
    must be the model of the last round reported (`rounds`), whose sha256 results.json records as
    final_model_sha256. Returns the path, or None with a warning on stderr (the run's results stand without it)."""
    from fairfl import codec
    from fairfl.config import ConfigError
    from fairfl.model_file import ModelFileError, save_run_model

    if not rounds:
        return None  # no round completed: there is no trained model (results.json's final_model_sha256 is null)
    last = rounds[-1]
    try:
        if engine is not None:
            layout, flat = engine.layout, engine.params
        elif control is not None:
            layout, flat, _ = fetch_model(control, run_id)
        else:
            raise ValueError("save_final_model needs the engine or a RunControl stub")
        save_run_model(path, config, run_id, last.round, layout, flat, expected_sha256=last.model_sha256)
    except (ModelFileError, ConfigError, codec.CodecError) as err:
        print(f"warning: {path.name} not written: {_first_line(err)}", file=sys.stderr, flush=True)
        return None
    except grpc.RpcError as err:
        print(
            f"warning: {path.name} not written: FetchModel answered {err.code().name}: {err.details()}",
            file=sys.stderr,
            flush=True,
        )
        return None
    return path


# --- fairfl model export ------------------------------------------------------------------------------------------


def export_checkpoint(checkpoint: Path, out: Path) -> ModelMetadata:
    """Write the model of an aggregator checkpoint (a run directory or its checkpoint.pb) to `out`."""
    import torch

    from aggregator_service.checkpoint import CHECKPOINT_FILE, EVENTS_FILE, CheckpointError, load, read_checkpoint
    from fairfl import codec
    from fairfl.config import ConfigError
    from fairfl.model_file import ModelFileError, save_run_model
    from fairfl.models import build_run_model
    from fairfl.params import ParamLayout

    path = checkpoint / CHECKPOINT_FILE if checkpoint.is_dir() else checkpoint
    if not path.is_file():
        where = f"{checkpoint} holds no {CHECKPOINT_FILE}" if checkpoint.is_dir() else f"{checkpoint}: no such file"
        raise ModelCommandError(
            f"{where}: pass a run directory under the aggregator's --checkpoint-dir (or the {CHECKPOINT_FILE} in it)"
        )
    try:
        ckpt, config = read_checkpoint(path)
        if not ckpt.HasField("model"):
            raise ModelCommandError(f"{path}: the checkpoint holds no model")
        flat = codec.tensor_from_proto(ckpt.model).reshape(-1).to(torch.float32).clone()
        layout = ParamLayout.of(build_run_model(config))
    except (CheckpointError, ConfigError, codec.CodecError) as err:
        raise ModelCommandError(_first_line(err)) from None
    if flat.numel() != layout.numel:
        raise ModelCommandError(
            f"{path}: the checkpoint's model has {flat.numel()} values, model {config.model.name!r} of its config "
            f"{layout.numel}"
        )
    expected = ""
    if path.name == CHECKPOINT_FILE and (path.parent / EVENTS_FILE).exists() and ckpt.events:
        try:
            loaded = load(path.parent)
        except CheckpointError as err:
            print(f"note: {_first_line(err)}; the model is not checked against the round log", file=sys.stderr)
        else:
            if loaded is not None and loaded.rounds and loaded.rounds[-1].round == ckpt.round:
                expected = loaded.rounds[-1].model_sha256  # the checkpoint's model is that of its last round
    try:
        return save_run_model(out, config, ckpt.run_id, ckpt.round, layout, flat, expected_sha256=expected)
    except ModelFileError as err:
        raise ModelCommandError(_first_line(err)) from None


def cmd_export(args: argparse.Namespace) -> int:
    metadata = export_checkpoint(Path(args.checkpoint), Path(args.out))
    _report(Path(args.out), metadata)
    return EXIT_OK


# --- fairfl model fetch -------------------------------------------------------------------------------------------


def _run_config(status: control_pb2.RunStatus, config_path: str, run_id: str) -> ExperimentConfig:
    """The run's experiment config: what GetRun sends (RunStatus.experiment_yaml), else --config."""
    from fairfl.config import ConfigError, experiment_from_yaml, load_experiment

    try:
        if status.experiment_yaml:
            return experiment_from_yaml(status.experiment_yaml)
        if config_path:
            return load_experiment(config_path)
    except ConfigError as err:
        raise ModelCommandError(
            f"run {run_id}'s config does not validate here ({_first_line(err)}); install the plug-ins it names"
        ) from None
    raise ModelCommandError(
        f"the aggregator sent no config for run {run_id} (an older aggregator); pass --config EXPERIMENT.yaml, the "
        "config the run was started with"
    )


def fetch_to_file(target: Any, run_id: str, out: Path, config_path: str = "") -> ModelMetadata:
    """Fetch run `run_id`'s model from `target` (fairfl.compose.operate.Target) into `out`. The model is that of the
    round GetRun reports: an ended run's final model, or a running run's latest (fetched again while a round sits
    between aggregation and its report)."""
    from fairfl import codec
    from fairfl.compose.operate import CALL_TIMEOUT_S
    from fairfl.config import ConfigError
    from fairfl.model_file import ModelFileError, save_run_model

    def failed(err: grpc.RpcError) -> ModelCommandError:
        refused = target.rpc_error(err, run_id)  # operate's wording and exit code (1: unreachable, 2: bad input)
        return ModelCommandError(str(refused), refused.code)

    def get(control: Any) -> control_pb2.RunStatus:
        try:
            status: control_pb2.RunStatus = control.GetRun(
                control_pb2.GetRunRequest(run_id=run_id), timeout=CALL_TIMEOUT_S
            )
            return status
        except grpc.RpcError as err:
            raise failed(err) from None

    with target.control() as control:
        status = get(control)
        config = _run_config(status, config_path, run_id)
        deadline = time.monotonic() + SETTLE_S
        while True:
            try:
                layout, flat, sha256 = fetch_model(control, run_id)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise ModelCommandError(f"run {run_id}: {err.details()}") from None
                raise failed(err) from None
            except codec.CodecError as err:
                raise ModelCommandError(f"the model of run {run_id} arrived damaged: {_first_line(err)}") from None
            status = get(control)
            if not status.model_sha256 or status.model_sha256 == sha256:
                break
            if status.state in TERMINAL:
                raise ModelCommandError(
                    f"run {run_id} ended with model {status.model_sha256}, but the aggregator sent {sha256}"
                )
            # A running run's model aggregated in a round not reported yet (its evaluation is out): wait for the
            # round's report, so the file is a reported round's model with its sha256, then fetch again.
            print(f"note: run {run_id}: waiting for round {status.round + 1} to be reported", file=sys.stderr)
            reported = status.round
            while status.round == reported and status.state not in TERMINAL:
                if time.monotonic() > deadline:
                    raise ModelCommandError(
                        f"run {run_id} is running and round {reported + 1} was not reported within {SETTLE_S:g}s; "
                        "fetch again, or when the run has ended"
                    )
                time.sleep(POLL_S)
                status = get(control)
    if status.state not in TERMINAL:
        print(f"note: run {run_id} is still running: this is its model after round {status.round}", file=sys.stderr)
    try:
        return save_run_model(out, config, run_id, status.round, layout, flat, expected_sha256=status.model_sha256)
    except (ModelFileError, ConfigError) as err:
        raise ModelCommandError(_first_line(err)) from None


def cmd_fetch(args: argparse.Namespace) -> int:
    from fairfl.compose.operate import Target

    try:
        security = security_from_args(args)
    except ValueError as err:
        raise ModelCommandError(str(err)) from None
    metadata = fetch_to_file(Target(args.aggregator, security), args.run, Path(args.out), args.config)
    _report(Path(args.out), metadata)
    return EXIT_OK


# --- the parser -----------------------------------------------------------------------------------------------------


def _report(out: Path, metadata: ModelMetadata) -> None:
    print(
        f"wrote {out}: run {metadata.run_id}, round {metadata.round}, model {metadata.model_name}, "
        f"{len(metadata.tensor_order)} tensors, sha256 {metadata.sha256}"
    )


def _command(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except ModelCommandError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            return err.code
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr, flush=True)
            return 130

    return run


def add_model_parser(sub: Any) -> None:
    """`fairfl model export|fetch` on the `fairfl` command's subparsers."""
    from fairfl.compose.operate import ADDRESS_ENV, DEFAULT_ADDRESS

    model = sub.add_parser(
        "model",
        help="write a run's model as a safetensors file (from a checkpoint, or fetched from a running aggregator)",
        description="Write a run's global model as a safetensors file: one float32 tensor per parameter, named as in "
        "model.named_parameters(), with the run, round, model, data signature and sha256 in its metadata. Load it "
        "into your model with model.load_state_dict(safetensors.torch.load_file(FILE)), or rebuild it with "
        "fairfl.model_file.build_model_from_file(FILE). Exit codes: 0 written, 1 the aggregator cannot be reached, "
        "2 any other error.",
    )
    commands = model.add_subparsers(dest="model_command", required=True, metavar="COMMAND")
    export = commands.add_parser(
        "export",
        help="the model of an aggregator checkpoint (a run directory, or its checkpoint.pb)",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="run directory under --checkpoint-dir, or the file")
    export.add_argument("--out", required=True, metavar="FILE", help=f"where to write it (e.g. {MODEL_FILE_NAME})")
    export.set_defaults(func=_command(cmd_export))
    fetch = commands.add_parser(
        "fetch",
        help="the model of a run on a running aggregator (RunControl.FetchModel, with the operator's identity)",
    )
    fetch.add_argument("run", metavar="RUN", help="run id (see `fairfl runs list`)")
    fetch.add_argument("--out", required=True, metavar="FILE", help=f"where to write it (e.g. {MODEL_FILE_NAME})")
    fetch.add_argument(
        "--aggregator",
        default=os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS),
        metavar="ADDR",
        help=f"the aggregator's host:port (env {ADDRESS_ENV}; default {DEFAULT_ADDRESS})",
    )
    fetch.add_argument(
        "--config",
        default="",
        metavar="EXPERIMENT.yaml",
        help="the run's config, for an aggregator that does not send it with the run's status",
    )
    add_transport_arguments(fetch, server=False)
    fetch.set_defaults(func=_command(cmd_fetch))
