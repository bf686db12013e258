"""The benchmark harness (scripts/bench_report.py): figures JSON -> docs/benchmarks.md with targets and pass/fail,
and how it runs scripts (missing, failing, --quick)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_report
import benchlib

MACHINE = {
    "cpu": "AMD EPYC",
    "cores": 2,
    "usable_cores": 2,
    "ram_gib": 23.5,
    "gpu": "none",
    "os": "Linux",
    "python": "3.11.7",
    "torch": "2.13.0+cpu",
    "grpcio": "1.85.1",
    "numpy": "2.4.6",
    "load_average": [0.5, 0.4, 0.3],
    "commit": "abc1234",
    "date": "2026-11-21 10:00 UTC",
}


def result(figures: list[dict], **extra: object) -> dict:
    return {
        "benchmark": "x",
        "command": "python scripts/x.py --json /tmp/x.json",
        "machine": MACHINE,
        "figures": figures,
        "notes": ["a note"],
        **extra,
    }


def aggregation_case(strategy: str, updates: int, peak_gib: float, streaming: bool = True) -> dict:
    return {"strategy": strategy, "updates": updates, "streaming": streaming, "seconds": updates * 0.2,
            "peak_rss_bytes": int(peak_gib * 2**30)}  # fmt: skip


def acceptance_rows(markdown: str) -> dict[str, list[str]]:
    """criterion -> [measured, target, result] from the Acceptance table."""
    section = markdown.split("## Acceptance", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and not set(cells[0]) <= {"-"} and cells[0] != "criterion":
            rows[cells[0]] = cells[1:]
    return rows


def test_targets_pass_and_fail_at_their_bounds() -> None:
    at_bound = benchlib.figure("r", 1.15, "x", ("<=", 1.15))
    assert bench_report.verdict(at_bound) == "pass"
    assert bench_report.verdict(benchlib.figure("r", 1.1501, "x", ("<=", 1.15))) == "FAIL"
    assert bench_report.verdict(benchlib.figure("g", 0.5, "GB/s", (">=", 0.5))) == "pass"
    assert bench_report.verdict(benchlib.figure("g", 0.49, "GB/s", (">=", 0.5))) == "FAIL"
    assert bench_report.verdict(benchlib.figure("n", None, "s", ("<=", 1.0))) == "FAIL"  # not measured never passes
    assert bench_report.verdict(benchlib.figure("t", 3.0, "s")) == ""  # no target, no verdict
    with pytest.raises(ValueError, match="target op"):
        benchlib.figure("bad", 1.0, "x", ("<", 1.0))


def test_values_are_rendered_in_their_units() -> None:
    fmt = bench_report.fmt_value
    assert fmt(1.0834, "x") == "1.083x"
    assert fmt(0.2534, "s") == "253.4 ms"
    assert fmt(12.345, "s") == "12.35 s"
    assert fmt(0.000042, "s") == "42 µs"
    assert fmt(3 * 2**20, "B") == "3.00 MiB"
    assert fmt(1000, "") == "1,000"
    assert fmt(1.0, "bool") == "yes" and fmt(0.0, "bool") == "no"
    assert fmt(None, "s") == "not measured"


def test_report_renders_figures_targets_commands_and_every_acceptance_criterion() -> None:
    records = {
        "round": {
            "status": "ok",
            "command": "python scripts/bench_round.py",
            "seconds": 201.5,
            "result": result(
                [
                    benchlib.figure("gRPC / plain", 1.08, "x", ("<=", 1.15), note="2 agents", key="grpc_over_plain"),
                    benchlib.figure("gRPC: seconds per round", 0.2534, "s", key="grpc_s"),
                ]
            ),
        },
        "wire": {
            "status": "ok",
            "result": result([benchlib.figure("w", 1.031, "x", ("<=", 1.02), key="wire_over_raw")]),
        },
        # bench_transfer.py writes flat keys; the adapter gives its figures their targets.
        "transfer": {
            "status": "ok",
            "command": "python scripts/bench_transfer.py",
            "result": {"down_gbps": 0.41, "up_gbps": 0.62, "up_float16_gbps": 1.1, "bytes_moved": 2**30},
        },
        # bench_aggregation.py writes its cases; the acceptance ratios are the worst strategy's.
        "aggregation": {
            "status": "ok",
            "result": {
                "params": 100_000_000,
                "cases": [
                    aggregation_case("fedavg", 10, 1.0),
                    aggregation_case("fedavg", 100, 1.1),
                    aggregation_case("fedavg", 1000, 1.2),
                    aggregation_case("fedeba", 10, 1.0),
                    aggregation_case("fedeba", 100, 1.05),
                    aggregation_case("fedeba", 1000, 2.5),
                    aggregation_case("fedavg", 10, 4.0, streaming=False),
                ],
            },
        },
        "scale": {"status": "failed", "reason": "exit status 1 and no JSON", "log_tail": "Traceback: boom"},
        "gpu": {"status": "skipped", "reason": "no CUDA device", "result": {"skipped": "no CUDA device"}},
    }
    md = bench_report.render(records, quick=False, generated="2026-11-21 10:00 UTC")
    rows = acceptance_rows(md)
    assert rows["Round overhead ≤ 1.15x the plain loop (default preset, 2-core CPU, loopback)"] == [
        "1.080x",
        "≤ 1.150x",
        "pass",
    ]
    assert rows["Lossless bytes on the wire ≤ 1.02x raw tensor bytes"] == ["1.031x", "≤ 1.020x", "FAIL"]
    assert rows["1 GiB model down to an agent ≥ 0.5 GB/s (default message limit)"] == [
        "0.41 GB/s",
        "≥ 0.5 GB/s",
        "FAIL",
    ]
    assert rows["1 GiB update up from an agent ≥ 0.5 GB/s (default message limit)"] == [
        "0.62 GB/s",
        "≥ 0.5 GB/s",
        "pass",
    ]
    assert rows["Aggregator peak memory for 100 updates ≤ 2x its memory for 10"] == ["1.100x", "≤ 2.000x", "pass"]
    assert rows["Aggregator peak memory for 1000 updates ≤ 2x its memory for 10"] == ["2.500x", "≤ 2.000x", "FAIL"]
    assert "| fedeba: 1000 updates, aggregator peak memory | 2.50 GiB |  |  |" in md
    assert "| fedavg: 10 updates of a 100M-parameter model, time | 2.00 s |  |  |" in md
    assert rows["1000 logical clients: the run completes (time per round and memory in section 5)"][0] == "failed"
    # Sections: the command without the harness's --json, figures with notes, the machine, failures with their log.
    assert "Command: `python scripts/bench_round.py` (201.5 s)" in md
    assert "| gRPC / plain (2 agents) | 1.080x | ≤ 1.150x | pass |" in md
    assert "| gRPC: seconds per round | 253.4 ms |  |  |" in md
    assert "| update up as float16 (lossy, float32-equivalent GB/s) | 1.1 GB/s |  |  |" in md
    assert "| CPU | AMD EPYC, 2 cores (2 usable) |" in md and "| commit | abc1234 |" in md
    assert (
        "Finished 2026-11-21 10:00 UTC at commit abc1234; load average then 0.5, 0.4, 0.3 (its own processes too)."
        in md
    )
    assert "**failed**: exit status 1 and no JSON" in md and "Traceback: boom" in md
    assert "**skipped**: no CUDA device" in md
    assert "## 3. Transfer" in md and "## 6b. Accounting" in md and "**not run**" in md
    assert "Smoke pass" not in md
    assert "Smoke pass" in bench_report.render(records, quick=True, generated="now")


def write_script(directory: Path, name: str, body: str) -> None:
    (directory / name).write_text(body)


def test_runner_passes_quick_records_failures_and_missing_scripts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    monkeypatch.setattr(bench_report, "SCRIPTS", scripts)
    monkeypatch.setattr(bench_report, "REPO", tmp_path)
    # A script with --quick that reports whether it got it; one that fails; none for the third.
    write_script(
        scripts,
        "bench_good.py",
        "import json, sys\n"
        "args = sys.argv[1:]\n"
        "path = args[args.index('--json') + 1]\n"
        "quick = '--quick' in args\n"
        "json.dump({'figures': [{'name': 'q', 'value': float(quick), 'unit': 'bool', 'key': 'q'}]}, open(path, 'w'))\n",
    )
    write_script(scripts, "bench_bad.py", "import sys\nprint('it broke', file=sys.stderr)\nsys.exit(3)\n")
    good = bench_report.Benchmark("good", "bench_good.py", "Good", "")
    bad = bench_report.Benchmark("bad", "bench_bad.py", "Bad", "")
    missing = bench_report.Benchmark("missing", "bench_missing.py", "Missing", "")
    json_dir, logs = tmp_path / "json", tmp_path / "logs"
    json_dir.mkdir()

    record = bench_report.run_benchmark(good, quick=True, json_dir=json_dir, log_dir=logs)
    assert record["status"] == "ok" and record["command"] == "python scripts/bench_good.py --quick"
    assert record["result"]["figures"][0]["value"] == 1.0
    assert (
        bench_report.run_benchmark(good, quick=False, json_dir=json_dir, log_dir=logs)["result"]["figures"][0]["value"]
        == 0.0
    )

    failed = bench_report.run_benchmark(bad, quick=False, json_dir=json_dir, log_dir=logs)
    assert failed["status"] == "failed" and failed["reason"] == "exit status 3 and no JSON"
    assert "it broke" in failed["log_tail"]

    assert bench_report.run_benchmark(missing, quick=False, json_dir=json_dir, log_dir=logs) == {
        "status": "not run",
        "reason": "scripts/bench_missing.py does not exist",
    }


def test_main_keeps_earlier_figures_when_one_benchmark_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "docs" / "benchmarks.md"
    out.parent.mkdir()
    earlier = {
        "wire": {
            "status": "ok",
            "result": result([benchlib.figure("w", 1.004, "x", ("<=", 1.02), key="wire_over_raw")]),
        }
    }
    out.with_suffix(".json").write_text(json.dumps(earlier))
    ran: list[str] = []

    def fake_run(bench: bench_report.Benchmark, quick: bool, json_dir: Path, log_dir: Path) -> dict:
        ran.append(bench.name)
        return {"status": "ok", "result": result([benchlib.figure("r", 1.2, "x", ("<=", 1.15), key="grpc_over_plain")])}

    monkeypatch.setattr(bench_report, "run_benchmark", fake_run)
    monkeypatch.setattr(bench_report, "LOG_DIR", tmp_path / "logs")
    assert bench_report.main(["--only", "round", "--output", str(out)]) == 0
    assert ran == ["round"]
    rows = acceptance_rows(out.read_text())
    assert rows["Lossless bytes on the wire ≤ 1.02x raw tensor bytes"] == ["1.004x", "≤ 1.020x", "pass"]
    assert rows["Round overhead ≤ 1.15x the plain loop (default preset, 2-core CPU, loopback)"][2] == "FAIL"
    assert set(json.loads(out.with_suffix(".json").read_text())) == {"wire", "round"}
    with pytest.raises(SystemExit):
        bench_report.main(["--only", "nonsense", "--output", str(out)])


def test_issue_21s_floor_figures_are_their_own_acceptance_rows() -> None:
    floor = [
        benchlib.figure("g", 2.31, "x", ("<=", 1.20), key="grpc_over_floor"),
        benchlib.figure("g all", 1.19, "x", ("<=", 1.20), key="all_grpc_over_floor"),
        benchlib.figure("c", 1.02, "x", ("<=", 1.15), key="grpc_cpu_over_floor"),
        benchlib.figure("i all", 2.5, "x", ("<=", 1.20), key="all_inprocess_over_floor"),
        benchlib.figure("r", 1.08, "x", ("<=", 1.15), key="grpc_over_plain"),
    ]
    md = bench_report.render({"round": {"status": "ok", "result": result(floor)}}, quick=False, generated="now")
    rows = acceptance_rows(md)
    assert rows["#21: gRPC round time ≤ 1.20x the ideal parallel floor (default preset, mTLS)"] == [
        "2.310x",
        "≤ 1.200x",
        "FAIL",
    ]
    assert rows["#21: gRPC round time ≤ 1.20x the ideal parallel floor (all-participating)"][2] == "pass"
    assert rows["#21: gRPC CPU per round, all processes ≤ 1.15x the one-thread plain loop's (default preset)"][2] == (
        "pass"
    )
    assert rows["#21: in-process round time ≤ 1.20x the ideal parallel floor (all-participating)"][2] == "FAIL"
    # A figure the script did not report is not evaluated, never passed; issue #9's row stays as it was.
    assert rows["#21: in-process round time ≤ 1.20x the ideal parallel floor (default preset)"] == [
        "not reported",
        "",
        "not evaluated",
    ]
    assert rows["Round overhead ≤ 1.15x the plain loop (default preset, 2-core CPU, loopback)"][2] == "pass"


def test_sections_measured_at_different_commits_say_so() -> None:
    older = {**result([]), "machine": {**MACHINE, "commit": "0ld0001"}}
    records = {"round": {"status": "ok", "result": result([])}, "wire": {"status": "ok", "result": older}}
    md = bench_report.render(records, quick=False, generated="now")
    assert "| commits | abc1234, 0ld0001 (each section names its own) |" in md
    assert "at commit abc1234;" in md and "at commit 0ld0001;" in md


def test_a_benchmark_measured_on_another_machine_is_added_and_says_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "docs" / "benchmarks.md"
    out.parent.mkdir()
    local = {"status": "ok", "result": result([])}
    out.with_suffix(".json").write_text(json.dumps({"round": local, "wire": local}))
    gpu_machine = {**MACHINE, "cpu": "Xeon", "cores": 16, "usable_cores": 16, "gpu": "NVIDIA H200", "commit": "9d0"}
    measured = {
        **result([benchlib.figure("GPU: seconds per round", 0.0814, "s", key="gpu_seconds_per_round")]),
        "machine": gpu_machine,
        "command": "python scripts/bench_gpu.py --json /root/out/gpu.json",
        "elapsed_s": 131.0,
    }
    (tmp_path / "gpu.json").write_text(json.dumps(measured))

    def must_not_run(*args: object, **kwargs: object) -> dict:
        raise AssertionError("--add alone runs no benchmark here")

    monkeypatch.setattr(bench_report, "run_benchmark", must_not_run)
    assert bench_report.main(["--add", f"gpu={tmp_path / 'gpu.json'}", "--output", str(out)]) == 0
    md = out.read_text()
    assert set(json.loads(out.with_suffix(".json").read_text())) == {"round", "wire", "gpu"}  # earlier ones kept
    assert "Command: `python scripts/bench_gpu.py` (131 s)" in md  # the harness's --json path left out
    assert "| GPU: seconds per round | 81.4 ms |  |  |" in md
    assert "Measured on another machine: NVIDIA H200, Xeon (16 usable cores)" in md
    assert md.count("Measured on another machine") == 1  # the other sections ran on the table's machine
    assert "| CPU | AMD EPYC, 2 cores (2 usable) |" in md  # the table: the machine most sections ran on
    before = out.read_text()
    (tmp_path / "bad.json").write_text("{}")
    (tmp_path / "skipped.json").write_text(json.dumps({"skipped": "no CUDA device"}))  # would erase the figures
    gpu = f"gpu={tmp_path / 'gpu.json'}"
    for args in (
        ["--add", "gpu"],
        ["--add", f"gpu={tmp_path / 'missing.json'}"],
        ["--add", f"gpu={tmp_path / 'bad.json'}"],
        ["--add", f"gpu={tmp_path / 'skipped.json'}"],
        ["--add", f"nonsense={tmp_path / 'gpu.json'}"],
        ["--add", f"round={tmp_path / 'gpu.json'}"],  # bench_gpu.py's figures are not the round section's
        ["--add", gpu, "--add", gpu],
        ["--only", "gpu", "--add", gpu],
    ):
        with pytest.raises(SystemExit):
            bench_report.main([*args, "--output", str(out)])
    assert out.read_text() == before  # a refused call writes nothing


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_bench_passes_its_variables_to_the_report() -> None:
    """`make bench BENCH_ONLY=... BENCH_ADD=...` (the README's commands) reach bench_report as --only and --add."""
    repo = Path(bench_report.__file__).resolve().parents[1]
    shown = subprocess.run(
        ["make", "-n", "bench", "BENCH_ONLY=wire", "BENCH_ADD=gpu=gpu.json"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    command = shown.replace("\\\n", " ")
    assert "scripts/bench_report.py" in command
    assert "--only wire" in command and "--add gpu=gpu.json" in command
