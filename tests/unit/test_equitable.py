"""Equitable-FL and its baselines (FedProx + Cluster2, FedProx + FairFed) against hand computations, plus the client's
activation vector (seed-equitable.md §1.4, §1.7, §4)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from aggregator_service.clustering_peer import ClusteringFailed
from aggregator_service.strategies.cluster2 import draw_weights
from aggregator_service.strategies.equitable import cluster_seed
from aggregator_service.strategies.fairfed import FairFed, fairfed_update
from client_agent.trainer import ClientRuntime
from fairfl.compose.local_selection import LocalClusterer
from fairfl.config import ConfigError, experiment_from_dict
from fairfl.data import load_run_data
from fairfl.params import load_flat
from fairfl.protocol import TRAIN, UPDATE, ClientResult
from fairfl.strategy import RoundContext, Strategy, build_strategy
from fairfl.v1 import clustering_pb2, federation_pb2, tensor_pb2

# --- helpers --------------------------------------------------------------------------------------------------------

# Planted activation centres: log-softmax vectors of two different "label sets" (all entries < 0, like the real ones).
_CENTRES = F.log_softmax(torch.tensor([[3.0, 0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 2.5, 0.0, 0.0, 3.0],
                                        [0.0, 2.0, 0.0, 0.0, 3.0, 0.0]]), dim=1).double().numpy()  # fmt: skip


def result(
    cid: int,
    update: Sequence[float],
    group: int | None = None,
    n: int = 100,
    accuracy: float | None = None,
    noise: float = 0.01,
) -> ClientResult:
    r = ClientResult(
        task_id=f"t{cid}",
        run_id="r",
        round=1,
        client_id=cid,
        phase=TRAIN,
        num_samples=n,
        loss_before=1.0,
        loss_after=0.5,
        payloads={UPDATE: torch.tensor(update, dtype=torch.float32)},
    )
    if group is not None:
        r.activation = _CENTRES[group] + noise * np.random.default_rng(cid).standard_normal(_CENTRES.shape[1])
    if accuracy is not None:
        r.metrics["accuracy_before"] = accuracy
    return r


LOCAL = LocalClusterer()


def context(
    clients: Sequence[int],
    params: Sequence[float] = (0.0, 0.0),
    groups: dict[int, int] | None = None,
    cluster: Any = LOCAL,
    num_clients: int = 10,
) -> RoundContext:
    cfg = federation_pb2.LocalTrainingConfig(local_epochs=5, batch_size=32, lr=0.01, prox_mu=0.0)
    return RoundContext(
        "r",
        3,
        torch.tensor(params, dtype=torch.float32),
        list(clients),
        cfg,
        lambda _: tensor_pb2.BlobRef(),
        seed=11,
        num_clients=num_clients,
        true_groups=groups,
        cluster=cluster,
    )


def strategy(name: str, **params: Any) -> Strategy:
    return build_strategy(name, params, 1.0)


# Equitable-FL's MNIST setup: clients 0-3 group A (3200 samples), 4-9 group B (4800 samples).
MNIST_GROUPS = {c: int(c >= 4) for c in range(10)}


def mnist_result(cid: int, update: Sequence[float]) -> ClientResult:
    return result(cid, update, MNIST_GROUPS[cid], n=3200 if cid < 4 else 4800)


# --- Equitable-FL ---------------------------------------------------------------------------------------------------


def test_equitable_weights_worked_example_and_cluster_masses() -> None:
    # spec §1.7: S_k = {0, 5, 6, 7}, C = 2, correct clusters → p = [1/2, 1/6, 1/6, 1/6] (FedProx: N-weighted).
    updates = {0: [6.0, 0.0], 5: [0.0, 6.0], 6: [0.0, 12.0], 7: [6.0, 6.0]}
    results = [mnist_result(c, u) for c, u in updates.items()]
    out = strategy("equitable").aggregate(context([0, 5, 6, 7], (1.0, 1.0), MNIST_GROUPS), [results])
    assert [out.weights[c] for c in (0, 5, 6, 7)] == pytest.approx([1 / 2, 1 / 6, 1 / 6, 1 / 6])
    assert sum(out.weights.values()) == pytest.approx(1.0)
    found = {k: sum(w for c, w in out.weights.items() if out.clusters[c] == k) for k in set(out.clusters.values())}
    assert sorted(found.values()) == pytest.approx([0.5, 0.5])  # every present cluster gets 1/C_present
    # x + Σ p_i Δ_i = 1 + [6/2 + 6/6, 0 + 6/6 + 12/6 + 6/6] = [5, 5]
    assert out.params.tolist() == pytest.approx([5.0, 5.0])
    assert out.clusters == {0: 0, 5: 1, 6: 1, 7: 1}
    assert out.metrics["nmi"] == pytest.approx(1.0) and out.metrics["all_groups_present"] == 1.0
    assert out.metrics["clusters_found"] == 2.0
    # FedProx on the same round weighs by sample count: 3200/17600 and 4800/17600.
    fedprox = strategy("fedprox").aggregate(context([0, 5, 6, 7], (1.0, 1.0)), [results])
    assert [fedprox.weights[c] for c in (0, 5, 6, 7)] == pytest.approx([3200 / 17600] + [4800 / 17600] * 3)


def test_equitable_balanced_round_is_uniform_and_three_groups() -> None:
    results = [mnist_result(c, [1.0, float(c)]) for c in (0, 1, 4, 5)]
    out = strategy("equitable").aggregate(context([0, 1, 4, 5], groups=MNIST_GROUPS), [results])
    assert list(out.weights.values()) == pytest.approx([0.25] * 4)
    # CIFAR-100 example: groups A, B, C with C = 3 and S_k = {0 (A), 2 (B), 5, 6 (C)} → [1/3, 1/3, 1/6, 1/6].
    groups = {0: 0, 2: 1, 5: 2, 6: 2}
    three = [result(c, [1.0], groups[c]) for c in (0, 2, 5, 6)]
    out = strategy("equitable", num_clusters=3).aggregate(context([0, 2, 5, 6], (0.0,), groups), [three])
    assert [out.weights[c] for c in (0, 2, 5, 6)] == pytest.approx([1 / 3, 1 / 3, 1 / 6, 1 / 6])
    assert out.metrics["nmi"] == pytest.approx(1.0)


def test_equitable_equals_fedavg_with_balanced_clusters_and_equal_sizes() -> None:
    # spec T8: balanced clusters, equal N_i, correct clustering → the FedAvg aggregate.
    rng = np.random.default_rng(0)
    results = [result(c, rng.standard_normal(5).tolist(), c % 2, n=200) for c in range(6)]
    ctx = context(range(6), [0.5] * 5, {c: c % 2 for c in range(6)})
    equitable = strategy("equitable").aggregate(ctx, [results])
    fedavg = strategy("fedavg").aggregate(ctx, [results])
    assert torch.allclose(equitable.params, fedavg.params, atol=1e-6)


def test_equitable_without_true_groups_reports_no_nmi_and_is_deterministic() -> None:
    results = [mnist_result(c, [1.0, 2.0]) for c in (0, 2, 5, 8)]
    first = strategy("equitable").aggregate(context([0, 2, 5, 8]), [results])
    again = strategy("equitable").aggregate(context([0, 2, 5, 8]), [results])
    assert "nmi" not in first.metrics and "all_groups_present" not in first.metrics
    assert first.weights == again.weights and first.clusters == again.clusters


def test_equitable_with_fewer_participants_than_clusters_uses_singletons() -> None:
    results = [result(c, [float(c)], 0) for c in (1, 2)]
    out = strategy("equitable", num_clusters=3).aggregate(context([1, 2, 3], (0.0,)), [results])
    assert list(out.weights.values()) == pytest.approx([0.5, 0.5])
    assert sorted(out.clusters.values()) == [0, 1]


def test_equitable_one_group_round_reports_partial_coverage() -> None:
    results = [mnist_result(c, [1.0]) for c in (4, 5, 6, 7)]  # all from group B: k-means still splits them (§1.6)
    out = strategy("equitable").aggregate(context([4, 5, 6, 7], (0.0,), MNIST_GROUPS), [results])
    assert out.metrics["all_groups_present"] == 0.0
    assert sum(out.weights.values()) == pytest.approx(1.0) and out.metrics["clusters_found"] == 2.0


def test_equitable_sends_the_round_to_the_clustering_service() -> None:
    seen: list[clustering_pb2.ClusterRequest] = []

    def spy(request: clustering_pb2.ClusterRequest) -> clustering_pb2.ClusterReply:
        seen.append(request)
        return LocalClusterer()(request)

    results = [mnist_result(c, [1.0]) for c in (0, 5, 6, 7)]
    strategy("equitable").aggregate(context([0, 5, 6, 7], (0.0,), MNIST_GROUPS, cluster=spy), [results])
    (request,) = seen
    assert request.method == clustering_pb2.CLUSTER_METHOD_SPECTRAL and request.num_clusters == 2
    assert list(request.client_ids) == [0, 5, 6, 7] and list(request.true_groups) == [0, 1, 1, 1]
    assert list(request.rows.spec.shape) == [4, 6] and request.seed == cluster_seed(11, 3)
    assert cluster_seed(11, 3) != cluster_seed(11, 4)  # a fresh k-means seed every round


def test_equitable_configure_asks_for_fedprox_and_activations() -> None:
    ctx = context([0, 1])
    plan = strategy("equitable", mu=0.1).configure(ctx, 0, [])
    assert plan is not None and plan.phase == TRAIN and plan.train is not None
    assert plan.train.prox_mu == 0.1 and plan.train.want_activation and plan.train.local_epochs == 5
    assert plan.train.activation_mode == federation_pb2.ACTIVATION_MODE_FINAL_EPOCH_MEAN  # the spec's default
    other = strategy("equitable", activation_mode="eval_pass").configure(ctx, 0, [])
    assert other is not None and other.train is not None
    assert other.train.activation_mode == federation_pb2.ACTIVATION_MODE_EVAL_PASS
    assert not ctx.train_config.want_activation and ctx.train_config.prox_mu == 0.0  # the run's config is untouched
    assert strategy("equitable").configure(ctx, 1, [[]]) is None


def test_equitable_refuses_what_it_cannot_aggregate() -> None:
    eq = strategy("equitable")
    no_activation = [mnist_result(0, [1.0]), result(5, [1.0])]
    with pytest.raises(RuntimeError, match=r"clients \[5\] sent no activation vector"):
        eq.aggregate(context([0, 5], (0.0,)), [no_activation])
    ragged = [mnist_result(0, [1.0]), mnist_result(5, [1.0])]
    ragged[1].activation = ragged[1].activation[:4]
    with pytest.raises(RuntimeError, match="different lengths"):
        eq.aggregate(context([0, 5], (0.0,)), [ragged])
    with pytest.raises(RuntimeError, match="no clustering service"):
        eq.aggregate(context([0, 5], (0.0,), cluster=None), [[mnist_result(0, [1.0]), mnist_result(5, [1.0])]])

    def short_reply(request: clustering_pb2.ClusterRequest) -> clustering_pb2.ClusterReply:
        return clustering_pb2.ClusterReply(labels=[0], sizes=[1], equal_cluster_weights=[1.0])

    def bad_weights(request: clustering_pb2.ClusterRequest) -> clustering_pb2.ClusterReply:
        return clustering_pb2.ClusterReply(labels=[0, 1], sizes=[1, 1], equal_cluster_weights=[0.9, 0.9])

    two = [mnist_result(0, [1.0]), mnist_result(5, [1.0])]
    with pytest.raises(RuntimeError, match="answered 1 labels and 1 weights for 2 clients"):
        eq.aggregate(context([0, 5], (0.0,), cluster=short_reply), [two])
    with pytest.raises(RuntimeError, match="not a distribution"):
        eq.aggregate(context([0, 5], (0.0,), cluster=bad_weights), [two])


def test_local_clusterer_reports_bad_requests() -> None:
    request = clustering_pb2.ClusterRequest(
        run_id="r", round=2, method=clustering_pb2.CLUSTER_METHOD_SPECTRAL, num_clusters=0, client_ids=[1, 2]
    )
    with pytest.raises(ClusteringFailed, match=r"Cluster\(run 'r'\) round 2: give exactly one of rows"):
        LocalClusterer()(request)


# --- Cluster2 and FairFed -------------------------------------------------------------------------------------------


def test_cluster2_averages_over_draws() -> None:
    assert draw_weights([1, 4, 7], [1, 4, 7]) == pytest.approx([1 / 3] * 3)  # 1/m per draw
    assert draw_weights([4, 1, 4, 7], [1, 4, 7]) == pytest.approx([0.25, 0.5, 0.25])  # drawn twice, counted twice
    assert draw_weights([4, 1, 4, 7], [1, 4]) == pytest.approx([1 / 3, 2 / 3])  # 7 dropped out: renormalised
    with pytest.raises(RuntimeError, match=r"clients \[9\] trained but were never drawn"):
        draw_weights([1, 4], [1, 9])
    results = [result(c, u, n=n) for c, u, n in ((1, [3.0], 100), (4, [6.0], 900), (7, [9.0], 10))]
    out = strategy("cluster2").aggregate(context([1, 4, 7], (1.0,)), [results])
    assert out.params.tolist() == pytest.approx([1.0 + 6.0])  # sample counts do not enter: (3 + 6 + 9) / 3
    plan = strategy("cluster2", mu=0.5).configure(context([1]), 0, [])
    assert plan is not None and plan.train is not None and plan.train.prox_mu == 0.5


def test_fairfed_update_rule_by_hand() -> None:
    # Acc_global = (100·0.9 + 300·0.5) / 400 = 0.6; Δ = [0.3, 0.1], mean 0.2; ω − β(Δ − mean) with β = 0.5.
    omega, gaps, acc = fairfed_update(np.array([0.2, 0.3]), np.array([0.9, 0.5]), np.array([100.0, 300.0]), 0.5)
    assert acc == pytest.approx(0.6) and gaps.tolist() == pytest.approx([0.3, 0.1])
    assert omega.tolist() == pytest.approx([0.15, 0.35])
    clipped, _, _ = fairfed_update(np.array([0.01, 0.3]), np.array([0.9, 0.5]), np.array([100.0, 300.0]), 1.0)
    assert clipped.tolist() == pytest.approx([0.0, 0.4])  # lower-bounded at 0 (the Equitable-FL paper's FairFed)


def test_fairfed_strategy_keeps_weights_across_rounds() -> None:
    ff = strategy("fairfed", beta=0.5)
    assert isinstance(ff, FairFed)
    # ω⁰ = N_i / (n · mean N) with n = 4 clients: 100/800 = 0.125 and 300/800 = 0.375.
    first = [result(0, [4.0], n=100, accuracy=90.0), result(1, [8.0], n=300, accuracy=50.0)]
    out = ff.aggregate(context([0, 1], (0.0,), num_clients=4), [first])
    # Δ = [0.3, 0.1] around Acc_global 0.6 → ω = [0.125 − 0.05, 0.375 + 0.05] = [0.075, 0.425]
    assert ff.omega == pytest.approx({0: 0.075, 1: 0.425})
    assert [out.weights[0], out.weights[1]] == pytest.approx([0.15, 0.85])
    assert out.params.tolist() == pytest.approx([0.15 * 4 + 0.85 * 8])
    assert out.metrics["fairfed_global_accuracy"] == pytest.approx(0.6)
    # Round 2: client 0 (ω carried over) deviates again and is clipped to 0; client 2 is new.
    second = [result(0, [1.0], n=100, accuracy=10.0), result(2, [2.0], n=300, accuracy=80.0)]
    out = ff.aggregate(context([0, 2], (0.0,), num_clients=4), [second])
    assert out.weights[0] == 0.0 and out.weights[2] == pytest.approx(1.0)
    assert out.metrics["fairfed_zero_weights"] == 1.0
    state = ff.state_dict()
    restored = strategy("fairfed", beta=0.5)
    restored.load_state_dict(state)
    assert restored.omega == ff.omega


def test_fairfed_falls_back_when_every_weight_is_clipped() -> None:
    ff = strategy("fairfed", beta=1.0)
    ff.omega = {0: 0.0, 1: 0.0}
    results = [result(0, [1.0], n=100, accuracy=50.0), result(1, [5.0], n=300, accuracy=50.0)]
    out = ff.aggregate(context([0, 1], (0.0,)), [results])
    assert [out.weights[0], out.weights[1]] == pytest.approx([0.25, 0.75])  # sample-size weights, not a 0/0
    with pytest.raises(RuntimeError, match=r"clients \[1\] reported no accuracy_before"):
        ff.aggregate(context([0, 1], (0.0,)), [[result(0, [1.0], accuracy=1.0), result(1, [1.0])]])


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("equitable", {"num_clusters": 0}, "strategy.params.num_clusters: must be >= 1"),
        ("equitable", {"mu": -0.1}, "strategy.params.mu: must be >= 0"),
        ("equitable", {"mu": math.inf}, "strategy.params.mu: must be a finite number"),
        ("equitable", {"clusters": 2}, "unknown parameter 'clusters'"),
        ("equitable", {"activation_mode": "mean"}, "strategy.params.activation_mode: 'mean' is not one of"),
        ("fairfed", {"beta": -1.0}, "strategy.params.beta: must be >= 0"),
        ("cluster2", {"mu": -1.0}, "strategy.params.mu: must be >= 0"),
    ],
)
def test_bad_strategy_parameters_name_the_field(name: str, params: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        experiment_from_dict({"strategy": {"name": name, "params": params}})


def test_cluster2_needs_the_clustered_sampler() -> None:
    with pytest.raises(ConfigError, match=r"selection\.method: strategy cluster2 needs clustered_sampling"):
        experiment_from_dict({"strategy": {"name": "cluster2"}, "selection": {"method": "random"}})


# --- the client's side ----------------------------------------------------------------------------------------------


def _runtime(seed: int = 3) -> tuple[ClientRuntime, torch.Tensor]:
    config = experiment_from_dict(
        {
            "seed": seed,
            "data": {"dataset": "synthetic", "num_clients": 3},
            "model": {"name": "mlp", "params": {"hidden": [16, 8]}},
            "selection": {"clients_per_round": 2},
        }
    )
    blobs: dict[str, torch.Tensor] = {}
    runtime = ClientRuntime(config, load_run_data(config), [0], torch.device("cpu"), lambda ref: blobs[ref.sha256])
    params = torch.cat([p.detach().reshape(-1) for p in runtime.model.parameters()]).clone()
    blobs["x0"] = params
    return runtime, params


def _train(
    runtime: ClientRuntime, lr: float, epochs: int, want_activation: bool, batch: int = 8, mode: int = 0
) -> ClientResult:
    task = federation_pb2.Task(task_id="t", run_id="r", round=1, phase=TRAIN, client_id=0, seed=5)
    task.model.sha256 = "x0"
    task.train.local_epochs = epochs
    task.train.batch_size = batch
    task.train.lr = lr
    task.train.want_activation = want_activation
    task.train.activation_mode = mode  # type: ignore[assignment]
    return runtime.run(task)


def test_activation_is_the_mean_log_softmax_of_the_penultimate_layer() -> None:
    runtime, x0 = _runtime()
    c = runtime.clients[0]
    # lr = 0 and one full-data batch per epoch: the model never moves, so the last epoch's mean is the mean over
    # every training sample at x0.
    still = _train(runtime, lr=0.0, epochs=2, want_activation=True, batch=len(c.y_train))
    with torch.no_grad():
        expected = F.log_softmax(runtime.model.features(c.x_train).double(), dim=1).mean(0).numpy()
        accuracy = 100.0 * float((runtime.model(c.x_train).argmax(1) == c.y_train).float().mean())
    assert torch.equal(still.payloads[UPDATE], torch.zeros_like(x0))
    assert still.activation is not None and still.activation.shape == (8,)  # D = the penultimate width
    assert np.allclose(still.activation, expected, atol=1e-6)
    assert (still.activation < 0).all()  # log-softmax over the penultimate units, not the class logits
    assert still.metrics["accuracy_before"] == pytest.approx(accuracy)
    # log_softmax_of_mean: the log-softmax of the mean penultimate output instead.
    of_mean = _train(runtime, 0.0, 2, True, len(c.y_train), federation_pb2.ACTIVATION_MODE_LOG_SOFTMAX_OF_MEAN)
    with torch.no_grad():
        expected_of_mean = F.log_softmax(runtime.model.features(c.x_train).double().mean(0), dim=0).numpy()
    assert of_mean.activation is not None and np.allclose(of_mean.activation, expected_of_mean, atol=1e-6)
    assert not np.allclose(of_mean.activation, expected, atol=1e-3)  # a different reduction, not a relabelling
    with pytest.raises(ValueError, match="unknown activation_mode 7"):
        _train(runtime, 0.0, 1, True, mode=7)


def test_activation_comes_from_training_forwards_and_leaves_training_unchanged() -> None:
    runtime, x0 = _runtime()
    with_activation = _train(runtime, lr=0.5, epochs=3, want_activation=True)
    without = _train(runtime, lr=0.5, epochs=3, want_activation=False)
    assert without.activation is None
    assert torch.equal(with_activation.payloads[UPDATE], without.payloads[UPDATE])  # same training, bit for bit
    # The vector averages the last epoch's forward passes, each at its own (moving) parameters, so it is not the
    # trained model's eval pass: with lr 0.5 the model moves a lot within the last epoch.
    load_flat(runtime.model, x0 + with_activation.payloads[UPDATE])
    with torch.no_grad():
        final = F.log_softmax(runtime.model.features(runtime.clients[0].x_train).double(), dim=1).mean(0).numpy()
    assert with_activation.activation is not None
    assert not np.allclose(with_activation.activation, final, atol=1e-4)
    assert np.isfinite(with_activation.activation).all()
    # eval_pass is exactly that pass of the trained model, after the same training.
    eval_pass = _train(runtime, 0.5, 3, True, mode=federation_pb2.ACTIVATION_MODE_EVAL_PASS)
    assert torch.equal(eval_pass.payloads[UPDATE], without.payloads[UPDATE])
    assert eval_pass.activation is not None and np.allclose(eval_pass.activation, final, atol=1e-9)
