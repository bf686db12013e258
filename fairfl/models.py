"""Model zoo: every model splits into `features` (penultimate activations) and `classifier` (the last nn.Linear).

The split exists for client signatures: HiCS-FL reads the output-layer bias update (`classifier.bias`) and
Equitable-FL reads the activation vector (`features`). Architectures follow the specs:
- mlp: FedEBA+/Equitable-FL MNIST/FMNIST MLP 784-200-200-10, 199,210 parameters (seed-fedeba.md §6.3,
  seed-equitable.md §2.2).
- cnn: FedFDP's FedAvgCNN (seed-fedfdp.md §4): two 5×5 convs without padding, 582,026 parameters on 1×28×28 and
  878,538 on 3×32×32.
- logreg: a single linear layer, for synthetic data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["MODEL_NAMES", "FairFLModel", "build_model", "count_parameters"]


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
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, kernel_size),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * height * width, hidden),
        nn.ReLU(),
    )
    return FairFLModel("cnn", input_shape, num_classes, body, nn.Linear(hidden, num_classes))


def _build_logreg(input_shape: tuple[int, ...], num_classes: int) -> FairFLModel:
    # Features are the flattened input itself, so the "activation vector" of a linear model is its input.
    return FairFLModel("logreg", input_shape, num_classes, nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


_BUILDERS: dict[str, Callable[..., FairFLModel]] = {"mlp": _build_mlp, "cnn": _build_cnn, "logreg": _build_logreg}
_KWARGS: dict[str, tuple[str, ...]] = {"mlp": ("hidden",), "cnn": ("channels", "hidden", "kernel_size"), "logreg": ()}
MODEL_NAMES: tuple[str, ...] = tuple(sorted(_BUILDERS))


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **kwargs: Any) -> FairFLModel:
    """Build a model by name. Initialisation uses torch's default RNG, so it is reproducible under torch.manual_seed.

    kwargs: mlp: hidden=(200, 200); cnn: channels=(32, 64), hidden=512, kernel_size=5; logreg: none.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}")
    shape = _positive_ints(input_shape, "input_shape", name)
    classes = _positive_int(num_classes, "num_classes", name)
    if classes < 2:
        raise ValueError(f"build_model({name!r}): num_classes must be at least 2, got {classes}")
    unknown = sorted(set(kwargs) - set(_KWARGS[name]))
    if unknown:
        valid = ", ".join(_KWARGS[name]) or "none"
        raise ValueError(f"build_model({name!r}): unknown argument {unknown[0]!r}; valid arguments: {valid}")
    return _BUILDERS[name](shape, classes, **kwargs)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of scalar parameters (all of them, or only those with requires_grad)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
