"""docs/federation.md, run as written: every ```bash block of the page, in order, in one shell in an empty directory,
so the page and the test cannot drift apart.

The page's first block holds its settings; the test gives them free loopback ports, this repository's path and
3 rounds. A block preceded by `<!-- not run ... -->` is skipped (the page says which and why). Background commands
(`... &`) are the shell's children in the shell's own process group (a script has no job control), which the test
kills in a `finally`, so no service or agent outlives the test even when a step fails.

Then it checks what the page promises: the run completed with the clients of the three sites (each client's
evaluation on its own site's test data); the site whose data does not fit was refused with a message naming the
site and the field while the run went on; the model files (written by `fairfl run` and the aggregator, fetched,
exported) carry results.json's final_model_sha256; no service was given a data path; and every process the page
started is gone.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from fairfl.data.datasets import DEBIAN_FASHION_MNIST_DIR
from fairfl.model_file import load_model_file

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "federation.md"
SKIP_MARK = "<!-- not run"
ROUNDS = 3
SCRIPT_TIMEOUT_S = 300  # a hang (a site never registering) fails here rather than at the suite's timeout
SITES = ("site-a", "site-b", "site-c")  # clients 0-3, 4-7 and 8-11; site-d (12-15) is refused
TEST_PER_CLIENT = 50  # examples/sites/make_site_data.py's default --test (site B: 20% of its 250 rows)

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Block:
    line: int  # where its ``` fence is in docs/federation.md (1-based)
    text: str
    run: bool


def doc_blocks(text: str) -> list[Block]:
    """The ```bash blocks of the page, each marked run or skipped by the non-blank line before its fence."""
    blocks = []
    for match in re.finditer(r"^```bash\n(.*?)^```$", text, re.S | re.M):
        line = text.count("\n", 0, match.start()) + 1
        before = [ln for ln in text[: match.start()].splitlines() if ln.strip()]
        blocks.append(Block(line, match.group(1), run=not (before and before[-1].startswith(SKIP_MARK))))
    return blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def settings(repo: Path) -> dict[str, str]:
    """What the test gives the page's settings block instead of its values."""
    return {
        "REPO": str(repo),
        "AGGREGATOR": f"127.0.0.1:{free_port()}",
        "CLUSTERING": f"127.0.0.1:{free_port()}",
        "PRIVACY": f"127.0.0.1:{free_port()}",
        "ROUNDS": str(ROUNDS),
    }


def with_settings(block: str, values: dict[str, str]) -> str:
    """The settings block with each `NAME=value   # comment` line of `values` replaced; every name must be there."""
    out = block
    for name, value in values.items():
        out, n = re.subn(rf"^{name}=\S*", lambda _, v=f"{name}={value}": v, out, flags=re.M)
        assert n == 1, f"docs/federation.md's first bash block sets {name} {n} times, expected once"
    return out


def script_of(blocks: list[Block], values: dict[str, str]) -> str:
    parts = ["set -eu"]
    for i, block in enumerate(blocks):
        if not block.run:
            continue
        text = with_settings(block.text, values) if i == 0 else block.text
        parts.append(f'echo "### docs/federation.md:{block.line} (at ${{SECONDS}}s)"\n{text}')
    return "\n".join(parts) + '\necho "### done (at ${SECONDS}s)"\n'


def group_members(pgid: int) -> list[int]:
    """Live processes (zombies aside) in process group `pgid`."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def kill_group(pgid: int) -> None:
    """SIGTERM the group, then SIGKILL whatever is left after 15 s."""
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not group_members(pgid):
            return


def path_with_tools(tmp: Path) -> str:
    """PATH with the project's `fairfl` and `python` first, and a `curl -s URL` stand-in where curl is missing."""
    bindir = Path(sys.executable).parent
    assert (bindir / "fairfl").exists(), f"no fairfl console script next to {sys.executable}"
    dirs = [str(bindir)]
    if shutil.which("curl") is None:
        shim = tmp / "shim"
        shim.mkdir()
        (shim / "curl").write_text(
            f"#!{sys.executable}\nimport sys, urllib.request\n"
            "sys.stdout.write(urllib.request.urlopen(sys.argv[-1], timeout=10).read().decode())\n"
        )
        (shim / "curl").chmod(0o755)
        dirs.append(str(shim))
    return os.pathsep.join([*dirs, os.environ.get("PATH", "")])


@dataclass(frozen=True)
class Ran:
    cwd: Path  # the directory the page ran in
    output: str  # the shell's stdout and stderr
    returncode: int
    leftover: list[int]  # processes of the shell's group alive after it exited (before the test killed them)

    def log(self, name: str) -> str:
        path = self.cwd / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else f"(no {path})"

    def explain(self) -> str:
        logs = "\n".join(f"--- logs/{p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in self.logs())
        return f"--- the page's shell (exit {self.returncode})\n{self.output[-4000:]}\n{logs}"

    def logs(self) -> list[Path]:
        return sorted((self.cwd / "logs").glob("*.log")) if (self.cwd / "logs").is_dir() else []


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ran]:
    if not (DEBIAN_FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.skip(f"Fashion-MNIST is not installed at {DEBIAN_FASHION_MNIST_DIR} (make setup installs it as root)")
    cwd = tmp_path_factory.mktemp("federation")
    script = tmp_path_factory.mktemp("script") / "federation.sh"
    script.write_text(script_of(doc_blocks(DOC.read_text()), settings(REPO)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAIRFL_")}  # the page sets what it needs
    env["PATH"] = path_with_tools(script.parent)
    out = cwd.parent / f"{cwd.name}.out"
    with out.open("w") as fh:
        shell = subprocess.Popen(
            ["bash", str(script)], cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        try:
            returncode = shell.wait(timeout=SCRIPT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            returncode = -1
        leftover = group_members(shell.pid)
        yield Ran(cwd, out.read_text(errors="replace"), returncode, leftover)
    finally:
        kill_group(shell.pid)
        shell.wait(timeout=10)


def test_the_page_has_runnable_blocks_and_says_which_it_skips() -> None:
    blocks = doc_blocks(DOC.read_text())
    assert len(blocks) >= 15, "docs/federation.md: fewer bash blocks than the walk-through has steps"
    assert [b.run for b in blocks[:1]] == [True], "the first bash block is the settings block and must run"
    skipped = [b for b in blocks if not b.run]
    assert len(skipped) == 1 and "runs stop" in skipped[0].text, [b.text for b in skipped]
    with_settings(blocks[0].text, settings(REPO))  # every setting the test gives is there, once
    for block in blocks:
        check = subprocess.run(["bash", "-n"], input=block.text, text=True, capture_output=True, check=False)
        assert check.returncode == 0, f"docs/federation.md:{block.line}: {check.stderr}"


def strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def test_no_service_is_given_a_data_path() -> None:
    """The aggregator, clustering and privacy commands name no site data; only agents take --data."""
    text = DOC.read_text().replace("\\\n", " ")
    commands = [ln for b in doc_blocks(text) for ln in b.text.splitlines() if "fairfl serve" in ln]
    services = [c for c in commands if re.search(r"fairfl serve (aggregator|clustering|privacy)\b", c)]
    assert len(services) == 3, commands
    for command in services:
        assert "sites" not in command and "--data" not in command, command
    block = re.search(r"cat > federation.yaml <<'EOF'\n(.*?)\nEOF", text, re.S)
    assert block, "docs/federation.md writes no federation.yaml"
    config = yaml.safe_load(block.group(1))
    assert config["data"] == {"dataset": "site", "num_clients": 12, "params": config["data"]["params"]}
    assert not [v for v in strings(config) if "/" in v], "the run's config names a path"


def test_the_page_runs_to_the_end(ran: Ran) -> None:
    assert ran.returncode == 0, ran.explain()
    assert ran.output.splitlines()[-1].startswith("### done"), ran.explain()
    assert not ran.leftover, f"processes left after the page's `kill $(jobs -p); wait`: {ran.leftover}"


def results(ran: Ran) -> dict[str, Any]:
    path = ran.cwd / "results" / "federation" / "results.json"
    assert path.exists(), ran.explain()
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_the_run_completed_over_the_three_sites_clients(ran: Ran) -> None:
    summary = results(ran)
    assert summary["state"] == "RUN_STATE_COMPLETED", summary["message"]
    assert summary["rounds_completed"] == ROUNDS
    assert summary["config"]["data"] == {
        **summary["config"]["data"],
        "dataset": "site",
        "num_clients": 12,
        "params": {"input_shape": [1, 28, 28], "num_classes": 10},
    }
    assert summary["final_fairness"]["evaluated_clients"] == 12
    with (ran.cwd / "results" / "federation" / "clients.csv").open() as fh:
        rows = [r for r in csv.DictReader(fh) if int(r["round"]) == ROUNDS]
    assert sorted(int(r["client_id"]) for r in rows) == list(range(12))  # sites A, B and C; never site D's 12-15
    assert {int(r["num_samples"]) for r in rows} == {TEST_PER_CLIENT}  # each evaluated on its own site's test data
    assert f"round {ROUNDS}/{ROUNDS}" in ran.output  # `fairfl runs watch` followed it to the end
    for site in SITES:
        assert "ERROR" not in ran.log(site), ran.log(site)


def test_the_site_whose_data_does_not_fit_is_refused(ran: Ran) -> None:
    """Site D (784 flat features for a run of 1x28x28 images) is refused, the refusal naming the site and the field,
    and the run goes on with the other three (test_the_run_completed_over_the_three_sites_clients)."""
    refusal = [ln for ln in ran.log("site-d").splitlines() if "registration refused" in ln]
    assert refusal, ran.log("site-d")
    assert "site 'site-d'" in refusal[0], refusal[0]
    assert "data_signature.input_shape is [784], the run expects [1, 28, 28]" in refusal[0], refusal[0]
    assert "shape=1x28x28" in refusal[0], refusal[0]  # what to do
    assert refusal[0] in ran.output  # the page's grep showed it
    warned = [ln for ln in ran.log("aggregator").splitlines() if "site 'site-d'" in ln and " refused " in ln]
    assert warned, ran.log("aggregator")


def test_the_model_files_are_the_runs_final_model(ran: Ran) -> None:
    summary = results(ran)
    final = summary["final_model_sha256"]
    assert re.fullmatch(r"[0-9a-f]{64}", final), final
    written = (
        "results/federation/model.safetensors",  # by `fairfl run`
        f"checkpoints/{summary['run_id']}/model.safetensors",  # by the aggregator, when the run ended
        "model.safetensors",  # `fairfl model fetch`
        "model-from-checkpoint.safetensors",  # `fairfl model export`
    )
    for name in written:
        path = ran.cwd / name
        assert path.exists(), f"{name} missing\n{ran.explain()}"
        tensors, metadata = load_model_file(path)  # checks the tensors against the sha256 in the metadata
        assert metadata.sha256 == final, name
        assert metadata.run_id == summary["run_id"] and metadata.round == ROUNDS, name
        assert tensors
    assert re.search(r"site A, client 0: \d+\.\d% of 50 test images right", ran.output), ran.explain()
