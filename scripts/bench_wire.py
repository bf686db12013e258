"""Bytes on the wire between agents and the aggregator, divided by the raw bytes of the tensors that had to move.

    python scripts/bench_wire.py                   # the default preset (experiments/quickstart.yaml), 40 rounds
    python scripts/bench_wire.py --quick           # 10 rounds
    python scripts/bench_wire.py --rounds 100 --json out.json

The run is `fairfl run` over gRPC (services and agents as processes, mutual TLS; see scripts/benchlib.py), except
that the agents dial the aggregator through a byte-counting TCP proxy in this process. Everything an agent and the
aggregator exchange crosses the proxy and is counted: TLS handshakes and records, HTTP/2 frames and pings, gRPC and
protobuf framing, registration, the run spec, long polls, heartbeats, task messages, model downloads and result
uploads, from the agents' start to the end of the run.

The denominator is what had to move, at its raw size (4 bytes per float32 value, nothing else):
- down: the global model, once per (agent, model version) that agent needed: the version a round trains from, for
  every agent with a client selected in that round, and the round's new model, for every agent, in each evaluation
  round. An agent that fetched a model twice pays for it in the numerator.
- up: every accepted training result's update (a full model of float32 values).
Scalars (losses, metrics), task messages and everything else are overhead. Lossless: updates travel as float32. The
script takes experiments whose results carry exactly that (FedAvg or FedProx, no HiCS-FL signatures or probes).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib

TARGET_RATIO = 1.02  # issue #9: lossless bytes on the wire within 1.02x the raw tensor bytes
DEFAULT_CONFIG = benchlib.REPO / "experiments" / "quickstart.yaml"
DEFAULT_ROUNDS = 40
QUICK_ROUNDS = 10


def owner_of(ranges: dict[str, tuple[int, int]]) -> dict[int, str]:
    return {cid: name for name, (lo, hi) in ranges.items() for cid in range(lo, hi + 1)}


def raw_tensor_bytes(
    rounds: list[Any], ranges: dict[str, tuple[int, int]], model_bytes: int, num_clients: int
) -> dict[str, int]:
    """The bytes that had to move (see the module doc): down (model downloads) and up (result tensors).

    `rounds` are the run's RoundEvents in order; a round trains from the previous round's model (model_sha256 of the
    event before; the initial model for round 1) and evaluates its own new model. Agents that all host every client
    (runtime.placement replicated) share a round's tasks evenly, so min(tasks, agents) of them need its model."""
    hosting = {name for name, (lo, hi) in ranges.items() if lo < num_clients and lo <= hi}
    replicated = len(hosting) > 1 and len(set(ranges.values())) == 1
    owner = {} if replicated else owner_of(ranges)
    needed: set[tuple[str, str]] = set()
    previous = "initial model"
    up = 0
    for r in rounds:
        if replicated:
            needed |= {(agent, previous) for agent in sorted(hosting)[: len(r.selected)]}
        else:
            needed |= {(owner[c], previous) for c in r.selected}
        if r.evaluated:
            needed |= {(agent, r.model_sha256) for agent in hosting}
        up += r.results_accepted * model_bytes
        previous = r.model_sha256
    return {"down": len(needed) * model_bytes, "up": up, "model_fetches_needed": len(needed)}


UPDATE_ONLY = ("fedavg", "fedprox")  # one exchange per round whose results carry exactly one update tensor


def check_applies(config: Any) -> None:
    """The denominator counts models down and one update up per result; other exchanges would be miscounted."""
    sampler = config.selection.sampler_class()  # its declared needs: signatures or loss probes add exchanges
    if config.strategy.name not in UPDATE_ONLY or sampler.client_signatures or sampler.needs_losses:
        raise SystemExit(
            f"bench_wire: counts one model down and one update up per task; use strategy {' or '.join(UPDATE_ONLY)} "
            "without HiCS-FL signatures or power-of-choice probes"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="experiment (default: the default preset)")
    parser.add_argument("--rounds", type=int, default=0, help=f"rounds (default {DEFAULT_ROUNDS})")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds: a smoke pass")
    parser.add_argument("--json", type=Path, default=None, help="write the figures JSON here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    config = benchlib.load_config(args.config, {"rounds": rounds})
    check_applies(config)
    from aggregator_service.engine import initial_model

    layout, _ = initial_model(config)
    model_bytes = layout.nbytes

    print(f"gRPC run through a byte-counting proxy: {rounds} rounds, {config.runtime.agents} agents")
    with tempfile.TemporaryDirectory(prefix="bench-wire-") as tmp:
        trace = benchlib.run_grpc_traced(config, Path(tmp), proxy=True)
    if not trace.completed:
        raise SystemExit(f"bench_wire: the run did not complete: {trace.state} {trace.message}")
    raw = raw_tensor_bytes(trace.rounds, trace.client_ranges, model_bytes, config.data.num_clients)
    wire_up, wire_down = trace.bytes_to_server, trace.bytes_to_client
    fetched = sum(
        benchlib.metric(s, "fairfl_agent_model_fetches_total", cache=how)
        for s in agent_metrics(trace)
        for how in ("miss", "inline")  # fetched, or inline in a poll reply
    )
    ratio = (wire_up + wire_down) / (raw["up"] + raw["down"])
    figures = [
        benchlib.figure(
            "bytes on the wire / raw tensor bytes (lossless, both ways)",
            ratio,
            "x",
            ("<=", TARGET_RATIO),
            note=f"whole run: {benchlib.fmt_bytes(wire_up + wire_down)} on the wire for "
            f"{benchlib.fmt_bytes(raw['up'] + raw['down'])} of tensors",
            key="wire_over_raw",
        ),
        benchlib.figure("up (agents → aggregator) / raw update bytes", wire_up / raw["up"], "x", key="up_over_raw"),
        benchlib.figure(
            "down (aggregator → agents) / raw model bytes", wire_down / raw["down"], "x", key="down_over_raw"
        ),
        benchlib.figure("bytes on the wire per round", (wire_up + wire_down) / rounds, "B", key="wire_per_round"),
        benchlib.figure("raw tensor bytes per round", (raw["up"] + raw["down"]) / rounds, "B", key="raw_per_round"),
    ]
    notes = [
        f"{rounds} rounds of {Path(args.config).name}, {config.runtime.agents} agents, mutual TLS; model "
        f"{layout.numel:,} float32 values ({benchlib.fmt_bytes(model_bytes)}).",
        f"Model downloads needed: {raw['model_fetches_needed']}; agents received {int(fetched)} (fetched or inline "
        "in a poll reply); "
        f"{sum(r.results_accepted for r in trace.rounds)} updates uploaded; {trace.proxy_connections} TCP "
        "connection(s) through the proxy.",
        "Counted from the agents' first connection (TLS handshake, registration, run spec) to the end of the run, "
        "polls and heartbeats included.",
    ]
    details = {
        "rounds": rounds,
        "wire_bytes_up": wire_up,
        "wire_bytes_down": wire_down,
        "raw_bytes_up": raw["up"],
        "raw_bytes_down": raw["down"],
        "model_bytes": model_bytes,
        "model_fetches_needed": raw["model_fetches_needed"],
        "model_fetches_done": fetched,
        "proxy_connections": trace.proxy_connections,
    }
    benchlib.write_result(args.json, "wire", figures, started, args.quick, notes, details)
    return 0


def agent_metrics(trace: benchlib.RunTrace) -> list[benchlib.Samples]:
    return [samples for name, samples in trace.metrics.items() if name.startswith("agent")]


if __name__ == "__main__":
    sys.exit(main())
