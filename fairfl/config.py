"""Experiment configuration: typed dataclasses loaded from YAML and validated at load.

Errors name the bad field by its dotted path (e.g. `training.batch_size: must be >= 1, got 0`), and unknown keys
are refused with the list of valid ones, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import yaml

from fairfl.plugins import parse_params
from fairfl.privacy import (
    COUNT_MAX,
    DELTA_RANGE,
    EPSILON_RANGE,
    NOISE_MULTIPLIER_RANGE,
    ORDER_MAX,
    ORDERS_MAX,
    SAMPLE_RATE_RANGE,
    out_of_sound_range,
)
from fairfl.schema import ConfigError, _at_least, _build, _join, _positive

if TYPE_CHECKING:
    from fairfl.sampling import Sampler

DEFAULT_LOCAL_STEPS = 10


@dataclass
class DataConfig:
    # Keys of the config schema before dataset plug-ins declared their own parameters (issue #19).
    MOVED_FIELDS: ClassVar[dict[str, str]] = {
        "synthetic_alpha": "data.params.alpha (of dataset synthetic)",
        "synthetic_beta": "data.params.beta (of dataset synthetic)",
    }
    # A dataset plug-in (fairfl.data.plugin): a registered name (FairFL's built-ins are entry points of group
    # fairfl.datasets: fashion_mnist, mnist, cifar10, synthetic) or package.module:attr.
    dataset: str = "fashion_mnist"
    params: dict[str, Any] = field(default_factory=dict)  # the dataset's declared Params (synthetic: alpha, beta)
    root: str | None = None
    download: bool = False
    num_clients: int = 100
    partition: Literal["iid", "shards", "dirichlet", "label_groups", "dirichlet_groups"] = "shards"
    shards_per_client: int = 2
    alpha: float = 0.5
    min_size: int = 10
    test_per_client: int | None = None
    # Client test splits: each follows its client's train label mix (follow_train), or `iid`: disjoint random slices
    # of the official test set, so the mean client accuracy is the global model's test accuracy (HiCS-FL's metric)
    # rather than an average over class-skewed splits.
    test_split: Literal["follow_train", "iid"] = "follow_train"
    # Grouped partitions (fairfl.data.groups): clients per ground-truth group, contiguous ids, group 0 first.
    group_sizes: list[int] = field(default_factory=list)
    # label_groups (Equitable-FL): classes per group, disjoint and in class-index order, and each client's samples of
    # each of its group's classes (None = the class split equally among the group's clients).
    group_classes: list[int] = field(default_factory=list)
    samples_per_class: int | None = None
    # dirichlet_groups (HiCS-FL's mixed α): the Dirichlet α of each group's label skew.
    group_alphas: list[float] = field(default_factory=list)

    def validate(self, path: str) -> None:
        from fairfl.data.groups import GROUPED_PARTITIONS
        from fairfl.data.plugin import dataset_signature_of
        from fairfl.data.run import run_dataset

        plugin, params = run_dataset(self, path)  # not importable, wrong type or bad params: named here
        signature = dataset_signature_of(plugin, params, f"{path}.dataset")
        _at_least(self.num_clients, 1, f"{path}.num_clients")
        for i, size in enumerate(self.group_sizes):
            _at_least(size, 1, f"{path}.group_sizes[{i}]")
        if self.partition in GROUPED_PARTITIONS:
            if plugin.partitions_itself:
                raise ConfigError(
                    f"{path}.partition: {self.partition} does not apply to {self.dataset} (it builds its clients' data "
                    "itself)"
                )
            if sum(self.group_sizes) != self.num_clients:
                raise ConfigError(
                    f"{path}.group_sizes: {self.group_sizes} hold {sum(self.group_sizes)} clients, "
                    f"num_clients is {self.num_clients}"
                )
        elif self.group_sizes:
            raise ConfigError(
                f"{path}.group_sizes: only for grouped partitions ({', '.join(GROUPED_PARTITIONS)}), "
                f"not {self.partition!r}"
            )
        if self.partition == "label_groups":
            if len(self.group_classes) != len(self.group_sizes):
                raise ConfigError(
                    f"{path}.group_classes: one class count per group, got {len(self.group_classes)} for "
                    f"{len(self.group_sizes)} groups"
                )
            for i, count in enumerate(self.group_classes):
                _at_least(count, 1, f"{path}.group_classes[{i}]")
            if sum(self.group_classes) > signature.num_classes:
                raise ConfigError(
                    f"{path}.group_classes: {self.group_classes} need {sum(self.group_classes)} classes, "
                    f"{self.dataset} has {signature.num_classes}"
                )
            if self.samples_per_class is not None:
                _at_least(self.samples_per_class, 1, f"{path}.samples_per_class")
        else:
            if self.group_classes:
                raise ConfigError(f"{path}.group_classes: applies to partition label_groups only")
            if self.samples_per_class is not None:
                raise ConfigError(f"{path}.samples_per_class: applies to partition label_groups only")
        if self.partition == "dirichlet_groups":
            if len(self.group_alphas) != len(self.group_sizes):
                raise ConfigError(
                    f"{path}.group_alphas: one α per group, got {len(self.group_alphas)} for "
                    f"{len(self.group_sizes)} groups"
                )
            for i, a in enumerate(self.group_alphas):
                _positive(a, f"{path}.group_alphas[{i}]")
        elif self.group_alphas:
            raise ConfigError(f"{path}.group_alphas: applies to partition dirichlet_groups only")
        _at_least(self.shards_per_client, 1, f"{path}.shards_per_client")
        _positive(self.alpha, f"{path}.alpha")
        _at_least(self.min_size, 0, f"{path}.min_size")
        if self.test_per_client is not None:
            _at_least(self.test_per_client, 1, f"{path}.test_per_client")
        if self.test_split != "follow_train" and plugin.partitions_itself:
            raise ConfigError(
                f"{path}.test_split: {self.test_split} does not apply to {self.dataset} (it builds its clients' data "
                "itself)"
            )


@dataclass
class ModelConfig:
    # Keys of the config schema before model factories declared their own parameters (issue #19).
    MOVED_FIELDS: ClassVar[dict[str, str]] = {
        "hidden": "model.params.hidden (of mlp or cnn)",
        "cnn_channels": "model.params.channels (of cnn)",
        "cnn_hidden": "model.params.hidden (of cnn)",
    }
    # A model factory (fairfl.models): a registered name (FairFL's built-ins are entry points of group fairfl.models:
    # mlp, cnn, logreg) or package.module:attr of a callable factory(signature, **params) -> torch.nn.Module.
    name: str = "mlp"
    # The factory's parameters (its declared Params, else its keyword arguments), e.g. mlp: hidden (default
    # [200, 200]); cnn: channels ([32, 64], FedAvgCNN), hidden (512), kernel_size (5).
    params: dict[str, Any] = field(default_factory=dict)

    def validate(self, path: str) -> None:
        from fairfl.models import MODELS, factory_params

        factory_params(MODELS.load(self.name, f"{path}.name"), self.params, f"{path}.params")


@dataclass
class TrainingConfig:
    local_steps: int | None = None  # default: 10 steps when local_epochs is not set either
    local_epochs: int | None = None
    batch_size: int = 50
    lr: float = 0.1
    lr_decay: float = 1.0  # multiplicative per round
    optimizer: Literal["sgd", "adam"] = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    prox_mu: float = 0.0
    loss_eval_batches: int = 0  # 0 = whole local training set
    # F_i before and after local training on every task, also when the strategy does not read them (Ψ of FedAvg-family
    # baselines, telemetry); strategies that weight by them (q-FFL, FedEBA+, FedFair, ...) always get them.
    loss_telemetry: bool = False

    def budget(self) -> tuple[Literal["local_steps", "local_epochs"], int]:
        """The local work per round: epochs when given, else steps (DEFAULT_LOCAL_STEPS when neither is set)."""
        if self.local_epochs is not None:
            return "local_epochs", self.local_epochs
        return "local_steps", self.local_steps if self.local_steps is not None else DEFAULT_LOCAL_STEPS

    def validate(self, path: str) -> None:
        if self.local_steps is not None and self.local_epochs is not None:
            raise ConfigError(f"{path}: set only one of local_steps and local_epochs")
        if self.local_steps is not None:
            _at_least(self.local_steps, 1, f"{path}.local_steps")
        if self.local_epochs is not None:
            _at_least(self.local_epochs, 1, f"{path}.local_epochs")
        _at_least(self.batch_size, 1, f"{path}.batch_size")
        _positive(self.lr, f"{path}.lr")
        if not 0 < self.lr_decay <= 1:
            raise ConfigError(f"{path}.lr_decay: must be in (0, 1], got {self.lr_decay}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"{path}.momentum: must be in [0, 1), got {self.momentum}")
        _positive(self.weight_decay, f"{path}.weight_decay", allow_zero=True)
        _positive(self.prox_mu, f"{path}.prox_mu", allow_zero=True)
        _at_least(self.loss_eval_batches, 0, f"{path}.loss_eval_batches")


@dataclass
class StrategyConfig:
    # A registered name (FairFL's built-ins are entry points of group fairfl.strategies) or package.module:attr.
    name: str = "fedavg"
    server_lr: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)  # the strategy's declared Params

    def validate(self, path: str) -> None:
        _positive(self.server_lr, f"{path}.server_lr")
        from fairfl.strategy import validate_strategy  # the strategy registry owns the parameters (torch: lazily)

        validate_strategy(self.name, self.params, path)


@dataclass
class SelectionConfig:
    # The sampler: a registered name (FairFL's built-ins are entry points of group fairfl.samplers: random, full, hics,
    # power_of_choice, clustered_sampling or clustered, divfl) or package.module:attr of a fairfl.sampling.Sampler.
    method: str = "random"
    clients_per_round: int = 10
    # The sampler's declared parameters (its Params dataclass; unset = the paper's value), e.g. hics: temperature,
    # lambda_entropy, gamma0, num_clusters, warmup_rounds; power_of_choice: candidates (d).
    params: dict[str, Any] = field(default_factory=dict)

    def sampler_class(self) -> type[Sampler]:
        """The sampler `method` names, loaded through the registry; PluginError naming selection.method."""
        from fairfl.sampling import SAMPLERS

        return SAMPLERS.load(self.method, "selection.method")

    def sampler_params(self, path: str = "selection.params") -> Any:
        """`params` as the sampler's Params instance; ConfigError naming `path.<key>`."""
        return parse_params(self.sampler_class().Params, self.params, path)

    def validate(self, path: str) -> None:
        _at_least(self.clients_per_round, 1, f"{path}.clients_per_round")
        self.sampler_params(f"{path}.params")

    def validate_run(self, cfg: ExperimentConfig) -> None:
        """Rules across sections, from what the sampler declares; each error names the field to change."""
        from fairfl.sampling import SIGNATURE_FIELDS, uniform_samplers

        cls = self.sampler_class()
        if cfg.privacy.enabled and not cls.uniform:
            raise ConfigError(
                f"selection.method: {self.method} is not a uniform sampler (it may select on clients' bias updates, "
                "losses or updates, which DP runs do not release unprotected and which break the privacy accounting's "
                f"uniform sampling); use a uniform one: {', '.join(uniform_samplers())}"
            )
        collected = {"bias_update"}  # the signatures the round engine asks trained clients for
        missing = sorted(set(cls.client_signatures) - collected)
        if missing:
            raise ConfigError(
                f"selection.method: {self.method} needs client signatures {missing} the round engine does not collect "
                f"for samplers (it collects {sorted(collected)} of {list(SIGNATURE_FIELDS)})"
            )
        cls.validate_run(self.sampler_params(), cfg)


@dataclass
class EvaluationConfig:
    every: int = 10  # evaluate every N rounds; the last round is always evaluated

    def validate(self, path: str) -> None:
        _at_least(self.every, 1, f"{path}.every")


@dataclass
class RuntimeConfig:
    agents: int = 2
    round_timeout_s: float = 120.0
    min_completion: float = 1.0  # fraction of selected clients whose results a round needs to be aggregated
    register_timeout_s: float = 120.0
    device: str = "auto"
    threads_per_agent: int = 1  # torch threads per agent process (in-process: per worker)
    # `--transport inprocess`: how many clients of a round train at once, each on a worker thread with its own model
    # (the run's data is loaded once and shared). auto: the usable cores divided by threads_per_agent, at most the
    # number of clients; on a GPU always 1. Results are bit-identical for any count, as long as client code draws
    # randomness only from the task's seed (a user model or procedure using torch's global RNG needs 1).
    inprocess_workers: int | Literal["auto"] = "auto"
    # What the in-process workers are: forked processes (each shares the run's data copy-on-write and trains without
    # waiting for another's GIL: the fast choice on a CPU) or threads of the run's process. auto: processes when there
    # is more than one worker on the CPU and the OS can fork, else threads. The results are the same bits either way.
    inprocess_pool: Literal["auto", "threads", "processes"] = "auto"
    # Per-client Prometheus series (accuracy, loss) only for client ids below this, so label cardinality stays bounded.
    metrics_client_limit: int = 100
    # Dropouts (docs/reliability.md): select ceil(k * (1 + over_selection)) clients and aggregate the first k results.
    over_selection: float = 0.0
    # A round below min_completion keeps the model; this many such rounds in a row stop the run (FAILED).
    max_failed_rounds: int = 3
    # Where the aggregator checkpoints this run (<dir>/<run id>/); empty = the aggregator's --checkpoint-dir.
    checkpoint_dir: str = ""
    # How `fairfl run` spreads the logical clients over its local agents. replicated: every agent can train every
    # client (in a simulation each holds the whole federated dataset) and the aggregator gives each task to the
    # least-loaded one, so a round's work splits evenly; partitioned: agent i hosts an even contiguous range, as sites
    # holding their own data do. auto: replicated, but partitioned for record-level DP (an agent guarantees that a
    # re-sent DP task gets the same noisy release only for the tasks it ran itself). Deployed agents choose their own
    # (client_agent --clients, --shared-clients).
    placement: Literal["auto", "replicated", "partitioned"] = "auto"

    def validate(self, path: str) -> None:
        _at_least(self.agents, 1, f"{path}.agents")
        _positive(self.over_selection, f"{path}.over_selection", allow_zero=True)
        if self.over_selection > 10:
            raise ConfigError(
                f"{path}.over_selection: must be at most 10 (select up to 11x the clients), got {self.over_selection}"
            )
        _at_least(self.max_failed_rounds, 1, f"{path}.max_failed_rounds")
        _at_least(self.metrics_client_limit, 0, f"{path}.metrics_client_limit")
        _positive(self.round_timeout_s, f"{path}.round_timeout_s")
        if not 0 < self.min_completion <= 1:
            raise ConfigError(f"{path}.min_completion: must be in (0, 1], got {self.min_completion}")
        _positive(self.register_timeout_s, f"{path}.register_timeout_s")
        _at_least(self.threads_per_agent, 1, f"{path}.threads_per_agent")
        if self.inprocess_workers != "auto":
            _at_least(self.inprocess_workers, 1, f"{path}.inprocess_workers")
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"{path}.device: expected 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")


@dataclass
class TransportConfig:
    # The dtype clients send their result tensors in (UPDATE, GRADIENT, FIRST_STEP_UPDATE): float32 is lossless;
    # float16 and bfloat16 halve the upload and round every value (relative error up to 2^-11 and 2^-8; float16
    # overflows beyond ±65504, which the agent refuses to send). The aggregator decodes them to float32 and refuses
    # results in any other dtype. Models always travel as float32.
    update_dtype: Literal["float32", "float16", "bfloat16"] = "float32"

    def validate(self, path: str) -> None:
        pass  # the only field is a choice, checked when the config is read


@dataclass
class PrivacyConfig:
    """Differential privacy of a run (seed-fedfdp §1.3, §2). Off by default; see privacy_service and client_agent.

    principal `client`: record-level DP per client, every client runs DP-SGD (Poisson rate `sample_rate`, clip
    `clip_norm`, noise `noise_multiplier`) and releases a noisy loss (σ_l = `loss_noise_multiplier`, 0 = none).
    principal `federation`: client-level DP-FedAvg, q = clients_per_round / num_clients, updates clipped to
    `clip_norm`, server noise `noise_multiplier`·clip_norm. `mode` chooses what the ledger accounts (§2.4–2.6).
    `plaintext_telemetry` (experiments only, not private): record-level clients also report their noiseless training
    losses, which the paper's Ψ is computed from (spec §5, §9.13); agents with a DP policy refuse such tasks.
    """

    enabled: bool = False
    epsilon: float = 3.52
    delta: float = 1e-5
    accountant: Literal["rdp", "pld"] = "rdp"
    orders: list[float] | None = None  # RDP orders; None = dp_accounting's defaults
    mode: Literal["theorem3", "gradient_only", "joint_batch"] = "theorem3"
    principal: Literal["client", "federation"] = "client"
    sample_rate: float = 0.05
    noise_multiplier: float = 2.0
    clip_norm: float = 0.1
    loss_noise_multiplier: float = 5.0
    loss_clip_init: float = 2.5
    loss_clip_min: float = 0.1
    grad_normalizer: Literal["expected", "realized", "fixed"] = "expected"
    fixed_batch: int = 64
    plaintext_telemetry: bool = False

    def validate(self, path: str) -> None:
        if not self.enabled:
            return
        # The basic ranges first, then the accountant's sound range (fairfl.privacy), each naming the field.
        _positive(self.epsilon, f"{path}.epsilon")
        _sound(self.epsilon, EPSILON_RANGE, f"{path}.epsilon")
        if not 0 < self.delta < 1:
            raise ConfigError(f"{path}.delta: must be in (0, 1), got {self.delta}")
        _sound(self.delta, DELTA_RANGE, f"{path}.delta")
        if self.orders is not None:
            if self.accountant != "rdp":
                raise ConfigError(f"{path}.orders: apply only to accountant rdp, not {self.accountant!r}")
            if len(self.orders) > ORDERS_MAX:
                raise ConfigError(f"{path}.orders: at most {ORDERS_MAX} orders, got {len(self.orders)}")
            for i, order in enumerate(self.orders):
                if not 1 < order < float("inf"):
                    raise ConfigError(f"{path}.orders[{i}]: must be > 1 and finite, got {order}")
                if order > ORDER_MAX:
                    raise ConfigError(
                        f"{path}.orders[{i}]: must be at most {ORDER_MAX:g} (each order α costs O(α) to account), "
                        f"got {order}"
                    )
        if not 0 < self.sample_rate <= 1:
            raise ConfigError(f"{path}.sample_rate: must be in (0, 1], got {self.sample_rate}")
        _sound(self.sample_rate, SAMPLE_RATE_RANGE, f"{path}.sample_rate")
        _positive(self.noise_multiplier, f"{path}.noise_multiplier")
        _sound(self.noise_multiplier, NOISE_MULTIPLIER_RANGE, f"{path}.noise_multiplier")
        _positive(self.clip_norm, f"{path}.clip_norm")
        _positive(self.loss_noise_multiplier, f"{path}.loss_noise_multiplier", allow_zero=True)
        if self.loss_noise_multiplier > 0:  # 0: no loss release, nothing to account
            _sound(self.loss_noise_multiplier, NOISE_MULTIPLIER_RANGE, f"{path}.loss_noise_multiplier")
        _positive(self.loss_clip_init, f"{path}.loss_clip_init")
        _positive(self.loss_clip_min, f"{path}.loss_clip_min")
        if self.loss_clip_min > self.loss_clip_init:
            raise ConfigError(
                f"{path}.loss_clip_min: {self.loss_clip_min} exceeds loss_clip_init = {self.loss_clip_init}"
            )
        _at_least(self.fixed_batch, 1, f"{path}.fixed_batch")
        if self.mode == "joint_batch" and self.loss_noise_multiplier == 0:
            raise ConfigError(f"{path}.loss_noise_multiplier: mode joint_batch needs a loss release (σ_l > 0)")
        if self.mode == "joint_batch" and self.principal == "client":
            # The ledger accounts the shared batch with σ_eff = (σ⁻² + σ_l⁻²)^(-1/2) (aggregator_service/dp.py).
            sigma_eff = (self.noise_multiplier**-2 + self.loss_noise_multiplier**-2) ** -0.5
            why = out_of_sound_range(sigma_eff, NOISE_MULTIPLIER_RANGE)
            if why is not None:
                raise ConfigError(
                    f"{path}.noise_multiplier: mode joint_batch accounts the shared batch with σ_eff = "
                    f"(σ⁻² + σ_l⁻²)^(-1/2), which {why}; raise noise_multiplier or loss_noise_multiplier"
                )


@dataclass
class ExperimentConfig:
    name: str = "experiment"
    seed: int = 0
    rounds: int = 100
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    output_dir: str = "runs"

    def validate(self, path: str = "") -> None:
        _at_least(self.rounds, 1, _join(path, "rounds"))
        _at_least(self.seed, 0, _join(path, "seed"))
        if self.selection.clients_per_round > self.data.num_clients:
            raise ConfigError(
                f"selection.clients_per_round: {self.selection.clients_per_round} exceeds "
                f"data.num_clients = {self.data.num_clients}"
            )
        if self.runtime.agents > self.data.num_clients:
            raise ConfigError(f"runtime.agents: {self.runtime.agents} agents for {self.data.num_clients} clients")
        self.selection.validate_run(self)
        from fairfl.strategy import check_run  # the strategy's declared capabilities against this run

        check_run(self)
        if self.privacy.enabled:
            self._validate_privacy()
        if self.runtime.placement == "replicated" and self.privacy.enabled and self.privacy.principal == "client":
            raise ConfigError(
                "runtime.placement: replicated agents would share record-level DP clients (privacy.principal client), "
                "and a DP task re-sent after an aggregator restart could reach another agent and release fresh noise; "
                "use partitioned (or auto)"
            )

    def agent_placement(self) -> str:
        """runtime.placement with auto resolved: replicated or partitioned."""
        if self.runtime.placement != "auto":
            return self.runtime.placement
        return "partitioned" if self.privacy.enabled and self.privacy.principal == "client" else "replicated"

    def _validate_privacy(self) -> None:
        """Cross-section rules of a DP run; each error names the field to change."""
        p = self.privacy
        if p.principal == "federation":
            # The ledger's q is clients_per_round / live candidates, at least clients_per_round / num_clients.
            q = self.selection.clients_per_round / self.data.num_clients
            if q < SAMPLE_RATE_RANGE[0]:
                raise ConfigError(
                    f"selection.clients_per_round: client-level DP samples q = {self.selection.clients_per_round} / "
                    f"{self.data.num_clients} = {q:.3g} clients a round, below {SAMPLE_RATE_RANGE[0]:g}, the lowest "
                    "sample rate the privacy accountant handles soundly"
                )
            if not self.selection.sampler_class().uniform:
                from fairfl.sampling import uniform_samplers

                # The accountant's q is each client's chance of being drawn; only uniform sampling gives every live
                # client the same chance, selected / live candidates.
                raise ConfigError(
                    f"selection.method: privacy.principal federation needs uniform sampling "
                    f"({', '.join(uniform_samplers())}), got {self.selection.method!r}"
                )
            return
        if self.training.local_epochs is not None:
            raise ConfigError(
                "training.local_epochs: DP-SGD counts Poisson-sampled steps; set training.local_steps instead"
            )
        steps = self.training.budget()[1]
        if steps > COUNT_MAX:
            raise ConfigError(
                f"training.local_steps: {steps} DP-SGD steps a round exceed {COUNT_MAX}, the compositions the privacy "
                "accountant handles soundly"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _sound(value: float, bounds: tuple[float, float], path: str) -> None:
    why = out_of_sound_range(value, bounds)
    if why is not None:
        raise ConfigError(f"{path}: {why}")


def _validate_tree(cfg: ExperimentConfig) -> None:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value.validate(f.name)
    cfg.validate()


def experiment_from_dict(data: Any) -> ExperimentConfig:
    cfg = _build(ExperimentConfig, data, "")
    _validate_tree(cfg)
    return cfg


def experiment_from_yaml(text: str) -> ExperimentConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config is not valid YAML: {err}") from err
    return experiment_from_dict(data)


def load_experiment(path: str | Path, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Load and validate a YAML experiment file; `overrides` maps dotted paths to values (e.g. {"rounds": 5})."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML: {err}") from err
    return experiment_from_dict(apply_overrides(data, overrides or {}))


def apply_overrides(data: Any, overrides: dict[str, Any]) -> Any:
    """Set dotted paths (e.g. "training.lr") in a parsed YAML mapping, creating empty sections on the way."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(data).__name__}")
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        walked = []
        for key in parents:
            walked.append(key)
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(walked)}: cannot set {dotted!r}, this field is not a section")
        node[leaf] = value
    return data
