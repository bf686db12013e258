"""Selection methods inside the round engine (in-process): config validation, HiCS-FL's signatures, power-of-choice's
loss probe, the update bank behind Clustered Sampling / DivFL, repeated draws, the per-round selection time, and
HiCS-FL's mixed-α partition."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from aggregator_service.engine import RoundEngine
from aggregator_service.selection import SelectionContext, UpdateBank, select_request, selection_input
from clustering_service.samplers import ClusteredSampler, HicsParams
from clustering_service.servicer import sampler_of, selection_input_from_proto
from fairfl.compose.compare import load_comparison
from fairfl.compose.inprocess import InProcessTransport
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalSelector
from fairfl.config import ConfigError, ExperimentConfig, experiment_from_dict, load_experiment
from fairfl.data.groups import client_groups
from fairfl.data.partition import partition_dirichlet_groups
from fairfl.protocol import PROBE, TRAIN, UPDATE
from fairfl.sampling import SelectionOutput
from fairfl.v1 import control_pb2, federation_pb2

REPO = Path(__file__).resolve().parents[2]


def _config(method: str, **over: Any) -> ExperimentConfig:
    cfg: dict[str, Any] = {
        "name": "sel",
        "seed": 5,
        "rounds": 6,
        "data": {"dataset": "synthetic", "num_clients": 12},
        "model": {"name": "mlp", "params": {"hidden": [16]}},
        "training": {"local_steps": 3, "batch_size": 16, "lr": 0.05},
        "selection": {"method": method, "clients_per_round": 3},
        "evaluation": {"every": 100},
        "runtime": {"agents": 1},
    }
    for dotted, value in over.items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return experiment_from_dict(cfg)


class RecordingTransport(InProcessTransport):
    """The in-process transport, keeping every task and result it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[federation_pb2.Task, Any]] = []

    def execute(self, tasks: list[federation_pb2.Task], timeout: float, *args: Any, **kwargs: Any) -> Any:
        outcome = super().execute(tasks, timeout, *args, **kwargs)
        by_client = {r.client_id: r for r in outcome.results}
        self.log.extend((t, by_client.get(t.client_id)) for t in tasks)
        return outcome


def _run(config: ExperimentConfig, selector: Any = None) -> tuple[list[control_pb2.RoundEvent], Any, Any]:
    events: list[control_pb2.RunEvent] = []
    transport = RecordingTransport()
    selector = selector or LocalSelector(config.selection.method)
    summary = RoundEngine("run", config, transport, selector, LocalPrivacy(), events.append).run()
    assert summary.state == control_pb2.RUN_STATE_COMPLETED, summary.message
    return [e.round for e in events if e.HasField("round")], transport, selector


# --- config -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"selection.params": {"temperature": -1.0}}, "selection.params.temperature: must be > 0"),
        ({"selection.params": {"tau": 1.0}}, "selection.params: unknown parameter 'tau'"),
        ({"selection.params": {"num_clusters": 13}}, "selection.params.num_clusters: 13 exceeds data.num_clients"),
        ({"selection.method": "power_of_choice", "selection.params": {"candidates": 2}}, "selection.params.candidates"),
        ({"selection.method": "hicsfl"}, "selection.method: unknown sampler 'hicsfl'"),
        ({"selection.params": {"total_rounds": 9}}, "selection.params.total_rounds: set by the run"),
        (
            {"privacy": {"enabled": True, "sample_rate": 0.1}, "training.local_steps": 2},
            "selection.method: hics is not a uniform sampler",
        ),
        ({"data.group_alphas": [0.1]}, "data.group_alphas: applies to partition dirichlet_groups only"),
    ],
)
def test_selection_config_errors_name_the_field(over: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _config("hics", **over)


def test_clustered_is_a_synonym_and_params_are_typed() -> None:
    assert _config("clustered").selection.sampler_class() is ClusteredSampler  # one sampler, two names
    cfg = _config("hics", **{"selection.params": {"temperature": 0.01, "gamma0": 2, "freeze_after_warmup": True}})
    assert cfg.selection.params == {"temperature": 0.01, "gamma0": 2, "freeze_after_warmup": True}
    with pytest.raises(ConfigError, match=r"data\.group_alphas: one α per group"):
        experiment_from_dict(
            {
                "data": {
                    "dataset": "fashion_mnist",
                    "num_clients": 20,
                    "partition": "dirichlet_groups",
                    "group_sizes": [10, 10],
                    "group_alphas": [0.1],
                }
            }
        )


def test_hicsfl_presets_and_comparison_load_and_evaluate_every_round() -> None:
    presets = [REPO / "experiments" / "hicsfl" / f"fmnist_setting{s}.yaml" for s in (1, 2, 3)]
    for path in presets:
        cfg = load_experiment(path)
        assert (cfg.data.num_clients, cfg.selection.clients_per_round, cfg.rounds) == (50, 5, 200)
        assert cfg.data.partition == "dirichlet_groups" and cfg.evaluation.every <= 2
        assert (cfg.training.local_epochs, cfg.training.batch_size) == (2, 64)
        # The paper's metric (global test accuracy) and the T calibrated for lr 0.001 with frozen warm-up updates.
        assert cfg.data.test_split == "iid" and cfg.training.lr == 0.001
        assert cfg.selection.params["temperature"] == 0.005 and cfg.selection.params["freeze_after_warmup"] is True
    spec = load_comparison(REPO / "experiments" / "hicsfl" / "fmnist_setting2.compare.yaml")
    assert spec.target_accuracy == 75
    runs = {run.label: run for run in spec.runs}
    methods = {label: spec.experiment(run, run.seeds[0]).selection.method for label, run in runs.items()}
    assert sorted(methods.values()) == ["clustered_sampling", "hics", "power_of_choice", "power_of_choice", "random"]
    assert all(run.seeds == [0, 1, 2, 3, 4] for run in spec.runs)  # five seeds each, pairing over partitions
    candidates = {
        spec.experiment(run, 0).selection.params.get("candidates") for run in spec.runs if "Power" in run.label
    }
    assert candidates == {None, 10}  # d = N (the HiCS-FL paper's) and d = 2K (the pow-d paper's)


# --- engine -----------------------------------------------------------------------------------------------------------


def test_hics_reports_every_trained_clients_bias_update_and_times_selection() -> None:
    config = _config("hics")
    rounds, transport, selector = _run(config)
    train_tasks = [t for t, _ in transport.log if t.phase == TRAIN]
    assert train_tasks and all(t.train.want_bias_update for t in train_tasks)
    stored = selector.store.run("run").signatures()
    trained = {t.client_id for t in train_tasks}
    assert set(stored) == trained == set(range(12))  # the 4 warm-up rounds visit everyone
    last = {t.client_id: r for t, r in transport.log if t.phase == TRAIN}
    for cid, sig in stored.items():
        np.testing.assert_array_equal(sig.bias_update, last[cid].bias_update)  # float64 end to end
        assert sig.num_samples == last[cid].num_samples
    assert [len(r.selected) for r in rounds] == [3] * 6
    assert all(r.selection_seconds > 0 for r in rounds)


def test_power_of_choice_probes_the_candidates_and_trains_the_highest_losses() -> None:
    config = _config("power_of_choice", **{"selection.params": {"candidates": 6}})
    rounds, transport, _ = _run(config)
    for event in rounds:
        probes = {t.client_id: r.loss_before for t, r in transport.log if t.phase == PROBE and t.round == event.round}
        assert len(probes) == 6 and all(not t.probe.want_gradient for t, _ in transport.log if t.phase == PROBE)
        top = sorted(probes, key=lambda c: (-probes[c], c))[:3]
        assert list(event.selected) == sorted(top)
        trained = sorted(t.client_id for t, _ in transport.log if t.phase == TRAIN and t.round == event.round)
        assert trained == sorted(top)
        assert event.results_accepted == 3  # the probe is selection work, not a phase of the round


@pytest.mark.parametrize("method", ["clustered_sampling", "divfl"])
def test_update_methods_run_and_see_the_gram_of_last_updates(method: str) -> None:
    seen: list[SelectionContext] = []

    class Spy(LocalSelector):
        def select(self, context: SelectionContext) -> SelectionOutput:
            seen.append(context)
            return super().select(context)

    rounds, transport, _ = _run(_config(method), Spy(method))
    assert len(rounds) == 6 == len(seen)
    numel = next(r.payloads[UPDATE].numel() for t, r in transport.log if t.phase == TRAIN)
    last: dict[int, torch.Tensor] = {}
    for context in seen:  # each round sees the Gram matrix of every client's latest update so far (zeros if none)
        x = torch.stack([last.get(c, torch.zeros(numel)) for c in range(12)]).double()
        np.testing.assert_allclose(context.similarity, (x @ x.T).numpy(), rtol=1e-6, atol=1e-12)
        last.update(
            {t.client_id: r.payloads[UPDATE] for t, r in transport.log if t.phase == TRAIN and t.round == context.round}
        )


def test_a_client_drawn_twice_trains_once() -> None:
    class Twice(LocalSelector):
        def select(self, context: SelectionContext) -> SelectionOutput:
            return SelectionOutput(selected=(context.candidates[0], context.candidates[0], context.candidates[1]))

    rounds, transport, _ = _run(_config("random"), Twice("random"))
    assert list(rounds[0].selected) == [0, 0, 1]
    assert sorted(t.client_id for t, _ in transport.log if t.phase == TRAIN and t.round == 1) == [0, 1]


def test_update_bank_gram_is_exact_and_the_sketch_estimates_it() -> None:
    gen = torch.Generator().manual_seed(0)
    updates = {c: torch.randn(5000, generator=gen) for c in range(5)}
    updates[1] = updates[0] + 0.1 * torch.randn(5000, generator=gen)  # a near-duplicate: cosine ≈ 0.995
    exact = UpdateBank(num_clients=6, numel=5000)
    exact.put({c: updates[c] for c in (0, 1, 2)})
    exact.put({c: updates[c] for c in (3, 4)})
    x = torch.stack([updates[c] for c in range(5)] + [torch.zeros(5000)]).double()
    np.testing.assert_allclose(exact.similarity(list(range(6))), (x @ x.T).numpy(), rtol=1e-6)
    exact.put({2: -updates[2]})  # a client's newer update replaces its row and column
    assert exact.similarity([2, 3])[0, 1] == pytest.approx(-(x[2] @ x[3]).item(), rel=1e-6)
    sketch = UpdateBank(num_clients=6, numel=5000, sketch_dim=1024, seed=1)
    sketch.put(updates)
    g = sketch.similarity(list(range(5)))
    cos = g / np.sqrt(np.outer(np.diag(g), np.diag(g)))
    true = (x[:5] @ x[:5].T).numpy()
    true_cos = true / np.sqrt(np.outer(np.diag(true), np.diag(true)))
    assert np.abs(cos - true_cos).max() < 0.1 and cos[0, 1] > 0.95


# --- partition --------------------------------------------------------------------------------------------------------


def test_dirichlet_groups_partition_is_grouped_balanced_and_skewed_by_alpha() -> None:
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 600)
    rng.shuffle(labels)
    sizes, alphas = [10, 10, 10], [0.001, 0.1, 100.0]
    parts = partition_dirichlet_groups(labels, sizes, alphas, np.random.default_rng(1))
    everything = np.concatenate(parts)
    assert len(parts) == 30 and np.unique(everything).size == everything.size == labels.size  # disjoint, complete
    assert all(len(p) == 200 for p in parts)  # the balance rule: no client beyond its fair share
    counts = np.stack([np.bincount(labels[p], minlength=10) for p in parts])
    np.testing.assert_array_equal(counts.reshape(3, 10, 10).sum(axis=1), np.full((3, 10), 200))  # class-balanced parts
    top_share = counts.max(axis=1) / counts.sum(axis=1)
    assert top_share[:10].min() > 0.95  # α = 0.001: one class per client
    assert top_share[20:].max() < 0.3  # α = 100: near uniform
    assert client_groups("dirichlet_groups", sizes).tolist() == [0] * 10 + [1] * 10 + [2] * 10
    again = partition_dirichlet_groups(labels, sizes, alphas, np.random.default_rng(1))
    assert all((a == b).all() for a, b in zip(parts, again, strict=True))
    with pytest.raises(ValueError, match="group_alphas"):
        partition_dirichlet_groups(labels, sizes, [0.1, 0.1], np.random.default_rng(1))


def test_selection_state_survives_a_checkpoint_round_trip() -> None:
    config = _config("clustered_sampling", rounds=3)
    _, _, selector = _run(config)
    engine = RoundEngine("run", config, InProcessTransport(), selector, LocalPrivacy(), lambda e: None)
    fresh = RoundEngine(
        "run", config, InProcessTransport(), LocalSelector("clustered_sampling"), LocalPrivacy(), lambda e: None
    )
    engine.selection.sizes = {3: 40, 7: 55}
    engine.selection.bank.put({3: torch.ones(engine.layout.numel), 7: torch.arange(engine.layout.numel).float()})
    fresh.selection.load_state_dict(engine.selection.state_dict())
    assert fresh.selection.sizes == {3: 40, 7: 55}
    np.testing.assert_array_equal(fresh.selection.bank.similarity([3, 7]), engine.selection.bank.similarity([3, 7]))
    hics = LocalSelector("hics")
    _run(_config("hics", rounds=2), hics)
    restored = LocalSelector("hics")
    restored.load_state_dict(hics.state_dict())
    before, after = hics.store.run("run").signatures(), restored.store.run("run").signatures()
    assert sorted(before) == sorted(after) and len(after) == 6
    assert all((before[c].bias_update == after[c].bias_update).all() for c in before)


def test_the_wire_request_carries_exactly_what_the_in_process_path_sees() -> None:
    rng = np.random.default_rng(0)
    gram = rng.standard_normal((4, 4))
    context = SelectionContext(
        "r",
        7,
        [9, 3, 5, 1],
        2,
        seed=4,
        params=HicsParams(temperature=0.01, lambda_entropy=0.0, total_rounds=50, freeze_after_warmup=False),
        num_samples=[10, 0, 30, 40],
        similarity=gram @ gram.T,
    )
    request = select_request("hics", context)
    ref, _, params = sampler_of(request)
    local, wire = selection_input(context), selection_input_from_proto(request, params)
    assert ref == "hics"
    assert wire.params == local.params  # unset stays unset, 0 and False stay set
    for name in ("candidates", "candidate_num_samples", "similarity"):
        np.testing.assert_array_equal(getattr(wire, name), getattr(local, name))
    too_big = replace(context, candidates=list(range(800)), similarity=np.zeros((800, 800)), num_samples=None)
    with pytest.raises(ValueError, match="does not fit one Select message"):
        select_request("clustered_sampling", too_big)


def test_the_aggregator_process_selects_only_through_a_clustering_service(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from aggregator_service.server import Aggregator, main

    monkeypatch.delenv("FAIRFL_CLUSTERING_ADDRESS", raising=False)
    with pytest.raises(SystemExit) as ended:
        main(["--bind", "127.0.0.1:0"])
    assert ended.value.code == 2 and "--clustering ADDRESS (env FAIRFL_CLUSTERING_ADDRESS) is required" in (
        capsys.readouterr().err
    )
    with pytest.raises(ValueError, match="--clustering ADDRESS"):
        Aggregator("")
