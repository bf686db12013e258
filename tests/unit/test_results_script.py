"""scripts/results.py (`make results`): the manifest, stale-folder pruning, the claims index and the refusal to
record results from uncommitted code. The runs themselves are `fairfl compare`, tested on its own."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from fairfl.config import ConfigError
from tests.compare_support import TINY_EXPERIMENT

REPO = Path(__file__).resolve().parents[2]


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("results_script", REPO / "scripts" / "results.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


results = _load_script()

BASE = TINY_EXPERIMENT


def federation(tmp_path: Path, manifest: Any) -> Path:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(BASE))
    compare = {
        "name": "tiny",
        "base": "base.yaml",
        "seeds": [0, 1],
        "runs": [{"label": "A", "set": {"strategy.name": "fedavg"}}, {"label": "B", "seeds": [0]}],
        "claims": [{"claim": "A is fairer", "run": "A", "metric": "variance", "is": "lower", "than": "B"}],
    }
    (tmp_path / "tiny.compare.yaml").write_text(yaml.safe_dump(compare, sort_keys=False))
    path = tmp_path / "results.yaml"
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    return path


def manifest_error(tmp_path: Path, manifest: Any) -> str:
    with pytest.raises(ConfigError) as info:
        results.load_manifest(federation(tmp_path, manifest))
    return str(info.value)


def test_the_committed_manifest_loads_and_every_comparison_tests_claims(monkeypatch: pytest.MonkeyPatch) -> None:
    from fairfl.compose.compare import load_comparison

    monkeypatch.chdir(REPO)
    entries = results.load_manifest(results.MANIFEST)
    assert {e.name for e in entries} >= {"hicsfl-fmnist-setting2", "fedfdp-fmnist-small", "equitable-fmnist"}
    headline = {"hicsfl-fmnist-setting2", "fedfdp-fmnist-small", "fedeba-table1-fmnist", "equitable-fmnist"}
    for entry in (e for e in entries if e.compare):
        spec = load_comparison(entry.compare)
        assert spec.claims, f"{entry.compare} declares no claims"
        tested = {c.run for c in spec.claims} | {c.than for c in spec.claims if isinstance(c.than, str)}
        fewest = 5 if entry.name in headline else 3  # headline rows at 5 seeds; the robustness grid at 3 or more
        assert all(len(spec.run(label).seeds) >= fewest for label in tested), entry.compare


@pytest.mark.parametrize(
    ("manifest", "expected"),
    [
        ({"name": "x"}, "expected a list of entries"),
        ([{"name": "x", "compare": "tiny.compare.yaml", "run": "base.yaml"}], "give exactly one of compare"),
        ([{"name": "x"}], "give exactly one of compare"),
        ([{"name": "x", "compare": "tiny.compare.yaml", "when": 1}], "unknown field 'when'"),
        ([{"name": "a/b", "compare": "tiny.compare.yaml"}], "[0].name: expected a unique folder name"),
        ([{"name": "..", "compare": "tiny.compare.yaml"}], "[0].name: expected a unique folder name"),
        ([{"name": ".", "compare": "tiny.compare.yaml"}], "[0].name: expected a unique folder name"),
        (
            [{"name": "x", "compare": "tiny.compare.yaml"}, {"name": "x", "compare": "tiny.compare.yaml"}],
            "[1].name: expected a unique folder name",
        ),
        ([{"name": "x", "compare": "missing.yaml"}], "[0] (x): comparison file 'missing.yaml' not found"),
        ([{"name": "x", "run": "base.yaml", "set": {"rounds": 0}}], "[0] (x): rounds"),
    ],
)
def test_bad_manifests_name_the_entry_and_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, manifest: Any, expected: str
) -> None:
    monkeypatch.chdir(tmp_path)
    assert expected in manifest_error(tmp_path, manifest)


def test_run_entries_become_fairfl_run_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    manifest = [
        {"name": "cmp", "compare": "tiny.compare.yaml", "jobs": 2},
        {"name": "one", "run": "base.yaml", "transport": "grpc", "set": {"rounds": 1, "strategy.name": "fedavg"}},
    ]
    cmp, one = results.load_manifest(federation(tmp_path, manifest))
    assert cmp.command() == [
        "fairfl", "compare", "tiny.compare.yaml", "--output", "docs/results/cmp", "--jobs", "2", "--resume",
    ]  # fmt: skip
    assert one.command() == [
        "fairfl", "run", "base.yaml", "--output", "docs/results/one", "--transport", "grpc",
        "--set", "rounds=1", "--set", "strategy.name=fedavg",
    ]  # fmt: skip


def test_prune_removes_runs_the_comparison_no_longer_has(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (entry,) = results.load_manifest(federation(tmp_path, [{"name": "cmp", "compare": "tiny.compare.yaml"}]))
    out = Path("docs/results/cmp")  # relative, as the script's paths are
    for path in ("a/seed0", "a/seed1", "a/seed2", "b/seed0", "b/seed1", "old-label/seed0"):
        (out / path).mkdir(parents=True)
        (out / path / "results.json").write_text("{}")
    (out / "comparison.md").write_text("kept")
    removed = {str(p.relative_to(out)) for p in results.prune(entry)}
    assert removed == {"a/seed2", "b/seed1", "old-label"}
    assert sorted(str(p.relative_to(out)) for p in out.glob("*/seed*")) == ["a/seed0", "a/seed1", "b/seed0"]
    assert (out / "comparison.md").read_text() == "kept"


def test_index_lists_each_claim_with_its_verdict_and_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    entries = results.load_manifest(
        federation(
            tmp_path,
            [{"name": "cmp", "compare": "tiny.compare.yaml"}, {"name": "none", "compare": "tiny.compare.yaml"}],
        )
    )
    out = tmp_path / "docs" / "results" / "cmp"
    out.mkdir(parents=True)
    from fairfl.compose.compare.claims import Claim, ClaimResult

    claim = Claim("A is fairer", "A", "variance", "lower", "B")
    tested = ClaimResult(claim, False, "not held: the difference points the claimed way but is within the noise "
                         "(p = 0.12 ≥ 0.05)", "paired t-test", 5, -1.5, (-4.0, 1.0), 0.12, 4)  # fmt: skip
    report = {
        "claims": [tested.as_dict()],
        "runs": [{"revision": "0123456789abcdef"}, {"revision": "0123456789abcdef+dirty"}],
    }
    (out / "comparison.json").write_text(json.dumps(report))
    index = results.render_index(entries)
    row = (
        "| [cmp](cmp/comparison.md) | A is fairer | `A variance < B variance` | paired t-test (5) | "
        "-1.5 [-4, 1] (90%) | 0.1200 | 4/5 | **not held**: the difference points the claimed way but is within the "
        "noise (p = 0.12 ≥ 0.05) | 0123456789, 0123456789+dirty |"
    )
    assert row in index.splitlines()
    assert "none" not in index  # no report yet: no rows


def test_uncommitted_code_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)  # main() moves to the repository; restored after the test
    monkeypatch.setattr(results, "source_revision", lambda: {"commit": "abc", "dirty": True})
    monkeypatch.setattr(results, "run_entry", lambda entry: pytest.fail("ran despite uncommitted changes"))
    assert results.main(["--only", "hicsfl-fmnist-setting2"]) == 2
    assert "uncommitted changes outside docs/ and runs/" in capsys.readouterr().err


def test_unknown_only_name_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    assert results.main(["--only", "nope"]) == 2
    assert "--only: unknown entry 'nope'; entries: hicsfl-fmnist-setting2" in capsys.readouterr().err


def test_a_child_killed_by_a_signal_is_a_failure_not_success() -> None:
    kill = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert results._call([sys.executable, "-c", kill]) == 137  # 128 + 9, as a shell reports it
    assert results._call([sys.executable, "-c", "raise SystemExit(3)"]) == 3


def test_since_reuses_only_what_ran_at_that_commit_or_later(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shlex
    import subprocess

    from fairfl.compose.provenance import descends_from, resolve_commit

    head = resolve_commit("HEAD")
    root = subprocess.run(
        ["git", "rev-list", "--max-parents=0", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()[0]
    assert descends_from(head, root) and descends_from(head, head)
    assert descends_from(root, head) == (root == head)
    assert not descends_from(f"{head}+dirty", root) and not descends_from("unknown", root)
    with pytest.raises(ValueError, match="'no-such-commit' is not a commit of this checkout"):
        resolve_commit("no-such-commit")

    monkeypatch.chdir(tmp_path)
    manifest = [
        {"name": "cmp", "compare": "tiny.compare.yaml"},
        {"name": "one", "run": "base.yaml", "set": {"rounds": 1}},
    ]
    cmp, one = results.load_manifest(federation(tmp_path, manifest))
    assert cmp.command(head)[-3:] == ["--resume", "--since", head]  # a comparison's pairs: fairfl compare decides
    one.output.mkdir(parents=True)

    def ran(revision: str, exit_code: int = 0, command: str = shlex.join(one.command())) -> None:
        record = {"command": command, "revision": revision, "exit_code": exit_code}
        (one.output / "provenance.json").write_text(json.dumps(record))

    ran(head)
    assert results.ran_since(one, root) and results.ran_since(one, head)
    assert not results.ran_since(one, None)  # without --since a run entry always runs again
    ran(head, exit_code=1)
    assert not results.ran_since(one, root)
    ran(head, command="fairfl run other.yaml")
    assert not results.ran_since(one, root)
    ran(root)
    assert results.ran_since(one, head) == (root == head)


def test_verify_reruns_one_committed_run_and_compares_its_final_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    monkeypatch.chdir(tmp_path)
    manifest = [{"name": "cmp", "compare": "tiny.compare.yaml"}, {"name": "one", "run": "base.yaml"}]
    cmp, one = results.load_manifest(federation(tmp_path, manifest))
    assert results.verify(cmp, tmp_path / "scratch").outcome == "skipped"  # nothing committed yet
    subprocess.run(
        [sys.executable, "-m", "fairfl.compose", "compare", str(tmp_path / "tiny.compare.yaml"), "--output",
         str(tmp_path / cmp.output), "--jobs", "1"],
        cwd=REPO, check=True, capture_output=True,
    )  # fmt: skip
    committed = tmp_path / cmp.output / "a" / "seed0"

    verdict = results.verify(cmp, tmp_path / "scratch")
    assert (verdict.entry, verdict.pair, verdict.outcome) == ("cmp", "A seed 0", "reproduced")
    rerun = json.loads((tmp_path / "scratch" / "cmp" / "a" / "seed0" / "results.json").read_text())
    assert rerun["final_model_sha256"] == json.loads((committed / "results.json").read_text())["final_model_sha256"]

    record = json.loads((committed / "results.json").read_text())
    (committed / "results.json").write_text(json.dumps({**record, "final_model_sha256": "0" * 64}))
    assert results.verify(cmp, tmp_path / "scratch2").outcome == "differs"
    provenance = json.loads((committed / "provenance.json").read_text())
    other_torch = {**provenance, "machine": {**provenance["machine"], "torch": "0.1.0"}}
    (committed / "provenance.json").write_text(json.dumps(other_torch))
    verdict = results.verify(cmp, tmp_path / "scratch2b")
    assert verdict.outcome == "differs elsewhere" and "torch 0.1.0" in verdict.detail  # not this code's doing
    (committed / "provenance.json").write_text(json.dumps(provenance))

    def ran_on_a_gpu(run_dir: Path) -> None:
        segment = {"machine": {"cuda": "NVIDIA H200"}, "after_round": 1}
        (run_dir / "provenance.json").write_text(json.dumps({**provenance, "resumed": [segment]}))

    ran_on_a_gpu(committed)  # the next committed run that ran on CPUs only is verified instead
    assert results.verify(cmp, tmp_path / "scratch3").pair == "A seed 1"
    for run_dir in (tmp_path / cmp.output).glob("*/seed*"):
        ran_on_a_gpu(run_dir)
    verdict = results.verify(cmp, tmp_path / "scratch3b")
    assert verdict.outcome == "skipped" and "NVIDIA H200" in verdict.detail
    assert not (tmp_path / "scratch3b").exists()
    for run_dir in (tmp_path / cmp.output).glob("*/seed*"):
        (run_dir / "provenance.json").write_text(json.dumps(provenance))

    compare = yaml.safe_load((tmp_path / "tiny.compare.yaml").read_text())
    compare["runs"][0]["set"]["training.lr"] = 0.5  # the file now makes another experiment than the committed one
    (tmp_path / "tiny.compare.yaml").write_text(yaml.safe_dump(compare, sort_keys=False))
    verdict = results.verify(cmp, tmp_path / "scratch4")
    assert verdict.outcome == "skipped" and "another experiment" in verdict.detail
    assert not (tmp_path / "scratch4").exists()  # skipped: nothing ran

    assert results.verify(one, tmp_path / "scratch").outcome == "skipped"  # a single run is re-run, not verified
    table = results.render_verdicts([verdict], "abc1234")
    assert "| cmp | A seed 0 | skipped |" in table


def test_list_since_counts_the_runs_still_to_re_run_and_what_they_took(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--list --since C` plans a re-measurement spread over sessions: per entry, how many runs already ran at C or
    later (fairfl compare's own reuse rule) and what the others' finished runs took last time, and on what."""
    import shlex
    import subprocess

    from fairfl.compose.provenance import resolve_commit

    head = resolve_commit("HEAD")
    root = subprocess.run(
        ["git", "rev-list", "--max-parents=0", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()[0]
    monkeypatch.chdir(tmp_path)
    manifest = [{"name": "cmp", "compare": "tiny.compare.yaml"}, {"name": "one", "run": "base.yaml"}]
    path = federation(tmp_path, manifest)
    cmp, one = results.load_manifest(path)
    subprocess.run(
        [sys.executable, "-m", "fairfl.compose", "compare", str(tmp_path / "tiny.compare.yaml"), "--output",
         str(tmp_path / cmp.output), "--jobs", "1"],
        cwd=REPO, check=True, capture_output=True,
    )  # fmt: skip
    pairs = sorted((tmp_path / cmp.output).glob("*/seed*"))
    assert len(pairs) == 3

    def ran_at(run_dir: Path, revision: str, resumed_on_gpu: bool = False) -> float:
        provenance = json.loads((run_dir / "provenance.json").read_text())
        gpu_segment = {**provenance, "machine": {**provenance["machine"], "cuda": "NVIDIA H200"}, "after_round": 1}
        record = {**provenance, "revision": revision, "resumed": [gpu_segment] if resumed_on_gpu else []}
        (run_dir / "provenance.json").write_text(json.dumps(record))
        return float(json.loads((run_dir / "results.json").read_text())["wall_seconds"])

    for run_dir in pairs:
        ran_at(run_dir, head)
    assert results.progress(cmp, head) == results.Progress(3, 3, 0, 0.0, 0)
    assert results.progress(one, head) == results.Progress(1, 0, 0, 0.0, 0)  # never ran
    one.output.mkdir(parents=True)
    record = {"command": shlex.join(one.command()), "revision": head, "exit_code": 0, "wall_seconds": 7.5}
    (one.output / "provenance.json").write_text(json.dumps(record))
    assert results.progress(one, head) == results.Progress(1, 1, 0, 0.0, 0)

    monkeypatch.setattr(results, "REPO", tmp_path)  # main() works from the repository's root: here, tmp_path
    monkeypatch.setattr(results, "MANIFEST", path)
    assert results.main(["--list", "--since", head]) == 0
    out = capsys.readouterr().out
    assert f"cmp: 3 run(s); 3 ran at {head[:12]} or later: done" in out
    assert f"one: 1 run(s); 1 ran at {head[:12]} or later: done" in out
    assert results.main(["--list", "--since", "no-such-commit"]) == 2
    assert "--since: 'no-such-commit' is not a commit" in capsys.readouterr().err

    if root == head:
        pytest.skip("a one-commit history has no older commit for a run to have run at")
    taken = ran_at(pairs[0], root) + ran_at(pairs[1], root, resumed_on_gpu=True)
    interrupted = json.loads((pairs[2] / "results.json").read_text())
    (pairs[2] / "results.json").write_text(json.dumps({**interrupted, "state": "RUN_STATE_STOPPED"}))
    ran_at(pairs[2], root)  # stopped part-way: stale, with no finished time to plan by
    state = results.progress(cmp, head)
    assert (state.runs, state.current, state.finished, state.finished_on_gpu) == (3, 0, 2, 1)
    assert state.finished_seconds == pytest.approx(taken) and taken > 0
    assert results.progress(cmp, root).current == 2  # the stopped run is not reused at any commit
    assert results.main(["--list", "--since", head]) == 0
    out = capsys.readouterr().out
    assert "cmp: 3 run(s); 0 ran at" in out and ", 3 to run (2 finished before in" in out
    assert "h of run time, 1 of them partly on a GPU; 1 never finished)" in out


def test_verification_exits_1_when_a_run_differs_or_fails_and_stops_when_interrupted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    entries = [results.Entry("a", compare="x"), results.Entry("b", compare="y")]

    def verdicts(*outcomes: str) -> int:
        found = iter(outcomes)
        monkeypatch.setattr(results, "verify", lambda e, _s: results.Verdict(e.name, "R seed 0", next(found), "d"))
        return results.run_verification(entries)

    assert verdicts("reproduced", "skipped") == 0
    assert verdicts("reproduced", "differs") == 1
    assert verdicts("failed", "reproduced") == 1
    assert verdicts("interrupted", "reproduced") == 130
    assert "| a | R seed 0 | interrupted | d |" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_results_passes_its_variables_to_the_script() -> None:
    """`make results RESULTS_ONLY=... RESULTS_SINCE=... RESULTS_VERIFY=1` (the README's commands) reach the script."""
    import subprocess

    shown = subprocess.run(
        ["make", "-n", "results", "RESULTS_ONLY=a,b", "RESULTS_SINCE=abc123", "RESULTS_VERIFY=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.replace("\\\n", " ")
    assert "scripts/results.py" in shown
    assert "--only a,b" in shown and "--since abc123" in shown and "--verify" in shown
    plain = subprocess.run(["make", "-n", "results"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "--verify" not in plain and "--only" not in plain
