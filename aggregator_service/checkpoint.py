"""Run checkpoints: the aggregator saves a run after every round and a restarted aggregator resumes it.

A run's directory (`<checkpoint dir>/<run id>/`) holds three files, each written so that a crash at any instant
leaves a usable state (docs/reliability.md):

- `rounds.log`: the run's RoundEvents, appended (length-prefixed protobuf) and fsynced before the checkpoint that
  covers them; records beyond the checkpoint's count (a crash between the two writes) are dropped on resume.
- `checkpoint.pb`: a `fairfl.v1.Checkpoint` replaced atomically (temp file, fsync, rename, fsync of the directory)
  when the run starts and after every round: config, round, model, strategy / DP / privacy-gate / selector state,
  RNG states, and the key of the run's task ids (a resumed run issues the same ids for the same tasks).
- `pending.pb`: every round authorised by the privacy gate and not yet in the checkpoint, each appended (and
  fdatasynced) before its ledger call (selection and candidate count), so a resumed run re-runs those rounds with the
  same selections and the ledger recognises the identical authorisations (or, if the crash came before the ledger
  call, records the last for the first time). Older aggregators wrote one bare PendingRound here; it still reads.

A round's checkpoint is written off the round's critical path: the engine snapshots its state when the round ends
and a writer thread (one, in round order) appends the event, replaces the checkpoint and only then reports the
round (`completed`'s `emit`), while the next round already trains. So a reported round is always on disk, and a
crash while a write is in flight loses no reported round: the round it was writing was authorised, so it is in
`pending.pb` and is re-run as authorised, with the next one (see RunCheckpointer).

Nothing is pickled: state trees are JSON with tensors as raw little-endian bytes (fairfl.codec).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
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
    replay: dict[int, tuple[list[int], int]]  # round -> (selected, population) authorised before a crash


FORMAT_VERSION = 1
AGGREGATOR, INPROCESS = "aggregator", "inprocess"  # who wrote a checkpoint (Loaded.origin)
CHECKPOINT_FILE = "checkpoint.pb"
EVENTS_FILE = "rounds.log"
PENDING_FILE = "pending.pb"
_LENGTH = struct.Struct("<I")
# pending.pb as a log: this magic, then (length, crc32, PendingRound) records. A bare PendingRound (older aggregators)
# starts with field 1's tag (0x0a), never with this.
PENDING_MAGIC = b"FFPENDING1\n"
_PENDING_HEADER = struct.Struct("<II")
PENDING_COMPACT_BYTES = 64 * 1024  # past this the log is rewritten with only the rounds a resume could still need
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


def _pending_record(record: checkpoint_pb2.PendingRound) -> bytes:
    payload = record.SerializeToString()
    return _PENDING_HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def _read_pending(path: Path) -> list[checkpoint_pb2.PendingRound]:
    """The authorised rounds `path` records, in the order written; a torn last record (a crash mid-append, before
    that round's ledger call) ends the log."""
    if not path.exists():
        return []
    data = path.read_bytes()
    if not data.startswith(PENDING_MAGIC):  # an older aggregator's single record
        legacy = checkpoint_pb2.PendingRound()
        try:
            legacy.ParseFromString(data)
        except Exception as err:  # protobuf's DecodeError
            raise CheckpointError(f"{path}: not a pending-round record ({err})") from err
        return [legacy]
    records: list[checkpoint_pb2.PendingRound] = []
    offset = len(PENDING_MAGIC)
    while offset + _PENDING_HEADER.size <= len(data):
        size, crc = _PENDING_HEADER.unpack_from(data, offset)
        start, end = offset + _PENDING_HEADER.size, offset + _PENDING_HEADER.size + size
        if end > len(data) or zlib.crc32(data[start:end]) != crc:
            break
        record = checkpoint_pb2.PendingRound()
        record.ParseFromString(data[start:end])
        records.append(record)
        offset = end
    return records


def _still_pending(
    records: list[checkpoint_pb2.PendingRound], run_id: str, after: int
) -> list[checkpoint_pb2.PendingRound]:
    """The rounds after `after` (the checkpoint's) that were authorised, each its newest record, consecutive from
    `after + 1`: a record of an older round is in the checkpoint already."""
    newest = {r.round: r for r in records if r.run_id == run_id and r.round > after}
    out: list[checkpoint_pb2.PendingRound] = []
    while (record := newest.get(after + 1 + len(out))) is not None:
        out.append(record)
    return out


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


def _write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a short write would leave a torn record before the next ones)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def snapshot_state(tree: Any) -> Any:
    """A copy of a state tree that the run can no longer change (a strategy's velocity is updated in place next
    round): containers copied, tensors cloned. What encode_state accepts, refused here with the same message."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, dict):
        return {k: snapshot_state(v) for k, v in tree.items()}  # keys are immutable (str, int, tuples of them)
    if isinstance(tree, list | tuple):  # a list either way: encode_state writes both as JSON arrays
        return [snapshot_state(v) for v in tree]
    if tree is None or isinstance(tree, bool | int | float | str | np.generic):
        return tree
    raise CheckpointError(f"cannot checkpoint a {type(tree).__name__} (state must be JSON data or tensors)")


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
    # Rounds authorised after the checkpoint's, consecutive from its round + 1 (two when a crash came while the
    # writer was saving a round and the next was authorised).
    pending_rounds: list[checkpoint_pb2.PendingRound] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        return self.checkpoint.run_id

    @property
    def origin(self) -> str:
        """Who wrote it: "aggregator" (the service) or "inprocess" (`fairfl run --transport inprocess`); each
        resumes only its own, since their privacy gates keep their ledgers in different places."""
        try:
            return str(json.loads(self.checkpoint.state_json).get("origin", AGGREGATOR))
        except (ValueError, AttributeError):
            return AGGREGATOR

    @property
    def pending(self) -> checkpoint_pb2.PendingRound | None:
        """The round after the checkpoint's, when it was authorised."""
        return self.pending_rounds[0] if self.pending_rounds else None


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
    pending = _still_pending(_read_pending(directory / PENDING_FILE), checkpoint.run_id, checkpoint.round)
    return Loaded(directory, checkpoint, config, rounds, offset, pending)


def find_unfinished(root: str | Path, *, origin: str = AGGREGATOR, failed: bool = False) -> list[Loaded]:
    """Checkpoints under `root` written by `origin` of runs that had not ended (with `failed`, and of runs that
    failed), most recently saved first; unusable ones are logged."""
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
        if loaded is None or loaded.origin != origin:
            continue
        if not loaded.checkpoint.finished or (failed and loaded.checkpoint.final_state == "RUN_STATE_FAILED"):
            found.append(loaded)
    return sorted(found, key=lambda c: c.checkpoint.saved_unix, reverse=True)


# --- writing and restoring --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RoundSave:
    """What a round's checkpoint holds, taken when the round ended: the writer serialises it while the next round
    runs (which changes the engine's state)."""

    round: int
    params: torch.Tensor  # the engine's: it replaces, never updates, its model (RoundEngine._publish_params)
    state: dict[str, Any]  # a snapshot_state copy
    task_key: bytes
    event: bytes  # the serialised RoundEvent
    emit: Callable[[], None] | None  # reports the round; called once the round is on disk


class RunCheckpointer:
    """Writes one run's checkpoints; the engine calls it after authorising a round, after each round and at the end.

    A round's checkpoint is written by a writer thread (one, rounds in order), off the round's critical path: at most
    one round is being written while the next runs, and the engine learns of a failed write at the next round's
    authorisation or end, or at the run's end, and fails the run with it. Every authorised round stays in
    `pending.pb` until a checkpoint covers it, so a crash while a write is in flight re-runs both that round and the
    next as they were authorised."""

    def __init__(self, directory: Path, run_id: str, config: ExperimentConfig, *, origin: str = AGGREGATOR) -> None:
        """`origin` INPROCESS (`fairfl run --transport inprocess`): a stop (a signal) leaves the last completed round's
        checkpoint unmarked, as a crash does, and a failure marks that checkpoint final as it is on disk, so either
        resumes bit-identically (`fairfl run --resume`); the aggregator's own stop is the run's end (StopRun)."""
        self.directory = directory
        self.run_id = run_id
        self.origin = origin
        self.config_yaml = config.to_yaml()
        self.events = 0
        self.events_offset = 0
        self.durable_round = 0  # the newest round whose checkpoint is on disk (the writer's; read racily, only grows)
        self._queue: queue.Queue[_RoundSave | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._failure: BaseException | None = None  # a write that failed: no later round is written or reported
        self._failure_raised = False
        self._authorised: dict[int, bytes] = {}  # round -> its pending.pb record, while no checkpoint covers it
        self._pending_fd: int | None = None
        self._pending_bytes = 0
        directory.mkdir(parents=True, exist_ok=True)

    def start_fresh(self, engine: RoundEngine | None = None) -> None:
        """A new run in this directory: no earlier files may leak into it. With `engine`, its starting point is saved
        (round 0), so a run killed before its first round completed resumes too (its authorised round 1 included)."""
        for name in (CHECKPOINT_FILE, EVENTS_FILE, PENDING_FILE, MODEL_FILE_NAME):
            (self.directory / name).unlink(missing_ok=True)
        self._authorised.clear()
        if engine is not None:
            self._write(engine)

    # -- the round about to be authorised (engine thread) -------------------------------------------------------------

    def planned(self, round_number: int, selected: list[int], population: int) -> None:
        """The round about to be authorised (written before the ledger call, see RoundEngine._authorize): appended to
        pending.pb and fdatasynced (one flush, no rename), with the earlier rounds no checkpoint covers yet."""
        self._raise_failure()
        record = _pending_record(
            checkpoint_pb2.PendingRound(
                run_id=self.run_id, round=round_number, selected=selected, population=population
            )
        )
        durable = self.durable_round
        for done in [r for r in self._authorised if r <= durable]:
            del self._authorised[done]
        self._authorised[round_number] = record
        if self._pending_fd is None or self._pending_bytes + len(record) > PENDING_COMPACT_BYTES:
            self._rewrite_pending()
            return
        _write_all(self._pending_fd, record)
        os.fdatasync(self._pending_fd)
        self._pending_bytes += len(record)

    def _rewrite_pending(self) -> None:
        """pending.pb anew (atomically) with the rounds a resume could still need, then kept open for appends: at the
        run's first round here (an older aggregator's file is replaced too) and when the log grew long."""
        self._close_pending()
        data = PENDING_MAGIC + b"".join(self._authorised[r] for r in sorted(self._authorised))
        path = self.directory / PENDING_FILE
        atomic_write(path, data)
        self._pending_fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._pending_bytes = len(data)

    def _close_pending(self) -> None:
        if self._pending_fd is not None:
            os.close(self._pending_fd)
            self._pending_fd = None

    # -- a completed round (snapshot here, written by the writer thread) ----------------------------------------------

    def completed(
        self, engine: RoundEngine, event: control_pb2.RoundEvent, emit: Callable[[], None] | None = None
    ) -> None:
        """Save the round that just ended: its state is taken now, then the writer appends its event, replaces the
        checkpoint (observed in fairfl_checkpoint_duration_seconds) and only then calls `emit`, so a reported round
        is never lost. Waits for the previous round's write first (one in flight at most) and raises its failure."""
        self.wait()
        save = _RoundSave(
            round=engine.completed_round,
            params=engine.params,
            state=snapshot_state(self._state(engine)),
            task_key=bytes(engine.task_key),
            event=event.SerializeToString(),
            emit=emit,
        )
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_rounds, name=f"checkpoint-{self.run_id}", daemon=True)
            self._writer.start()
        self._queue.put(save)

    def wait(self) -> None:
        """Until every round handed to the writer is on disk and reported; raises a write's failure (once)."""
        self._queue.join()
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None and not self._failure_raised:
            self._failure_raised = True
            raise self._failure

    def _write_rounds(self) -> None:
        while (save := self._queue.get()) is not None:
            try:
                if self._failure is None:  # after a failure nothing later is written (or reported)
                    with telemetry.CHECKPOINT_DURATION.time():
                        self._append_event(save.event)
                        self._save(save.round, save.params, save.state, save.task_key)
                    self.durable_round = save.round
                    if save.emit is not None:
                        save.emit()
            except BaseException as err:  # raised in the engine's thread (wait / planned)
                self._failure = err
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _append_event(self, payload: bytes) -> None:
        with open(self.directory / EVENTS_FILE, "r+b" if self.events_offset else "wb") as fh:
            fh.seek(self.events_offset)
            fh.write(_LENGTH.pack(len(payload)) + payload)
            fh.truncate()
            fh.flush()
            os.fsync(fh.fileno())
        self.events += 1
        self.events_offset += _LENGTH.size + len(payload)

    def close(self) -> None:
        """Let the writer finish what it was given (its rounds reported) and end it; no failure is raised here."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None
        self._close_pending()

    # -- the run's end ------------------------------------------------------------------------------------------------

    def finished(self, engine: RoundEngine, state: int, message: str) -> tuple[int, torch.Tensor]:
        """Mark the run ended, so a restarted aggregator does not resume it; its model (that of its last completed
        round) goes to model.safetensors beside the checkpoint (fairfl.model_file). The writer's rounds are on disk
        first: nothing is written after the end marker. After a failed write the run ends where its checkpoint on
        disk is (the last round written and reported), never on a round no one heard of: that checkpoint is marked
        final as it is. Returns the round and model the run ended with."""
        self.close()
        final = (control_pb2.RunState.Name(state), message)
        if self.origin == INPROCESS and state != control_pb2.RUN_STATE_COMPLETED:
            # Every completed round is on disk: that checkpoint, not the engine's state mid-round, is what a resume
            # must start from (a stop stays unmarked, as after a crash).
            return self._on_disk(mark=None if state == control_pb2.RUN_STATE_STOPPED else final)
        if self._failure is None:
            self._write(engine, final=final)  # type: ignore[arg-type]
            round_number, params = engine.completed_round, engine.params
        else:
            round_number, params = self._on_disk(mark=final)
        if round_number > 0:
            try:
                save_run_model(
                    self.directory / MODEL_FILE_NAME, engine.config, self.run_id, round_number, engine.layout, params
                )
            except (ModelFileError, ConfigError) as err:  # the checkpoint stands; `fairfl model export` reads it
                log.error("run %s: model file not written: %s", self.run_id, err)
        return round_number, params

    def _on_disk(self, mark: tuple[str, str] | None) -> tuple[int, torch.Tensor]:
        """The checkpoint on disk, marked final with `mark` (state, message) when given; its round and model."""
        checkpoint = checkpoint_pb2.Checkpoint.FromString((self.directory / CHECKPOINT_FILE).read_bytes())
        if mark is not None:
            checkpoint.finished, (checkpoint.final_state, checkpoint.final_message) = True, mark
            checkpoint.saved_unix = time.time()
            atomic_write(self.directory / CHECKPOINT_FILE, checkpoint.SerializeToString())
        return checkpoint.round, codec.tensor_from_proto(checkpoint.model).reshape(-1)

    # -- the checkpoint file ------------------------------------------------------------------------------------------

    def _state(self, engine: RoundEngine) -> dict[str, Any]:
        return {
            "strategy": engine.strategy.state_dict(),
            "dp": engine.dp.state_dict() if engine.dp is not None else None,
            "privacy": _component_state(engine.privacy),
            "selector": _component_state(engine.selector),
            "selection": _component_state(getattr(engine, "selection", None)),  # the engine's selection driver
            "failed_rounds": engine.failed_rounds,
            "rng": _rng_state(),
            "origin": self.origin,
        }

    def _write(self, engine: RoundEngine, final: tuple[str, str] | None = None) -> None:
        """The engine's checkpoint now, from its thread (the run's start and end: no round is running)."""
        self._save(engine.completed_round, engine.params, self._state(engine), engine.task_key, final)

    def _save(
        self,
        round_number: int,
        params: torch.Tensor,
        state: dict[str, Any],
        task_key: bytes,
        final: tuple[str, str] | None = None,
    ) -> None:
        state_json, tensors = encode_state(state)
        checkpoint = checkpoint_pb2.Checkpoint(
            format_version=FORMAT_VERSION,
            run_id=self.run_id,
            experiment_yaml=self.config_yaml,
            round=round_number,
            model=codec.tensor_to_proto("model", params.detach().to(torch.float32).contiguous()),
            state_json=state_json,
            tensors=tensors,
            events=self.events,
            saved_unix=time.time(),
            finished=final is not None,
            final_state=final[0] if final else "",
            final_message=final[1] if final else "",
            task_id_key=task_key,
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
        pending = loaded.pending_rounds
        engine.replay = {r.round: (list(r.selected), r.population) for r in pending}
        # Kept in pending.pb until a checkpoint covers them: a second crash must re-run them as authorised too.
        self._authorised = {r.round: _pending_record(r) for r in pending}
        self.durable_round = ckpt.round
        self.events, self.events_offset = len(loaded.rounds), loaded.events_offset
        authorised = ", ".join(str(r.round) for r in pending)
        log.info(
            "run %s resumes after round %d of %d%s",
            self.run_id,
            ckpt.round,
            engine.config.rounds,
            f"; round {authorised} was authorised before the restart and is re-run as authorised"
            if len(pending) == 1
            else f"; rounds {authorised} were authorised before the restart and are re-run as authorised"
            if pending
            else "",
        )
