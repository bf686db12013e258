"""Aggregation time and peak memory for 10, 100 and 1000 updates of a 100M-parameter model (streaming aggregation).

    python scripts/bench_aggregation.py                      # FedAvg and FedEBA, 10/100/1000 updates, 100M params
    python scripts/bench_aggregation.py --counts 10 100 --params 20000000 --json out.json
    FAIRFL_FOLD_KERNEL=torch python scripts/bench_aggregation.py ...   # the fold as torch ops, not compiled

Each case runs in a fresh process, so its peak memory (VmHWM, the resident high-water mark) is its own. The process
does what the aggregator does with a round's results: the strategy's folds (fairfl/fold.py)
take each update as it arrives through the engine's sink, the update is dropped, and the strategy forms the new model
at the end. Updates arrive as the wire delivers them: float32 tensors viewing a receive buffer (zero-copy decode);
two receive buffers are reused round-robin, as a server receiving two streams at a time would (generating 1000
distinct 400 MB random vectors would time the random generator, not the aggregator). The buffered figure (every
update kept until the round closes, the design streaming replaced) is measured for the smallest count only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RECEIVE_BUFFERS = 2


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def run_case(strategy_name: str, count: int, numel: int, streaming: bool) -> dict[str, float | int | str | bool]:
    import torch

    from aggregator_service.engine import _folding
    from fairfl.fold_kernel import kernel_for
    from fairfl.protocol import TRAIN, UPDATE, ClientResult
    from fairfl.strategy import PhasePlan, RoundContext, build_strategy
    from fairfl.v1 import federation_pb2

    torch.set_num_threads(1)
    kernel_for(numel)  # as the engine does when a run starts: numba's import and compile are not the fold's
    baseline = peak_rss_bytes()
    gen = torch.Generator().manual_seed(0)
    buffers = []
    for _ in range(RECEIVE_BUFFERS):  # what the gRPC receiver fills (PayloadReceiver's bytearray)
        raw = bytearray(numel * 4)
        torch.frombuffer(raw, dtype=torch.float32).normal_(0.0, 1e-3, generator=gen)
        buffers.append(raw)
    params = torch.zeros(numel)
    strategy = build_strategy(strategy_name, {"tau": 0.1} if strategy_name == "fedeba" else {}, 1.0)
    ctx = RoundContext(
        "bench", 1, params, list(range(count)), federation_pb2.LocalTrainingConfig(lr=0.1), lambda _: None
    )
    plan = PhasePlan(phase=TRAIN, train=ctx.train_config)
    folds = strategy.folds(ctx, 0, plan) if streaming else []
    sink = _folding(folds) if folds else None
    before_fold = peak_rss_bytes()
    results = []
    started = time.perf_counter()
    for i in range(count):
        update = torch.frombuffer(buffers[i % RECEIVE_BUFFERS], dtype=torch.float32)
        if not streaming:
            update = update.clone()  # a buffered aggregator keeps every received update until the round closes
        result = ClientResult(
            f"t{i}", "bench", 1, i, TRAIN, 100 + i, loss_before=1.0 + i % 7 / 10, loss_after=0.5 + i % 5 / 10
        )
        result.payloads[UPDATE] = update
        if sink is not None:
            sink(result)
        results.append(result)
    folded = time.perf_counter() - started
    if folds:
        ctx.folds[0] = folds
    outcome = strategy.aggregate(ctx, [results])
    total = time.perf_counter() - started
    assert bool(torch.isfinite(outcome.params).all()) and len(outcome.weights) == count
    return {
        "strategy": strategy_name,
        "updates": count,
        "params": numel,
        "streaming": streaming,
        "seconds": round(total, 3),
        "fold_seconds": round(folded, 3),
        "seconds_per_update": round(total / count, 4),
        "fold_ms_per_update": round(folded / count * 1e3, 3),
        "fold_gbps": round(count * numel * 4 / folded / 1e9, 3),
        "fold_kernel": "compiled" if kernel_for(numel) is not None else "torch ops",
        "peak_rss_bytes": peak_rss_bytes(),
        "baseline_rss_bytes": baseline,
        "rss_before_fold_bytes": before_fold,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--strategies", nargs="+", default=["fedavg", "fedeba"])
    parser.add_argument("--no-buffered", action="store_true", help="skip the buffered comparison")
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case in this process
    args = parser.parse_args()
    if args.case:
        name, count, streaming = args.case.split(":")
        print(json.dumps(run_case(name, int(count), args.params, streaming == "1")))
        return 0
    cases = [(s, c, True) for s in args.strategies for c in args.counts]
    if not args.no_buffered:
        cases.append((args.strategies[0], min(args.counts), False))
    figures = []
    for name, count, streaming in cases:
        out = subprocess.run(
            [sys.executable, __file__, "--params", str(args.params), "--case", f"{name}:{count}:{int(streaming)}"],
            check=True,
            capture_output=True,
            text=True,
        )
        figure = json.loads(out.stdout.strip().splitlines()[-1])
        figures.append(figure)
        print(
            f"{name:7s} {'streaming' if streaming else 'buffered ':9s} {count:5d} updates of {args.params / 1e6:.3g}M "
            f"params: {figure['seconds']:8.2f} s ({figure['seconds_per_update']:.3f} s/update; fold "
            f"{figure['fold_ms_per_update']:.3f} ms/update, {figure['fold_gbps']:.2f} GB/s, {figure['fold_kernel']}), "
            f"peak RSS {figure['peak_rss_bytes'] / 2**30:.2f} GiB",
            flush=True,
        )
    for name in args.strategies:
        mine = {f["updates"]: f["peak_rss_bytes"] for f in figures if f["strategy"] == name and f["streaming"]}
        smallest = mine[min(mine)]
        ratios = {count: round(peak / smallest, 3) for count, peak in sorted(mine.items())}
        print(f"{name}: peak memory relative to {min(mine)} updates: {ratios} (target <= 2)")
    summary = {"params": args.params, "receive_buffers": RECEIVE_BUFFERS, "cases": figures}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
