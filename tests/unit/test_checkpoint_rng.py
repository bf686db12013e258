"""Checkpointed RNG states: Python's generator travels as one tensor and resumes its stream exactly, and checkpoints
written before that (a list of 625 numbers) still load."""

from __future__ import annotations

import random

import numpy as np
import torch

from aggregator_service.checkpoint import _rng_state, _set_rng_state, decode_state, encode_state


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.random()), float(torch.rand(1))


def test_rng_state_round_trips_through_a_checkpoint_tree() -> None:
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    _draws()  # move every stream off its seed
    text, tensors = encode_state({"rng": _rng_state()})
    expected = _draws()
    assert len(text) < 2000  # the 625 words of Python's state are a tensor, not JSON numbers
    _draws()
    _set_rng_state(decode_state(text, tensors)["rng"])
    assert _draws() == expected


def test_rng_state_of_an_older_checkpoint_with_a_list_still_loads() -> None:
    random.seed(11)
    state = _rng_state()
    version, internal, gauss = state["python"]
    state["python"] = [version, [int(x) for x in internal], gauss]  # the format before the tensor
    text, tensors = encode_state({"rng": state})
    expected = _draws()
    _draws()
    _set_rng_state(decode_state(text, tensors)["rng"])
    assert _draws() == expected
