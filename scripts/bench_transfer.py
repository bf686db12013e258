"""Transfer speed of a ~1 GiB model down to an agent and a ~1 GiB update back up, over mutual TLS on loopback.

    python scripts/bench_transfer.py                  # ~1 GiB, 5 repeats, lossless + float16 + bfloat16 updates
    python scripts/bench_transfer.py --json out.json  # also write the final JSON line to a file
    python scripts/bench_transfer.py --hidden 4096 4096 --repeats 5 --dtypes float32

What it measures: an aggregator process (`python -m aggregator_service`, mTLS with an ephemeral CA as `fairfl run`
deploys it, gRPC's per-message limit at its 4 MiB default) runs an experiment whose MLP (synthetic data, 60 inputs,
hidden 16384 x 16384) has ~270M float32 parameters, so the global model it publishes is a ~1.08 GB blob. This process
is the client agent, `client_agent.agent.Agent` with its own code paths:
- down: `Agent._fetch_model` fetches the published model (FetchBlob byte ranges on concurrent streams, sha256 of the
  whole checked against its address, layout checked); the agent's model cache is emptied before each repeat so every
  repeat moves the whole blob (its receive buffer is reused, as from round to round);
- up: `Agent.submit` sends one ~1 GiB UPDATE per round (encode, stream with the sha256 in a trailer, wait for the
  reply), accepted only after `FederationState.accept`'s checks (task, identity, layout, size, sha256, finiteness).
  The update is random: this times the wire, not SGD. One client and one round per upload, with strategy afl by
  default, which aggregates at the end of the round: FedAvg's streaming fold runs inside SubmitResult, so with
  `--strategy fedavg` an upload also times aggregation.
GB/s = the model's float32 bytes / wall seconds of one call, median over the repeats. Each direction first makes one
cold transfer, reported apart and left out of the median: it first-touches the receive and send buffers that every
later transfer reuses (codec.TRANSFER_BUFFERS, the heap kept by rpc.tune_allocator), and fresh memory costs this kind
of VM ~1-3 s of page faults per GiB, once per process, not per round. With `transport.update_dtype` float16 or
bfloat16 the agent sends half the bytes (lossy); those figures are reported apart, still as float32 bytes per second
(how fast a 1 GiB float32 update gets through), next to the bytes that crossed the wire. Each variant runs on a fresh
aggregator process. Also reported: CPU seconds of the agent and the aggregator per transfer (Linux) and both
processes' peak memory (~7 and ~10 GB: keep ~18 GB free). About three minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import torch  # noqa: E402

from client_agent.agent import FETCH_STREAMS, Agent  # noqa: E402
from client_agent.trainer import ClientRuntime  # noqa: E402
from fairfl import telemetry  # noqa: E402
from fairfl.compose.launcher import LocalCluster  # noqa: E402
from fairfl.config import experiment_from_dict  # noqa: E402
from fairfl.protocol import TRAIN, UPDATE, ClientResult  # noqa: E402
from fairfl.rpc import CHUNK_BYTES, MAX_MESSAGE_BYTES  # noqa: E402
from fairfl.tls import ROLE_AGENT  # noqa: E402
from fairfl.v1 import control_pb2, control_pb2_grpc, federation_pb2  # noqa: E402

torch.set_num_threads(1)
GB = 1e9
COLD = 1  # transfers each way before the measured ones: they first-touch the buffers later ones reuse (see above)


def experiment(hidden: list[int], uploads: int, update_dtype: str, strategy: str) -> dict:
    return {
        "name": "bench-transfer",
        "seed": 0,
        # One client, one round per upload: each round's result is aggregated and dropped before the next arrives.
        # The last round (evaluated) is never reached: the run is stopped after the uploads.
        "rounds": uploads + 1,
        "data": {"dataset": "synthetic", "num_clients": 1},
        "model": {"name": "mlp", "params": {"hidden": hidden}},
        "training": {"local_steps": 1, "batch_size": 8},
        "strategy": {"name": strategy},
        "selection": {"method": "full", "clients_per_round": 1},
        "runtime": {"agents": 1, "round_timeout_s": 600, "register_timeout_s": 120, "device": "cpu"},
        "transport": {"update_dtype": update_dtype},
    }


def prepare(agent: Agent, run_id: str) -> ClientRuntime:
    """The agent's runtime for the run, as soon as the aggregator serves its spec (right after StartRun)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return agent._runtime(run_id)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def next_train_task(agent: Agent, control: control_pb2_grpc.RunControlStub, run_id: str) -> federation_pb2.Task:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        reply = agent.stub.PollTasks(
            federation_pb2.PollRequest(agent_id=agent.agent_id, max_tasks=1, wait_seconds=2.0), timeout=30
        )
        for task in reply.tasks:
            if task.phase == TRAIN:
                return task
        status = control.GetRun(control_pb2.GetRunRequest(run_id=run_id), timeout=30)
        if status.state not in (control_pb2.RUN_STATE_PENDING, control_pb2.RUN_STATE_RUNNING):
            raise RuntimeError(f"run {run_id} ended ({control_pb2.RunState.Name(status.state)}): {status.message}")
    raise TimeoutError(f"run {run_id}: no training task within 300 s")


class Timed:
    """Wall seconds of a block, and the CPU seconds this process (the agent) and the aggregator spent in it."""

    def __init__(self, aggregator_pid: int) -> None:
        self.pid = aggregator_pid

    def __enter__(self) -> Timed:
        self.cpu0, self.agg0 = _own_cpu(), _process_cpu(self.pid)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.agent_cpu = _own_cpu() - self.cpu0
        self.aggregator_cpu = _process_cpu(self.pid) - self.agg0


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of a child process (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss(pid: str) -> int:
    """Peak resident memory of a process in bytes (Linux /proc; 0 elsewhere)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0)


def one_run(cluster: LocalCluster, args: argparse.Namespace, update_dtype: str, measure_down: bool) -> dict:
    """One run on a fresh aggregator process (so no earlier run's models stay in its memory)."""
    name = f"aggregator-{update_dtype}"
    clustering = cluster.start_service(f"clustering-{update_dtype}", "clustering_service", [])  # selects for it
    options = ["--rate-limit", "0", "--clustering", clustering.address]
    aggregator = cluster.start_service(name, "aggregator_service", options)
    config = experiment_from_dict(experiment(args.hidden, COLD + args.repeats, update_dtype, args.strategy))
    run_id = f"bench-transfer-{update_dtype}"
    security = cluster.issue(f"bench-agent-{update_dtype}", ROLE_AGENT, [(0, 0)])
    agent = Agent(aggregator.address, [0], device="cpu", name="bench", security=security)
    pid = aggregator.process.pid
    try:
        with cluster.open_channel(aggregator.address) as operator:
            control = control_pb2_grpc.RunControlStub(operator)
            started = time.perf_counter()
            agent._register()
            threading.Thread(target=agent._heartbeats, name="heartbeat", daemon=True).start()  # or its tasks close
            control.StartRun(control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id=run_id), timeout=30)
            runtime = prepare(agent, run_id)  # builds the agent's model while the aggregator builds its own
            task = next_train_task(agent, control, run_id)
            layout = runtime.layout
            out: dict = {"model_params": layout.numel, "model_bytes": layout.nbytes}
            print(f"{update_dtype}: run set up in {time.perf_counter() - started:.1f}s", flush=True)
            if measure_down:
                down = []
                for _ in range(COLD + args.repeats):
                    agent.models.clear()  # the cache by sha256 would answer the next fetch without the wire
                    with Timed(pid) as timed:
                        agent._fetch_model(task.model)
                    down.append(timed)
                out["down_cold"], out["down"] = down[:COLD], down[COLD:]
            update = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0)).mul_(1e-3)
            up, wire = [], []
            for repeat in range(COLD + args.repeats):
                if repeat:  # the next round's task, once the aggregator has aggregated this one
                    task = next_train_task(agent, control, run_id)
                result = ClientResult(
                    task_id=task.task_id,
                    run_id=task.run_id,
                    round=task.round,
                    client_id=task.client_id,
                    phase=TRAIN,
                    num_samples=100,
                    loss_before=1.0,
                    loss_after=0.9,
                    payloads={UPDATE: update},
                    agent_id=agent.agent_id,
                )
                sent_before = _sent_bytes()
                with Timed(pid) as timed:
                    agent.uploads.submit(result, runtime)
                up.append(timed)
                wire.append(_sent_bytes() - sent_before)
            out["up_cold"], out["up"] = up[:COLD], up[COLD:]
            out["up_wire_bytes"] = int(statistics.median(wire))
            out["aggregator_peak_rss_bytes"] = _peak_rss(str(pid))
            return out
    finally:
        agent.stop.set()
        agent.channel.close()
        cluster.kill(name)  # the run with it: the next variant starts on a fresh aggregator


def _sent_bytes() -> float:
    """The agent's own count of result-stream bytes it sent (serialised chunks: what crossed the wire, less framing)."""
    (family,) = telemetry.AGENT_SENT_BYTES.collect()
    return sum(sample.value for sample in family.samples if sample.name.endswith("_total"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[16384, 16384], help="MLP hidden widths")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="measured transfers each way per variant, after one cold transfer (median reported)",
    )
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "float16", "bfloat16"], choices=["float32", "float16", "bfloat16"]
    )
    parser.add_argument(
        "--strategy",
        default="afl",
        help="the run's strategy (default afl: aggregates at the end of the round; FedAvg's streaming fold runs "
        "inside SubmitResult, so with fedavg an upload also times aggregation)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the final JSON line to this file")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the aggregator's log here")
    args = parser.parse_args()
    if "float32" not in args.dtypes:
        args.dtypes.insert(0, "float32")  # the lossless figures are the point; the others are extras
    runs: dict[str, dict] = {}
    wall = time.perf_counter()
    load_before = round(os.getloadavg()[0], 2)
    with (
        tempfile.TemporaryDirectory(prefix="bench-transfer-") as tmp,
        LocalCluster(args.log_dir or Path(tmp) / "logs", metrics=False) as cluster,
    ):
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
        for dtype in args.dtypes:
            runs[dtype] = r = one_run(cluster, args, dtype, measure_down=dtype == "float32")
            gc.collect()  # the agent and its runtime (the model) form reference cycles: free them before the next run
            if "down" in r:
                print(_line("down", "float32", r["model_bytes"], r["down"], r["down_cold"]), flush=True)
            print(_line("up", dtype, r["model_bytes"], r["up"], r["up_cold"]), flush=True)
    lossless = runs["float32"]
    nbytes = lossless["model_bytes"]
    figures: dict = {
        "benchmark": "transfer",
        "tls": True,
        "max_message_bytes": MAX_MESSAGE_BYTES,
        "chunk_bytes": CHUNK_BYTES,
        "fetch_streams": FETCH_STREAMS,
        "repeats": args.repeats,
        "strategy": args.strategy,
        "model_params": lossless["model_params"],
        "bytes_moved": nbytes,
        "down_gbps": _gbps(nbytes, lossless["down"]),
        "up_gbps": _gbps(nbytes, lossless["up"]),
        "down_cold_gbps": _gbps(nbytes, lossless["down_cold"]),
        "up_cold_gbps": _gbps(nbytes, lossless["up_cold"]),
        **_details("down", lossless["down"]),
        **_details("up", lossless["up"]),
        **_details("down_cold", lossless["down_cold"]),
        **_details("up_cold", lossless["up_cold"]),
        "up_wire_bytes": lossless["up_wire_bytes"],
    }
    for dtype in args.dtypes:
        if dtype != "float32":  # lossy: reported apart, as float32 bytes per second (how fast the update got through)
            r = runs[dtype]
            figures[f"up_{dtype}_gbps"] = _gbps(nbytes, r["up"])
            figures.update(_details(f"up_{dtype}", r["up"]))
            figures[f"up_{dtype}_wire_bytes"] = r["up_wire_bytes"]
    figures["agent_peak_rss_bytes"] = _peak_rss("self")
    figures["aggregator_peak_rss_bytes"] = max(r["aggregator_peak_rss_bytes"] for r in runs.values())
    figures["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform(terse=True)}"
    figures["load_average_before"] = load_before  # other work on the machine slows the figures down
    figures["wall_seconds"] = round(time.perf_counter() - wall, 1)
    line = json.dumps(figures)
    print(line)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(line + "\n")
    return 0


def _gbps(nbytes: int, timings: list[Timed]) -> float:
    return round(nbytes / statistics.median(t.seconds for t in timings) / GB, 3) if timings else math.nan


def _details(key: str, timings: list[Timed]) -> dict[str, list[float]]:
    return {
        f"{key}_seconds": [round(t.seconds, 3) for t in timings],
        f"{key}_agent_cpu_seconds": [round(t.agent_cpu, 2) for t in timings],
        f"{key}_aggregator_cpu_seconds": [round(t.aggregator_cpu, 2) for t in timings],
    }


def _line(direction: str, dtype: str, nbytes: int, timings: list[Timed], cold: list[Timed]) -> str:
    each = ", ".join(f"{t.seconds:.2f}" for t in timings)
    cpu = ", ".join(f"{t.agent_cpu:.1f}+{t.aggregator_cpu:.1f}" for t in timings)
    first = ", ".join(f"{t.seconds:.2f} s (CPU {t.agent_cpu:.1f}+{t.aggregator_cpu:.1f} s)" for t in cold)
    return (
        f"{direction:4s} {dtype:8s} {nbytes / GB:.3f} GB: median {_gbps(nbytes, timings):.3f} GB/s "
        f"(wall {each} s; CPU agent+aggregator {cpu} s; cold first transfer {first})"
    )


if __name__ == "__main__":
    sys.exit(main())
