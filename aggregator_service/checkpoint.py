"""Run checkpoints: the aggregator saves a run after every round and a restarted aggregator resumes it.

A run's directory (`<checkpoint dir>/<run id>/`) holds three files, each written so that a crash at any instant
leaves a usable state (docs/reliability.md):

- `rounds.log`: the run's RoundEvents, appended (length-prefixed protobuf) and fsynced before the checkpoint that
  covers them; records beyond the checkpoint's count (a crash between the two writes) are dropped on resume.
- `checkpoint.pb`: a `fairfl.v1.Checkpoint` replaced atomically (temp file, fsync, rename, fsync of the directory)
  when the run starts and after every round: config, round, model, strategy / DP / privacy-gate / selector state,
  RNG states, and the key of the run's task ids (a resumed run issues the same ids for the same tasks).
- `pending.pb`: the round about to be authorised by the privacy gate, written before the ledger call (selection and
  candidate count), so a resumed run re-runs that round with the same selection and the ledger recognises the
  identical authorisation (or, if the crash came before the ledger call, records it for the first time).

Nothing is pickled: state trees are JSON with tensors as raw little-endian bytes (fairfl.codec).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from fairfl import codec, telemetry
from fairfl.config import ConfigError, ExperimentConfig, experiment_from_yaml
from fairfl.model_file import MODEL_FILE_NAME, ModelFileError, save_run_model
from fairfl.params import ParamLayout
from fairfl.v1 import checkpoint_pb2, control_pb2

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RoundEngine(Protocol):
    """What a checkpoint saves of a run's engine and puts back (aggregator_service.engine.RoundEngine has it); a
    protocol, so this module does not import the engine that imports it."""

    @property
    def config(self) -> ExperimentConfig: ...

    @property
    def strategy(self) -> Stateful: ...

    @property
    def dp(self) -> Stateful | None: ...

    @property
    def privacy(self) -> Any: ...  # the privacy gate; saved when it keeps state (the in-memory ledger)

    @property
    def selector(self) -> Any: ...

    layout: ParamLayout
    params: torch.Tensor
    task_key: bytes
    failed_rounds: int
    round: int
    completed_round: int
    start_round: int
    replay: tuple[int, list[int], int] | None


FORMAT_VERSION = 1
CHECKPOINT_FILE = "checkpoint.pb"
EVENTS_FILE = "rounds.log"
PENDING_FILE = "pending.pb"
_LENGTH = struct.Struct("<I")
_SAFE_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class CheckpointError(Exception):
    """A checkpoint cannot be written, read or applied; the message says which file and why."""


# --- files ------------------------------------------------------------------------------------------------------------


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a reader (or a crash) sees the old or the new file, never a mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)  # the rename itself must survive a power loss


def run_directory(root: str | Path, run_id: str) -> Path:
    """`root/run_id`; the run id must be one safe path component (it names a directory on the aggregator)."""
    if not _SAFE_RUN_ID.match(run_id):
        raise CheckpointError(
            f"run id {run_id!r} cannot name a checkpoint directory: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return Path(root) / run_id


def _read_events(path: Path, count: int) -> tuple[list[control_pb2.RoundEvent], int]:
    """The first `count` round events of the log and the byte offset after them."""
    events: list[control_pb2.RoundEvent] = []
    data = path.read_bytes() if path.exists() else b""
    offset = 0
    while len(events) < count:
        if offset + _LENGTH.size > len(data):
            raise CheckpointError(f"{path}: holds {len(events)} round events, the checkpoint covers {count}")
        (size,) = _LENGTH.unpack_from(data, offset)
        start, offset = offset + _LENGTH.size, offset + _LENGTH.size + size
        if offset > len(data):
            raise CheckpointError(f"{path}: record {len(events) + 1} is cut short")
        event = control_pb2.RoundEvent()
        event.ParseFromString(data[start:offset])
        events.append(event)
    return events, offset


# --- state trees (JSON + tensors) ---------------------------------------------------------------------------------


def encode_state(tree: Any) -> tuple[str, list[checkpoint_pb2.StateTensor]]:
    """A state tree (dicts, lists, tuples, numbers, strings, None, torch tensors, numpy arrays) as JSON + tensors."""
    tensors: list[checkpoint_pb2.StateTensor] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor | np.ndarray):
            is_numpy = isinstance(node, np.ndarray)
            value = node if is_numpy else node.detach().cpu()
            tensors.append(checkpoint_pb2.StateTensor(tensor=codec.tensor_to_proto("", value), numpy=is_numpy))
            return {"__tensor__": len(tensors) - 1}
        if isinstance(node, dict):
            if all(isinstance(k, str) for k in node) and "__tensor__" not in node and "__items__" not in node:
                return {k: walk(v) for k, v in node.items()}
            return {"__items__": [[walk(k), walk(v)] for k, v in node.items()]}  # non-string keys keep their type
        if isinstance(node, list | tuple):
            return [walk(v) for v in node]
        if isinstance(node, np.generic):
            return node.item()
        if node is None or isinstance(node, bool | int | float | str):
            return node
        raise CheckpointError(f"cannot checkpoint a {type(node).__name__} (state must be JSON data or tensors)")

    return json.dumps(walk(tree), allow_nan=True), tensors


def decode_state(text: str, tensors: list[checkpoint_pb2.StateTensor]) -> Any:
    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if set(node) == {"__tensor__"}:
                entry = tensors[int(node["__tensor__"])]
                value = codec.tensor_from_proto(entry.tensor).clone()
                return value.numpy() if entry.numpy else value
            if set(node) == {"__items__"}:
                return {_hashable(walk(k)): walk(v) for k, v in node["__items__"]}
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    try:
        return walk(json.loads(text))
    except (ValueError, IndexError, codec.CodecError) as err:
        raise CheckpointError(f"checkpoint state cannot be decoded: {err}") from err


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def _rng_state() -> dict[str, Any]:
    """Process-global generators. The engine derives its own randomness from (seed, round, client), but a strategy
    or library may draw from these, and a resumed run must continue their streams."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()  # keys travel as int64 (no uint32 wire dtype)
    return {
        # One tensor, not 625 JSON numbers: the state tree is walked value by value, every round.
        "python": [version, np.asarray(internal, dtype=np.int64), gauss],
        "numpy": [name, np.asarray(keys, dtype=np.int64), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(np.asarray(internal).tolist()), gauss))  # a list in checkpoints before 2026-11
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].to(torch.uint8))


def _component_state(component: Any) -> Any:
    """State of an optional checkpointable component (privacy gate, selector): None when it keeps none."""
    state_dict: Callable[[], Any] | None = getattr(component, "state_dict", None)
    return state_dict() if callable(state_dict) else None


def _load_component(component: Any, state: Any, what: str) -> None:
    if state is None:
        return
    load: Callable[[Any], None] | None = getattr(component, "load_state_dict", None)
    if not callable(load):
        raise CheckpointError(f"the checkpoint holds {what} state but this aggregator's {what} cannot load it")
    load(state)


# --- loading ----------------------------------------------------------------------------------------------------------


@dataclass
class Loaded:
    """A run's checkpoint as read from its directory."""

    directory: Path
    checkpoint: checkpoint_pb2.Checkpoint
    config: ExperimentConfig
    rounds: list[control_pb2.RoundEvent]
    events_offset: int  # bytes of rounds.log the checkpoint covers
    pending: checkpoint_pb2.PendingRound | None

    @property
    def run_id(self) -> str:
        return self.checkpoint.run_id


def read_checkpoint(path: Path) -> tuple[checkpoint_pb2.Checkpoint, ExperimentConfig]:
    """One checkpoint file and its experiment config; CheckpointError naming the file when it is unusable."""
    checkpoint = checkpoint_pb2.Checkpoint()
    try:
        checkpoint.ParseFromString(path.read_bytes())
    except Exception as err:  # protobuf raises DecodeError (a Message error) on malformed input
        raise CheckpointError(f"{path}: not a checkpoint ({err})") from err
    if checkpoint.format_version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {checkpoint.format_version}, this aggregator reads {FORMAT_VERSION}"
        )
    try:
        config = experiment_from_yaml(checkpoint.experiment_yaml)
    except ConfigError as err:
        raise CheckpointError(f"{path}: its experiment config no longer validates: {err}") from err
    return checkpoint, config


def load(directory: Path) -> Loaded | None:
    """The run's checkpoint, or None when the directory holds none. Raises CheckpointError when it is unusable."""
    path = directory / CHECKPOINT_FILE
    if not path.exists():
        return None
    checkpoint, config = read_checkpoint(path)
    rounds, offset = _read_events(directory / EVENTS_FILE, checkpoint.events)
    pending: checkpoint_pb2.PendingRound | None = checkpoint_pb2.PendingRound()
    pending_path = directory / PENDING_FILE
    if pending_path.exists():
        pending.ParseFromString(pending_path.read_bytes())
        if pending.run_id != checkpoint.run_id or pending.round != checkpoint.round + 1:
            pending = None  # an older round's record: that round completed and is in the checkpoint
    else:
        pending = None
    return Loaded(directory, checkpoint, config, rounds, offset, pending)


def find_unfinished(root: str | Path) -> list[Loaded]:
    """Checkpoints under `root` of runs that had not ended, most recently saved first; unusable ones are logged."""
    found: list[Loaded] = []
    base = Path(root)
    if not base.is_dir():
        return found
    for directory in sorted(p for p in base.iterdir() if p.is_dir()):
        try:
            loaded = load(directory)
        except CheckpointError as err:
            log.error("ignoring checkpoint in %s: %s", directory, err)
            continue
        if loaded is not None and not loaded.checkpoint.finished:
            found.append(loaded)
    return sorted(found, key=lambda c: c.checkpoint.saved_unix, reverse=True)


# --- writing and restoring --------------------------------------------------------------------------------------------


class RunCheckpointer:
    """Writes one run's checkpoints; the engine calls it after authorising a round, after each round and at the end."""

    def __init__(self, directory: Path, run_id: str, config: ExperimentConfig) -> None:
        self.directory = directory
        self.run_id = run_id
        self.config_yaml = config.to_yaml()
        self.events = 0
        self.events_offset = 0
        directory.mkdir(parents=True, exist_ok=True)

    def start_fresh(self, engine: RoundEngine | None = None) -> None:
        """A new run in this directory: no earlier files may leak into it. With `engine`, its starting point is saved
        (round 0), so a run killed before its first round completed resumes too (its authorised round 1 included)."""
        for name in (CHECKPOINT_FILE, EVENTS_FILE, PENDING_FILE, MODEL_FILE_NAME):
            (self.directory / name).unlink(missing_ok=True)
        if engine is not None:
            self._write(engine)

    def planned(self, round_number: int, selected: list[int], population: int) -> None:
        """The round about to be authorised (written before the ledger call, see RoundEngine._run_round)."""
        record = checkpoint_pb2.PendingRound(
            run_id=self.run_id, round=round_number, selected=selected, population=population
        )
        atomic_write(self.directory / PENDING_FILE, record.SerializeToString())

    def completed(self, engine: RoundEngine, event: control_pb2.RoundEvent) -> None:
        """Append the round's event, then replace the checkpoint; observed in fairfl_checkpoint_duration_seconds."""
        with telemetry.CHECKPOINT_DURATION.time():
            payload = event.SerializeToString()
            with open(self.directory / EVENTS_FILE, "r+b" if self.events_offset else "wb") as fh:
                fh.seek(self.events_offset)
                fh.write(_LENGTH.pack(len(payload)) + payload)
                fh.truncate()
                fh.flush()
                os.fsync(fh.fileno())
            self.events += 1
            self.events_offset += _LENGTH.size + len(payload)
            self._write(engine)

    def finished(self, engine: RoundEngine, state: int, message: str) -> None:
        """Mark the run ended, so a restarted aggregator does not resume it; its model (that of its last completed
        round) goes to model.safetensors beside the checkpoint (fairfl.model_file)."""
        self._write(engine, final=(control_pb2.RunState.Name(state), message))  # type: ignore[arg-type]
        if engine.completed_round > 0:
            try:
                save_run_model(
                    self.directory / MODEL_FILE_NAME,
                    engine.config,
                    self.run_id,
                    engine.completed_round,
                    engine.layout,
                    engine.params,
                )
            except (ModelFileError, ConfigError) as err:  # the checkpoint stands; `fairfl model export` reads it
                log.error("run %s: model file not written: %s", self.run_id, err)

    def _write(self, engine: RoundEngine, final: tuple[str, str] | None = None) -> None:
        state = {
            "strategy": engine.strategy.state_dict(),
            "dp": engine.dp.state_dict() if engine.dp is not None else None,
            "privacy": _component_state(engine.privacy),
            "selector": _component_state(engine.selector),
            "selection": _component_state(getattr(engine, "selection", None)),  # the engine's selection driver
            "failed_rounds": engine.failed_rounds,
            "rng": _rng_state(),
        }
        state_json, tensors = encode_state(state)
        checkpoint = checkpoint_pb2.Checkpoint(
            format_version=FORMAT_VERSION,
            run_id=self.run_id,
            experiment_yaml=self.config_yaml,
            round=engine.completed_round,
            model=codec.tensor_to_proto("model", engine.params.detach().to(torch.float32).contiguous()),
            state_json=state_json,
            tensors=tensors,
            events=self.events,
            saved_unix=time.time(),
            finished=final is not None,
            final_state=final[0] if final else "",
            final_message=final[1] if final else "",
            task_id_key=engine.task_key,
        )
        atomic_write(self.directory / CHECKPOINT_FILE, checkpoint.SerializeToString())

    def restore(self, engine: RoundEngine, loaded: Loaded) -> None:
        """Put the engine where the checkpoint left the run: the next round to run is checkpoint.round + 1."""
        ckpt = loaded.checkpoint
        if ckpt.run_id != self.run_id:
            raise CheckpointError(f"checkpoint of run {ckpt.run_id!r} cannot resume run {self.run_id!r}")
        if loaded.config.to_dict() != engine.config.to_dict():
            raise CheckpointError(
                f"run {self.run_id!r} was checkpointed with a different experiment config; resume it with the same "
                "config or start a new run id"
            )
        params = codec.tensor_from_proto(ckpt.model).reshape(-1).clone()
        if params.shape != engine.params.shape:
            raise CheckpointError(
                f"checkpoint model has {params.numel()} parameters, the run's model {engine.params.numel()}"
            )
        state = decode_state(ckpt.state_json, list(ckpt.tensors))
        engine.params = params
        if ckpt.task_id_key:  # checkpoints from before task ids were keyed have none: the run keeps its new key
            engine.task_key = bytes(ckpt.task_id_key)
        engine.strategy.load_state_dict(state["strategy"])
        if engine.dp is not None and state["dp"] is not None:
            engine.dp.load_state_dict(state["dp"])
        _load_component(engine.privacy, state["privacy"], "privacy gate")
        _load_component(engine.selector, state["selector"], "selector")
        _load_component(getattr(engine, "selection", None), state.get("selection"), "selection driver")
        # A failed run resumed on request gets a fresh allowance of failed rounds; an interrupted one keeps its count.
        engine.failed_rounds = 0 if ckpt.finished else int(state["failed_rounds"])
        _set_rng_state(state["rng"])
        engine.round = engine.completed_round = ckpt.round
        engine.start_round = ckpt.round + 1
        pending = loaded.pending
        engine.replay = (pending.round, list(pending.selected), pending.population) if pending else None
        self.events, self.events_offset = len(loaded.rounds), loaded.events_offset
        log.info(
            "run %s resumes after round %d of %d%s",
            self.run_id,
            ckpt.round,
            engine.config.rounds,
            f"; round {pending.round} was authorised before the restart and is re-run as authorised" if pending else "",
        )
