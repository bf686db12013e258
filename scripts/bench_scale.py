"""Scale: 1000 logical clients across 4 agent processes, 100 per round, over gRPC; time per round and memory.

    python scripts/bench_scale.py                 # 1000 clients, 4 agents, 100 per round, 12 rounds
    python scripts/bench_scale.py --quick         # 4 rounds
    python scripts/bench_scale.py --clients 2000 --agents 8 --per-round 200 --json out.json

The run is `fairfl run` over gRPC (services and agents as processes, mutual TLS, a checkpoint every round; see
scripts/benchlib.py) of the default preset scaled out: Fashion-MNIST in 2-label shards over `--clients` clients (60
training and 10 test samples each at 1000), the same MLP 784-200-200-10, 5 local steps of batch 50, FedAvg, random
selection, evaluation of every client every `--eval-every` rounds and in the last round. It checks that every client
registered and every round aggregated `--per-round` results, and reports seconds per round (rounds 2 to the last:
round 1 is the agents' setup), the setup itself (start of the run to round 1's end), and the peak resident memory
(VmHWM from /proc) of the aggregator and of the agents.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchlib

DEFAULT_CONFIG = benchlib.REPO / "experiments" / "quickstart.yaml"
DEFAULT_ROUNDS = 12
QUICK_ROUNDS = 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=0, help=f"rounds (default {DEFAULT_ROUNDS})")
    parser.add_argument("--eval-every", type=int, default=5, help="evaluate every client every N rounds")
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds: a smoke pass")
    parser.add_argument("--json", type=Path, default=None, help="write the figures JSON here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    if rounds < 2:
        raise SystemExit("bench_scale: needs at least 2 rounds (round 1 is setup)")
    config = benchlib.load_config(
        DEFAULT_CONFIG,
        {
            "name": "scale",
            "rounds": rounds,
            "data.num_clients": args.clients,
            "selection.clients_per_round": args.per_round,
            "training.local_steps": args.local_steps,
            "evaluation.every": args.eval_every,
            "runtime.agents": args.agents,
            "runtime.threads_per_agent": 1,
            "runtime.round_timeout_s": 300,
            "runtime.register_timeout_s": 300,
        },
    )
    print(
        f"gRPC run: {args.clients} clients on {args.agents} agents, {args.per_round} per round, {rounds} rounds "
        f"(evaluation of every client every {args.eval_every})"
    )
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        trace = benchlib.run_grpc_traced(config, Path(tmp))
    accepted = [r.results_accepted for r in trace.rounds]
    complete = trace.completed and len(trace.rounds) == rounds and min(accepted, default=0) >= args.per_round
    per_round, measured = trace.round_wall() if len(trace.rounds) > 1 else (float("nan"), 0)
    gaps = [b - a for a, b in zip(trace.arrivals, trace.arrivals[1:], strict=False)]
    plain = [g for g, r in zip(gaps, trace.rounds[1:], strict=True) if not r.evaluated]
    evaluated = [g for g, r in zip(gaps, trace.rounds[1:], strict=True) if r.evaluated]
    aggregator_peak = trace.peak_rss.get("aggregator")
    agent_peaks = [v for k, v in trace.peak_rss.items() if k.startswith("agent") and v]
    figures = [
        benchlib.figure(
            f"run of {args.clients} clients completes, every round aggregating {args.per_round} results",
            1.0 if complete else 0.0,
            "bool",
            (">=", 1.0),
            note=f"{trace.state}: {trace.message}; results per round {min(accepted, default=0)}-"
            f"{max(accepted, default=0)}",
            key="completed",
        ),
        benchlib.figure(
            "clients registered", trace.registered_clients, "", (">=", args.clients), key="registered_clients"
        ),
        benchlib.figure(f"seconds per round (rounds 2-{rounds})", per_round, "s", key="seconds_per_round"),
        benchlib.figure(
            "seconds per round without evaluation (median)",
            statistics.median(plain) if plain else None,
            "s",
            key="seconds_per_training_round",
        ),
        benchlib.figure(
            f"seconds per round with evaluation of all {args.clients} clients (median)",
            statistics.median(evaluated) if evaluated else None,
            "s",
            key="seconds_per_evaluation_round",
        ),
        benchlib.figure(
            "setup: start of the run to round 1's end (registration, agents load data)",
            trace.arrivals[0] - trace.started if trace.arrivals else None,
            "s",
            key="setup_seconds",
        ),
        benchlib.figure(
            "aggregator peak memory (VmHWM)",
            aggregator_peak / 2**20 if aggregator_peak else None,
            "MiB",
            key="aggregator_peak_mib",
        ),
        benchlib.figure(
            "agent peak memory (VmHWM, largest of the agents)",
            max(agent_peaks) / 2**20 if agent_peaks else None,
            "MiB",
            key="agent_peak_mib",
        ),
    ]
    notes = [
        f"{args.clients} clients on {args.agents} agent processes x 1 torch thread, {args.per_round} per round, "
        f"{args.local_steps} local steps of batch 50, MLP 784-200-200-10 (778 KiB per update), mutual TLS, a "
        f"checkpoint every round; {measured} rounds measured.",
        "Peak memory of every process (MiB): "
        + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in trace.peak_rss.items() if v),
    ]
    details = {
        "clients": args.clients,
        "agents": args.agents,
        "per_round": args.per_round,
        "rounds": rounds,
        "state": trace.state,
        "message": trace.message,
        "results_accepted": accepted,
        "round_gaps_s": [round(g, 4) for g in gaps],
        "engine_round_durations_s": [round(r.duration_seconds, 4) for r in trace.rounds],
        "peak_rss_bytes": trace.peak_rss,
        "cpu_seconds_per_round": {k: round(v, 4) for k, v in trace.round_cpu().items()} if measured else {},
    }
    benchlib.write_result(args.json, "scale", figures, started, args.quick, notes, details)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
