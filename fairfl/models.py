"""Models: the model-factory plug-in protocol, its registry, the head helper, and the built-in model zoo.

A model factory is any callable `factory(signature: DataSignature, **params) -> torch.nn.Module`, named in the config
by `model.name` (a registered name, an entry point of group `fairfl.models`, or `package.module:attr`) with its
parameters in `model.params`. It may declare them as a dataclass `factory.Params` (checked like the rest of the
config); otherwise they are checked against its keyword arguments.

Client signatures need a model's head: HiCS-FL reads the output-layer bias update and Equitable-FL the penultimate
activations. `model_head` finds them for any nn.Module: a declared hook (a `features(x)` method and a `classifier`
nn.Linear, as FairFLModel has) or by convention the last nn.Linear. The built-ins follow the specs:
- mlp: FedEBA+/Equitable-FL MNIST/FMNIST MLP 784-200-200-10, 199,210 parameters (seed-fedeba.md §6.3,
  seed-equitable.md §2.2).
- cnn: FedFDP's FedAvgCNN (seed-fedfdp.md §4): two 5×5 convs without padding, 582,026 parameters on 1×28×28 and
  878,538 on 3×32×32.
- logreg: a single linear layer, for synthetic data.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch import nn

from fairfl.data.signature import DataSignature
from fairfl.plugins import NoParams, PluginError, Registry, parse_params
from fairfl.schema import ConfigError

if TYPE_CHECKING:
    from fairfl.config import ExperimentConfig

__all__ = [
    "MODELS",
    "FairFLModel",
    "Head",
    "HeadError",
    "ModelFactory",
    "build_model",
    "build_run_model",
    "cnn",
    "count_parameters",
    "factory_params",
    "logreg",
    "mlp",
    "model_factory",
    "model_head",
    "require_signatures",
]

F = TypeVar("F", bound=Callable[..., Any])


class FairFLModel(nn.Module):
    """A feature extractor followed by one linear classifier; forward(x) == classifier(features(x))."""

    def __init__(
        self, name: str, input_shape: tuple[int, ...], num_classes: int, body: nn.Module, classifier: nn.Linear
    ) -> None:
        super().__init__()
        self.name = name
        self.input_shape = input_shape
        self.num_classes = num_classes
        self.body = body
        self.classifier = classifier

    @property
    def feature_dim(self) -> int:
        return self.classifier.in_features

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate activations, i.e. the input of `classifier`, shape (batch, feature_dim)."""
        # Reshape to the declared sample shape so flat and image-shaped batches both work; reshape (not view with -1)
        # raises on a wrong sample size instead of silently changing the batch size.
        return self.body(x.reshape(x.shape[0], *self.input_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _positive_int(value: Any, arg: str, model: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"build_model({model!r}): {arg} must be a positive integer, got {value!r}")
    return value


def _positive_ints(value: Any, arg: str, model: str, length: int | None = None) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) == 0:
        raise ValueError(f"build_model({model!r}): {arg} must be a non-empty sequence of positive integers")
    if length is not None and len(value) != length:
        raise ValueError(f"build_model({model!r}): {arg} must have {length} entries, got {len(value)}")
    return tuple(_positive_int(v, arg, model) for v in value)


def _build_mlp(input_shape: tuple[int, ...], num_classes: int, hidden: Sequence[int] = (200, 200)) -> FairFLModel:
    widths = _positive_ints(hidden, "hidden", "mlp")
    layers: list[nn.Module] = [nn.Flatten()]
    prev = math.prod(input_shape)
    for width in widths:
        layers += [nn.Linear(prev, width), nn.ReLU()]
        prev = width
    return FairFLModel("mlp", input_shape, num_classes, nn.Sequential(*layers), nn.Linear(prev, num_classes))


class MaxPool2x2(nn.MaxPool2d):
    """nn.MaxPool2d(2) whose passes without autograd (evaluation, loss measurements) pool in channels-last layout
    on a CPU, where PyTorch's kernel for the default layout is not vectorised over channels and several times slower
    (`python scripts/bench_pool.py`). A maximum is the same value in any layout, and the result is handed on in the
    default layout, so every later layer computes the same bits. With autograd the usual kernel runs: its backward
    is the faster one."""

    def __init__(self) -> None:
        super().__init__(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._channels_last_pays(x):
            return super().forward(x.contiguous(memory_format=torch.channels_last)).contiguous()
        return super().forward(x)

    @staticmethod
    def _channels_last_pays(x: torch.Tensor) -> bool:
        """A plain CPU batch in the default layout, outside autograd: not a vmap's batched tensor (its layout cannot
        change), and not an input already in another layout (nn.MaxPool2d hands that layout on; so must this)."""
        return (
            x.device.type == "cpu"
            and x.dim() == 4
            and not (torch.is_grad_enabled() and x.requires_grad)
            and not _functorch_wrapped(x)
            and x.is_contiguous()
        )


def _functorch_wrapped(x: torch.Tensor) -> bool:
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return True if check is None else bool(check(x))  # unknown: assume wrapped, take the usual kernel


def _build_cnn(
    input_shape: tuple[int, ...],
    num_classes: int,
    channels: Sequence[int] = (32, 64),
    hidden: int = 512,
    kernel_size: int = 5,
) -> FairFLModel:
    if len(input_shape) != 3:
        raise ValueError(f"build_model('cnn'): input_shape must be (channels, height, width), got {input_shape}")
    conv_channels = _positive_ints(channels, "channels", "cnn", length=2)
    hidden = _positive_int(hidden, "hidden", "cnn")
    kernel_size = _positive_int(kernel_size, "kernel_size", "cnn")
    in_ch, height, width = input_shape
    # Each block: valid conv (no padding, as in FedAvgCNN) then 2×2 max-pool with floor.
    for _ in conv_channels:
        height, width = (height - kernel_size + 1) // 2, (width - kernel_size + 1) // 2
        if height < 1 or width < 1:
            raise ValueError(
                f"build_model('cnn'): input_shape {input_shape} is too small for two {kernel_size}x{kernel_size} "
                "conv + 2x2 pool blocks"
            )
    c1, c2 = conv_channels
    body = nn.Sequential(
        nn.Conv2d(in_ch, c1, kernel_size),
        nn.ReLU(),
        MaxPool2x2(),
        nn.Conv2d(c1, c2, kernel_size),
        nn.ReLU(),
        MaxPool2x2(),
        nn.Flatten(),
        nn.Linear(c2 * height * width, hidden),
        nn.ReLU(),
    )
    return FairFLModel("cnn", input_shape, num_classes, body, nn.Linear(hidden, num_classes))


def _build_logreg(input_shape: tuple[int, ...], num_classes: int) -> FairFLModel:
    # Features are the flattened input itself, so the "activation vector" of a linear model is its input.
    return FairFLModel("logreg", input_shape, num_classes, nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


# ------------------------------------------------------------------------------------------------ factory protocol


class ModelFactory(Protocol):
    """What `model.name` names: called with the run's data signature and `model.params` as keyword arguments, it
    returns any `torch.nn.Module`. It may declare its parameters as a dataclass attribute `Params` (`model_factory`);
    without one, `model.params` are checked against its keyword arguments."""

    def __call__(self, signature: DataSignature, /, **params: Any) -> nn.Module: ...


def model_factory(params: type) -> Callable[[F], F]:
    """Declare a factory's parameters: `@model_factory(MyParams)` sets `factory.Params = MyParams`."""

    def attach(factory: F) -> F:
        setattr(factory, "Params", params)  # noqa: B010 - a plain attribute on a function; mypy refuses `.Params =`
        return factory

    return attach


def _factory_arguments(factory: Any) -> tuple[list[str], list[str]] | None:
    """(keyword arguments after the signature, the required ones among them); None when any keyword is accepted or
    the callable cannot be introspected."""
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    rest = [p for p in parameters[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return [p.name for p in rest], [p.name for p in rest if p.default is inspect.Parameter.empty]


def _keyword_arguments(factory: Any) -> list[str] | None:
    arguments = _factory_arguments(factory)
    return None if arguments is None else arguments[0]


def _check_factory(obj: Any) -> str | None:
    if not callable(obj):
        return f"expected a callable factory(signature, **params) -> torch.nn.Module, got {type(obj).__name__}"
    try:
        parameters = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return None  # not introspectable (a C callable): calling it is the only check
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not parameters or parameters[0].kind not in (*positional, inspect.Parameter.VAR_POSITIONAL):
        return "a model factory must take the data signature as its first positional argument"
    params = getattr(obj, "Params", None)
    if params is not None and not dataclasses.is_dataclass(params):
        return f"its Params {params!r} is not a dataclass"
    return None


MODELS: Registry[ModelFactory] = Registry("model", "fairfl.models", _check_factory)


def factory_params(factory: Any, raw: Any, path: str = "model.params") -> Any:
    """`model.params` checked for `factory`: parsed into its declared Params dataclass, else checked against its
    keyword arguments (unknown or missing ones refused naming `path`) and returned as a dict."""
    declared = getattr(factory, "Params", None)
    if declared is not None:
        return parse_params(declared, raw, path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise PluginError(f"{path}: expected a mapping of parameters, got {type(raw).__name__}")
    arguments = _factory_arguments(factory)
    if arguments is not None:
        accepted, required = arguments
        unknown = sorted(set(raw) - set(accepted))
        if unknown:
            raise PluginError(
                f"{path}: unknown parameter {unknown[0]!r}; valid parameters: {', '.join(accepted) or 'none'}"
            )
        missing = [name for name in required if name not in raw]
        if missing:
            raise PluginError(f"{path}.{missing[0]}: required by the model factory, not set")
    return dict(raw)


def _as_kwargs(params: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    return dict(params)


def build_run_model(config: ExperimentConfig, signature: DataSignature | None = None) -> nn.Module:
    """The run's initial model: every process (aggregator and agents) builds the same one from the run seed.

    `signature` defaults to the dataset plug-in's declaration; an agent passes the one of the data it loaded.
    """
    from fairfl.data.run import run_signature  # fairfl.data imports nothing of this module; keep it that way

    name = config.model.name
    factory = MODELS.load(name, "model.name")
    kwargs = _as_kwargs(factory_params(factory, config.model.params, "model.params"))
    if signature is None:
        signature = run_signature(config)
    torch.manual_seed(config.seed)
    try:
        model = factory(signature, **kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise PluginError(f"model.name: {name!r} cannot build a model for {signature}: {err}") from err
    if not isinstance(model, nn.Module):
        raise PluginError(f"model.name: {name!r} returned {type(model).__name__}, expected a torch.nn.Module")
    return model


# ------------------------------------------------------------------------------------------------------- built-ins


@dataclass
class MlpParams:
    hidden: list[int] = field(default_factory=lambda: [200, 200])  # hidden widths (FedEBA+/Equitable-FL: 200, 200)

    def validate(self, path: str) -> None:
        if not self.hidden:
            raise ConfigError(f"{path}.hidden: expected at least one hidden width")
        for i, width in enumerate(self.hidden):
            if width < 1:
                raise ConfigError(f"{path}.hidden[{i}]: must be >= 1, got {width}")


@dataclass
class CnnParams:
    channels: list[int] = field(default_factory=lambda: [32, 64])  # conv widths (FedAvgCNN: 32, 64)
    hidden: int = 512  # fully connected width (FedAvgCNN: 512)
    kernel_size: int = 5

    def validate(self, path: str) -> None:
        if len(self.channels) != 2:
            raise ConfigError(f"{path}.channels: expected 2 conv widths, got {len(self.channels)}")
        for i, width in enumerate(self.channels):
            if width < 1:
                raise ConfigError(f"{path}.channels[{i}]: must be >= 1, got {width}")
        for name in ("hidden", "kernel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{path}.{name}: must be >= 1, got {getattr(self, name)}")


@model_factory(MlpParams)
def mlp(signature: DataSignature, hidden: Sequence[int] = (200, 200)) -> FairFLModel:
    """Fully connected ReLU network with the given hidden widths."""
    return _build_mlp(signature.input_shape, signature.num_classes, hidden)


@model_factory(CnnParams)
def cnn(
    signature: DataSignature, channels: Sequence[int] = (32, 64), hidden: int = 512, kernel_size: int = 5
) -> FairFLModel:
    """FedAvgCNN: two valid convolutions with 2x2 max-pooling, one hidden fully connected layer."""
    return _build_cnn(signature.input_shape, signature.num_classes, channels, hidden, kernel_size)


@model_factory(NoParams)  # logreg takes no parameters
def logreg(signature: DataSignature) -> FairFLModel:
    """Multinomial logistic regression: one linear layer on the flattened input."""
    return _build_logreg(signature.input_shape, signature.num_classes)


# ------------------------------------------------------------------------------------------------------------ head


class HeadError(PluginError):
    """The model cannot give a signature an algorithm needs (no output layer, or no output-layer bias)."""


class _Captured(Exception):  # control flow, not an error: stops the forward pass at the output layer
    pass


def _input_of(model: nn.Module, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The input `layer` receives in model(x); the forward pass stops there, so the layer itself is never run."""
    captured: list[torch.Tensor] = []

    def grab(module: nn.Module, args: tuple[Any, ...]) -> None:
        captured.append(args[0])
        raise _Captured

    handle = layer.register_forward_pre_hook(grab)
    try:
        model(x)
    except _Captured:
        pass
    finally:
        handle.remove()
    if not captured:
        raise HeadError(
            f"model.name: {type(model).__name__}'s forward never called its last nn.Linear, so it is not the output "
            "layer; declare a features(x) method and a classifier nn.Linear"
        )
    return captured[0]


@dataclass(frozen=True, eq=False)
class Head:
    """A model's output layer (`classifier`, an nn.Linear) and its penultimate features (the classifier's input)."""

    model: nn.Module
    classifier: nn.Linear
    declared: bool  # True: the model's own features(x) method; False: the input of its last nn.Linear, by a hook

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate activations of a batch: what `classifier` receives in model(x)."""
        if self.declared:
            return self.model.features(x)  # type: ignore[operator]  # checked callable by model_head
        return _input_of(self.model, self.classifier, x)

    @property
    def feature_dim(self) -> int:
        return self.classifier.in_features

    @property
    def bias_name(self) -> str:
        """The output-layer bias's name in model.named_parameters() (HiCS-FL's signature)."""
        bias = self.classifier.bias
        if bias is not None:
            for name, param in self.model.named_parameters():
                if param is bias:
                    return name
        raise HeadError(
            f"model.name: {type(self.model).__name__}'s output layer has no trainable bias (nn.Linear(..., bias=False) "
            "or not a registered parameter), so it gives no output-layer bias signature"
        )


def model_head(model: nn.Module, purpose: str | None = None, need_bias: bool = False) -> Head:
    """The head of any nn.Module: a declared hook (a `features(x)` method and a `classifier` nn.Linear), else by
    convention the last nn.Linear registered (its input = the penultimate features, its bias = the output bias).

    HeadError (naming model.name and `purpose`, e.g. "strategy equitable's activation signatures") when the model
    has no output layer, or no output-layer bias and `need_bias`.
    """
    needs = f"{purpose} needs" if purpose else "needs"
    classifier = getattr(model, "classifier", None)
    features = getattr(model, "features", None)
    # A `features` submodule (torchvision's VGG, DenseNet) is a trunk, not penultimate features: only a method counts.
    if isinstance(classifier, nn.Linear) and callable(features) and not isinstance(features, nn.Module):
        head = Head(model, classifier, declared=True)
    else:
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise HeadError(
                f"model.name: {needs} the model's output layer, but {type(model).__name__} has no nn.Linear; end the "
                "model in an nn.Linear, or declare a features(x) method and a classifier nn.Linear"
            )
        head = Head(model, linears[-1], declared=False)
    if need_bias:
        try:
            head.bias_name  # noqa: B018 - raises HeadError when there is none
        except HeadError as err:
            raise HeadError(f"{err} ({needs} it)") from None
    return head


def require_signatures(model: nn.Module, signature: DataSignature, needs: dict[str, str]) -> None:
    """Check before round 1 that `model` gives the client signatures a run asks for: `needs` maps a signature name
    ("bias_update": the output-layer bias; "activation": the penultimate features) to who needs it (e.g.
    "selection.method hics"). Runs one zero sample through the features, so a head that is not the model's output
    layer, or features that are not one vector per sample, fail here rather than in a client's task."""
    for name, purpose in needs.items():
        if name not in ("bias_update", "activation"):
            raise ValueError(f"unknown client signature {name!r} (needed by {purpose})")
        head = model_head(model, purpose, need_bias=name == "bias_update")
        if name == "activation":
            with torch.no_grad():
                features = head.features(torch.zeros(1, *signature.input_shape))
            if features.shape != (1, head.feature_dim):
                raise HeadError(
                    f"model.name: {purpose} needs one penultimate feature vector per sample, but "
                    f"{type(model).__name__}'s output layer receives shape {tuple(features.shape)} for one sample"
                )


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **kwargs: Any) -> nn.Module:
    """Build a registered model (or `module:attr` factory) directly, outside a run config. Initialisation uses
    torch's default RNG, so it is reproducible under torch.manual_seed.

    kwargs: mlp: hidden=(200, 200); cnn: channels=(32, 64), hidden=512, kernel_size=5; logreg: none.
    """
    factory = MODELS.load(name, "model.name")
    signature = DataSignature(tuple(_positive_ints(input_shape, "input_shape", name)), num_classes)
    accepted = _keyword_arguments(factory)
    if accepted is not None:
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            valid = ", ".join(accepted) or "none"
            raise ValueError(f"build_model({name!r}): unknown argument {unknown[0]!r}; valid arguments: {valid}")
    return factory(signature, **kwargs)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of scalar parameters (all of them, or only those with requires_grad)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
