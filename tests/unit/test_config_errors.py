"""A data section the data cannot hold ends as one config-error line naming the field (exit 2), on both transports,
before anything starts; never a traceback from the partitioners at data load (issue #20)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fairfl.compose import cli
from fairfl.compose.cli import check_run_data, main
from fairfl.config import ConfigError, experiment_from_dict
from fairfl.data.datasets import DEBIAN_FASHION_MNIST_DIR, DatasetNotFoundError, clear_cache
from fairfl.data.federated import DataConfigError, build_federated
from fairfl.data.partition import PartitionError, partition_shards
from tests.unit.test_data import write_idx_dataset

REPO = Path(__file__).resolve().parents[2]
N_TRAIN, N_TEST = 200, 50  # the tiny dataset: labels cycle 0..9, so 20 train and 5 test samples per class
DATA_FIELDS = {
    "data.num_clients",
    "data.partition",
    "data.shards_per_client",
    "data.alpha",
    "data.min_size",
    "data.test_per_client",
    "data.test_split",
    "data.group_sizes",
    "data.group_classes",
    "data.samples_per_class",
    "data.group_alphas",
}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny-fmnist")
    write_idx_dataset(root, n_train=N_TRAIN, n_test=N_TEST)
    return root


def experiment(root: Path, **data: Any) -> dict[str, Any]:
    return {
        "name": "bad-data",
        "rounds": 1,
        "data": {"dataset": "fashion_mnist", "root": str(root), "num_clients": 10, **data},
        "model": {"name": "mlp", "params": {"hidden": [8]}},
        "training": {"local_steps": 1},
        "selection": {"clients_per_round": 2},
        "runtime": {"agents": 1},
    }


# (data overrides, the field the error must name); each is valid config, but the tiny dataset cannot hold it.
CASES = [
    ({"num_clients": 100000}, "data.num_clients"),  # shards: more clients than samples
    ({"shards_per_client": 50}, "data.shards_per_client"),  # 10 x 50 shards of 200 samples
    ({"partition": "iid", "num_clients": 300}, "data.num_clients"),
    ({"partition": "dirichlet", "min_size": 30}, "data.min_size"),  # 10 x 30 > 200
    ({"partition": "dirichlet", "alpha": 1.0, "min_size": 19}, "data.min_size"),  # no draw (seed 0) gives all 19
    ({"num_clients": 60}, "data.num_clients"),  # shards fit, but 50 test samples for 60 clients
    ({"test_per_client": 20}, "data.test_per_client"),  # a shard client's 2 classes have 10 test samples
    ({"test_split": "iid", "test_per_client": 6}, "data.test_per_client"),  # 60 disjoint of 50
    (
        {"partition": "label_groups", "group_sizes": [4, 6], "group_classes": [4, 6], "samples_per_class": 10},
        "data.samples_per_class",  # 4 clients x 10 of a class with 20
    ),
    (
        {"partition": "label_groups", "num_clients": 30, "group_sizes": [25, 5], "group_classes": [5, 5]},
        "data.group_sizes",  # 25 clients share a class of 20 samples
    ),
    (
        {"partition": "dirichlet_groups", "group_sizes": [5, 5], "group_alphas": [0.1, 1.0], "min_size": 21},
        "data.min_size",  # each client gets 20
    ),
]


def assert_one_error_line(err: str, field: str) -> None:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: {field}: "), err


@pytest.mark.parametrize("transport", ["inprocess", "grpc"])
@pytest.mark.parametrize(("data", "field"), CASES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(CASES)])
def test_a_split_the_data_cannot_hold_is_one_config_error_line(
    data_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    data: dict[str, Any],
    field: str,
    transport: str,
) -> None:
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(experiment(data_root, **data)))
    experiment_from_dict(yaml.safe_load(config.read_text()))  # valid config: only the data cannot hold it
    out = tmp_path / "out"
    code = main(["run", str(config), "--transport", transport, "--output", str(out)])
    captured = capsys.readouterr()
    assert code == 2
    assert_one_error_line(captured.err, field)
    assert captured.out == ""  # refused before the run's header: nothing started
    assert not out.exists()  # no service, agent or results directory


def test_the_issue_command_ends_in_one_line_naming_num_clients() -> None:
    """`fairfl run experiments/quickstart.yaml --set data.num_clients=100000`, as the issue ran it (gRPC, default)."""
    if not (DEBIAN_FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.skip(f"Fashion-MNIST is not installed at {DEBIAN_FASHION_MNIST_DIR}")
    cmd = [sys.executable, "-m", "fairfl.compose", "run", "experiments/quickstart.yaml"]
    cmd += ["--set", "data.num_clients=100000"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_one_error_line(proc.stderr, "data.num_clients")
    assert "60000" in proc.stderr  # says how much data there is


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_clients=st.integers(1, 400),
    partition=st.sampled_from(["iid", "shards", "dirichlet"]),
    shards_per_client=st.integers(1, 60),
    alpha=st.floats(0.001, 100.0),
    min_size=st.integers(0, 40),
    test_per_client=st.none() | st.integers(1, 80),
    test_split=st.sampled_from(["follow_train", "iid"]),
)
def test_build_federated_fails_only_with_a_data_config_error(
    data_root: Path,
    num_clients: int,
    partition: str,
    shards_per_client: int,
    alpha: float,
    min_size: int,
    test_per_client: int | None,
    test_split: str,
) -> None:
    """Any values the config accepts either split or raise DataConfigError naming one data field."""
    try:
        data = build_federated(
            "fashion_mnist",
            num_clients,
            partition,
            seed=0,
            root=str(data_root),
            shards_per_client=shards_per_client,
            alpha=alpha,
            min_size=min_size,
            test_per_client=test_per_client,
            test_split=test_split,
        )
    except DataConfigError as err:
        assert err.field in DATA_FIELDS
        assert str(err).startswith(f"{err.field}: ")
        assert "\n" not in str(err)
        return
    assert data.num_clients == num_clients
    assert all(len(t) >= 1 for t in data.test_indices)


def test_partition_errors_name_the_argument_to_change() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(PartitionError) as info:
        partition_shards(np.zeros(100, np.int64), 200, 1, rng)
    assert info.value.argument == "num_clients"
    with pytest.raises(PartitionError) as info:
        partition_shards(np.zeros(100, np.int64), 40, 3, rng)
    assert info.value.argument == "shards_per_client"
    assert "at most 2 shards per client for 40 clients, or at most 33 clients with 3 shards each" in str(info.value)
    assert isinstance(info.value, ValueError)  # callers catching ValueError still do


def test_a_remote_run_is_checked_only_where_the_data_is_here(data_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = experiment_from_dict(experiment(data_root, num_clients=100000))
    with pytest.raises(DataConfigError, match=r"^data\.num_clients: "):
        check_run_data(config, remote=True, keep=False)

    def missing(_config: Any) -> None:
        raise DatasetNotFoundError("dataset 'fashion_mnist' (split 'train') not found")

    monkeypatch.setattr("fairfl.data.run.load_run_data", missing)
    check_run_data(config, remote=True, keep=False)  # the agents' data is theirs: nothing to say here
    with pytest.raises(ConfigError, match=r"^data\.dataset: dataset 'fashion_mnist'"):
        check_run_data(config, remote=False, keep=False)
    clear_cache()


def test_data_providers_and_good_splits_pass_the_check(data_root: Path) -> None:
    check_run_data(experiment_from_dict(experiment(data_root)), remote=False, keep=False)
    synthetic = {"data": {"dataset": "synthetic", "num_clients": 4}, "selection": {"clients_per_round": 2}}
    check_run_data(experiment_from_dict(synthetic), remote=False, keep=False)
    assert cli.check_run_data is check_run_data


def test_tls_dir_without_an_aggregator_is_refused_not_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FAIRFL_TLS_DIR", raising=False)
    out = tmp_path / "out"
    config = str(REPO / "experiments" / "quickstart.yaml")
    assert main(["run", config, "--tls-dir", str(tmp_path / "operator"), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tls-dir is the identity for reaching a running aggregator (--aggregator ADDR)")
    assert len(err.strip().splitlines()) == 1 and not out.exists()
