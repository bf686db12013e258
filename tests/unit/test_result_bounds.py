"""Numbers in a result header that are finite but absurd (issue #18): a forged loss of 1e300 would overflow what the
strategies compute from it (softmax(F/τ), q-FFL's F^q) and fail the round; such values are refused like NaN."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from fairfl import codec
from fairfl.models import build_model
from fairfl.params import ParamLayout
from fairfl.protocol import (
    EVALUATE,
    MAX_NUM_SAMPLES,
    MAX_REPORTED_MAGNITUDE,
    TRAIN,
    UPDATE,
    ClientResult,
    ResultAssembler,
    encode_result,
)

HUGE = 1e300


@pytest.fixture(scope="module")
def layout() -> ParamLayout:
    return ParamLayout.of(build_model("mlp", (4,), 3, hidden=(5,)))


def _train(layout: ParamLayout) -> ClientResult:
    return ClientResult(
        "t", "r", 1, 0, TRAIN, 10, loss_before=1.0, loss_after=0.5, payloads={UPDATE: torch.zeros(layout.numel)}
    )


def _evaluation() -> ClientResult:
    return ClientResult("t", "r", 1, 0, EVALUATE, num_samples=10, test_accuracy=50.0, test_loss=0.7)


def _assemble(result: ClientResult, layout: ParamLayout) -> ClientResult:
    header, *data = list(encode_result(result, layout))
    assembler = ResultAssembler(header.header, layout)
    for chunk in data:
        assembler.add(chunk.data)
    return assembler.finish()


@pytest.mark.parametrize(
    "field, value",
    [
        ("loss_before", HUGE),
        ("loss_after", MAX_REPORTED_MAGNITUDE * 2),
        ("noisy_loss", -HUGE),
        ("num_samples", MAX_NUM_SAMPLES + 1),
        ("num_samples", 2**64 - 1),
        ("metrics", {"train_loss": HUGE}),
        ("bias_update", np.array([0.0, HUGE, 0.0])),
        ("activation", np.array([-HUGE, 0.0])),
    ],
)
def test_a_training_result_with_an_absurd_number_is_refused(layout: ParamLayout, field: str, value: object) -> None:
    with pytest.raises(codec.CodecError, match=field if field != "metrics" else "train_loss"):
        _assemble(replace(_train(layout), **{field: value}), layout)


@pytest.mark.parametrize("field, value", [("test_loss", HUGE), ("num_samples", 2**40), ("test_accuracy", math.inf)])
def test_an_evaluation_with_an_absurd_number_is_refused(layout: ParamLayout, field: str, value: object) -> None:
    with pytest.raises(codec.CodecError, match=field):
        _assemble(replace(_evaluation(), **{field: value}), layout)


def test_large_honest_values_still_pass(layout: ParamLayout) -> None:
    honest = replace(
        _train(layout),
        loss_before=1e4,  # a diverging client
        noisy_loss=-3.5,  # DP noise may make a release negative
        num_samples=60_000,
        metrics={"local_steps": 1e6},
    )
    assert _assemble(honest, layout).loss_before == 1e4
    assert _assemble(replace(_evaluation(), num_samples=MAX_NUM_SAMPLES), layout).num_samples == MAX_NUM_SAMPLES
