"""Issue #20's site-data acceptance, with real processes: data that stays at its site.

Three agent processes each serve two clients from their own directory, written here from real Fashion-MNIST images in
a different format per site: .npz arrays, one Parquet table of 784 pixel columns with a label and a client column, and
PNG image folders (one folder per class, decoded by Pillow). The run names no public dataset (`data.dataset: site`,
the signature only) and no path; it runs over mutual TLS (an ephemeral CA: fairfl.compose.launcher.LocalCluster) and
completes, and its fairness report (results.json's evaluated rounds) lists the three sites' clients with the test
sample counts each site holds.

Every service and agent runs under a wrapper interpreter that installs an audit hook recording the path of every
`open` event of the process (imports included) before the service's main runs. The aggregator, clustering and
privacy services opened nothing under the sites' root (nor were they given it: their command lines and the run's
config hold no site path), and at the end of the run none holds a site file open or mapped (/proc: what native code
would open, which the hook does not see); each agent opened its own site's files (the Parquet site's are opened by
pyarrow's native code: not seen) and no other site's.

A fourth agent whose data does not fit (scikit-learn's digits: 64 features, not 1x28x28) is refused at registration
with FAILED_PRECONDITION naming the site and the field, which its log says once; the run goes on without its clients.
"""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fairfl.compose.launcher import LocalCluster
from fairfl.data import parse_idx
from fairfl.tls import ROLE_AGENT

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
PER_CLIENT = 100  # images per client (80 train, 20 test where the site gives no split)
SITES = {  # agent name -> (client ids, format)
    "site-a": ((0, 1), "npz"),
    "site-b": ((2, 3), "parquet"),
    "site-c": ((4, 5), "png"),
}
MISFIT = ("site-d", (6, 7))  # digits: 64 features
NUM_CLIENTS = 8  # the run counts the misfit's clients too: it goes on without them


# -- the sites' data --------------------------------------------------------------------------------------------------


def fashion_mnist(count: int) -> tuple[np.ndarray, np.ndarray]:
    """The first `count` Fashion-MNIST training images (uint8, N x 28 x 28) and labels, read with fairfl's IDX
    parser."""
    images = FASHION_MNIST / "train-images-idx3-ubyte.gz"
    labels = FASHION_MNIST / "train-labels-idx1-ubyte.gz"
    if not images.is_file() or not labels.is_file():
        pytest.skip(f"Fashion-MNIST not installed at {FASHION_MNIST}")
    x = parse_idx(gzip.decompress(images.read_bytes()), str(images))[:count]
    y = parse_idx(gzip.decompress(labels.read_bytes()), str(labels))[:count]
    return x, y.astype(np.int64)


def write_npz_site(root: Path, images: list[np.ndarray], labels: list[np.ndarray]) -> str:
    """One .npz per client (keys x, y): x float32 (N, 1, 28, 28) in [0, 1]."""
    root.mkdir(parents=True)
    for k, (x, y) in enumerate(zip(images, labels, strict=True)):
        np.savez(root / f"ward-{k + 1}.npz", x=(x[:, None] / np.float32(255)).astype(np.float32), y=y)
    return str(root)


def write_parquet_site(root: Path, images: list[np.ndarray], labels: list[np.ndarray]) -> str:
    """One Parquet table holding both clients: pixel0..pixel783 in [0, 1], `label`, and the client column `clinic`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True)
    x = np.concatenate([im.reshape(len(im), -1) for im in images]) / np.float32(255)
    columns: dict[str, Any] = {f"pixel{i}": x[:, i].astype(np.float32) for i in range(x.shape[1])}
    columns["label"] = np.concatenate(labels)
    columns["clinic"] = np.repeat([f"clinic-{k + 1}" for k in range(len(images))], [len(im) for im in images])
    pq.write_table(pa.table(columns), root / "records.parquet")
    return f"{root / 'records.parquet'},label=label,client_column=clinic,shape=1x28x28,num_classes=10"


def write_png_site(root: Path, images: list[np.ndarray], labels: list[np.ndarray]) -> str:
    """One image folder per client: <class>/<n>.png, 8-bit grayscale."""
    from PIL import Image

    for k, (x, y) in enumerate(zip(images, labels, strict=True)):
        for n, (pixels, label) in enumerate(zip(x, y, strict=True)):
            folder = root / f"camera-{k + 1}" / str(int(label))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels, mode="L").save(folder / f"{n:04d}.png")
    return f"{root},num_classes=10"


def write_digits_site(root: Path) -> str:
    """scikit-learn's digits (8x8 = 64 features, 10 classes) as two .npz clients: a site that does not fit."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    root.mkdir(parents=True)
    x = (digits.data / 16.0).astype(np.float32)
    for k, rows in enumerate(np.array_split(np.arange(200), 2)):
        np.savez(root / f"digits-{k + 1}.npz", x=x[rows], y=digits.target[rows].astype(np.int64))
    return str(root)


def write_sites(root: Path) -> dict[str, str]:
    """Each site's --data SPEC, its data cut from distinct Fashion-MNIST images."""
    x, y = fashion_mnist(PER_CLIENT * 2 * len(SITES))
    writers = {"npz": write_npz_site, "parquet": write_parquet_site, "png": write_png_site}
    specs = {}
    for s, (name, (_, fmt)) in enumerate(SITES.items()):
        parts = [slice((2 * s + k) * PER_CLIENT, (2 * s + k + 1) * PER_CLIENT) for k in range(2)]
        specs[name] = writers[fmt](root / name, [x[p] for p in parts], [y[p] for p in parts])
    specs[MISFIT[0]] = write_digits_site(root / MISFIT[0])
    return specs


# -- every process under an audit hook ---------------------------------------------------------------------------------

AUDIT_WRAPPER = '''\
"""`python -m MODULE ARGS` with every `open` event's path appended to RECORDS/<module>-<pid>.opens."""
import os
import runpy
import sys

RECORDS = {records!r}
module, args = sys.argv[2], sys.argv[3:]  # argv: this file, -m, MODULE, ARGS...
_fd = os.open(os.path.join(RECORDS, f"{{module}}-{{os.getpid()}}.opens"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)


def _record(event, hook_args):
    if event == "open" and hook_args and isinstance(hook_args[0], (str, bytes, os.PathLike)):
        os.write(_fd, os.fsencode(os.path.abspath(os.fsdecode(hook_args[0]))) + b"\\n")


sys.addaudithook(_record)
sys.path.insert(0, {repo!r})
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__", alter_sys=True)
'''


def audited_python(directory: Path) -> tuple[Path, Path]:
    """An interpreter stand-in for LocalCluster (it runs `PYTHON -m module ...`) that records every file each process
    opens; returns (the stand-in, the records' directory)."""
    records = directory / "opens"
    records.mkdir(parents=True)
    wrapper = directory / "audit_wrapper.py"
    wrapper.write_text(AUDIT_WRAPPER.format(records=str(records), repo=str(REPO)))
    python = directory / "python-audited"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{wrapper}" "$@"\n')
    python.chmod(0o755)
    return python, records


def opened(records: Path, module: str) -> list[Path]:
    """Every path the processes of `module` opened (one record file per process)."""
    files = sorted(records.glob(f"{module}-*.opens"))
    assert files, f"no process of {module} ran under the audit hook"
    return [Path(line) for f in files for line in f.read_text().splitlines() if line]


def held_files(pid: int) -> list[Path]:
    """The files a live process has open (/proc/PID/fd) or mapped (/proc/PID/maps): what native code opened too."""
    paths = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            paths.append(Path(fd.readlink()))
        except OSError:  # closed meanwhile
            continue
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            paths.append(Path(fields[5].strip()))
    return paths


def under(paths: list[Path], root: Path) -> list[Path]:
    return [p for p in paths if p == root or root in p.parents]


# -- the run ---------------------------------------------------------------------------------------------------------


def experiment() -> dict[str, Any]:
    return {
        "name": "sites",
        "seed": 3,
        "rounds": 2,
        "data": {
            "dataset": "site",
            "num_clients": NUM_CLIENTS,
            "params": {"input_shape": [1, 28, 28], "num_classes": 10},
        },
        "model": {"name": "mlp", "params": {"hidden": [32]}},
        "training": {"local_steps": 5, "batch_size": 16, "lr": 0.1},
        "strategy": {"name": "fedavg"},
        "selection": {"method": "random", "clients_per_round": 6},
        "evaluation": {"every": 1},
        "runtime": {"agents": 4, "device": "cpu", "round_timeout_s": 60, "register_timeout_s": 8},
    }


def wait_for_line(log: Path, needle: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if needle in text:
            return text
        time.sleep(0.2)
    raise AssertionError(f"{log.name} never said {needle!r}:\n{text[-3000:]}")


def test_three_sites_train_a_run_the_services_never_see_their_data(tmp_path: Path) -> None:
    sites = tmp_path / "sites"
    specs = write_sites(sites)
    python, records = audited_python(tmp_path / "audit")
    config_path = tmp_path / "sites.yaml"
    config_path.write_text(yaml.safe_dump(experiment(), sort_keys=False))
    assert str(sites) not in config_path.read_text()
    out = tmp_path / "out"
    with LocalCluster(tmp_path / "logs", python=str(python), metrics=False, tls_dir=tmp_path / "tls") as cluster:
        (tmp_path / "state").mkdir()
        aggregator, _, _ = cluster.start_services(tmp_path / "state")
        agents = {name: (ids, specs[name]) for name, (ids, _) in SITES.items()}
        agents[MISFIT[0]] = (MISFIT[1], specs[MISFIT[0]])
        for name, (ids, spec) in agents.items():
            args = ["--aggregator", aggregator.address, "--clients", f"{ids[0]}-{ids[-1]}", "--name", name]
            cluster.spawn(
                name,
                "client_agent",
                [*args, "--device", "cpu", "--threads", "1", "--data", spec],
                announce=False,
                role=ROLE_AGENT,
                clients=[(ids[0], ids[-1])],
            )
        operator = ["--aggregator", aggregator.address, "--tls-dir", str(tmp_path / "tls" / "operator")]
        run = subprocess.run(
            [sys.executable, "-m", "fairfl.compose", "run", str(config_path), *operator, "--output", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        misfit_log = wait_for_line(cluster.log_dir / f"{MISFIT[0]}.log", "registration refused")
        services = {c.name: [str(a) for a in c.process.args] for c in cluster.children}  # type: ignore[union-attr]
        pids = {c.name: c.process.pid for c in cluster.children}  # the wrapper execs: the recorded pid
        held = {name: held_files(pids[name]) for name in ("aggregator", "clustering", "privacy")}
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    results = json.loads((out / "results.json").read_text())
    assert results["state"] == "RUN_STATE_COMPLETED", results["message"]

    # The fairness report lists the three sites' clients, each with the test samples its site holds.
    final = results["rounds"][-1]
    evaluated = {c.get("client_id", 0): int(c["num_samples"]) for c in final["clients"]}  # proto JSON: 0 left out
    assert sorted(evaluated) == [0, 1, 2, 3, 4, 5]
    test_share = round(PER_CLIENT * 0.2)
    assert all(n == test_share for n in evaluated.values()), evaluated  # every site split 80/20 (seeded)
    assert all(0 <= c.get("accuracy", 0) <= 100 and math.isfinite(c["loss"]) for c in final["clients"])
    assert sorted({c for r in results["rounds"] for c in r.get("selected", [])}) == [0, 1, 2, 3, 4, 5]

    # The misfit was refused at registration, naming the site and the field, said once; its clients never trained.
    refusals = [line for line in misfit_log.splitlines() if "registration refused" in line]
    assert len(refusals) == 1, misfit_log[-3000:]
    assert "site 'site-d'" in refusals[0] and "refused for run" in refusals[0]
    assert "data_signature.input_shape is [64], the run expects [1, 28, 28]" in refusals[0]
    assert " E " in refusals[0]  # at ERROR
    assert not {6, 7} & {c for r in results["rounds"] for c in r.get("selected", [])}
    assert "Traceback" not in misfit_log

    # No service was told a site path, and none opened a file under the sites' root; each agent opened its own site.
    for name in ("aggregator", "clustering", "privacy"):
        assert not any(str(sites) in arg for arg in services[name]), services[name]
    for name in ("aggregator", "clustering", "privacy"):
        module = f"{name}_service"
        paths = opened(records, module)
        assert any(p.suffix == ".py" for p in paths)  # the hook saw this process's opens (its imports at least)
        assert under(paths, sites) == [], f"{module} opened site files: {under(paths, sites)[:5]}"
        assert under(held[name], sites) == [], f"{name} holds site files open or mapped: {held[name]}"
    for name in (*SITES, MISFIT[0]):
        paths = [Path(line) for line in (records / f"client_agent-{pids[name]}.opens").read_text().splitlines()]
        if SITES.get(name, ((), ""))[1] != "parquet":  # pyarrow opens its files natively, unseen by the hook
            assert under(paths, sites / name), f"{name} did not open its own files"
        others = [p for p in under(paths, sites) if not under([p], sites / name)]
        assert others == [], f"{name} opened another site's files: {others[:5]}"
