"""Run the benchmark scripts and write their figures, commands and machine to docs/benchmarks.md (`make bench`).

    python scripts/bench_report.py                         # every benchmark; docs/benchmarks.md and .json
    python scripts/bench_report.py --quick                 # smoke pass: runs/bench/benchmarks-quick.md
    python scripts/bench_report.py --only round,wire       # run these again, keep the others' last figures
    python scripts/bench_report.py --render                # only re-render the markdown from the JSON
    python scripts/bench_report.py --add gpu=gpu.json      # a script's --json written on another machine (a GPU)

Each scripts/bench_<name>.py is run as its own process with `--json PATH` (and `--quick` when asked and the script
has it); its output goes to runs/bench/<name>.log. A script writes either a `figures` list (scripts/benchlib.py:
name, value, unit, optional target {op, value}, key) or flat keys, which an adapter here turns into figures
(bench_transfer.py's down_gbps / up_gbps ...); a script that is missing is "not run", one that fails is reported with
its exit status and the tail of its log. The acceptance table lists every acceptance criterion of issues #9 and #20,
and issue #21's figures against the ideal parallel floor, with the figure that measures it, its target and pass or
fail.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
DEFAULT_OUTPUT = REPO / "docs" / "benchmarks.md"
QUICK_OUTPUT = REPO / "runs" / "bench" / "benchmarks-quick.md"
LOG_DIR = REPO / "runs" / "bench"
TIMEOUT_S = float(os.environ.get("BENCH_TIMEOUT", "1800"))
MACHINE_KEYS = ("cpu", "cores", "gpu", "os")  # what makes two sections' machines the same one


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str
    title: str
    what: str
    quick_args: tuple[str, ...] = ()  # for scripts without --quick: arguments that make a smoke pass, if it has them
    acceptance_note: str = ""  # said under the Acceptance table when this benchmark ran: what its figures add to it


BENCHMARKS = [
    Benchmark(
        "round",
        "bench_round.py",
        "1. Round overhead",
        "Wall time per round over gRPC and in-process against the ideal parallel floor (the one-thread plain "
        "PyTorch loop's per-client work, summed over each round's clients and divided over the usable cores), and "
        "CPU per round of every process against the one-thread loop's, for the default preset and the "
        "all-participating one (experiments/bench_all_participating.yaml); second, the single-process comparison: "
        "gRPC round time divided by the same local training and evaluation in a plain PyTorch loop in one process, "
        "and gRPC against the in-process transport.",
    ),
    Benchmark(
        "grpc_cost",
        "bench_grpc_cost.py",
        "1b. Where a gRPC round's CPU goes",
        "CPU per round of every process over gRPC on the all-participating preset with 2 and 10 clients a round, at "
        "the preset's model and a tiny one; the aggregator's CPU split, by an exact fit of the four runs, into a cost "
        "per round, per MB of model per round, per client task and per MB of update received.",
    ),
    Benchmark(
        "transport_floor",
        "bench_transport_floor.py",
        "1c. The transport's own floor",
        "The CPU that only moving the all-participating preset's bytes costs (each of 2 agent processes fetching the "
        "0.8 MB model and sending 5 updates of 0.8 MB a round), on bare transports with no FairFL code in the path: "
        "gRPC with and without mutual TLS, gRPC carrying one partial sum per agent, both gRPC shapes again with a "
        "grpc.aio server and 1 MiB TCP read chunks, and a TLS socket receiving into a preallocated buffer; against "
        "#21's budget for everything but training (0.15x the one-thread plain loop's CPU) and against the cipher "
        "alone.",
        acceptance_note="#21's gRPC rows against what the transport alone costs: section 1c measures the CPU that "
        "only moving a round's bytes takes over gRPC with mutual TLS, with no FairFL code in the path, against the "
        "same budget.",
    ),
    Benchmark(
        "wire",
        "bench_wire.py",
        "2. Bytes on the wire",
        "Bytes agents and the aggregator put on the wire (through a counting proxy: TLS, HTTP/2, gRPC and protobuf "
        "framing, polls and heartbeats) divided by the raw bytes of the tensors that had to move.",
    ),
    Benchmark(
        "transfer",
        "bench_transfer.py",
        "3. Transfer",
        "A 1 GiB model down to an agent and a 1 GiB update up from it on loopback, gRPC's per-message limit at its "
        "default; lossy fp16/bf16 updates separately.",
        quick_args=("--repeats", "1"),
    ),
    Benchmark(
        "aggregation",
        "bench_aggregation.py",
        "4. Aggregation",
        "Time and aggregator peak memory aggregating 10, 100 and 1000 updates of a 100M-parameter model.",
        quick_args=("--counts", "10", "100", "--params", "10000000"),
    ),
    Benchmark(
        "scale",
        "bench_scale.py",
        "5. Scale",
        "1000 logical clients across 4 agent processes, 100 per round: the run completes; time per round and "
        "aggregator memory.",
    ),
    Benchmark(
        "selection",
        "bench_selection.py",
        "6a. Selection",
        "HiCS-FL selection over 10,000 clients, through the clustering service and in-process.",
    ),
    Benchmark(
        "accounting",
        "bench_accounting.py",
        "6b. Accounting",
        "ε query on a privacy ledger of 1,000 clients x 1,000 rounds, through the privacy service.",
    ),
    Benchmark(
        "gpu",
        "bench_gpu.py",
        "7. GPU",
        "Where a GPU is present: the default preset with agents on the GPU, its utilisation during local training, and "
        "the same rounds in a plain PyTorch loop on the GPU. A GPU machine's figures join this report with "
        "`python scripts/bench_gpu.py --json gpu.json` there and `make bench BENCH_ADD=gpu=gpu.json` here.",
    ),
    Benchmark(
        "site_memory",
        "bench_site_memory.py",
        "8. Site data larger than memory",
        "An agent serving a site's own data (`fairfl serve agent --data DIR`, .npy features read from disk with "
        "os.pread) trains from a site dataset of over 2 GB: its peak resident memory.",
    ),
]
BY_NAME = {b.name: b for b in BENCHMARKS}

# Acceptance criteria of issues #9, #20 and #21: (benchmark, figure key, criterion). A figure is found by its key.
ACCEPTANCE = [
    ("round", "grpc_over_plain", "Round overhead ≤ 1.15x the plain loop (default preset, 2-core CPU, loopback)"),
    ("wire", "wire_over_raw", "Lossless bytes on the wire ≤ 1.02x raw tensor bytes"),
    ("transfer", "down_gbps", "1 GiB model down to an agent ≥ 0.5 GB/s (default message limit)"),
    ("transfer", "up_gbps", "1 GiB update up from an agent ≥ 0.5 GB/s (default message limit)"),
    ("aggregation", "peak_ratio_100", "Aggregator peak memory for 100 updates ≤ 2x its memory for 10"),
    ("aggregation", "peak_ratio_1000", "Aggregator peak memory for 1000 updates ≤ 2x its memory for 10"),
    ("scale", "completed", "1000 logical clients: the run completes (time per round and memory in section 5)"),
    ("site_memory", "agent_peak_rss", "A site dataset of at least 2 GB trains with the agent's peak RSS under 1 GB"),
    ("round", "grpc_over_floor", "#21: gRPC round time ≤ 1.20x the ideal parallel floor (default preset, mTLS)"),
    ("round", "all_grpc_over_floor", "#21: gRPC round time ≤ 1.20x the ideal parallel floor (all-participating)"),
    (
        "round",
        "grpc_cpu_over_floor",
        "#21: gRPC CPU per round, all processes ≤ 1.15x the one-thread plain loop's (default preset)",
    ),
    (
        "round",
        "all_grpc_cpu_over_floor",
        "#21: gRPC CPU per round, all processes ≤ 1.15x the one-thread plain loop's (all-participating)",
    ),
    ("round", "inprocess_over_floor", "#21: in-process round time ≤ 1.20x the ideal parallel floor (default preset)"),
    (
        "round",
        "all_inprocess_over_floor",
        "#21: in-process round time ≤ 1.20x the ideal parallel floor (all-participating)",
    ),
]


# --- adapters: a script's JSON -> figures ---------------------------------------------------------------------


def _figure(name: str, value: Any, unit: str = "", target: tuple[str, float] | None = None, key: str = "") -> dict:
    out: dict[str, Any] = {"name": name, "value": value, "unit": unit, "key": key or name}
    if target is not None:
        out["target"] = {"op": target[0], "value": target[1]}
    return out


def _transfer(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """bench_transfer.py writes flat keys: down_gbps, up_gbps, up_<dtype>_gbps, bytes_moved, ..."""
    figures = [
        _figure("1 GiB model down (FetchBlob), lossless", raw.get("down_gbps"), "GB/s", (">=", 0.5), "down_gbps"),
        _figure("1 GiB update up (SubmitResult), lossless", raw.get("up_gbps"), "GB/s", (">=", 0.5), "up_gbps"),
    ]
    for key, direction in (("down_cold_gbps", "model down"), ("up_cold_gbps", "update up")):
        if key in raw:  # first-touches the buffers the measured transfers reuse: once per process, not per round
            figures.append(
                _figure(f"1 GiB {direction}, cold first transfer (not in the median)", raw[key], "GB/s", key=key)
            )
    for key in sorted(raw):
        if key.startswith("up_") and key.endswith("_gbps") and key not in ("up_gbps", "up_cold_gbps"):
            dtype = key[3:-5]
            figures.append(_figure(f"update up as {dtype} (lossy, float32-equivalent GB/s)", raw[key], "GB/s", key=key))
            wire = raw.get(f"up_{dtype}_wire_bytes")
            if isinstance(wire, int | float):
                figures.append(_figure(f"bytes on the wire for a {dtype} update", wire, "B", key=f"{key}_wire"))
    for key, name, unit in (
        ("bytes_moved", "model size moved each way", "B"),
        ("up_wire_bytes", "bytes on the wire for a lossless update", "B"),
        ("max_message_bytes", "gRPC per-message limit", "B"),
        ("repeats", "measured repeats each way, after one cold transfer (median reported)", ""),
    ):
        if key in raw:
            figures.append(_figure(name, raw[key], unit, key=key))
    return figures


def _aggregation(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """bench_aggregation.py writes {"params", "cases": [{strategy, updates, streaming, seconds, peak_rss_bytes, ...}]}.
    The acceptance keys peak_ratio_<n> are the largest ratio over the strategies (each strategy's own rows follow)."""
    cases = [c for c in raw.get("cases", []) if isinstance(c, dict)]
    params = raw.get("params")
    size = f"{params / 1e6:g}M-parameter" if isinstance(params, int | float) else "?"
    figures: list[dict[str, Any]] = []
    worst: dict[int, float] = {}
    for strategy in sorted({c.get("strategy", "?") for c in cases}):
        mine = sorted(
            (c for c in cases if c.get("strategy") == strategy and c.get("streaming")), key=lambda c: c["updates"]
        )
        if not mine:
            continue
        base = mine[0]
        for case in mine:
            n = case["updates"]
            figures.append(
                _figure(
                    f"{strategy}: {n} updates of a {size} model, time",
                    case.get("seconds"),
                    "s",
                    key=f"{strategy}_seconds_{n}",
                )
            )
            figures.append(
                _figure(
                    f"{strategy}: {n} updates, aggregator peak memory",
                    case.get("peak_rss_bytes"),
                    "B",
                    key=f"{strategy}_peak_{n}",
                )
            )
            if case is not base and base.get("peak_rss_bytes"):
                ratio = case["peak_rss_bytes"] / base["peak_rss_bytes"]
                worst[n] = max(worst.get(n, 0.0), ratio)
                figures.append(
                    _figure(
                        f"{strategy}: peak memory for {n} updates / for {base['updates']}",
                        ratio,
                        "x",
                        ("<=", 2.0),
                        key=f"{strategy}_peak_ratio_{n}",
                    )
                )
    for case in cases:
        if not case.get("streaming"):
            figures.append(
                _figure(
                    f"{case.get('strategy')}: {case.get('updates')} updates kept until the round "
                    "closes (the design streaming replaced), peak memory",
                    case.get("peak_rss_bytes"),
                    "B",
                    key=f"buffered_peak_{case.get('updates')}",
                )
            )
    for n, ratio in sorted(worst.items()):
        figures.append(
            _figure(
                f"peak memory for {n} updates / for the fewest, worst strategy",
                ratio,
                "x",
                ("<=", 2.0),
                key=f"peak_ratio_{n}",
            )
        )
    return figures


def _generic(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Any flat JSON: its numeric top-level values, as reported (no targets)."""
    return [
        _figure(key, value, key=key)
        for key, value in raw.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    ]


ADAPTERS: dict[str, Callable[[dict[str, Any]], list[dict[str, Any]]]] = {
    "transfer": _transfer,
    "aggregation": _aggregation,
}


def figures_of(name: str, raw: dict[str, Any]) -> list[dict[str, Any]]:
    if isinstance(raw.get("figures"), list):
        return raw["figures"]
    return ADAPTERS.get(name, _generic)(raw)


# --- running ------------------------------------------------------------------------------------------------------


def run_benchmark(bench: Benchmark, quick: bool, json_dir: Path, log_dir: Path) -> dict[str, Any]:
    """Run one script; its JSON plus the harness's record of how it went (status, command, seconds)."""
    script = SCRIPTS / bench.script
    if not script.exists():
        return {"status": "not run", "reason": f"scripts/{bench.script} does not exist"}
    source = script.read_text()
    extra: list[str] = []
    if quick:
        if "--quick" in source:
            extra = ["--quick"]
        elif all(arg in source for arg in bench.quick_args if arg.startswith("--")):
            extra = list(bench.quick_args)
    json_path = json_dir / f"{bench.name}.json"
    json_path.unlink(missing_ok=True)
    argv = [sys.executable, str(script), *extra, "--json", str(json_path)]
    shown = shlex.join(["python", f"scripts/{bench.script}", *extra])
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{bench.name}.log"
    print(f"[bench] {shown}  (log: {log_path})")
    started = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with log_path.open("w") as log:
        try:
            done = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=TIMEOUT_S, env=env)
            code: int | None = done.returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = round(time.monotonic() - started, 1)
    shown_log = log_path.relative_to(REPO) if log_path.is_relative_to(REPO) else log_path
    record: dict[str, Any] = {"command": shown, "seconds": seconds, "log": str(shown_log)}
    if json_path.exists():
        try:
            record["result"] = json.loads(json_path.read_text())
        except json.JSONDecodeError as err:
            record["reason"] = f"its JSON could not be read: {err}"
    if code is None:
        record.update(status="failed", reason=f"timed out after {TIMEOUT_S:g}s (BENCH_TIMEOUT)")
    elif "result" not in record:
        record.setdefault("reason", f"exit status {code} and no JSON")
        record["status"] = "failed"
    elif isinstance(record["result"], dict) and "skipped" in record["result"]:
        record.update(status="skipped", reason=str(record["result"]["skipped"]))
    else:
        record["status"] = "ok" if code == 0 else f"exit status {code}"
    if record["status"] not in ("ok", "skipped"):
        record["log_tail"] = log_path.read_text()[-1500:]
    print(f"[bench] {bench.name}: {record['status']} in {seconds:g}s")
    return record


# --- rendering ----------------------------------------------------------------------------------------------------


def fmt_value(value: Any, unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "not measured"
    if unit == "bool":
        return "yes" if value else "no"
    if unit == "x":
        return f"{value:.3f}x"
    if unit == "s":
        if value >= 100:
            return f"{value:.0f} s"
        if value >= 1:
            return f"{value:.2f} s"
        if value >= 1e-3:
            return f"{value * 1e3:.1f} ms"
        return f"{value * 1e6:.0f} µs"
    if unit == "B":
        for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(value) >= size:
                return f"{value / size:.2f} {name}"
        return f"{value:,.0f} B"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 10):
        text = f"{int(value):,}"
    elif isinstance(value, float):
        text = f"{value:.4g}"
    else:
        text = str(value)
    return f"{text} {unit}".rstrip()


def verdict(figure: dict[str, Any]) -> str:
    """'pass', 'FAIL' or '' (no target)."""
    target = figure.get("target")
    if not target:
        return ""
    value = figure.get("value")
    if not isinstance(value, int | float) or (isinstance(value, float) and math.isnan(value)):
        return "FAIL"
    ok = value <= target["value"] if target["op"] == "<=" else value >= target["value"]
    return "pass" if ok else "FAIL"


def fmt_target(figure: dict[str, Any]) -> str:
    target = figure.get("target")
    if not target:
        return ""
    op = {"<=": "≤", ">=": "≥"}[target["op"]]
    unit = figure.get("unit", "")
    bound = fmt_value(target["value"], unit) if unit not in ("bool",) else "yes"
    return f"{op} {bound}" if unit != "bool" else "yes"


def _machine_of(record: dict[str, Any]) -> dict[str, Any] | None:
    """The machine a benchmark's result says it ran on, or None (not run, failed, or no machine reported)."""
    result = record.get("result")
    machine = result.get("machine") if isinstance(result, dict) else None
    return machine if isinstance(machine, dict) else None


def _commits_row(records: dict[str, dict[str, Any]]) -> str:
    """The commit(s) the sections measured: one, or each distinct one (a BENCH_ONLY re-run keeps older sections)."""
    commits: list[str] = []
    for record in records.values():
        commit = (_machine_of(record) or {}).get("commit")
        if commit and commit not in commits:
            commits.append(commit)
    if len(commits) > 1:
        return f"| commits | {', '.join(commits)} (each section names its own) |"
    return f"| commit | {commits[0] if commits else 'unknown'} |"


def _main_machine(records: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The machine most sections ran on (the table's; a section measured elsewhere, --add, says so itself)."""
    machines = [m for m in map(_machine_of, records.values()) if m]
    if not machines:
        return None
    counts = Counter(_machine_key(m) for m in machines)
    return max(machines, key=lambda m: counts[_machine_key(m)])  # the first of the most common on ties


def _machine_key(machine: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(machine.get(k) for k in MACHINE_KEYS)


def _other_machine(machine: dict[str, Any]) -> str:
    """The line for a section measured elsewhere than the machine table's (a GPU machine, say)."""
    return (
        f"Measured on another machine: {machine.get('gpu', 'no GPU')}, {machine.get('cpu', '?')} "
        f"({machine.get('usable_cores', '?')} usable cores), {machine.get('ram_gib', '?')} GiB; "
        f"{machine.get('os', '?')}; "
        f"Python {machine.get('python')}, torch {machine.get('torch')}, grpcio {machine.get('grpcio')}, numpy "
        f"{machine.get('numpy')}."
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(records: dict[str, dict[str, Any]], quick: bool, generated: str) -> str:
    """The markdown report of `records` (benchmark name -> record)."""
    lines = ["# Benchmarks (issues #9, #20 and #21)", ""]
    if quick:
        lines += [
            "**Smoke pass (`make bench BENCH_QUICK=1`): fewer rounds and repeats; these are not the figures.**",
            "",
        ]
    lines += [
        f"Written by `make bench` (scripts/bench_report.py) on {generated}. Each section gives the command that "
        "produced its figures (run from the repository root; `make bench` runs them all, `python "
        "scripts/bench_report.py --only NAME` one again) and the machine it ran on. Figures with a target are issues "
        "#9, #20 and #21's acceptance criteria (#21's rows are marked).",
        "",
    ]
    machine = _main_machine(records)
    if machine:
        lines += ["## Machine", "", "| | |", "|---|---|"]
        lines += [
            f"| CPU | {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores "
            f"({machine.get('usable_cores', '?')} usable) |",
            f"| memory | {machine.get('ram_gib', '?')} GiB |",
            f"| GPU | {machine.get('gpu', '?')} |",
            f"| OS | {machine.get('os', '?')} |",
            f"| Python, torch, grpcio, numpy | {machine.get('python')}, {machine.get('torch')}, "
            f"{machine.get('grpcio')}, {machine.get('numpy')} |",
            _commits_row(records),
            "",
            "Each section names when it finished, the commit it measured (`make bench BENCH_ONLY=...` re-runs some "
            "sections and keeps the others) and the machine's load average then (other jobs sharing the cores make "
            "timings noisy).",
            "",
        ]
    lines += ["## Acceptance", "", "| criterion | measured | target | result |", "|---|---|---|---|"]
    for name, key, criterion in ACCEPTANCE:
        record = records.get(name, {"status": "not run"})
        figure = next((f for f in _figures(name, record) if f.get("key") == key), None)
        if figure is None:  # not run, failed, or a script that does not report this figure (by its key)
            status = record.get("status", "not run")
            lines.append(f"| {_cell(criterion)} | {'not reported' if status == 'ok' else status} | | not evaluated |")
            continue
        lines.append(
            f"| {_cell(criterion)} | {fmt_value(figure.get('value'), figure.get('unit', ''))} | "
            f"{fmt_target(figure)} | {verdict(figure)} |"
        )
    lines += [line for b in BENCHMARKS if b.acceptance_note and b.name in records for line in ("", b.acceptance_note)]
    lines.append("")
    for bench in BENCHMARKS:
        record = records.get(bench.name, {"status": "not run", "reason": f"scripts/{bench.script} was not run"})
        lines += [f"## {bench.title}", "", bench.what, ""]
        status = record.get("status", "not run")
        result = record.get("result") if isinstance(record.get("result"), dict) else {}
        command = record.get("command") or _strip_json(result.get("command", ""))
        if command:
            lines.append(f"Command: `{command}`" + (f" ({record['seconds']:g} s)" if "seconds" in record else ""))
            lines.append("")
        run_machine = _machine_of(record)
        if run_machine:
            load = ", ".join(str(x) for x in run_machine.get("load_average", []))
            at = f" at commit {run_machine['commit']}" if run_machine.get("commit") else ""
            lines += [
                f"Finished {run_machine.get('date', '?')}{at}; load average then {load} (its own processes too).",
                "",
            ]
            if machine and _machine_key(run_machine) != _machine_key(machine):
                lines += [_other_machine(run_machine), ""]
        if status not in ("ok",):
            reason = record.get("reason", "")
            lines += [f"**{status}**" + (f": {reason}" if reason else ""), ""]
            if record.get("log_tail"):
                lines += ["```", record["log_tail"].strip()[-1200:], "```", ""]
        figures = _figures(bench.name, record)
        if figures:
            lines += ["| figure | measured | target | result |", "|---|---|---|---|"]
            for f in figures:
                name = _cell(f.get("name", f.get("key", "?")))
                note = f" ({_cell(f['note'])})" if f.get("note") else ""
                lines.append(
                    f"| {name}{note} | {fmt_value(f.get('value'), f.get('unit', ''))} | {fmt_target(f)} | "
                    f"{verdict(f)} |"
                )
            lines.append("")
        for note in result.get("notes", []) if isinstance(result.get("notes"), list) else []:
            lines.append(f"- {note}")
        if result.get("notes"):
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _figures(name: str, record: dict[str, Any]) -> list[dict[str, Any]]:
    result = record.get("result")
    if not isinstance(result, dict) or "skipped" in result:
        return []
    return figures_of(name, result)


def _strip_json(command: str) -> str:
    """A script's own command line without its `--json PATH` (where the harness put the file)."""
    words = shlex.split(command) if command else []
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
            continue
        if word == "--json":
            skip = True
            continue
        if word.startswith("--json="):
            continue
        out.append(word)
    return shlex.join(out)


def _added_record(parser: argparse.ArgumentParser, spec: str) -> tuple[str, dict[str, Any]]:
    """`NAME=PATH` of --add: the record of a benchmark run elsewhere, from the JSON its script wrote there."""
    name, sep, path = (part.strip() for part in spec.partition("="))
    if not sep or not name or not path:
        parser.error(f"--add {spec!r}: expected NAME=PATH, e.g. gpu=runs/gpu.json")
    if name not in BY_NAME:
        parser.error(f"--add {spec!r}: unknown benchmark {name!r}; known: {', '.join(BY_NAME)}")
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        parser.error(f"--add {spec!r}: cannot read the benchmark's JSON: {err}")
    if isinstance(result, dict) and "skipped" in result:  # it would replace the figures kept here with nothing
        parser.error(f"--add {spec!r}: the benchmark was skipped where it ran ({result['skipped']}): nothing to add")
    if not isinstance(result, dict) or not isinstance(result.get("figures"), list):
        parser.error(f"--add {spec!r}: {path} is not a benchmark script's --json output (no figures)")
    script = BY_NAME[name].script
    if script not in str(result.get("command", "")):
        command = result.get("command")
        parser.error(f"--add {spec!r}: {path} was not written by scripts/{script} (its command: {command!r})")
    record: dict[str, Any] = {"command": _strip_json(str(result["command"])), "result": result, "status": "ok"}
    if isinstance(result.get("elapsed_s"), int | float):
        record["seconds"] = result["elapsed_s"]
    return name, record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke pass: fewer rounds and repeats")
    parser.add_argument("--only", default="", help="comma-separated benchmarks to run: " + ", ".join(BY_NAME))
    parser.add_argument("--render", action="store_true", help="run nothing; render the markdown from the JSON")
    parser.add_argument(
        "--add",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="take benchmark NAME's figures from the JSON its script wrote with --json PATH on another machine (one "
        "with a GPU, say) instead of running it here; nothing else runs unless --only names it",
    )
    parser.add_argument("--output", type=Path, default=None, help="markdown path (the JSON goes beside it)")
    args = parser.parse_args(argv)
    output = args.output or (QUICK_OUTPUT if args.quick else DEFAULT_OUTPUT)
    json_path = output.with_suffix(".json")
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    added_records = [_added_record(parser, spec) for spec in args.add]
    added = dict(added_records)
    names = Counter(n for n, _ in added_records)
    twice = sorted({n for n, count in names.items() if count > 1} | (set(only) & set(added)))
    if twice:
        parser.error(f"benchmark(s) {', '.join(twice)} named twice (in --add twice, or in --only and --add)")
    unknown = [n for n in only if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    records: dict[str, dict[str, Any]] = {}
    if json_path.exists() and (only or added or args.render):  # keep the figures of benchmarks not run again
        records = json.loads(json_path.read_text())
    records.update(added)
    if not args.render and (only or not added):
        json_dir = LOG_DIR / "json"
        json_dir.mkdir(parents=True, exist_ok=True)
        for bench in BENCHMARKS:
            if only and bench.name not in only:
                continue
            records[bench.name] = run_benchmark(bench, args.quick, json_dir, LOG_DIR)
    output.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(records, indent=1, allow_nan=True) + "\n")
    generated = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    output.write_text(render(records, args.quick, generated))
    print(f"[bench] wrote {output} and {json_path}")
    failed = [n for n, r in records.items() if r.get("status") not in ("ok", "skipped", "not run")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
