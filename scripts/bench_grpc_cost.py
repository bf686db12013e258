"""Where a gRPC round's CPU goes (issue #21): each process's CPU per round, and the aggregator's split into a cost per
round, per megabyte of model per round, per client task and per megabyte of update.

    python scripts/bench_grpc_cost.py                  # the all-participating preset, four runs
    python scripts/bench_grpc_cost.py --quick          # fewer rounds: a smoke pass
    python scripts/bench_grpc_cost.py --json out.json  # also write the figures for scripts/bench_report.py

Four runs of experiments/bench_all_participating.yaml over gRPC as `fairfl run` starts it (services and 2 agent
processes, mutual TLS, a checkpoint every round; scripts/benchlib.py), with the MLP at its hidden widths (784-200-200-
10, an 800 KB update) and at 8 hidden units (6.4k parameters, 25 KB), each with 2 and with 10 of the 10 clients a round.
CPU per round of every process comes from /proc at each round's event (round 1, setup, left out). The aggregator's
CPU per round is then fitted, exactly (four runs, four unknowns), by
    fixed + model MB x per model MB + tasks x (per task + model MB x per update MB)
(a model of M MB sends updates of M MB): `per update MB` is what a task adds per megabyte it sends up (gRPC's receive
and copies, the payload checks, the exact fold), `per task` the rest of a task (dispatch, admission, bookkeeping),
`per model MB` the round's work that grows with the model (publishing it, sending it to the agents, the checkpoint)
and `fixed` the rest of a round (selection, the ledger record, the round event). The agents' CPU is mostly training,
whose cost grows with the model too, so only the aggregator is split.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchlib  # first: puts the repository on sys.path and pins OMP threads before torch loads

from aggregator_service.engine import initial_model

CONFIG = benchlib.REPO / "experiments" / "bench_all_participating.yaml"
TINY_HIDDEN = [8]
ROUNDS = {"tiny": 300, "big": 100}  # tiny rounds take ~40 ms: more of them for the same CPU-clock resolution
QUICK_ROUNDS = {"tiny": 40, "big": 20}
FEW, MANY = 2, 10  # clients a round


@dataclass(frozen=True)
class Variant:
    model: str  # "tiny" or "big"
    tasks: int  # clients a round

    @property
    def name(self) -> str:
        return f"{self.model}, {self.tasks} tasks"


VARIANTS = [Variant(m, t) for m in ("tiny", "big") for t in (FEW, MANY)]


def split_aggregator_cpu(cpu: dict[Variant, float], model_mb: dict[str, float]) -> dict[str, float]:
    """The exact fit of the aggregator's CPU per round over the four variants (see the module doc): `fixed`,
    `per_model_mb`, `per_task` and `per_update_mb`, in the unit of `cpu`."""
    tasks = {m: (cpu[Variant(m, MANY)] - cpu[Variant(m, FEW)]) / (MANY - FEW) for m in ("tiny", "big")}
    rounds = {m: cpu[Variant(m, FEW)] - FEW * tasks[m] for m in ("tiny", "big")}  # a round with no task
    spread = model_mb["big"] - model_mb["tiny"]
    per_update_mb = (tasks["big"] - tasks["tiny"]) / spread
    per_model_mb = (rounds["big"] - rounds["tiny"]) / spread
    return {
        "fixed": rounds["tiny"] - per_model_mb * model_mb["tiny"],
        "per_model_mb": per_model_mb,
        "per_task": tasks["tiny"] - per_update_mb * model_mb["tiny"],
        "per_update_mb": per_update_mb,
    }


def measure(variant: Variant, rounds: int, workdir: Path) -> tuple[dict[str, float], float, float]:
    """(CPU seconds per round by process, seconds per round, update MB) of one run."""
    overrides: dict[str, Any] = {"rounds": rounds, "selection.clients_per_round": variant.tasks}
    if variant.model == "tiny":
        overrides["model.params.hidden"] = TINY_HIDDEN
    config = benchlib.load_config(CONFIG, overrides)
    trace = benchlib.run_grpc_traced(config, workdir)
    if not trace.completed:
        raise SystemExit(f"bench_grpc_cost: the {variant.name} run ended {trace.state}: {trace.message}")
    layout, _ = initial_model(config)
    return trace.round_cpu(), trace.round_wall()[0], layout.numel * 4 / 1e6


def by_role(cpu: dict[str, float]) -> dict[str, float]:
    """Process name -> role: the agents summed."""
    out: dict[str, float] = {}
    for name, seconds in cpu.items():
        role = "agents" if name.startswith("agent") else name
        out[role] = out.get(role, 0.0) + seconds
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds: a smoke pass")
    parser.add_argument("--json", type=Path, default=None, help="write the figures JSON here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rounds = QUICK_ROUNDS if args.quick else ROUNDS
    cpu: dict[Variant, dict[str, float]] = {}
    seconds: dict[Variant, float] = {}
    update_mb: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-grpc-cost-") as tmp:
        for variant in VARIANTS:
            print(f"{variant.name}: {rounds[variant.model]} rounds over gRPC")
            per_process, seconds[variant], update_mb[variant.model] = measure(
                variant, rounds[variant.model], Path(tmp) / f"{variant.model}-{variant.tasks}"
            )
            cpu[variant] = by_role(per_process)
            shown = ", ".join(f"{k} {1000 * v:.1f}" for k, v in sorted(cpu[variant].items()))
            print(f"  {1000 * seconds[variant]:.1f} ms a round; CPU ms a round: {shown}")
    split = split_aggregator_cpu({v: cpu[v]["aggregator"] for v in VARIANTS}, update_mb)
    big = Variant("big", MANY)
    figures = [
        benchlib.figure(
            f"CPU per round, {v.name}: {role}",
            1000 * cpu[v][role],
            "ms",
            key=f"cpu_{v.model}_{v.tasks}_{role}",
        )
        for v in VARIANTS
        for role in sorted(cpu[v])
    ]
    figures += [
        benchlib.figure(
            "aggregator: fixed CPU per round",
            1000 * split["fixed"],
            "ms",
            note="what does not grow with the model or the tasks: selection, the ledger record, the checkpoint's "
            "syncs, the round event",
            key="aggregator_fixed_ms",
        ),
        benchlib.figure(
            "aggregator: CPU per round per MB of model",
            1000 * split["per_model_mb"],
            "ms",
            note="publishing the model, sending it to the agents, the checkpoint",
            key="aggregator_per_model_mb_ms",
        ),
        benchlib.figure(
            "aggregator: CPU per client task",
            1000 * split["per_task"],
            "ms",
            note="dispatching the task, receiving and admitting its result, apart from the update's bytes",
            key="aggregator_per_task_ms",
        ),
        benchlib.figure(
            "aggregator: CPU per MB of update received",
            1000 * split["per_update_mb"],
            "ms",
            note="gRPC's receive and copies, the payload checks and the exact fold",
            key="aggregator_per_update_mb_ms",
        ),
        benchlib.figure(
            "aggregator: share of the preset's 10-task round spent on its updates' bytes",
            100 * MANY * split["per_update_mb"] * update_mb["big"] / cpu[big]["aggregator"],
            "%",
            note=f"{MANY} updates of {update_mb['big']:.2f} MB",
            key="aggregator_update_bytes_share",
        ),
    ]
    notes = [
        f"Model (and update) sizes: {update_mb['big']:.3f} MB (the preset's MLP) and {update_mb['tiny']:.4f} MB "
        f"(hidden {TINY_HIDDEN}). The split is an exact fit of four runs, so run-to-run noise (about ±5% between runs "
        "here) goes into it whole.",
    ]
    details = {
        "rounds": rounds,
        "update_mb": update_mb,
        "seconds_per_round": {v.name: seconds[v] for v in VARIANTS},
        "cpu_per_round": {v.name: cpu[v] for v in VARIANTS},
        "aggregator_split": split,
    }
    benchlib.write_result(args.json, "grpc_cost", figures, started, quick=args.quick, notes=notes, details=details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
