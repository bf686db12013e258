"""Shared by the comparison tests that never train: the tiny experiment their comparison files use as a base."""

from __future__ import annotations

from typing import Any

# Loads and validates in milliseconds (synthetic data, logistic regression); the tests only build specs and reports.
TINY_EXPERIMENT: dict[str, Any] = {
    "name": "tiny",
    "rounds": 2,
    "data": {"dataset": "synthetic", "num_clients": 4},
    "model": {"name": "logreg"},
    "training": {"local_steps": 1},
    "selection": {"clients_per_round": 2},
}
