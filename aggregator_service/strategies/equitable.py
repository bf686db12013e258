"""Equitable-FL (seed-equitable.md, Algorithm 1): FedProx local training; every participant also sends its activation
vector a_i (mean log-softmax of the penultimate layer over its last local epoch, client_agent/trainer.py). The server
clusters this round's participants by S = A·Aᵀ (linear kernel) into C clusters (top-C eigenvectors of S + k-means,
done by the clustering service's Cluster call) and aggregates with eq. 6: p_i = 1 / (C_present · |cluster of i|),
so every cluster found this round gets the same total weight whatever its size or sample count.

C is fixed (Remark 3: the number of planted groups, 2 for the paper's MNIST/CIFAR-10). Clustering runs every round on
the round's participants only, with no memory. Fewer participants than C (a round closed on min_completion) clusters
into as many clusters as there are participants (all singletons, uniform weights; spec §1.7), with a warning.
Where the partition plants groups (data.group_sizes), the round's NMI of found clusters against them is reported.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aggregator_service.strategies.fedfair import require_finite
from fairfl import codec
from fairfl.metrics.fairness import weight_entropy_metrics
from fairfl.privacy import dp_seed
from fairfl.protocol import TRAIN, UPDATE, ClientResult
from fairfl.strategy import (
    AggregateOutcome,
    PhasePlan,
    RoundContext,
    Strategy,
    train_results,
    weighted_sum,
)
from fairfl.v1 import clustering_pb2, federation_pb2

log = logging.getLogger(__name__)

ACTIVATION_MODES = {
    "final_epoch_mean": federation_pb2.ACTIVATION_MODE_FINAL_EPOCH_MEAN,
    "eval_pass": federation_pb2.ACTIVATION_MODE_EVAL_PASS,
    "log_softmax_of_mean": federation_pb2.ACTIVATION_MODE_LOG_SOFTMAX_OF_MEAN,
}
_CLUSTER_SEED = 0x45_51  # keeps the k-means seed stream apart from the task seeds derived from the same run seed


@dataclass
class EquitableParams:
    num_clusters: int = 2  # C, fixed: the number of planted groups (paper: 2 MNIST/CIFAR-10, 3 CIFAR-100, 5 FEMNIST)
    # FedProx μ (eq. 4). The paper tunes it over {0.001, 0.01, 0.1, 1} and does not report the choice; spec §1.11
    # takes 0.01, inside Theorem 1's μ < 1.
    mu: float = 0.01
    # How each client reduces its penultimate activations to one vector (the paper leaves it open; spec §1.4):
    # final_epoch_mean (default), eval_pass or log_softmax_of_mean, see federation.proto ActivationMode.
    activation_mode: str = "final_epoch_mean"

    def validate(self, path: str) -> None:
        from fairfl.schema import ConfigError

        if self.num_clusters < 1:
            raise ConfigError(f"{path}.num_clusters: must be >= 1, got {self.num_clusters}")
        if self.activation_mode not in ACTIVATION_MODES:
            raise ConfigError(
                f"{path}.activation_mode: {self.activation_mode!r} is not one of {', '.join(ACTIVATION_MODES)}"
            )
        require_finite(path, mu=self.mu)
        if self.mu < 0:
            raise ConfigError(f"{path}.mu: must be >= 0, got {self.mu}")


def fedprox_plan(ctx: RoundContext, mu: float) -> PhasePlan:
    """One FedProx training phase with μ set by the strategy (overriding training.prox_mu)."""
    cfg = federation_pb2.LocalTrainingConfig()
    cfg.CopyFrom(ctx.train_config)
    cfg.prox_mu = mu
    return PhasePlan(phase=TRAIN, train=cfg)


def cluster_seed(run_seed: int, round_number: int) -> int:
    """The k-means seed of one round: the same in every transport and process."""
    return dp_seed("task", run_seed, round_number, _CLUSTER_SEED)


def activation_rows(results: Sequence[ClientResult]) -> np.ndarray:
    """The round's activation matrix A [r, D], rows in client-id order; a missing or ragged vector is an error."""
    missing = [r.client_id for r in results if r.activation is None]
    if missing:
        raise RuntimeError(f"equitable: clients {missing} sent no activation vector (want_activation was set)")
    dims = {len(r.activation) for r in results}  # type: ignore[arg-type]
    if len(dims) != 1:
        raise RuntimeError(f"equitable: activation vectors of different lengths {sorted(dims)} in one round")
    return np.stack([np.asarray(r.activation, dtype=np.float64) for r in results])


def check_reply(reply: clustering_pb2.ClusterReply, n: int) -> None:
    """A reply the weights can be trusted from: one label and one weight per client, weights a distribution."""
    if len(reply.labels) != n or len(reply.equal_cluster_weights) != n:
        raise RuntimeError(
            f"equitable: the clustering service answered {len(reply.labels)} labels and "
            f"{len(reply.equal_cluster_weights)} weights for {n} clients"
        )
    weights = np.asarray(reply.equal_cluster_weights, dtype=np.float64)
    if not np.isfinite(weights).all() or (weights <= 0).any() or not math.isclose(weights.sum(), 1.0, rel_tol=1e-9):
        raise RuntimeError(f"equitable: the clustering service's weights {weights.tolist()} are not a distribution")


class Equitable(Strategy):
    name = "equitable"
    client_signatures = frozenset({"activation"})  # clusters clients by their penultimate-layer activations
    reads_client_losses = False  # F_i feed only the engine's Ψ telemetry (training.loss_telemetry)
    Params = EquitableParams

    def configure(self, ctx: RoundContext, phase_index: int, prior: Sequence[list[ClientResult]]) -> PhasePlan | None:
        if phase_index > 0:
            return None
        plan = fedprox_plan(ctx, self.params.mu)
        assert plan.train is not None
        plan.train.want_activation = True
        plan.train.activation_mode = ACTIVATION_MODES[self.params.activation_mode]  # type: ignore[assignment]
        return plan

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        results = train_results(phases)
        if ctx.cluster is None:
            raise RuntimeError("equitable: the engine has no clustering service to call")
        ids = [r.client_id for r in results]
        rows = activation_rows(results)
        clusters = min(self.params.num_clusters, len(results))
        if clusters < self.params.num_clusters:
            log.warning(
                "round %d: %d participants for C = %d clusters; clustering into %d (uniform weights)",
                ctx.round,
                len(results),
                self.params.num_clusters,
                clusters,
            )
        request = clustering_pb2.ClusterRequest(
            run_id=ctx.run_id,
            round=ctx.round,
            method=clustering_pb2.CLUSTER_METHOD_SPECTRAL,
            num_clusters=clusters,
            client_ids=ids,
            rows=codec.tensor_to_proto("activations", rows),
            seed=cluster_seed(ctx.seed, ctx.round),
        )
        if ctx.true_groups is not None:
            request.true_groups.extend(ctx.true_groups[c] for c in ids)
        reply = ctx.cluster(request)
        check_reply(reply, len(ids))
        weights = list(reply.equal_cluster_weights)
        delta = weighted_sum([r.payloads[UPDATE] for r in results], weights)
        metrics = weight_entropy_metrics(weights)
        metrics["clusters_found"] = float(len(reply.sizes))
        if ctx.true_groups is not None:
            metrics["nmi"] = reply.nmi
            present = {ctx.true_groups[c] for c in ids}
            metrics["all_groups_present"] = float(len(present) == len(set(ctx.true_groups.values())))
        return AggregateOutcome(
            params=ctx.params + self.server_lr * delta,
            weights=dict(zip(ids, weights, strict=True)),
            metrics=metrics,
            clusters={c: int(label) for c, label in zip(ids, reply.labels, strict=True)},
        )
