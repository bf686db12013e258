"""Resuming an in-process run from its checkpoint: `fairfl run CONFIG --transport inprocess --resume`.

An in-process run with `runtime.checkpoint_dir` writes the aggregator's checkpoints (aggregator_service.checkpoint)
after every round. One that a signal interrupted (Ctrl-C: its last completed round's checkpoint is left as a crash
leaves it), that crashed, or that failed, continues from that checkpoint with the same experiment: the rounds it
authorised but did not finish re-run with the same selections, and the final model is bit-identical to an
uninterrupted run's (tests/integration/test_inprocess_resume.py). The comparison runner resumes its unfinished runs
this way (`fairfl compare --resume`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aggregator_service.checkpoint import INPROCESS, CheckpointError, Loaded, find_unfinished
from fairfl.config import ExperimentConfig

# How a run executes, not what it computes (the final model is bit-identical for any worker count): a resume may change
# them, e.g. a comparison resumed with another --jobs gives its runs another worker count. threads_per_agent is not
# one: torch's kernels sum in another order with more threads.
EXECUTION_FIELDS = ("inprocess_workers", "inprocess_pool", "checkpoint_dir")
LOCK_FILE = "run.lock"


class NothingToResume(Exception):
    """No unfinished run of this experiment under its checkpoint directory; the message says where it looked."""


def _computation(config: ExperimentConfig) -> dict[str, Any]:
    tree = config.to_dict()
    runtime = dict(tree.get("runtime", {}))
    for field in EXECUTION_FIELDS:
        runtime.pop(field, None)
    return {**tree, "runtime": runtime}


def unstated_fields(stored: Any, config: ExperimentConfig) -> list[str]:
    """Fields of `config` that a stored experiment (its YAML, as loaded) does not state, other than EXECUTION_FIELDS:
    a config written before such a field existed took its default when read, and nothing proves that default is what
    the older code did, so a result written then is not reused as this experiment's."""
    missing: list[str] = []
    may_be_unstated = {f"runtime.{f}" for f in EXECUTION_FIELDS}

    def walk(have: Any, want: dict[str, Any], path: str) -> None:
        for key, value in want.items():
            where = f"{path}{key}"
            if not isinstance(have, dict) or key not in have:
                if where not in may_be_unstated:
                    missing.append(where)
            elif isinstance(value, dict):
                walk(have[key], value, f"{where}.")

    walk(stored, config.to_dict(), "")
    return missing


def same_experiment(a: ExperimentConfig, b: ExperimentConfig) -> bool:
    """Whether two configs compute the same run (they may differ in EXECUTION_FIELDS only)."""
    return _computation(a) == _computation(b)


def resumable_run(config: ExperimentConfig, *, failed: bool = True) -> Loaded | None:
    """The newest checkpoint under `config.runtime.checkpoint_dir` that an in-process run of this experiment left
    unfinished (interrupted or crashed; with `failed`, or failed), with `config` as its config; None when none."""
    root = config.runtime.checkpoint_dir
    if not root:
        return None
    for loaded in find_unfinished(root, origin=INPROCESS, failed=failed):
        if same_experiment(loaded.config, config):
            return dataclasses.replace(loaded, config=config)
    return None


def find_resumable(config: ExperimentConfig) -> Loaded:
    """resumable_run, or NothingToResume saying why there is nothing to resume."""
    root = config.runtime.checkpoint_dir
    if not root:
        raise NothingToResume(
            "--resume needs the run's checkpoints: set runtime.checkpoint_dir (e.g. --set runtime.checkpoint_dir="
            "runs/checkpoints) for the run and for its resume"
        )
    try:
        loaded = resumable_run(config)
    except CheckpointError as err:
        raise NothingToResume(str(err)) from None
    if loaded is None:
        others = len(find_unfinished(root, origin=INPROCESS, failed=True)) if Path(root).is_dir() else 0
        hint = f"; {others} unfinished run(s) there are of other experiments" if others else ""
        raise NothingToResume(
            f"no unfinished run of this experiment under runtime.checkpoint_dir {root!r} (a run that completed is "
            f"not resumed; the config must match the interrupted run's){hint}"
        )
    return loaded


@contextlib.contextmanager
def run_lock(directory: Path) -> Iterator[None]:
    """Hold the run's checkpoint directory for this process: a second process resuming the same run (a comparison
    resumed while an orphaned child still runs it) is refused instead of writing the same files."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            raise CheckpointError(
                f"run {directory.name!r} is running in process {holder} (its checkpoints in {directory}/); stop it "
                "first, or start a new run"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def running_elsewhere(root: Path) -> str | None:
    """The process id (as written in its lock) of a process that holds a run under checkpoint root `root`, else None."""
    for lock in sorted(root.glob(f"*/{LOCK_FILE}")) if root.is_dir() else []:
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        finally:
            os.close(fd)
    return None
