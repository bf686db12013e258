"""The strategy interface (public API): a strategy plans each round's phases and turns the clients' results into a new
model.

The round engine owns selection, transport, deadlines, privacy and evaluation; a strategy owns only the algorithm,
so FedAvg, FedEBA+ (two phases per round) and the fairness baselines plug into the same loop and the same
transports. Strategy state (momentum buffers, dual variables) is exposed through state_dict for checkpoints.

A strategy is found through `STRATEGIES` by the config's `strategy.name`: a registered name, an entry point of group
`fairfl.strategies` (FairFL's own built-ins are entry points of the `fairfl` distribution, exactly like a third
party's), or `package.module:attr`. What it needs from a run is declared on the class (`privacy_principals`,
`needs_loss_release_under_dp`, `required_selection`, `client_procedure`, `validate_run`, ...) and checked when the
config is loaded, so no list of strategy names is kept anywhere else.
"""

from __future__ import annotations

import dataclasses
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from fairfl.fold import ResultFold
from fairfl.plugins import NoParams, PluginError, Registry, parse_params
from fairfl.procedure import PROCEDURES, LocalProcedure, attach_procedure
from fairfl.protocol import TRAIN, ClientResult
from fairfl.schema import ConfigError
from fairfl.v1 import clustering_pb2, federation_pb2, tensor_pb2

if TYPE_CHECKING:
    from fairfl.config import ExperimentConfig

__all__ = [
    "STRATEGIES",
    "AggregateOutcome",
    "NoParams",
    "PhasePlan",
    "RoundContext",
    "Strategy",
    "build_strategy",
    "check_run",
    "load_strategy",
    "measures_client_losses",
    "phase_folds",
    "register_strategy",
    "train_phase",
    "train_results",
    "validate_strategy",
    "weighted_sum",
]


@dataclass
class RoundContext:
    run_id: str
    round: int
    params: torch.Tensor  # global model x_t, flat float32
    selected: list[int]
    train_config: federation_pb2.LocalTrainingConfig  # the run's local config for this round (lr decay applied)
    publish: Callable[[torch.Tensor], tensor_pb2.BlobRef]  # make a flat tensor fetchable by clients
    seed: int = 0  # the run seed; strategies derive their own randomness from it and the round
    num_clients: int = 0  # the run's data.num_clients (0 = unknown)
    true_groups: dict[int, int] | None = None  # ground-truth group per client id (grouped partitions), else None
    # The clustering service's Cluster call (gRPC, or the same code in-process); None when the engine has none.
    cluster: Callable[[clustering_pb2.ClusterRequest], clustering_pb2.ClusterReply] | None = None
    # Streaming aggregation: the folds the engine fed each phase's results into as they arrived (by phase index); a
    # phase without an entry kept its results whole (see Strategy.folds and phase_folds).
    folds: dict[int, list[ResultFold]] = field(default_factory=dict)


@dataclass
class PhasePlan:
    """One exchange with the selected clients."""

    phase: int  # PHASE_TRAIN or PHASE_PROBE
    train: federation_pb2.LocalTrainingConfig | None = None
    probe: federation_pb2.ProbeConfig | None = None
    clients: list[int] | None = None  # default: the round's selected clients


@dataclass
class AggregateOutcome:
    params: torch.Tensor
    weights: dict[int, float] = field(default_factory=dict)  # aggregation weight per client
    metrics: dict[str, float] = field(default_factory=dict)
    clusters: dict[int, int] = field(default_factory=dict)  # found cluster per client, when the strategy clusters


def measures_client_losses(strategy: Strategy | type[Strategy], loss_telemetry: bool) -> bool:
    """Whether non-DP TRAIN tasks measure F_i before and after training: the strategy reads them, or
    training.loss_telemetry asks for them anyway."""
    return strategy.reads_client_losses or loss_telemetry


class Strategy(ABC):
    """Subclass it, declare `Params` (a dataclass whose fields all have defaults) and the capabilities below, and
    implement `aggregate`; override `configure` for more than one exchange per round or other local settings."""

    name: ClassVar[str] = ""  # a display name (logs, reports); the config names the strategy as it was registered
    Params: ClassVar[type] = NoParams
    # Whether aggregate() reads the clients' F_i (loss_before, loss_after, accuracy_before). If not, agents skip the two
    # forward passes that measure them unless training.loss_telemetry asks for them. Ψ telemetry is the engine's: it is
    # reported for every strategy whose clients measured F_i (fairfl.metrics.fairness.psi_telemetry).
    reads_client_losses: ClassVar[bool] = True
    # The privacy.principal values this strategy has a DP procedure for: "client" (record-level DP-SGD on every
    # client, the engine adds it to each TRAIN task) and/or "federation" (client-level DP-FedAvg: the engine clips,
    # averages and noises the updates itself, so only a plain weighted average may claim it). Empty: not under DP.
    privacy_principals: ClassVar[frozenset[str]] = frozenset()
    # Under record-level DP, whether aggregate() needs the clients' losses, which then must be released with noise.
    needs_loss_release_under_dp: ClassVar[bool] = False
    # A selection.method the strategy only makes sense with (e.g. a sampling-based algorithm), else None.
    required_selection: ClassVar[str | None] = None
    # Client-side signatures the strategy asks for beyond the update: "activation" (penultimate-layer activations,
    # LocalTrainingConfig.want_activation), so the model must expose its head (fairfl.models).
    client_signatures: ClassVar[frozenset[str]] = frozenset()
    # The most exchanges (phases) one round may have; the engine refuses a plan beyond it.
    max_phases: ClassVar[int] = 1
    # A client-side piece of the local-training loop (fairfl.procedure.LocalProcedure, or its registered name /
    # package.module:attr) put on every TRAIN task the default `configure` plans, with `procedure_params(ctx)`.
    client_procedure: ClassVar[type[LocalProcedure] | str | None] = None

    def __init__(self, params: Any, server_lr: float) -> None:
        self.params = params
        self.server_lr = server_lr

    @classmethod
    def validate_run(cls, cfg: ExperimentConfig, params: Any) -> None:
        """Rules across config sections beyond the declared capabilities (ConfigError naming the field to change);
        `params` are this run's parsed Params. Runs when the config is loaded, before round 1."""
        del cfg, params

    def procedure_params(self, ctx: RoundContext) -> Any:
        """The parameters of `client_procedure` for this round (its Params, a mapping, or None for the defaults)."""
        del ctx
        return None

    def with_procedure(
        self, ctx: RoundContext, cfg: federation_pb2.LocalTrainingConfig
    ) -> federation_pb2.LocalTrainingConfig:
        """`cfg` with `client_procedure` attached (a copy; `cfg` itself when the strategy declares none). Strategies
        that override `configure` call it on their TRAIN configs to keep the procedure."""
        if self.client_procedure is None:
            return cfg
        out = federation_pb2.LocalTrainingConfig()
        out.CopyFrom(cfg)
        attach_procedure(out, self.client_procedure, self.procedure_params(ctx), field="strategy.client_procedure")
        return out

    def configure(self, ctx: RoundContext, phase_index: int, prior: Sequence[list[ClientResult]]) -> PhasePlan | None:
        """The plan of phase `phase_index`, given the results of earlier phases; None ends the round's exchanges."""
        if phase_index == 0:
            return PhasePlan(phase=TRAIN, train=self.with_procedure(ctx, ctx.train_config))
        return None

    def folds(self, ctx: RoundContext, phase_index: int, plan: PhasePlan) -> list[ResultFold]:
        """Folds that take phase `phase_index`'s results as they arrive, so the aggregator holds one accumulator
        instead of every client's tensors (streaming aggregation, fairfl/fold.py). [] (the
        default) keeps the results whole for `aggregate`: strategies whose weights need every update at once."""
        del ctx, phase_index, plan
        return []

    @abstractmethod
    def aggregate(self, ctx: RoundContext, phases: Sequence[list[ClientResult]]) -> AggregateOutcome:
        """New global parameters from the results of every phase (each list sorted by client id)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


def weighted_sum(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Σ w_i v_i folded one vector at a time: memory independent of the client count, and the result does not depend
    on BLAS threading, so every process computes bit-identical aggregates."""
    out = torch.zeros_like(vectors[0], dtype=torch.float32)
    for vector, weight in zip(vectors, weights, strict=True):
        out.add_(vector, alpha=float(weight))
    return out


def train_phase(phases: Sequence[list[ClientResult]]) -> int:
    """Index of the last training phase (-1 if none)."""
    for index in range(len(phases) - 1, -1, -1):
        if phases[index] and phases[index][0].phase == TRAIN:
            return index
    return -1


def train_results(phases: Sequence[list[ClientResult]]) -> list[ClientResult]:
    """The results of the last training phase (their UPDATE may have been folded away already: see phase_folds)."""
    index = train_phase(phases)
    return list(phases[index]) if index >= 0 else []


def phase_folds(
    ctx: RoundContext, phases: Sequence[list[ClientResult]], index: int, make: Callable[[], list[ResultFold]]
) -> list[ResultFold]:
    """The folds of phase `index`: those the engine streamed its results into, or `make()` filled now from the kept
    results. The sums are order-independent, so both give the same bits."""
    folds = ctx.folds.get(index)
    if folds is None:
        folds = make()
        for fold in folds:
            fold.fill(phases[index])
    return folds


def _check(obj: Any) -> str | None:
    if not isinstance(obj, type) or not issubclass(obj, Strategy):
        return f"expected a subclass of fairfl.strategy.Strategy, got {obj!r}"
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        return f"{obj.__qualname__} is abstract (implement {missing})"
    if not dataclasses.is_dataclass(obj.Params):
        return f"its Params {obj.Params!r} is not a dataclass"
    if not obj.privacy_principals <= {"client", "federation"}:
        return f"privacy_principals {sorted(obj.privacy_principals)} may hold only 'client' and 'federation'"
    if obj.max_phases < 1:
        return f"max_phases must be >= 1, got {obj.max_phases}"
    procedure = obj.client_procedure
    if not (procedure is None or isinstance(procedure, str) or _is_procedure(procedure)):
        return f"its client_procedure {procedure!r} is not a subclass of fairfl.procedure.LocalProcedure"
    return None


def _is_procedure(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, LocalProcedure)


STRATEGIES: Registry[type[Strategy]] = Registry("strategy", "fairfl.strategies", _check)


def register_strategy(name: str, strategy: type[Strategy]) -> type[Strategy]:
    """Make `strategy` known as `name` in this process (a `module:attr` reference works in every process)."""
    return STRATEGIES.register(name, strategy)


def load_strategy(ref: str, field: str = "strategy.name") -> type[Strategy]:
    """The strategy class `ref` names (a registered name, an entry point or `package.module:attr`)."""
    return STRATEGIES.load(ref, field)


def validate_strategy(name: str, params: dict[str, Any] | None, path: str = "strategy") -> Any:
    """The strategy's parsed Params from config, naming `path.name` or `path.params.<key>` when refused."""
    return parse_params(load_strategy(name, f"{path}.name").Params, params or {}, f"{path}.params")


def build_strategy(name: str, params: dict[str, Any] | None, server_lr: float) -> Strategy:
    return load_strategy(name)(validate_strategy(name, params, "strategy"), server_lr)


def strategies_supporting(principal: str) -> list[str]:
    """Names of the installed strategies with a DP procedure for `principal` (for error messages)."""
    out = []
    for name in STRATEGIES.names():
        try:
            cls = STRATEGIES.load(name, "strategy.name")
        except PluginError:
            continue
        if principal in cls.privacy_principals:
            out.append(name)
    return out


def check_run(cfg: ExperimentConfig) -> None:
    """Whether the configured strategy can run this config: its declared capabilities against the other sections,
    then its own `validate_run`. ConfigError naming the field to change."""
    name = cfg.strategy.name
    cls = load_strategy(name)
    params = validate_strategy(name, cfg.strategy.params)
    if isinstance(cls.client_procedure, str):  # a procedure by name: it must resolve before round 1
        PROCEDURES.load(cls.client_procedure, "strategy.name")
    required = cls.required_selection
    if required is not None and not _same_selection(cfg.selection.method, required):
        raise ConfigError(
            f"selection.method: strategy {name} needs {required} (declared required_selection), "
            f"got {cfg.selection.method!r}"
        )
    if cfg.privacy.enabled:
        principal = cfg.privacy.principal
        if principal not in cls.privacy_principals:
            supporting = ", ".join(strategies_supporting(principal)) or "none installed"
            what = (
                "no DP procedure"
                if not cls.privacy_principals
                else f"no DP procedure for privacy.principal {principal} ({_PRINCIPALS[principal]})"
            )
            raise ConfigError(
                f"strategy.name: {name!r} has {what} (its privacy_principals: "
                f"{', '.join(sorted(cls.privacy_principals)) or 'none'}); with privacy.enabled and privacy.principal "
                f"{principal} use one of {supporting}"
            )
        if principal == "client" and cls.client_procedure is not None:
            raise ConfigError(
                f"strategy.name: {name!r} puts a client procedure on its tasks, which DP-SGD tasks refuse "
                "(privacy.principal client)"
            )
        if principal == "client" and cls.needs_loss_release_under_dp and cfg.privacy.loss_noise_multiplier == 0:
            raise ConfigError(
                f"privacy.loss_noise_multiplier: strategy {name} uses the clients' losses, so they must be released "
                "with noise (σ_l > 0)"
            )
    cls.validate_run(cfg, params)


_PRINCIPALS = {"client": "record-level DP-SGD", "federation": "client-level DP-FedAvg"}


def _same_selection(method: str, required: str) -> bool:
    """Whether selection.method names the required sampler (directly, or as another name of the same sampler)."""
    if method == required:
        return True
    from fairfl.sampling import SAMPLERS  # the samplers' registry resolves aliases (e.g. clustered)

    try:
        return SAMPLERS.load(method, "selection.method") is SAMPLERS.load(required, "selection.method")
    except PluginError:
        return False
