"""GPU: the default preset with its client agents on CUDA, and how busy the GPU is while clients train.

    python scripts/bench_gpu.py                  # the preset (200 rounds), the packed run and the trainer alone
    python scripts/bench_gpu.py --quick          # fewer rounds and clients: a smoke pass
    python scripts/bench_gpu.py --json out.json  # also write the figures JSON (scripts/bench_report.py reads it)

Without a CUDA device it prints {"skipped": "no CUDA device"} (also to --json) and exits 0.

Three measurements, one after another, all on `cuda`:
- preset: `fairfl run experiments/quickstart.yaml` over gRPC with `runtime.device: cuda` (services and 2 agent
  processes on loopback, mutual TLS; 10 of 100 clients per round; scripts/benchlib.py drives it as fairfl.compose.cli
  does).
- packed: the same preset with one agent hosting all 100 logical clients and 50 of them per round, so one agent
  trains 50 clients back to back each round: does the GPU stay busy from one client to the next?
- trainer: the agent's trainer alone (client_agent.trainer.ClientRuntime, no network): every hosted client runs the
  preset's TRAIN task from one global model, back to back, as an agent does within a round (the ceiling for an agent).

Seconds per round = wall time from round 1's event to the last one's over the rounds between (round 1 loads data and
starts CUDA). GPU utilisation is sampled every 100 ms: NVML through torch.cuda.utilization when pynvml is installed,
else `nvidia-smi --query-gpu=timestamp,utilization.gpu -lms 100`; each sample is the % of its period in which a kernel
ran. "While training" = the samples within rounds that did not evaluate (a round's window ends when its event arrives
and lasts its duration_seconds; round 1 left out), and for the trainer the samples within its loop.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import benchlib  # first: puts the repository on sys.path and pins OMP threads before torch loads
import torch
from bench_round import SAME_WORK_POINTS, LoopTiming, check_plain_loop_applies, loss_passes_run, plain_loop

DEFAULT_CONFIG = benchlib.REPO / "experiments" / "quickstart.yaml"
SAMPLE_MS = 100
SKIPPED = {"skipped": "no CUDA device"}


class UtilisationSampler:
    """GPU utilisation of CUDA device 0 every SAMPLE_MS, as (monotonic seconds, %) samples, in a background thread
    (NVML) or an nvidia-smi child process."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self.source = "none"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> UtilisationSampler:
        try:
            torch.cuda.utilization(0)  # needs pynvml (or amdsmi)
            self.source = "nvml"
            self._thread = threading.Thread(target=self._poll_nvml, name="gpu-util", daemon=True)
        except Exception:  # no pynvml: fall back to nvidia-smi
            device = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
            command = [
                "nvidia-smi",
                "--query-gpu=timestamp,utilization.gpu",
                "--format=csv,noheader,nounits",
                f"--loop-ms={SAMPLE_MS}",
                f"--id={device}",
            ]
            try:
                self._process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
            except OSError:
                return self  # neither: no samples, and the figures say so
            self.source = "nvidia-smi"
            self._thread = threading.Thread(target=self._read_smi, name="gpu-util", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._process is not None:
            self._process.terminate()
            with suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=5)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _poll_nvml(self) -> None:
        while not self._stop.wait(SAMPLE_MS / 1000):
            self.samples.append((time.monotonic(), float(torch.cuda.utilization(0))))

    def _read_smi(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        # nvidia-smi stamps each sample with local wall time; its output may arrive in blocks through the pipe.
        wall_to_monotonic = time.time() - time.monotonic()
        for line in self._process.stdout:
            stamp, _, value = line.rpartition(",")
            try:
                at = datetime.datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self.samples.append((at - wall_to_monotonic, float(value)))
            except ValueError:
                continue  # a header or a "[N/A]" reading

    def within(self, windows: list[tuple[float, float]]) -> list[float]:
        return [u for t, u in self.samples if any(lo <= t <= hi for lo, hi in windows)]


def summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "samples": 0}
    return {
        "mean": round(statistics.fmean(values), 1),
        "p50": round(statistics.median(values), 1),
        "samples": len(values),
    }


def grpc_variant(config: Any, workdir: Path) -> tuple[dict[str, Any], list[list[int]]]:
    """The run's figures and each round's selected clients (which the plain loop replays)."""
    with UtilisationSampler() as sampler:
        trace = benchlib.run_grpc_traced(config, workdir)
    if not trace.completed:
        raise SystemExit(f"bench_gpu: the run ended {trace.state}: {trace.message}")
    per_round, measured = trace.round_wall()
    windows = [(t - r.duration_seconds, t) for r, t in zip(trace.rounds, trace.arrivals, strict=True)]
    training = [w for w, r in zip(windows, trace.rounds, strict=True) if not r.evaluated and r.round > 1]
    train_rounds = [r.duration_seconds for r in trace.rounds if not r.evaluated and r.round > 1]
    final = next((r.fairness.mean for r in reversed(trace.rounds) if r.evaluated), math.nan)
    figures = {
        "agents": config.runtime.agents,
        "clients": config.data.num_clients,
        "clients_per_round": config.selection.clients_per_round,
        "rounds": config.rounds,
        "seconds_per_round": round(per_round, 4),
        "rounds_measured": measured,
        "training_round_seconds_p50": round(statistics.median(train_rounds), 4) if train_rounds else None,
        "util_training": summary(sampler.within(training)),
        "util_whole_run": summary(sampler.within(windows[1:])),
        "util_source": sampler.source,
        "final_mean_accuracy": None if math.isnan(final) else round(final, 2),
    }
    return figures, [list(r.selected) for r in trace.rounds]


def plain_variant(config: Any, selections: list[list[int]], device: torch.device) -> dict[str, Any]:
    """The preset's rounds in scripts/bench_round.py's plain PyTorch loop on `device`, replaying the gRPC run's
    selections: the same clients, batches and evaluations in one process, with no services, agents or wire."""
    passes_run = loss_passes_run(config)
    with UtilisationSampler() as sampler:
        plain = plain_loop(config, selections, loss_passes=passes_run, device=device)
    windows = list(zip(plain.arrivals, plain.arrivals[1:], strict=False))
    training = [w for w, e in zip(windows, plain.eval_round_seconds[1:], strict=True) if e == 0.0]
    return {
        "rounds": len(selections),
        "seconds_per_round": round(LoopTiming.of(plain, passes_run).floor, 4),
        "util_training": summary(sampler.within(training)),
        "util_source": sampler.source,
        "final_mean_accuracy": None if math.isnan(plain.final_accuracy) else round(plain.final_accuracy, 2),
    }


def same_work_warnings(details: dict[str, Any]) -> list[str]:
    """A warning for each gRPC run whose final accuracy the plain loop replaying it does not reproduce."""
    warnings = []
    for name in ("preset", "packed"):
        run, plain = details[name]["final_mean_accuracy"], details[f"plain_{name}"]["final_mean_accuracy"]
        if run is None or plain is None or abs(run - plain) > SAME_WORK_POINTS:
            warnings.append(
                f"WARNING: the {name} run ended at {run}% and the plain loop replaying it at {plain}%, more than "
                f"{SAME_WORK_POINTS} points apart: the loop may not be doing the same work."
            )
    return warnings


def trainer_variant(config: Any, clients: int, device: torch.device) -> dict[str, Any]:
    """Every client's TRAIN task of round 1, back to back on one ClientRuntime (what an agent does in a round)."""
    from aggregator_service.engine import initial_model
    from client_agent.trainer import ClientRuntime
    from fairfl.data import load_run_data
    from fairfl.params import synchronize
    from fairfl.v1 import federation_pb2, tensor_pb2

    data = load_run_data(config)
    _, x0 = initial_model(config)
    hosted = list(range(min(clients, data.num_clients)))
    runtime = ClientRuntime(config, data, hosted, device, lambda ref: x0)
    t = config.training
    train = federation_pb2.LocalTrainingConfig(batch_size=t.batch_size, lr=t.lr, loss_eval_batches=t.loss_eval_batches)
    unit, count = t.budget()
    setattr(train, unit, count)

    def task(client: int) -> federation_pb2.Task:
        return federation_pb2.Task(
            task_id=f"bench/c{client}",
            run_id="bench",
            round=1,
            phase=federation_pb2.PHASE_TRAIN,
            client_id=client,
            model=tensor_pb2.BlobRef(sha256="x0"),
            seed=client + 1,
            train=train,
        )

    runtime.run(task(hosted[0]))  # warm-up: CUDA context, kernels, allocator
    with UtilisationSampler() as sampler:
        time.sleep(2 * SAMPLE_MS / 1000)  # a sample or two before the loop, so the loop's first window is covered
        started = time.monotonic()
        for client in hosted:
            runtime.run(task(client))
        synchronize(device)
        ended = time.monotonic()
    return {
        "clients": len(hosted),
        "local_steps": count if unit == "local_steps" else None,
        "seconds": round(ended - started, 4),
        "ms_per_client": round(1000 * (ended - started) / len(hosted), 3),
        "model_copies_to_device": runtime.resident.loads,  # 1: the global model went up once for every client
        "util_training": summary(sampler.within([(started, ended)])),
        "util_source": sampler.source,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="experiment (default: the default preset)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds of the preset run (default: the preset's)")
    parser.add_argument("--packed-rounds", type=int, default=40, help="rounds of the packed run (default 40)")
    parser.add_argument("--packed-per-round", type=int, default=50, help="clients per round, packed run (default 50)")
    parser.add_argument("--quick", action="store_true", help="20 rounds each, 20 clients for the trainer")
    parser.add_argument("--json", type=Path, default=None, help="write the figures JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        line = json.dumps(SKIPPED)
        print(line)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(line + "\n")
        return 0
    started = time.perf_counter()
    torch.set_num_threads(1)
    overrides: dict[str, Any] = {"runtime.device": "cuda"}
    if args.rounds or args.quick:
        overrides["rounds"] = args.rounds or 20
    config = benchlib.load_config(args.config, overrides)
    check_plain_loop_applies(config)  # before any run: the loop must do the same work to be compared with
    packed = benchlib.with_overrides(
        config,
        {
            "rounds": 20 if args.quick else args.packed_rounds,
            "runtime.agents": 1,
            "selection.clients_per_round": min(args.packed_per_round, config.data.num_clients),
        },
    )
    gpu = torch.cuda.get_device_name(0)
    print(f"GPU: {gpu}")
    details: dict[str, Any] = {"gpu": gpu, "cuda": torch.version.cuda}
    selections: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        for name, cfg in (("preset", config), ("packed", packed)):
            print(
                f"{name}: {cfg.rounds} rounds, {cfg.runtime.agents} agent(s), {cfg.selection.clients_per_round}/round"
            )
            details[name], selections[name] = grpc_variant(cfg, Path(tmp) / name)
            print(f"  {json.dumps(details[name])}")
    for name, cfg in (("preset", config), ("packed", packed)):
        print(f"plain GPU loop, the {name} run's selections")
        details[f"plain_{name}"] = plain_variant(cfg, selections[name], torch.device("cuda"))
        print(f"  {json.dumps(details[f'plain_{name}'])}")
    print("trainer alone")
    details["trainer"] = trainer_variant(config, 20 if args.quick else config.data.num_clients, torch.device("cuda"))
    print(f"  {json.dumps(details['trainer'])}")

    p, k, tr = details["preset"], details["packed"], details["trainer"]
    lp, lk = details["plain_preset"], details["plain_packed"]
    figures = [
        benchlib.figure(
            "GPU: seconds per round, default preset over gRPC",
            p["seconds_per_round"],
            "s",
            note=f"{p['agents']} agents on cuda, {p['clients_per_round']} clients/round, rounds 2-{p['rounds']}",
            key="gpu_seconds_per_round",
        ),
        benchlib.figure(
            "GPU: plain PyTorch loop, seconds per round, default preset",
            lp["seconds_per_round"],
            "s",
            note=f"one process on cuda replaying the gRPC run's selections; GPU utilisation while training mean "
            f"{lp['util_training']['mean']}%, p50 {lp['util_training']['p50']}%",
            key="gpu_plain_seconds_per_round",
        ),
        benchlib.figure(
            "GPU: default preset over gRPC / the plain GPU loop, round time",
            p["seconds_per_round"] / lp["seconds_per_round"],
            "x",
            note="2 agent processes on one GPU, mutual TLS, against one plain process",
            key="gpu_over_plain",
        ),
        benchlib.figure(
            "GPU utilisation while training, default preset (mean)",
            p["util_training"]["mean"],
            "%",
            note=f"p50 {p['util_training']['p50']}%, {p['util_training']['samples']} samples ({p['util_source']})",
            key="gpu_util_mean",
        ),
        benchlib.figure(
            "GPU: seconds per round, 1 agent with 50 logical clients per round",
            k["seconds_per_round"],
            "s",
            note=f"{k['clients_per_round']} clients/round on one agent, rounds 2-{k['rounds']}",
            key="gpu_packed_seconds_per_round",
        ),
        benchlib.figure(
            "GPU: 1 agent with 50 logical clients per round / the plain GPU loop, round time",
            k["seconds_per_round"] / lk["seconds_per_round"],
            "x",
            note=f"plain loop {lk['seconds_per_round']} s/round on the same selections, utilisation mean "
            f"{lk['util_training']['mean']}%",
            key="gpu_packed_over_plain",
        ),
        benchlib.figure(
            "GPU utilisation while training, 1 agent with 50 logical clients per round (mean)",
            k["util_training"]["mean"],
            "%",
            note=f"p50 {k['util_training']['p50']}%, {k['util_training']['samples']} samples",
            key="gpu_packed_util_mean",
        ),
        benchlib.figure(
            "GPU: trainer alone, ms per logical client (the preset's TRAIN task)",
            tr["ms_per_client"],
            "ms",
            note=f"{tr['clients']} clients back to back; utilisation mean {tr['util_training']['mean']}%, "
            f"p50 {tr['util_training']['p50']}%",
            key="gpu_trainer_ms_per_client",
        ),
    ]
    notes = [
        *same_work_warnings(details),
        "Utilisation is the share of each ~100 ms sample in which a kernel ran, not how much of the GPU it used: the "
        "preset's MLP (784-200-200-10, batch 50) is far too small to fill a data-centre GPU.",
        "The plain loop replays the gRPC runs' selections in one process: the same clients, batches and evaluations, "
        "one client after another, as one agent trains them. Two agent processes sharing the GPU overlap their "
        "kernel launches; one agent with 50 clients a round compares with the plain loop like for like.",
    ]
    result = benchlib.write_result(args.json, "gpu", figures, started, quick=args.quick, notes=notes, details=details)
    print(json.dumps(result, allow_nan=False, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
