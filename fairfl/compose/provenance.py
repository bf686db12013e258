"""Which code produced a result: the git commit of the fairfl checkout that ran, for result files to record."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
# Result folders live in the tree (docs/results, runs/): writing them does not make the code that ran differ.
_NOT_CODE = (":(exclude)docs", ":(exclude)runs")


def source_revision() -> dict[str, Any] | None:
    """{"commit": sha, "dirty": bool} of the checkout this fairfl runs from (dirty: uncommitted changes to tracked
    files outside docs/ and runs/); None outside a git checkout, e.g. an installed package."""
    try:
        if Path(_git("rev-parse", "--show-toplevel")).resolve() != REPO_ROOT:
            return None
        changes = _git("status", "--porcelain", "--untracked-files=no", "--", ".", *_NOT_CODE)
        return {"commit": _git("rev-parse", "HEAD"), "dirty": bool(changes)}
    except (OSError, subprocess.SubprocessError):
        return None


def revision_text(revision: dict[str, Any] | None) -> str:
    """`<sha>` or `<sha>+dirty`; "unknown" outside a git checkout."""
    if revision is None:
        return "unknown"
    return revision["commit"] + ("+dirty" if revision.get("dirty") else "")


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.strip()
