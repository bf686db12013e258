"""Which code produced a result, where and when: the git commit of the fairfl checkout that ran, the machine and the
start time, for result files to record."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
# What running writes into the tree (result folders, the claims index, runs/) and prose (docs' Markdown) does not make
# the code that ran differ; everything else does, untracked files included (a new module, a changed manifest).
_NOT_CODE = (
    ":(exclude,glob)docs/results/*/**",
    ":(exclude)docs/results/claims.md",
    ":(exclude,glob)docs/**/*.md",
    ":(exclude)runs",
)


def source_revision() -> dict[str, Any] | None:
    """{"commit": sha, "dirty": bool} of the checkout this fairfl runs from (dirty: uncommitted or untracked files other
    than result folders, runs/ and docs' Markdown); None outside a git checkout, e.g. an installed package."""
    try:
        if Path(_git("rev-parse", "--show-toplevel")).resolve() != REPO_ROOT:
            return None
        changes = _git("status", "--porcelain", "--untracked-files=normal", "--", ".", *_NOT_CODE)
        return {"commit": _git("rev-parse", "HEAD"), "dirty": bool(changes)}
    except (OSError, subprocess.SubprocessError):
        return None


def revision_text(revision: dict[str, Any] | None) -> str:
    """`<sha>` or `<sha>+dirty`; "unknown" outside a git checkout."""
    if revision is None:
        return "unknown"
    return revision["commit"] + ("+dirty" if revision.get("dirty") else "")


def run_provenance(started: float) -> dict[str, Any]:
    """What a result folder records of the run that wrote it: the code's commit, the machine and when it started."""
    import time

    from fairfl.cores import usable_cores

    return {
        "revision": revision_text(source_revision()),
        "machine": machine_description(),
        "usable_cores": usable_cores(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
    }


PROVENANCE_FILE = "provenance.json"  # in a result's run folder: run_provenance's record, one per segment of the run


def run_segments(run_dir: Path) -> list[dict[str, Any]]:
    """The records of every invocation that ran the run in `run_dir` (its provenance.json: the first, then each
    resumed one, which also names the round it went on after); empty when none is recorded or it is unreadable."""
    import json

    try:
        provenance = json.loads((run_dir / PROVENANCE_FILE).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(provenance, dict):
        return []
    resumed = provenance.get("resumed", [])
    return [provenance, *(r for r in resumed if isinstance(r, dict))] if isinstance(resumed, list) else [provenance]


def machine_description() -> dict[str, Any]:
    """Platform, CPU count, Python, torch and the GPU, if any (informational: never fails)."""
    import os
    import platform

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # the header is informational only
        pass
    return info


def resolve_commit(ref: str) -> str:
    """The full sha of commit `ref` in this checkout; ValueError naming it when there is none."""
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except (OSError, subprocess.SubprocessError):
        raise ValueError(f"{ref!r} is not a commit of this checkout ({REPO_ROOT})") from None


def descends_from(revision: str | None, ancestor: str) -> bool:
    """Whether a result's recorded revision is commit `ancestor` or a later one on its line. A `+dirty` or unknown
    revision never is: no commit holds the code it ran."""
    if not revision or revision == "unknown" or revision.endswith("+dirty"):
        return False
    try:
        _git("merge-base", "--is-ancestor", ancestor, revision)
    except (OSError, subprocess.SubprocessError):  # exit 1: not an ancestor; other errors: an unknown commit
        return False
    return True


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.strip()
