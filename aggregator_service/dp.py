"""Differential privacy on the aggregator side (seed-fedfdp §1.3, §2.4–2.6, §8): one place for what a DP run adds.

- `round_events`: the privacy events a round spends, built from the config before any task leaves the server; the
  privacy gate records them (ledger) and refuses a round that would overspend.
- `DpController`: puts the DP-SGD settings into every TRAIN task (`LocalTrainingConfig.dp`), carries each client's
  adaptive loss clip bound C_l between rounds (Eq. 16: C_l^{i,t} = the client's previous noisy loss, floored at the
  public `loss_clip_min`), so agents stay stateless, and aggregates client-level DP-FedAvg (federation principal).

Record-level events per selected client and round, with K = training.local_steps DP-SGD steps:
  theorem3:      GRADIENT(q, σ, K) + LOSS(q, σ_l, 1)     gradient and loss on independent Poisson batches (§2.6 a)
  gradient_only: GRADIENT(q, σ, K)                       the paper's parity accounting (the loss is still released)
  joint_batch:   JOINT(q, σ_eff, 1) + GRADIENT(q, σ, K−1) the loss on the last gradient batch (§2.6 b),
                 σ_eff = (σ⁻² + σ_l⁻²)^(−1/2)
Client-level (principal federation): MODEL(m/n, σ, 1) for the principal "federation", with m clients drawn uniformly
from the n live candidates of the round (not the configured population: when agents drop, each remaining client is
more likely to be drawn, and the accountant must see that larger q).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from fairfl import accounting as accountant
from fairfl.config import ConfigError, ExperimentConfig
from fairfl.privacy import Budget, Event, check_randomness, dp_seed
from fairfl.protocol import TRAIN, UPDATE, ClientResult
from fairfl.strategy import AggregateOutcome, RoundContext, train_results
from fairfl.v1 import federation_pb2

log = logging.getLogger(__name__)

FEDERATION = "federation"
_NORMALIZERS = {
    "expected": federation_pb2.GRAD_NORMALIZER_EXPECTED,
    "realized": federation_pb2.GRAD_NORMALIZER_REALIZED,
    "fixed": federation_pb2.GRAD_NORMALIZER_FIXED,
}


def effective_noise_multiplier(sigma: float, sigma_l: float) -> float:
    """σ_eff of one Gaussian releasing the gradient sum and the loss sum of the same batch (spec §2.6 b)."""
    return (sigma**-2 + sigma_l**-2) ** -0.5


def client_level_sample_rate(selected: int, population: int) -> float:
    """Each live candidate's chance of being drawn: `selected` of `population` uniformly without replacement."""
    if population < 1 or not 0 < selected <= population:
        raise ValueError(f"cannot sample {selected} of {population} candidates")
    return selected / population


def principal_events(config: ExperimentConfig, principal: str, population: int | None = None) -> list[Event]:
    """One principal's events for one round (see the module docstring). `population` is the number of live candidates
    the round's clients were drawn from (client-level DP only; None = all configured clients)."""
    p = config.privacy
    if p.principal == "federation":
        n = config.data.num_clients if population is None else population
        q = client_level_sample_rate(min(config.selection.clients_per_round, n), n)
        return [Event(FEDERATION, "model", q, p.noise_multiplier, 1)]
    steps = config.training.budget()[1]
    q, sigma, sigma_l = p.sample_rate, p.noise_multiplier, p.loss_noise_multiplier
    if p.mode == "joint_batch":
        events = [Event(principal, "joint", q, effective_noise_multiplier(sigma, sigma_l), 1)]
        if steps > 1:
            events.append(Event(principal, "gradient", q, sigma, steps - 1))
        return events
    events = [Event(principal, "gradient", q, sigma, steps)]
    if p.mode == "theorem3" and sigma_l > 0:
        events.append(Event(principal, "loss", q, sigma_l, 1))
    return events


def round_events(config: ExperimentConfig, selected: Sequence[int], population: int) -> list[Event]:
    """The events a round spends: none for a non-private run; per selected client (record-level) or one for the
    federation (client-level, q = selected / population, the live candidates drawn from). Planned before dispatch, so
    a crash can over-count a round but never under-count."""
    if not config.privacy.enabled:
        return []
    if config.privacy.principal == "federation":
        q = client_level_sample_rate(len(selected), population)
        return [Event(FEDERATION, "model", q, config.privacy.noise_multiplier, 1)]
    return [e for cid in sorted(selected) for e in principal_events(config, str(cid))]


def run_budget(run_id: str, config: ExperimentConfig) -> Budget:
    """The ledger budget of a run; a non-private run is registered with principal kind 'none' (audit only)."""
    p = config.privacy
    if not p.enabled:
        return Budget(run_id=run_id, epsilon=0.0, delta=0.0, accountant="rdp", principal_kind="none")
    orders = tuple(p.orders) if p.orders else None
    return Budget(run_id, p.epsilon, p.delta, p.accountant, p.principal, orders)


def check_accountable(config: ExperimentConfig) -> None:
    """Refuse, before round 1, a DP run whose rounds the ledger would refuse as unaccountable (ConfigError naming
    the fields): the accountant's sound range (the config's own check, repeated for configs built without loading),
    then one principal's round through the accountant and its RDP/PLD cross-check, which refuse an ε of 0 (a round
    below what they resolve) or a disagreement. Both transports' ledgers apply the same checks to every round."""
    p = config.privacy
    p.validate("privacy")
    specs = [accountant.EventSpec(e.sample_rate, e.noise_multiplier, e.count) for e in principal_events(config, "0")]
    orders = tuple(p.orders) if p.orders else None
    try:
        accountant.epsilon(specs, p.delta, p.accountant, orders)
        accountant.cross_check(specs, p.delta, orders if p.accountant == "rdp" else None)
    except ValueError as err:
        fields = (
            "privacy.noise_multiplier, selection.clients_per_round"
            if p.principal == "federation"
            else "privacy.noise_multiplier, privacy.sample_rate, privacy.loss_noise_multiplier, training.local_steps"
        )
        raise ConfigError(f"{fields}: the privacy ledger cannot account one round of this run: {err}") from err


def affordable_rounds(config: ExperimentConfig) -> int:
    """Rounds the budget allows a principal that takes part in every round (exact under full participation; the
    ledger, not this estimate, enforces the budget)."""
    p = config.privacy
    specs = [accountant.EventSpec(e.sample_rate, e.noise_multiplier, e.count) for e in principal_events(config, "0")]
    return accountant.max_rounds(specs, [], p.epsilon, p.delta, p.accountant, p.orders or None, limit=10**7)


class DpController:
    """Aggregator-side DP state of one run (only for runs with privacy.enabled)."""

    def __init__(self, config: ExperimentConfig, randomness: str = "task") -> None:
        if not config.privacy.enabled:
            raise ValueError("DpController needs privacy.enabled")
        self.config = config
        self.randomness = check_randomness(randomness)
        self.p = config.privacy
        self.client_level = self.p.principal == "federation"
        self.loss_clip: dict[int, float] = {}  # C_l^{i,t} per client; absent = loss_clip_init
        self.floor_hits = 0
        self.budget_rounds = affordable_rounds(config)
        log.info(
            "privacy: ε=%g δ=%g %s accountant, %s, principal %s; the budget allows %d rounds per principal taking "
            "part in every round (configured: %d)",
            self.p.epsilon,
            self.p.delta,
            self.p.accountant,
            self.p.mode,
            self.p.principal,
            self.budget_rounds,
            config.rounds,
        )
        if self.p.mode == "gradient_only" and not self.client_level:
            log.info(
                "gradient_only is the paper's parity accounting (the noisy loss is released but not accounted); "
                "its code's bisection gives T = %d DP-SGD steps for these settings",
                accountant.paper_parity_max_rounds(
                    self.p.sample_rate, self.p.noise_multiplier, self.p.epsilon, self.p.delta
                ),
            )

    @property
    def last_round(self) -> int:
        """The last round the run can complete if every principal spends every round (evaluated like the last)."""
        return min(self.config.rounds, self.budget_rounds)

    # -- tasks ------------------------------------------------------------------------------------------------------

    def configure(self, cfg: federation_pb2.LocalTrainingConfig) -> None:
        """The round's DP-SGD settings, shared by every TRAIN task (record-level DP only)."""
        if self.client_level:
            return
        p = self.p
        cfg.dp.CopyFrom(
            federation_pb2.DpSgd(
                sample_rate=p.sample_rate,
                noise_multiplier=p.noise_multiplier,
                clip_norm=p.clip_norm,
                loss_noise_multiplier=p.loss_noise_multiplier,
                loss_clip=p.loss_clip_init,
                loss_clip_min=p.loss_clip_min,
                grad_normalizer=_NORMALIZERS[p.grad_normalizer],  # type: ignore[arg-type]
                fixed_batch=p.fixed_batch,
                shared_loss_batch=p.mode == "joint_batch",
                plaintext_telemetry=p.plaintext_telemetry,
            )
        )

    def fill(self, task: federation_pb2.Task) -> None:
        """Per-client part of a TRAIN task: this client's loss clip bound C_l^{i,t}."""
        if task.WhichOneof("config") == "train" and task.train.HasField("dp"):
            task.train.dp.loss_clip = self.loss_clip.get(task.client_id, self.p.loss_clip_init)

    def observe(self, results: Sequence[ClientResult]) -> None:
        """Eq. 16: the next round's C_l is the client's noisy loss (post-processing), floored at loss_clip_min."""
        if self.client_level or self.p.loss_noise_multiplier == 0:
            return
        for r in results:
            if r.phase != TRAIN or not math.isfinite(r.noisy_loss):
                continue
            if r.noisy_loss < self.p.loss_clip_min:
                self.floor_hits += 1
                log.info(
                    "client %d: noisy loss %.4g below loss_clip_min; C_l floored at %g",
                    r.client_id,
                    r.noisy_loss,
                    self.p.loss_clip_min,
                )
            self.loss_clip[r.client_id] = max(self.p.loss_clip_min, float(r.noisy_loss))

    # -- client-level DP-FedAvg ---------------------------------------------------------------------------------------

    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        """DP-FedAvg with client-level DP (McMahan et al. 2018, trusted aggregator): every update clipped to norm C,
        averaged with the fixed denominator m = clients selected, plus N(0, (σC/m)²) per coordinate. Sensitivity of
        the average to one client is C/m whatever the others send, and missing results only lower it."""
        results = train_results(phases)
        m = len(ctx.selected)
        clip = self.p.clip_norm
        total = torch.zeros_like(ctx.params, dtype=torch.float32)
        for r in results:
            update = r.payloads[UPDATE]
            norm = float(torch.linalg.vector_norm(update.double()))
            total.add_(update, alpha=min(1.0, clip / (norm + 1e-12)))
        gen = torch.Generator().manual_seed(dp_seed(self.randomness, self.config.seed, ctx.round, 0x44504641))
        noise = torch.normal(0.0, self.p.noise_multiplier * clip, ctx.params.shape, generator=gen)
        mean = (total + noise) / m
        # No data-dependent metric (e.g. how many updates were clipped) is reported: only the noisy model leaves.
        return AggregateOutcome(
            params=ctx.params + self.config.strategy.server_lr * mean,
            weights={r.client_id: 1.0 / m for r in results},
        )

    # -- checkpoints --------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"loss_clip": dict(self.loss_clip)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_clip = {int(k): float(v) for k, v in state.get("loss_clip", {}).items()}
