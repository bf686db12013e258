"""Privacy accounting at scale: record 1,000 clients x 1,000 rounds in the privacy service, then query ε.

    python scripts/bench_accounting.py                  # 1,000 clients x 1,000 rounds
    python scripts/bench_accounting.py --quick          # 1,000 clients x 100 rounds
    python scripts/bench_accounting.py --clients 1000 --rounds 1000 --json out.json

The privacy service runs as `fairfl run` starts it (its own process, SQLite ledger in WAL mode with synchronous=FULL,
mutual TLS, /metrics). This process plays the aggregator with its own privacy gate (aggregator_service.peers.
RemotePrivacy): it registers the budget of a FedFDP run (experiments/fedfdp/fmnist_cnn.yaml: record-level DP per
client, Theorem 3 accounting, one DP-SGD step with q = 0.05, σ = 2 and a noisy loss with σ_l = 5 per round) scaled to
`--clients` clients that all take part in every round, and authorises `--rounds` rounds one after another, as the
engine does before each round's tasks leave: each AuthorizeRound records 2 events per client (gradient and loss) and
checks every client's ε against the budget, so the ledger ends with clients x rounds x 2 events.
Then the ε query: GetSpend for the whole run (every client's ε, recomputed from the stored events) and for one
client, each timed over `--repeats` calls (median). The ε returned is checked against dp_accounting's for the same
composition.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchlib

PRESET = benchlib.REPO / "experiments" / "fedfdp" / "fmnist_cnn.yaml"
QUICK_ROUNDS = 100


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=0, help="rounds recorded (default 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="ε queries timed (median reported)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds: a smoke pass")
    parser.add_argument("--json", type=Path, default=None, help="write the figures JSON here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else 1000)

    from aggregator_service.dp import principal_events
    from aggregator_service.peers import RemotePrivacy
    from fairfl import accounting as accountant
    from fairfl.compose.launcher import LocalCluster
    from fairfl.rpc_security import use_security
    from fairfl.v1 import privacy_pb2, privacy_pb2_grpc

    config = benchlib.load_config(
        PRESET,
        {
            "rounds": rounds,
            "data.num_clients": args.clients,
            "selection.clients_per_round": args.clients,
            "privacy.epsilon": 100.0,  # room for every round: the point is the ledger's size, not refusing rounds
        },
    )
    clients = list(range(args.clients))
    run_id = f"bench-accounting-{int(time.time())}"
    record_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-accounting-") as tmp, LocalCluster(Path(tmp) / "logs") as cluster:
        db = Path(tmp) / "ledger.sqlite"
        service = cluster.start_service("privacy", "privacy_service", ["--db", str(db)])
        use_security(cluster.security)  # the gate dials as the cluster's operator, a service identity
        gate = RemotePrivacy(service.address)
        try:
            gate.start(run_id, config)
            print(f"recording {rounds} rounds x {args.clients} clients x 2 events")
            for r in range(1, rounds + 1):
                t0 = time.perf_counter()
                epsilon = gate.authorize_round(run_id, r, config, clients, args.clients)
                record_s.append(time.perf_counter() - t0)
                if r % max(1, rounds // 10) == 0:
                    print(f"  round {r}: {record_s[-1] * 1e3:.1f} ms, ε = {epsilon:.4f}")
            stub = privacy_pb2_grpc.PrivacyStub(gate.channel)
            query_all: list[float] = []
            query_one: list[float] = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                spend = stub.GetSpend(privacy_pb2.GetSpendRequest(run_id=run_id), timeout=600)
                query_all.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                one = stub.GetSpend(privacy_pb2.GetSpendRequest(run_id=run_id, principal="0"), timeout=600)
                query_one.append(time.perf_counter() - t0)
        finally:
            gate.close()
            use_security(None)
        ledger_bytes = sum(p.stat().st_size for p in Path(tmp).glob("ledger.sqlite*"))
        service_peak = benchlib.peak_rss_bytes(service.process.pid)

    per_round = principal_events(config, "0")
    expected, _ = accountant.epsilon(
        [accountant.EventSpec(e.sample_rate, e.noise_multiplier, e.count * rounds) for e in per_round],
        config.privacy.delta,
        config.privacy.accountant,
        config.privacy.orders,
    )
    epsilons = [s.epsilon for s in spend.spends]
    agrees = len(epsilons) == args.clients and all(math.isclose(e, expected, rel_tol=1e-9) for e in epsilons)
    tenth = max(1, rounds // 10)
    events = sum(s.events for s in spend.spends)
    figures = [
        benchlib.figure(
            f"ε query, whole run ({args.clients} clients' ε from {events:,} events)",
            statistics.median(query_all),
            "s",
            key="query_all_s",
        ),
        benchlib.figure("ε query, one client", statistics.median(query_one), "s", key="query_one_s"),
        benchlib.figure(
            f"time to record {rounds} rounds (AuthorizeRound, budget checked every round)",
            sum(record_s),
            "s",
            key="record_total_s",
        ),
        benchlib.figure("AuthorizeRound, median", statistics.median(record_s), "s", key="record_median_s"),
        benchlib.figure(
            f"AuthorizeRound, median of the first {tenth} rounds",
            statistics.median(record_s[:tenth]),
            "s",
            key="record_first_s",
        ),
        benchlib.figure(
            f"AuthorizeRound, median of the last {tenth} rounds",
            statistics.median(record_s[-tenth:]),
            "s",
            key="record_last_s",
        ),
        benchlib.figure(
            "ε of every client = dp_accounting's for the same composition",
            1.0 if agrees else 0.0,
            "bool",
            (">=", 1.0),
            note=f"ε = {max(epsilons):.6f} (expected {expected:.6f}) at δ = {config.privacy.delta:g}",
            key="epsilon_agrees",
        ),
        benchlib.figure("ledger size on disk (SQLite + WAL)", ledger_bytes / 2**20, "MiB", key="ledger_mib"),
        benchlib.figure(
            "privacy service peak memory (VmHWM)",
            service_peak / 2**20 if service_peak else None,
            "MiB",
            key="service_peak_mib",
        ),
    ]
    notes = [
        f"Budget of {PRESET.relative_to(benchlib.REPO)} (mode {config.privacy.mode}, accountant "
        f"{config.privacy.accountant}) with {args.clients} clients all selected every round; ε budget raised to "
        f"{config.privacy.epsilon:g} so every round fits.",
        f"Ledger after the run: {events:,} event rows, {one.rounds_recorded} rounds; privacy service over mutual TLS, "
        "SQLite WAL with synchronous=FULL (a commit per round).",
    ]
    details = {
        "clients": args.clients,
        "rounds": rounds,
        "record_seconds": [round(s, 5) for s in record_s],
        "query_all_seconds": query_all,
        "query_one_seconds": query_one,
        "epsilon": max(epsilons),
        "expected_epsilon": expected,
        "events": events,
    }
    benchlib.write_result(args.json, "accounting", figures, started, args.quick, notes, details)
    return 0 if agrees else 1


if __name__ == "__main__":
    sys.exit(main())
