"""Run results: consume RunEvents, print progress and the fairness table, write JSON and CSV files."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from google.protobuf.json_format import MessageToDict

from fairfl.config import ExperimentConfig
from fairfl.data.groups import client_groups
from fairfl.v1 import control_pb2

FAIRNESS_COLUMNS = [
    "mean",
    "variance",
    "std",
    "worst_5",
    "worst_10",
    "best_5",
    "best_10",
    "jain_index",
    "cv",
    "weighted_accuracy",
    "mean_loss",
    "loss_variance",
    "evaluated_clients",
    "missing_clients",
]
ROUND_COLUMNS = [
    "round",
    "duration_seconds",
    "selection_seconds",
    "selected",
    "results_accepted",
    "results_rejected",
    "results_late",
    "mean_train_loss",
    "epsilon_spent",
    "model_sha256",
    *FAIRNESS_COLUMNS,
    "nmi",
    "clusters",
]


TERMINAL_STATES = ("RUN_STATE_COMPLETED", "RUN_STATE_FAILED", "RUN_STATE_STOPPED")


class RunRecorder:
    """Collects a run's events; prints one line per evaluation round and a progress bar on terminals."""

    def __init__(self, config: ExperimentConfig, out: TextIO | None = None, quiet: bool = False) -> None:
        self.config = config
        self.out = out or sys.stdout
        self.quiet = quiet
        self.rounds: list[control_pb2.RoundEvent] = []
        self.status: control_pb2.RunStatus | None = None
        self.started = time.monotonic()
        self.tty = self.out.isatty()

    def __call__(self, event: control_pb2.RunEvent) -> None:
        if event.HasField("status"):
            self.status = event.status
            if not self.quiet and event.status.message:
                self._line(f"[{control_pb2.RunState.Name(event.status.state)[10:].lower()}] {event.status.message}")
            return
        r = event.round
        self.rounds.append(r)
        if self.quiet:
            return
        if r.evaluated:
            f = r.fairness
            self._line(
                f"round {r.round:>5}/{self.config.rounds}  acc {f.mean:6.2f}  var {f.variance:8.2f}  "
                f"worst5% {f.worst_5:6.2f}  best5% {f.best_5:6.2f}  ({time.monotonic() - self.started:6.1f}s)"
            )
        elif self.tty:
            done = r.round / self.config.rounds
            bar = "#" * int(30 * done)
            self.out.write(f"\r[{bar:<30}] round {r.round}/{self.config.rounds}")
            self.out.flush()

    def _line(self, text: str) -> None:
        if self.tty:
            self.out.write("\r" + " " * 60 + "\r")
        self.out.write(text + "\n")
        self.out.flush()

    @property
    def final_evaluation(self) -> control_pb2.RoundEvent | None:
        return next((r for r in reversed(self.rounds) if r.evaluated), None)

    def fairness_table(self) -> str:
        final = self.final_evaluation
        if final is None:
            return "no evaluation round completed"
        f = final.fairness
        rows = [
            ("mean accuracy (%)", f.mean),
            ("pooled accuracy (%)", f.weighted_accuracy),
            ("variance (%²)", f.variance),
            ("std (%)", f.std),
            ("worst 5% (%)", f.worst_5),
            ("worst 10% (%)", f.worst_10),
            ("best 5% (%)", f.best_5),
            ("best 10% (%)", f.best_10),
            ("Jain's index", f.jain_index),
            ("coeff. of variation", f.cv),
            ("mean test loss", f.mean_loss),
            ("clients evaluated", f.evaluated_clients),
            ("clients missing", f.missing_clients),
        ]
        width = max(len(k) for k, _ in rows)
        title = f"Fairness after round {final.round} ({self.config.strategy.name}, {self.config.data.dataset})"
        lines = [title, "-" * len(title)]
        for key, value in rows:
            text = f"{value:.4f}" if isinstance(value, float) and not float(value).is_integer() else f"{value:g}"
            lines.append(f"{key:<{width}}  {text:>12}")
        return "\n".join(lines)

    def summary(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        final = self.final_evaluation
        return {
            "run_id": self.status.run_id if self.status else "",
            "state": control_pb2.RunState.Name(self.status.state) if self.status else "UNKNOWN",
            "message": self.status.message if self.status else "",
            "rounds_completed": len(self.rounds),
            "wall_seconds": round(time.monotonic() - self.started, 3),
            "final_round": final.round if final else None,
            "final_fairness": {k: _num(getattr(final.fairness, k)) for k in FAIRNESS_COLUMNS} if final else None,
            "final_model_sha256": self.rounds[-1].model_sha256 if self.rounds else None,
            # Mean time per round the engine spent selecting clients (RoundEvent.selection_seconds).
            "mean_selection_seconds": (
                round(sum(r.selection_seconds for r in self.rounds) / len(self.rounds), 6) if self.rounds else None
            ),
            "client_groups": _client_groups(self.config),
            "clustering": clustering_summary(self.rounds),
            "config": self.config.to_dict(),
            **(extra or {}),
        }

    @property
    def ended(self) -> bool:
        """The run reported its end (completed, failed or stopped)."""
        return self.status is not None and control_pb2.RunState.Name(self.status.state) in TERMINAL_STATES

    def write(self, directory: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """results.json, rounds.csv and clients.csv of the rounds received so far. Each file is replaced atomically
        (a forced exit mid-write leaves the previous file or the new one, never half of one)."""
        directory.mkdir(parents=True, exist_ok=True)
        rounds = list(self.rounds)  # a forced stop writes from another thread while events may still arrive
        summary = self.summary(extra)
        summary["rounds"] = [MessageToDict(r, preserving_proto_field_name=True) for r in rounds if r.evaluated]
        _write_atomic(directory / "results.json", json.dumps(summary, indent=2, allow_nan=True))
        with io.StringIO(newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(ROUND_COLUMNS)
            for r in rounds:
                row: list[Any] = [
                    r.round,
                    f"{r.duration_seconds:.4f}",
                    f"{r.selection_seconds:.6f}",
                    " ".join(map(str, r.selected)),
                    r.results_accepted,
                    r.results_rejected,
                    r.results_late,
                    _fmt(r.mean_train_loss),
                    _fmt(r.epsilon_spent),
                    r.model_sha256,
                ]
                row += [_fmt(getattr(r.fairness, c)) if r.evaluated else "" for c in FAIRNESS_COLUMNS]
                nmi = strategy_metric(r, "nmi")
                row += ["" if nmi is None else _fmt(nmi), " ".join(f"{c.client_id}:{c.cluster}" for c in r.clusters)]
                writer.writerow(row)
            _write_atomic(directory / "rounds.csv", fh.getvalue())
        with io.StringIO(newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["round", "client_id", "accuracy", "loss", "num_samples"])
            for r in rounds:
                for c in r.clients:
                    writer.writerow([r.round, c.client_id, _fmt(c.accuracy), _fmt(c.loss), c.num_samples])
            _write_atomic(directory / "clients.csv", fh.getvalue())
        return summary


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with tmp.open("w", newline="") as fh:
        fh.write(text)
    os.replace(tmp, path)


def strategy_metric(event: control_pb2.RoundEvent, name: str) -> float | None:
    return next((m.value for m in event.strategy_metrics if m.name == name), None)


def _client_groups(config: ExperimentConfig) -> list[int] | None:
    groups = client_groups(config.data.partition, config.data.group_sizes)
    return None if groups is None else groups.tolist()


def clustering_summary(rounds: list[control_pb2.RoundEvent]) -> dict[str, Any] | None:
    """NMI of the clusters a strategy found against the true groups (spec seed-equitable.md §5): mean over every
    round that reported one, and over the rounds whose clients covered every true group. None when no round did."""
    nmis = [
        (v, strategy_metric(r, "all_groups_present") == 1.0)
        for r in rounds
        if (v := strategy_metric(r, "nmi")) is not None
    ]
    if not nmis:
        return None
    covered = [v for v, every in nmis if every]
    return {
        "rounds": len(nmis),
        "nmi_mean": sum(v for v, _ in nmis) / len(nmis),
        "rounds_all_groups": len(covered),
        "nmi_all_groups_mean": sum(covered) / len(covered) if covered else None,
    }


def _num(value: float) -> float | int | None:
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _fmt(value: float) -> str:
    return "" if isinstance(value, float) and math.isnan(value) else f"{value:.6g}"
