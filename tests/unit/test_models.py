"""Model zoo: parameter counts from the specs, the features/classifier split, determinism, argument errors."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from fairfl.models import MaxPool2x2, build_model, count_parameters


@pytest.mark.parametrize(
    ("name", "input_shape", "num_classes", "expected"),
    [
        # 784·200+200 + 200·200+200 + 200·10+10 = 157,000 + 40,200 + 2,010 (seed-fedeba.md §6.3)
        ("mlp", (1, 28, 28), 10, 199_210),
        ("mlp", (784,), 10, 199_210),
        # conv 1·32·25+32 = 832; conv 32·64·25+64 = 51,264; 28→24→12→8→4: 64·4·4 = 1024;
        # fc 1024·512+512 = 524,800; fc 512·10+10 = 5,130 → 582,026 (seed-fedfdp.md §4)
        ("cnn", (1, 28, 28), 10, 582_026),
        # conv 3·32·25+32 = 2,432; 32→28→14→10→5: 64·5·5 = 1600; fc 1600·512+512 = 819,712 → 878,538
        ("cnn", (3, 32, 32), 10, 878_538),
        # 60·10 + 10
        ("logreg", (60,), 10, 610),
    ],
)
def test_parameter_counts(name: str, input_shape: tuple[int, ...], num_classes: int, expected: int) -> None:
    assert count_parameters(build_model(name, input_shape, num_classes)) == expected


def test_count_trainable_only() -> None:
    model = build_model("logreg", (60,), 10)
    model.classifier.bias.requires_grad_(False)
    assert count_parameters(model) == 610
    assert count_parameters(model, trainable_only=True) == 600


@pytest.mark.parametrize(
    ("name", "input_shape", "feature_dim"),
    [("mlp", (1, 28, 28), 200), ("cnn", (1, 28, 28), 512), ("cnn", (3, 32, 32), 512), ("logreg", (60,), 60)],
)
def test_shapes_and_split(name: str, input_shape: tuple[int, ...], feature_dim: int) -> None:
    torch.manual_seed(0)
    model = build_model(name, input_shape, 10)
    x = torch.randn(4, *input_shape)
    feats = model.features(x)
    logits = model(x)
    assert feats.shape == (4, feature_dim) == (4, model.feature_dim)
    assert logits.shape == (4, 10)
    assert isinstance(model.classifier, nn.Linear)
    assert model.classifier.bias.shape == (10,)
    # The classifier is the last Linear: no parameters may sit after it.
    last_linear = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    assert last_linear is model.classifier
    torch.testing.assert_close(logits, model.classifier(feats))


def test_flat_input_accepted_and_wrong_size_rejected() -> None:
    model = build_model("cnn", (1, 28, 28), 10)
    x = torch.randn(3, 1, 28, 28)
    torch.testing.assert_close(model(x.reshape(3, 784)), model(x))
    with pytest.raises(RuntimeError):
        model(torch.randn(3, 2, 28, 28))


def test_custom_widths() -> None:
    mlp = build_model("mlp", (20,), 3, hidden=(8,))
    assert count_parameters(mlp) == 20 * 8 + 8 + 8 * 3 + 3
    cnn = build_model("cnn", (1, 28, 28), 10, channels=(4, 8), hidden=16)
    assert cnn.feature_dim == 16
    assert cnn(torch.randn(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.parametrize("name", ["cnn", "logreg", "mlp"])
def test_same_seed_same_parameters(name: str) -> None:
    shape = (1, 28, 28) if name == "cnn" else (30,)
    torch.manual_seed(123)
    a = build_model(name, shape, 5)
    torch.manual_seed(123)
    b = build_model(name, shape, 5)
    torch.manual_seed(124)
    c = build_model(name, shape, 5)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key])
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown model 'resnet'") as info:
        build_model("resnet", (3, 32, 32), 10)
    for name in ("cnn", "logreg", "mlp"):
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("name", "shape", "kwargs", "arg"),
    [
        ("mlp", (784,), {"hidden": (200, 0)}, "hidden"),
        ("mlp", (784,), {"hidden": ()}, "hidden"),
        ("mlp", (784,), {"width": 3}, "width"),
        ("logreg", (60,), {"hidden": (10,)}, "hidden"),
        ("cnn", (1, 28, 28), {"channels": (32,)}, "channels"),
        ("cnn", (1, 28, 28), {"hidden": -1}, "hidden"),
        ("cnn", (1, 28, 28), {"kernel_size": 2.5}, "kernel_size"),
        ("cnn", (784,), {}, "input_shape"),
        ("cnn", (1, 8, 8), {}, "input_shape"),
        ("mlp", (0, 28), {}, "input_shape"),
    ],
)
def test_bad_arguments_name_the_argument(name: str, shape: tuple[int, ...], kwargs: dict, arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        build_model(name, shape, 10, **kwargs)


def test_bad_num_classes() -> None:
    with pytest.raises(ValueError, match="num_classes"):
        build_model("mlp", (784,), 1)


def _twins(input_shape: tuple[int, ...], **params: Any) -> tuple[nn.Module, nn.Module]:
    """The built-in CNN, and the same network (same weights) with torch's own pooling layer."""
    model = build_model("cnn", input_shape, 10, **params)
    twin = copy.deepcopy(model)
    for index, module in enumerate(twin.body):
        if isinstance(module, MaxPool2x2):
            twin.body[index] = nn.MaxPool2d(2)
    return model, twin


@pytest.fixture
def pool_layouts(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per max-pool call from here on: was its input in channels-last layout (and not also the default one)?"""
    layouts: list[bool] = []
    pool = torch.nn.functional.max_pool2d

    def recording(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not torch._C._functorch.is_functorch_wrapped_tensor(x):
            layouts.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
        return pool(x, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "max_pool2d", recording)
    return layouts


@pytest.mark.parametrize(("input_shape", "kernel_size"), [((1, 28, 28), 5), ((3, 29, 29), 4)])
def test_the_cnn_pools_without_autograd_to_the_same_bits_as_nn_maxpool2d(
    pool_layouts: list[bool], input_shape: tuple[int, ...], kernel_size: int
) -> None:
    model, twin = _twins(input_shape, kernel_size=kernel_size)  # (3, 29, 29) with 4x4 kernels: odd pooling inputs
    torch.manual_seed(0)
    x = (torch.rand(16, *input_shape) * 4).round() / 4  # coarse values: many tied maxima inside pooling windows
    x[0, 0, 3, 5] = float("nan")
    with torch.no_grad():
        fast = model(x)
        assert pool_layouts == [True, True]  # the channels-last kernel ran
        assert torch.equal(fast[1:], twin(x)[1:]) and bool(torch.isnan(fast[0]).all())
    # Under autograd the usual kernel runs (its backward is the faster one), and the gradients match too.
    pool_layouts.clear()
    x = x[1:]
    for net in (model, twin):
        torch.nn.functional.cross_entropy(net(x), torch.arange(len(x)) % 10).backward()
    assert pool_layouts == [False] * 4
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def test_the_cnn_keeps_the_usual_kernel_for_vmap_and_for_channels_last_inputs(pool_layouts: list[bool]) -> None:
    model, twin = _twins((3, 32, 32))
    x = torch.rand(4, 3, 32, 32)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def per_sample(net: nn.Module) -> torch.Tensor:
        return torch.func.vmap(lambda xi: torch.func.functional_call(net, params, (xi.unsqueeze(0),)))(x)

    with torch.no_grad():
        assert torch.equal(per_sample(model), per_sample(twin))  # a batched tensor cannot change layout
        # An input already channels-last: handed on in that layout, as nn.MaxPool2d does, so conv2 gets what it would.
        x_cl = x.contiguous(memory_format=torch.channels_last)
        pool_layouts.clear()
        assert torch.equal(model(x_cl), twin(x_cl))
    assert pool_layouts == [True, True] * 2  # channels-last in both networks alike (the input's own layout)
