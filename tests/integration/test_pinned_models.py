"""Built-ins' behaviour pinned across restructurings: short runs of the quickstart, FedEBA+, a DP preset (FedFDP),
HiCS-FL selection and Equitable-FL, run the way a user runs them (`fairfl run ... --transport inprocess`), must end
in exactly the final model recorded before the open-platform restructuring (commit 2e4f7f2). A change that moves a
single bit of any of them fails here; a deliberate behaviour change re-records the hash and says why."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fairfl.data.datasets import DatasetNotFoundError, load_dataset

REPO = Path(__file__).resolve().parents[2]
FAIRFL = Path(sys.executable).parent / "fairfl"

PINNED = {
    "quickstart": (
        [
            "experiments/quickstart.yaml",
            "--rounds",
            "3",
            "--set",
            "data.num_clients=20",
            "--set",
            "selection.clients_per_round=5",
        ],
        "3f8a53a07cb51940fbad52c488da55dac09f0ddab4a2fcb6dd3e822a78d04df8",
    ),
    "fedeba_plus": (
        [
            "experiments/fedeba/fmnist_mlp.yaml",
            "--rounds",
            "3",
            "--set",
            "data.num_clients=20",
            "--set",
            "strategy.name=fedeba_plus",
            "--set",
            "strategy.params.alpha=0.9",
            "--set",
            "strategy.params.tau=0.1",
        ],
        "888209ae77e80482c2e98fd99cbef291a5bfce39942706b9ae763127722c85f8",
    ),
    "fedfdp_dp": (
        [
            "experiments/fedfdp/fmnist_cnn.yaml",
            "--rounds",
            "2",
            "--set",
            "model.params.channels=[4,8]",
            "--set",
            "model.params.hidden=32",
        ],
        "d0d93f8e174a64d2be0a8c38af9bef4e73db02604b931a2fdac2869fe3fe0d56",
    ),
    "hicsfl": (
        [
            "experiments/hicsfl/fmnist_setting2.yaml",
            "--rounds",
            "3",
            "--set",
            "training.local_epochs=1",
            "--set",
            "data.group_sizes=[2,2,2,2,2]",
            "--set",
            "data.num_clients=10",
            "--set",
            "selection.clients_per_round=3",
        ],
        "fb7bdb6f206004b7bc6118e99507290c5a023cd044485f50933267fb3c4865c8",
    ),
    "equitable": (
        [
            "experiments/equitable/fmnist_mlp.yaml",
            "--rounds",
            "2",
            "--set",
            "training.local_epochs=1",
            "--set",
            "data.samples_per_class=100",
        ],
        "5f32fc9ba5733763a221da792a9780cd0d45d2bf389a173c7601d683dde2109d",
    ),
}


@pytest.fixture(scope="module", autouse=True)
def _fashion_mnist() -> None:
    try:
        load_dataset("fashion_mnist", "test")
    except DatasetNotFoundError as err:
        pytest.skip(f"Fashion-MNIST is not installed: {err}")


@pytest.mark.parametrize("preset", sorted(PINNED))
def test_final_model_is_pinned(preset: str, tmp_path: Path) -> None:
    args, want = PINNED[preset]
    out = tmp_path / preset
    proc = subprocess.run(
        [str(FAIRFL), "run", *args, "--transport", "inprocess", "--output", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["final_model_sha256"] == want, f"{preset}: the built-in's final model changed"
