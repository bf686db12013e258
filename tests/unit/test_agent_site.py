"""The agent side of site data (issue #20): clients built from their own (train, test) sets, on-disk samples read a
batch at a time with the same numbers as in memory, the registration's signature and counts, the site-run rules
(no --data → unusable, said once; a refused registration said once and tried again slowly), and `--data` at start."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from client_agent import agent as agent_module
from client_agent.agent import Agent, RunUnusable, signature_message
from client_agent.rows import DiskRows
from client_agent.trainer import ClientRuntime, LocalClient, LocalData
from fairfl.config import ExperimentConfig, experiment_from_dict
from fairfl.data import ArrayDataset, DataSignature, load_run_data
from fairfl.data.lazy import is_lazy
from fairfl.params import flatten_parameters
from fairfl.protocol import GRADIENT, UPDATE
from fairfl.v1 import federation_pb2, tensor_pb2

CPU = torch.device("cpu")
FEATURES, CLASSES = 20, 10


def synthetic_config() -> ExperimentConfig:
    return experiment_from_dict(
        {
            "data": {"dataset": "synthetic", "num_clients": 2},
            "model": {"params": {"hidden": [16]}},
            "selection": {"clients_per_round": 2},
            "runtime": {"agents": 1},
        }
    )


def two_clients(directory: Path, on_disk: bool) -> LocalData:
    """Two clients of different sizes; with on_disk, every x is a read-only memory map of its own .npy file."""
    g = np.random.default_rng(3)
    clients = {}
    for cid, (n_train, n_test) in enumerate([(150, 40), (97, 23)]):
        parts = []
        for split, n in (("train", n_train), ("test", n_test)):
            x = g.normal(size=(n, FEATURES)).astype(np.float32)
            y = g.integers(0, CLASSES, n).astype(np.int64)
            if on_disk:
                np.save(directory / f"{cid}_{split}_x.npy", x)
                x = np.load(directory / f"{cid}_{split}_x.npy", mmap_mode="r")
            parts.append(ArrayDataset(x, y, CLASSES, f"{cid}-{split}"))
        clients[cid] = LocalClient(*parts)
    return LocalData(DataSignature((FEATURES,), CLASSES), clients)


def runtime_of(data: LocalData, randomness: str = "task") -> tuple[ClientRuntime, dict[str, torch.Tensor]]:
    blobs: dict[str, torch.Tensor] = {}
    torch.manual_seed(0)
    runtime = ClientRuntime(
        synthetic_config(), data, [0, 1], CPU, lambda ref: blobs[ref.sha256], dp_randomness=randomness
    )
    blobs["x0"] = flatten_parameters(runtime.model)
    return runtime, blobs


def task(phase: int, client: int, seed: int = 7) -> federation_pb2.Task:
    t = federation_pb2.Task(task_id="t", run_id="r", round=1, phase=phase, client_id=client, seed=seed)
    t.model.CopyFrom(tensor_pb2.BlobRef(sha256="x0"))
    return t


def tasks() -> list[federation_pb2.Task]:
    """Every procedure that reads x: plain epochs with loss subsamples, FedProx + the activation's own pass, DP-SGD
    (its Poisson batches and noisy loss), a probe with a gradient, an evaluation with the train loss."""
    plain = task(federation_pb2.PHASE_TRAIN, 0)
    plain.train.CopyFrom(federation_pb2.LocalTrainingConfig(local_epochs=2, batch_size=32, lr=0.1, loss_eval_batches=2))
    activation = task(federation_pb2.PHASE_TRAIN, 1, seed=11)
    activation.train.CopyFrom(
        federation_pb2.LocalTrainingConfig(
            local_steps=5,
            batch_size=16,
            lr=0.05,
            prox_mu=0.1,
            want_activation=True,
            activation_mode=federation_pb2.ACTIVATION_MODE_EVAL_PASS,
        )
    )
    dp = task(federation_pb2.PHASE_TRAIN, 0, seed=5)
    dp.train.CopyFrom(federation_pb2.LocalTrainingConfig(local_steps=3, batch_size=32, lr=0.5))
    dp.train.dp.CopyFrom(
        federation_pb2.DpSgd(
            sample_rate=0.2, noise_multiplier=1.0, clip_norm=1.0, loss_noise_multiplier=2.0, loss_clip=2.5
        )
    )
    probe = task(federation_pb2.PHASE_PROBE, 1)
    probe.probe.CopyFrom(
        federation_pb2.ProbeConfig(batch_size=20, loss_eval_batches=2, want_gradient=True, gradient_batches=2)
    )
    evaluate = task(federation_pb2.PHASE_EVALUATE, 1)
    evaluate.evaluate.include_train_loss = True
    return [plain, activation, dp, probe, evaluate]


def test_on_disk_clients_train_evaluate_and_probe_with_the_in_memory_numbers(tmp_path: Path) -> None:
    in_memory, _ = runtime_of(two_clients(tmp_path, on_disk=False))
    on_disk, _ = runtime_of(two_clients(tmp_path, on_disk=True))
    assert isinstance(in_memory.clients[0].x_train, torch.Tensor)
    assert isinstance(on_disk.clients[0].x_train, DiskRows) and isinstance(on_disk.clients[1].x_test, DiskRows)
    assert isinstance(on_disk.clients[0].y_train, torch.Tensor)  # labels are small: always on the device
    for t in tasks():
        a, b = in_memory.run(t), on_disk.run(t)
        assert a.num_samples == b.num_samples > 0
        for field in ("loss_before", "loss_after", "test_accuracy", "test_loss", "noisy_loss"):
            x, y = getattr(a, field), getattr(b, field)
            assert (math.isnan(x) and math.isnan(y)) or x == y, (t.phase, field, x, y)
        assert a.metrics == b.metrics
        assert sorted(a.payloads) == sorted(b.payloads)
        for key in a.payloads:
            assert torch.equal(a.payloads[key], b.payloads[key]), (t.phase, key)
        if a.activation is not None:
            assert np.array_equal(a.activation, b.activation)
    assert UPDATE in in_memory.run(tasks()[0]).payloads and GRADIENT in in_memory.run(tasks()[3]).payloads


def test_disk_rows_read_the_asked_rows_in_order(tmp_path: Path) -> None:
    x = np.arange(60, dtype=np.float32).reshape(20, 3)
    np.save(tmp_path / "x.npy", x)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    assert is_lazy(mapped)
    rows = DiskRows(mapped, CPU)
    assert len(rows) == 20 and rows.shape == (20, 3)
    idx = torch.tensor([7, 2, 2, 19, 0])
    assert torch.equal(rows[idx], torch.from_numpy(x[[7, 2, 2, 19, 0]]))
    assert torch.equal(rows[3:9], torch.from_numpy(x[3:9]))
    assert torch.equal(rows[np.array([5, 4])], torch.from_numpy(x[[5, 4]]))
    chunks = list(rows.chunks(8))
    assert [len(c) for c in chunks] == [8, 8, 4]
    assert torch.equal(torch.cat(chunks), torch.from_numpy(x))
    rows[idx][0, 0] = -1.0  # a private copy: the file is read-only and unchanged
    assert np.array_equal(np.load(tmp_path / "x.npy"), x)


def test_simulation_clients_are_the_partition_slices() -> None:
    config = synthetic_config()
    fed = load_run_data(config)
    local = LocalData.of_simulation(fed, [1])
    assert local.signature == DataSignature(fed.input_shape, fed.num_classes)
    assert np.array_equal(local.clients[1].train.x, fed.train.x[fed.train_indices[1]])
    assert np.array_equal(local.clients[1].test.y, fed.test.y[fed.test_indices[1]])
    with pytest.raises(ValueError, match="client id 5 outside the run's 2 clients"):
        LocalData.of_simulation(fed, [5])
    with pytest.raises(ValueError, match="client id 3 has no data here"):
        ClientRuntime(config, local, [3], CPU, lambda ref: torch.empty(0))


# -- the agent ------------------------------------------------------------------------------------------------------


@dataclass
class FakeSite:
    """What the agent reads of fairfl.data.site.SiteData: the signature and each client's (train, test)."""

    signature: DataSignature
    clients: dict[int, LocalClient]


def fake_site(tmp_path: Path, classes: int = CLASSES) -> FakeSite:
    data = two_clients(tmp_path, on_disk=True)
    names = tuple(f"f{i}" for i in range(FEATURES))
    return FakeSite(DataSignature((FEATURES,), classes, names), dict(data.clients))


def site_config(num_classes: int = CLASSES, input_shape: list[int] | None = None) -> ExperimentConfig:
    return experiment_from_dict(
        {
            "data": {
                "dataset": "site",
                "num_clients": 2,
                "params": {"input_shape": input_shape or [FEATURES], "num_classes": num_classes},
            },
            "model": {"params": {"hidden": [16]}},
            "selection": {"clients_per_round": 2},
            "runtime": {"agents": 1},
        }
    )


class SpecStub:
    """The Federation stub as _runtime uses it: GetRunSpec answers one run's config."""

    def __init__(self, config: ExperimentConfig) -> None:
        self.yaml = config.to_yaml()

    def GetRunSpec(self, request: federation_pb2.RunSpecRequest, timeout: float) -> federation_pb2.RunSpec:
        return federation_pb2.RunSpec(run_id=request.run_id, experiment_yaml=self.yaml)


def make_agent(site: FakeSite | None) -> Agent:
    agent = Agent("127.0.0.1:1", [0, 1], "cpu", "site-a", dp_randomness="task", site=site)  # type: ignore[arg-type]
    return agent


def test_registration_carries_the_signature_and_counts(tmp_path: Path) -> None:
    site = fake_site(tmp_path)
    request = make_agent(site).register_request()
    assert list(request.data_signature.input_shape) == [FEATURES]
    assert request.data_signature.num_classes == CLASSES
    assert list(request.data_signature.feature_names) == [f"f{i}" for i in range(FEATURES)]
    assert [(c.client_id, c.num_train, c.num_test) for c in request.client_data] == [(0, 150, 40), (1, 97, 23)]
    plain = make_agent(None).register_request()  # a simulation agent reports no data
    assert not plain.HasField("data_signature") and not plain.client_data
    assert signature_message(DataSignature((1, 28, 28), 10)).feature_names == []


def test_site_runs_are_served_from_the_site_data(tmp_path: Path) -> None:
    site = fake_site(tmp_path, classes=7)  # fewer classes than the run's 10: the run's model, the site's labels
    agent = make_agent(site)
    agent.stub = SpecStub(site_config())  # type: ignore[assignment]
    runtime = agent._runtime("run-1")
    assert sorted(runtime.clients) == [0, 1]
    assert runtime.num_classes == CLASSES
    assert isinstance(runtime.clients[0].x_train, DiskRows)
    assert torch.equal(runtime.clients[1].y_test, torch.from_numpy(site.clients[1].test.y))


def test_a_site_run_without_site_data_is_unusable_said_once(caplog: pytest.LogCaptureFixture) -> None:
    agent = make_agent(None)
    agent.stub = SpecStub(site_config())  # type: ignore[assignment]
    with caplog.at_level(logging.ERROR, logger="client_agent.agent"):
        for _ in range(3):
            with pytest.raises(RunUnusable, match="start it with --data SPEC"):
                agent._runtime("run-1")
    said = [r for r in caplog.records if "cannot run on this agent" in r.getMessage()]
    assert len(said) == 1


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"input_shape": [64]}, "data.params.input_shape"), ({"num_classes": 5}, "data.params.num_classes")],
)
def test_site_data_that_cannot_feed_the_run_model_is_unusable(
    tmp_path: Path, changes: dict[str, object], field: str
) -> None:
    agent = make_agent(fake_site(tmp_path))
    agent.stub = SpecStub(site_config(**changes))  # type: ignore[assignment]
    with pytest.raises(RunUnusable, match=field):
        agent._runtime("run-1")


def test_a_site_agent_takes_no_part_in_a_run_on_another_dataset(tmp_path: Path) -> None:
    """An agent started with --data trains on its site's data only: a simulation run (a public dataset the agent would
    load itself) is refused, so a site never trains on data other than its own by mistake."""
    agent = make_agent(fake_site(tmp_path))
    simulation = experiment_from_dict(
        {"data": {"dataset": "synthetic", "num_clients": 2}, "selection": {"clients_per_round": 2}}
    )
    agent.stub = SpecStub(simulation)  # type: ignore[assignment]
    with pytest.raises(RunUnusable, match=r"serves its site's own data \(--data\).*data.dataset: site"):
        agent._runtime("run-1")
    assert agent.runtimes == {}


class Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_refused_registration_is_said_once_and_tried_again_slowly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent = make_agent(fake_site(tmp_path))
    refusal = "site 'site-a' refused: data_signature.input_shape is [20], the run expects [784]"
    answers: list[Exception | federation_pb2.RegisterReply] = [
        Refused(grpc.StatusCode.FAILED_PRECONDITION, refusal),
        Refused(grpc.StatusCode.FAILED_PRECONDITION, refusal),
        Refused(grpc.StatusCode.FAILED_PRECONDITION, refusal),
        Refused(grpc.StatusCode.UNAVAILABLE, "connection refused"),
        federation_pb2.RegisterReply(agent_id="a" * 16, heartbeat_interval_seconds=1, poll_wait_seconds=1),
    ]
    requests: list[federation_pb2.RegisterRequest] = []

    class Stub:
        def Register(self, request: federation_pb2.RegisterRequest, **_: object) -> federation_pb2.RegisterReply:
            requests.append(request)
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    pauses: list[float] = []
    agent.stub = Stub()  # type: ignore[assignment]
    agent.stop.wait = lambda timeout=None: pauses.append(timeout) or False  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="client_agent.agent"):
        agent._register()
    assert agent.agent_id == "a" * 16
    assert all(r.HasField("data_signature") for r in requests) and len(requests) == 5
    assert pauses[:3] == [agent_module.REFUSED_RETRY_S] * 3 == [30.0] * 3  # slowly, not a tight loop
    assert pauses[3] < 1.0  # an unreachable aggregator: today's quick backoff
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and refusal in errors[0].getMessage()


def mapped_resident_kb(path: Path) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps (Linux)")
def test_on_disk_rows_are_read_not_mapped(tmp_path: Path) -> None:
    """A client over a memory map reads its rows with pread: after a full evaluation pass and many random batches,
    none of the file's mapped pages is resident in the process (reading through the map would keep each touched page
    resident and counted in the agent's RSS)."""
    n, path = 20_000, tmp_path / "x.npy"
    x = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, 784))
    x[:] = np.random.default_rng(0).random((n, 784), dtype=np.float32)
    x.flush()
    del x
    mapped = np.load(path, mmap_mode="r")  # 63 MB on disk
    rows = DiskRows(mapped, CPU)
    assert mapped_resident_kb(path) == 0
    total = 0.0
    for chunk in rows.chunks(2048):
        total += float(chunk[:, 0].sum())
    for seed in range(20):
        total += float(rows[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:512]].sum())
    assert total > 0
    assert mapped_resident_kb(path) == 0
    assert float(np.asarray(mapped[:100]).sum()) > 0  # the check does see pages read through the map
    assert mapped_resident_kb(path) > 0


# -- a real site through open_site and the agent's command line --------------------------------------------------------


def write_wine_site(root: Path) -> list[str]:
    """scikit-learn's wine data (178 samples, 13 named features, 3 classes), standardised, as two clients' CSV tables
    (the label column `cultivar`); returns the feature names."""
    from sklearn.datasets import load_wine

    wine = load_wine()
    x = (wine.data - wine.data.mean(0)) / wine.data.std(0)
    order = np.random.default_rng(0).permutation(len(x))
    root.mkdir(parents=True)
    for k, rows in enumerate(np.array_split(order, 2)):
        header = ",".join([*wine.feature_names, "cultivar"])
        lines = [",".join([*(f"{v:.6f}" for v in x[i]), str(int(wine.target[i]))]) for i in rows]
        (root / f"hospital-{k + 1}.csv").write_text("\n".join([header, *lines]) + "\n")
    return list(wine.feature_names)


def test_an_agent_serves_a_table_site_made_from_scikit_learn_wine(tmp_path: Path) -> None:
    from fairfl.data.site import open_site

    names = write_wine_site(tmp_path / "wine")
    site = open_site(f"{tmp_path / 'wine'},label=cultivar,test_fraction=0.25", [4, 5])
    agent = Agent("127.0.0.1:1", [4, 5], "cpu", "hospital", dp_randomness="task", site=site)
    request = agent.register_request()
    assert list(request.data_signature.input_shape) == [13] and request.data_signature.num_classes == 3
    assert list(request.data_signature.feature_names) == names  # the table's columns, in order, label left out
    counts = {c.client_id: (c.num_train, c.num_test) for c in request.client_data}
    assert sorted(counts) == [4, 5] and sum(a + b for a, b in counts.values()) == 178
    assert all(test == round((train + test) * 0.25) for train, test in counts.values())

    config = experiment_from_dict(
        {
            "data": {
                "dataset": "site",
                "num_clients": 6,
                "params": {"input_shape": [13], "num_classes": 3, "feature_names": names},
            },
            "model": {"params": {"hidden": [16]}},
            "selection": {"clients_per_round": 2},
            "runtime": {"agents": 1},
        }
    )
    agent.stub = SpecStub(config)  # type: ignore[assignment]
    runtime = agent._runtime("wine-run")
    assert sorted(runtime.clients) == [4, 5]
    blobs = {"x0": flatten_parameters(runtime.model)}
    runtime.resolve_blob = lambda ref: blobs[ref.sha256]

    def accuracy() -> float:
        evaluate = task(federation_pb2.PHASE_EVALUATE, 5)
        evaluate.evaluate.SetInParent()
        return runtime.run(evaluate).test_accuracy

    before = accuracy()
    for rnd in range(8):  # a few rounds of FedAvg by hand over the two hospitals
        updates = []
        for cid in (4, 5):
            train = task(federation_pb2.PHASE_TRAIN, cid, seed=rnd)
            train.train.CopyFrom(federation_pb2.LocalTrainingConfig(local_epochs=1, batch_size=16, lr=0.1))
            updates.append(runtime.run(train).payloads[UPDATE])
        blobs["x0"] = blobs["x0"] + torch.stack(updates).mean(0)
    assert accuracy() > max(before, 80.0)


def run_agent(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "fairfl.compose", "serve", "agent", "--insecure", "--metrics-port", "-1", *args]
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)


def test_a_bad_data_spec_stops_the_agent_with_one_line(tmp_path: Path) -> None:
    missing = run_agent(["--clients", "0-1", "--data", str(tmp_path / "nowhere")], tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"client_agent: --data: --data {tmp_path / 'nowhere'}: no such file or directory"
    ]
    write_wine_site(tmp_path / "wine")
    env_spec = subprocess.run(  # FAIRFL_DATA, and a site whose client count differs from the agent's
        [sys.executable, "-m", "client_agent", "--insecure", "--metrics-port", "-1", "--clients", "0-2"],
        cwd=tmp_path,
        env={**os.environ, "FAIRFL_DATA": f"{tmp_path / 'wine'},label=cultivar"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert env_spec.returncode == 2
    lines = env_spec.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds 2 client(s)" in lines[0] and "the agent hosts 3" in lines[0], lines
    assert "Traceback" not in env_spec.stderr
    (tmp_path / "broken.npz").write_bytes(b"not a zip: an interrupted copy")
    for spec in (str(tmp_path / "broken.npz"), "/dev/null"):  # unreadable data, or no data at all
        bad = run_agent(["--clients", "0", "--data", spec], tmp_path)
        assert bad.returncode == 2, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr, bad.stderr
        assert spec in bad.stderr


# -- scripts/bench_site_memory.py's helpers on a small site ------------------------------------------------------------


def test_the_memory_benchmark_writes_a_site_the_agent_opens_lazily(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import bench_site_memory as bench

    from fairfl.data.site import open_site

    rows = bench.rows_for(3 * 784 * 4 * 100 + 1, 3)  # just over 300 rows' worth of bytes
    assert rows == [101, 100, 100]
    site = bench.write_site(tmp_path / "site", rows)
    assert site.bytes_on_disk > sum(rows) * bench.ROW_BYTES
    opened = open_site(str(site.root), [0, 1, 2])
    assert opened.signature == DataSignature((784,), 10)
    assert [len(c.train) + len(c.test) for c in opened.clients.values()] == rows
    assert all(is_lazy(c.train.x) and is_lazy(c.test.x) for c in opened.clients.values())
    labels = np.concatenate([np.load(site.root / f"client-{k:02d}" / "y.npy") for k in range(3)])
    assert len(np.unique(labels)) >= 5  # a rule over all classes, something to learn
    config = experiment_from_dict(bench.experiment(3, 2, 32, [8]))
    assert config.data.dataset == "site" and config.data.params == {"input_shape": [784], "num_classes": 10}
    assert bench.check_free_space(tmp_path, 10**6) is None
    problem = bench.check_free_space(tmp_path / "not" / "yet", 10**18)
    assert problem is not None and "choose another --dir or a smaller --gb" in problem
    assert bench.resident_in_mappings(os.getpid(), site.root) == 0
