"""Client training on a CUDA device agrees with the CPU. Skipped where no GPU is present (CI has none)."""

from __future__ import annotations

import pytest
import torch

from aggregator_service.engine import initial_model
from client_agent.trainer import ClientRuntime, load_run_data, resolve_device
from fairfl.config import experiment_from_dict
from fairfl.protocol import UPDATE
from fairfl.v1 import federation_pb2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


def test_cuda_training_matches_cpu() -> None:
    config = experiment_from_dict(
        {
            "data": {"dataset": "synthetic", "num_clients": 4},
            "model": {"hidden": [32]},
            "selection": {"clients_per_round": 2},
            "runtime": {"agents": 1},
        }
    )
    data = load_run_data(config)
    _, params = initial_model(config)
    task = federation_pb2.Task(task_id="t", run_id="r", round=1, phase=federation_pb2.PHASE_TRAIN, client_id=1, seed=5)
    task.train.CopyFrom(federation_pb2.LocalTrainingConfig(local_steps=5, batch_size=16, lr=0.05))
    updates = {}
    for device in ("cpu", "cuda"):
        runtime = ClientRuntime(config, data, [1], resolve_device(device), lambda ref: params)
        updates[device] = runtime.run(task).payloads[UPDATE]
    assert updates["cuda"].device.type == "cpu"  # results always come back on the host
    torch.testing.assert_close(updates["cuda"], updates["cpu"], rtol=1e-4, atol=1e-5)
