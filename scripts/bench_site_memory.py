"""Site data larger than memory: an agent trains from a >= 2 GB on-disk dataset with its peak RSS under 1 GB.

    python scripts/bench_site_memory.py                    # 2.2 GB site in a temporary directory under /tmp
    python scripts/bench_site_memory.py --dir /data/bench --keep
    python scripts/bench_site_memory.py --gb 0.2 --rounds 1  # a smoke pass (the 1 GB bound then proves little)
    python scripts/bench_site_memory.py --json out.json    # also the figures JSON (scripts/benchlib.py's format)

It writes a site of `--clients` clients, each a directory holding `x.npy` (float32 rows of 784 features) and `y.npy`
(int64 labels of a fixed random linear rule, so there is something to learn), `--gb` in all. Then, as a real
deployment runs: privacy, clustering and aggregator services and one client agent started with `--data DIR`, each its
own process, mutual TLS with an ephemeral CA (fairfl.compose.launcher.LocalCluster); a run with `data.dataset: site`
(the aggregator knows only the signature: input_shape [784], 10 classes) trains every client for one local epoch per
round and evaluates every client every round, so each round reads every row of the files. The agent's `.npy`
features stay on disk (np.memmap, rows read with os.pread: fairfl.data.lazy), so its resident memory is the Python
runtime, torch and the model, not the data.

Reported: the agent's peak resident set (VmHWM of its process at the end) against the 1 GB bound, its resident set at
the end, how much of the site's files is resident in its mappings (smaps), the site's size on disk, the rows read per
round and the run's time and accuracy. The site is removed afterwards unless --keep. Exit status 2 when the disk has
too little room (said before anything is written), 1 when the run fails.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchlib  # first: puts the repository on sys.path and pins OMP threads before torch loads
import numpy as np

FEATURES, CLASSES = 784, 10
ROW_BYTES = FEATURES * 4  # float32
RSS_BOUND_BYTES = 1_000_000_000  # issue #20: peak RSS under 1 GB
DISK_MARGIN = 1.05  # room for y.npy, logs and checkpoints on top of the features
WRITE_ROWS = 32_768  # rows generated and written at a time


@dataclass(frozen=True)
class Site:
    """A written site: its directory, each client's row count and its bytes on disk."""

    root: Path
    rows: list[int]
    bytes_on_disk: int


def rows_for(total_bytes: float, clients: int) -> list[int]:
    """Rows per client so that the clients' features add up to at least `total_bytes`."""
    total_rows = math.ceil(total_bytes / ROW_BYTES)
    base, extra = divmod(total_rows, clients)
    return [base + (1 if i < extra else 0) for i in range(clients)]


def check_free_space(directory: Path, needed: int) -> str | None:
    """None when `directory`'s file system has room for `needed` bytes (with a margin), else why not."""
    probe = directory
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    want = int(needed * DISK_MARGIN)
    if free < want:
        return (
            f"{probe}: {benchlib.fmt_bytes(free)} free, the site needs {benchlib.fmt_bytes(want)}; "
            "choose another --dir or a smaller --gb"
        )
    return None


def write_site(root: Path, rows: list[int], seed: int = 0) -> Site:
    """One directory per client with x.npy (uniform [0, 1) features) and y.npy (argmax of a fixed random linear map of
    the features: learnable), written a block at a time so this process never holds a client's array."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=(FEATURES, CLASSES)).astype(np.float32)
    total = 0
    for cid, n in enumerate(rows):
        directory = root / f"client-{cid:02d}"
        directory.mkdir(parents=True, exist_ok=True)
        x = np.lib.format.open_memmap(directory / "x.npy", mode="w+", dtype=np.float32, shape=(n, FEATURES))
        y = np.empty(n, dtype=np.int64)
        for start in range(0, n, WRITE_ROWS):
            block = rng.random((min(WRITE_ROWS, n - start), FEATURES), dtype=np.float32)
            x[start : start + len(block)] = block
            y[start : start + len(block)] = np.argmax((block - 0.5) @ weights, axis=1)
            x.flush()
        del x
        np.save(directory / "y.npy", y)
        total += sum(p.stat().st_size for p in directory.iterdir())
    return Site(root, rows, total)


def experiment(clients: int, rounds: int, batch_size: int, hidden: list[int]) -> dict[str, Any]:
    """The run: data at the sites (signature only), every client trained one epoch and evaluated every round."""
    return {
        "name": "site-memory",
        "seed": 0,
        "rounds": rounds,
        "data": {
            "dataset": "site",
            "num_clients": clients,
            "params": {"input_shape": [FEATURES], "num_classes": CLASSES},
        },
        "model": {"name": "mlp", "params": {"hidden": hidden}},
        "training": {"local_epochs": 1, "batch_size": batch_size, "lr": 0.05},
        "strategy": {"name": "fedavg"},
        "selection": {"method": "random", "clients_per_round": clients},
        "evaluation": {"every": 1},
        "runtime": {"agents": 1, "device": "cpu", "round_timeout_s": 1800, "register_timeout_s": 120},
    }


def resident_in_mappings(pid: int, under: Path) -> int | None:
    """Bytes of files under `under` resident in `pid`'s memory mappings (smaps Rss), None when unreadable."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return None
    total, inside, prefix = 0, False, str(under.resolve())
    for line in text.splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1].startswith(prefix)
        elif inside and fields and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def current_rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class RssSampler:
    """The largest resident set of one process seen every `period` seconds, and the largest site-file residency."""

    def __init__(self, pid: int, site: Path, period: float = 0.5) -> None:
        self.pid, self.site, self.period = pid, site, period
        self.max_rss = 0
        self.max_mapped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.max_rss = max(self.max_rss, current_rss_bytes(self.pid) or 0)
            self.max_mapped = max(self.max_mapped, resident_in_mappings(self.pid, self.site) or 0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Measured:
    state: str
    message: str
    rounds: list[Any]
    seconds: float
    peak_rss: int | None
    end_rss: int | None
    sampled_rss: int
    mapped_resident: int
    agent_log: str


def run_site(site: Site, workdir: Path, config_dict: dict[str, Any], threads: int) -> Measured:
    """Services and one agent serving `site` with --data, over mutual TLS; the run driven as `fairfl run` does."""
    import grpc

    from fairfl.compose.cli import follow_run
    from fairfl.compose.launcher import LocalCluster
    from fairfl.config import experiment_from_dict
    from fairfl.v1 import control_pb2, control_pb2_grpc

    config = experiment_from_dict(config_dict)
    run_id = f"site-memory-{int(time.time())}"
    rounds: list[Any] = []
    state, message = "", ""
    with LocalCluster(workdir / "logs", tls=True, tls_dir=workdir / "tls") as cluster:
        aggregator, _, _ = cluster.start_services(workdir, ["--checkpoint-dir", str(workdir / "checkpoints")])
        (agent,) = cluster.start_agents(
            aggregator.address, len(site.rows), 1, "cpu", threads, agent_args=["--data", str(site.root)]
        )
        sampler = RssSampler(agent.process.pid, site.root)

        def on_event(event: Any) -> None:
            nonlocal state, message
            if event.HasField("round"):
                rounds.append(event.round)
                r = event.round
                accuracy = f", mean accuracy {r.fairness.mean:.2f}%" if r.evaluated else ""
                rss = benchlib.fmt_bytes(current_rss_bytes(agent.process.pid) or 0)
                print(f"  round {r.round}: {r.duration_seconds:.1f}s{accuracy}; agent RSS now {rss}", flush=True)
            else:
                state = control_pb2.RunState.Name(event.status.state)
                message = event.status.message

        started = time.monotonic()
        with cluster.open_channel(aggregator.address) as channel:
            control = control_pb2_grpc.RunControlStub(channel)
            control.StartRun(control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id=run_id), timeout=30)
            try:
                follow_run(control, run_id, on_event, reconnect_s=0.0)
            except grpc.RpcError as err:
                state, message = state or "RPC_FAILED", f"{err.code().name}: {err.details()}"
        seconds = time.monotonic() - started
        sampler.stop()
        pid = agent.process.pid
        peak, end = benchlib.peak_rss_bytes(pid), current_rss_bytes(pid)
        mapped = max(sampler.max_mapped, resident_in_mappings(pid, site.root) or 0)
        log = agent.log_path
    return Measured(state, message, rounds, seconds, peak, end, sampler.max_rss, mapped, log.read_text()[-3000:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="where the site is written (default: a new directory under /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the site's files afterwards")
    parser.add_argument("--gb", type=float, default=2.2, help="size of the site's features in GB (default 2.2)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--hidden", type=int, nargs="+", default=[200, 200])
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the agent (default 2)")
    parser.add_argument("--json", type=Path, help="also write the figures JSON here")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    rows = rows_for(args.gb * 1e9, args.clients)
    base = args.dir if args.dir is not None else Path(tempfile.gettempdir())
    problem = check_free_space(base, sum(rows) * ROW_BYTES)
    if problem is not None:
        print(f"bench_site_memory: not enough disk space: {problem}", file=sys.stderr)
        return 2
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="bench-site-", dir=args.dir))
    else:
        work = Path(tempfile.mkdtemp(prefix="bench-site-"))
    print(f"command: {benchlib.command_line()}")
    try:
        t0 = time.perf_counter()
        site = write_site(work / "site", rows)
        print(
            f"site: {site.root} ({len(rows)} clients, {sum(rows):,} rows of {FEATURES} float32 features, "
            f"{benchlib.fmt_bytes(site.bytes_on_disk)} = {site.bytes_on_disk / 1e9:.2f} GB on disk; "
            f"written in {time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
        config = experiment(args.clients, args.rounds, args.batch_size, args.hidden)
        measured = run_site(site, work / "run", config, args.threads)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    if measured.state != "RUN_STATE_COMPLETED":
        print(f"the run did not complete: {measured.state} {measured.message}\n{measured.agent_log}", file=sys.stderr)
        return 1
    last = measured.rounds[-1]
    # Per round: every client's train rows once (one local epoch) and its test rows once (evaluation every round).
    test_rows = sum(c.num_samples for c in last.clients)
    figures = [
        benchlib.figure(
            "agent peak RSS (VmHWM) training from the on-disk site",
            measured.peak_rss,
            "B",
            target=("<=", RSS_BOUND_BYTES),
            note=f"site {site.bytes_on_disk / 1e9:.2f} GB on disk",
            key="agent_peak_rss",
        ),
        benchlib.figure("site size on disk", site.bytes_on_disk, "B", key="site_bytes"),
        benchlib.figure("agent RSS at the end of the run", measured.end_rss, "B", key="agent_end_rss"),
        benchlib.figure(
            "site files resident in the agent's mappings (largest seen)", measured.mapped_resident, "B", key="mapped"
        ),
        benchlib.figure("rows read per round (every row once)", sum(rows), "", key="rows_per_round"),
        benchlib.figure("of which test rows (evaluation)", test_rows, "", key="test_rows"),
        benchlib.figure("seconds per round", measured.seconds / max(len(measured.rounds), 1), "s", key="round_s"),
        benchlib.figure("final mean client accuracy", last.fairness.mean, "%", key="accuracy"),
    ]
    notes = [
        f"{len(rows)} clients in one agent (--data DIR, each client a directory with x.npy + y.npy, test split 20% "
        f"seeded), {args.rounds} rounds of 1 local epoch (batch {args.batch_size}, mlp {args.hidden}), every client "
        f"evaluated every round; agent with {args.threads} torch threads; services and agent over mutual TLS.",
    ]
    benchlib.write_result(args.json, "site_memory", figures, started, notes=notes)
    peak = measured.peak_rss or 0
    verdict = "under" if peak <= RSS_BOUND_BYTES else "OVER"
    print(
        f"\nagent peak RSS {peak / 1e6:.0f} MB for a {site.bytes_on_disk / 1e9:.2f} GB site: {verdict} the 1 GB bound"
    )
    return 0 if peak <= RSS_BOUND_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())
