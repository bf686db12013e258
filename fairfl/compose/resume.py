"""Resuming an in-process run from its checkpoint: `fairfl run CONFIG --transport inprocess --resume`.

An in-process run with `runtime.checkpoint_dir` writes the aggregator's checkpoints (aggregator_service.checkpoint)
after every round. One that a signal interrupted (Ctrl-C: its last completed round's checkpoint is left as a crash
leaves it), that crashed, or that failed, continues from that checkpoint with the same experiment: the rounds it
authorised but did not finish re-run with the same selections, and the final model is bit-identical to an
uninterrupted run's (tests/integration/test_inprocess_resume.py). The comparison runner resumes its unfinished runs
this way (`fairfl compare --resume`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from aggregator_service.checkpoint import CheckpointError, Loaded, find_unfinished
from fairfl.config import ExperimentConfig

# How a run executes, not what it computes (results are bit-identical for any value): a resume may change them, e.g.
# a comparison resumed with another --jobs gives its runs another worker count.
EXECUTION_FIELDS = ("inprocess_workers", "threads_per_agent", "checkpoint_dir")


class NothingToResume(Exception):
    """No unfinished run of this experiment under its checkpoint directory; the message says where it looked."""


def _computation(config: ExperimentConfig) -> dict[str, Any]:
    tree = config.to_dict()
    runtime = dict(tree.get("runtime", {}))
    for field in EXECUTION_FIELDS:
        runtime.pop(field, None)
    return {**tree, "runtime": runtime}


def same_experiment(a: ExperimentConfig, b: ExperimentConfig) -> bool:
    """Whether two configs compute the same run (they may differ in EXECUTION_FIELDS only)."""
    return _computation(a) == _computation(b)


def resumable_run(config: ExperimentConfig) -> Loaded | None:
    """The newest checkpoint under `config.runtime.checkpoint_dir` of an unfinished (interrupted, crashed or failed)
    run of this experiment, with `config` as its config; None when there is none."""
    root = config.runtime.checkpoint_dir
    if not root:
        return None
    for loaded in find_unfinished(root, failed=True):
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
        others = len(find_unfinished(root, failed=True)) if Path(root).is_dir() else 0
        hint = f"; {others} unfinished run(s) there are of other experiments" if others else ""
        raise NothingToResume(
            f"no unfinished run of this experiment under runtime.checkpoint_dir {root!r} (a run that completed is "
            f"not resumed; the config must match the interrupted run's){hint}"
        )
    return loaded
