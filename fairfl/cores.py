"""The cores this process may run on: what parallel work divides (in-process workers, comparison jobs, benchmark
floors). Imports nothing heavy, so the comparison driver can use it without loading torch."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS reports one, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity API
        return os.cpu_count() or 1
