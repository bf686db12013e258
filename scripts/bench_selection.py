"""Time one HiCS-FL selection over many clients, through the real clustering service (gRPC, its own process, mTLS
as `fairfl run` deploys it) and in-process (fairfl.compose.local_selection.LocalSelector).

    python scripts/bench_selection.py                       # 10,000 clients, 10 classes, 10% per round
    python scripts/bench_selection.py --clients 2000 --per-round 100 --repeats 5
    python scripts/bench_selection.py --json out.json      # also write the figures for scripts/bench_report.py

Signatures are planted like SGD makes them (Δb ≈ η·R·(D − 1/C) + noise, D ~ Dirichlet(α) with α from HiCS-FL's
setting (2)), reported once, then a post-warm-up round is selected `--repeats` times. Above `max_ward_points`
(default 2000) clients the sampler clusters representatives (clustering_service/samplers/hierarchy.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib
import numpy as np

from aggregator_service.selection import SelectionContext, select_request
from clustering_service.samplers import HicsParams
from fairfl import codec
from fairfl.compose.launcher import LocalCluster
from fairfl.compose.local_selection import LocalSelector
from fairfl.v1 import clustering_pb2, clustering_pb2_grpc

ALPHAS = (0.001, 0.002, 0.005, 0.01, 0.2)
REPORT_BATCH = 2000  # signatures per ReportSignatures call, well inside gRPC's 4 MiB message limit


def planted_signatures(clients: int, classes: int, seed: int) -> list[clustering_pb2.ClientSignature]:
    rng = np.random.default_rng(seed)
    alpha = np.asarray(ALPHAS)[np.arange(clients) * len(ALPHAS) // clients]
    dist = np.stack([rng.dirichlet(np.full(classes, a)) for a in alpha])
    bias = 0.04 * (dist - 1.0 / classes) + 1e-4 * rng.standard_normal((clients, classes))
    sizes = rng.integers(100, 1000, clients)
    return [
        clustering_pb2.ClientSignature(
            client_id=c, round=1, num_samples=int(sizes[c]), bias_update=codec.tensor_to_proto("bias_update", bias[c])
        )
        for c in range(clients)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=0, help="K (default: 10%% of the clients)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-ward-points", type=int, default=0, help="sampler default when 0")
    parser.add_argument("--quick", action="store_true", help="2,000 clients, 1 repeat: a smoke pass")
    parser.add_argument("--json", type=Path, default=None, help="write the figures JSON here (scripts/bench_report.py)")
    args = parser.parse_args()
    bench_started = time.perf_counter()
    if args.quick:
        args.clients, args.repeats = min(args.clients, 2000), 1
    k = args.per_round or max(1, args.clients // 10)
    params = HicsParams(total_rounds=200, max_ward_points=args.max_ward_points or None)
    signatures = planted_signatures(args.clients, args.classes, seed=0)
    candidates = list(range(args.clients))

    def context(repeat: int) -> SelectionContext:
        # Round 100 of 200: past the ⌈N/K⌉ warm-up, γ_t = γ0/2.
        return SelectionContext("bench", 100, candidates, k, seed=repeat, params=params)

    timings: dict[str, list[float]] = {"grpc (client-side wall)": [], "grpc (sampler, server-side)": []}
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(Path(tmp) / "logs", metrics=False) as cluster:
        service = cluster.start_service("clustering", "clustering_service", [])
        with cluster.open_channel(service.address) as channel:
            stub = clustering_pb2_grpc.ClusteringStub(channel)
            for start in range(0, args.clients, REPORT_BATCH):
                batch = signatures[start : start + REPORT_BATCH]
                stub.ReportSignatures(
                    clustering_pb2.ReportSignaturesRequest(run_id="bench", signatures=batch), timeout=60
                )
            for repeat in range(args.repeats):
                started = time.perf_counter()
                reply = stub.Select(select_request("hics", context(repeat)), timeout=60)
                timings["grpc (client-side wall)"].append(time.perf_counter() - started)
                timings["grpc (sampler, server-side)"].append(reply.selection_seconds)
                assert len(set(reply.selected)) == k

    local = LocalSelector("hics")
    for start in range(0, args.clients, REPORT_BATCH):
        local.report_signatures("bench", signatures[start : start + REPORT_BATCH])
    timings["in-process"] = []
    for repeat in range(args.repeats):
        started = time.perf_counter()
        out = local.select(context(repeat))
        timings["in-process"].append(time.perf_counter() - started)
        assert len(set(out.selected)) == k

    print(f"HiCS-FL selection: {args.clients} clients, {args.classes} classes, K = M = {k}, {args.repeats} repeats")
    print(f"{'path':<30} {'median s':>9} {'max s':>9}")
    for path, values in timings.items():
        print(f"{path:<30} {statistics.median(values):>9.3f} {max(values):>9.3f}")
    label = f"HiCS-FL selection of {k} of {args.clients:,} clients"
    figures = [
        benchlib.figure(
            f"{label}, through the clustering service (median)",
            statistics.median(timings["grpc (client-side wall)"]),
            "s",
            key="grpc_s",
        ),
        benchlib.figure(
            f"{label}, the sampler inside the service (median)",
            statistics.median(timings["grpc (sampler, server-side)"]),
            "s",
            key="sampler_s",
        ),
        benchlib.figure(
            f"{label}, in-process (median)", statistics.median(timings["in-process"]), "s", key="inprocess_s"
        ),
    ]
    notes = [
        f"{args.classes} classes, K = M = {k}, {args.repeats} repeat(s) each; clustering service over mutual TLS; "
        "signatures planted as SGD makes them (see the script)."
    ]
    benchlib.write_result(args.json, "selection", figures, bench_started, args.quick, notes, dict(timings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
