"""A plug-in's declared parameters on the wire (a protobuf Struct, whose numbers are doubles) come back exactly as
they were sent: ints stay ints (also inside lists, mappings and optional fields), None stays None, bools stay bools;
an int a double cannot hold exactly is refused when sent, naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from fairfl.plugins import PluginError, params_from_struct, params_to_struct, parse_params
from fairfl.schema import ConfigError


@dataclass
class Knobs:
    count: int = 1
    rate: float = 0.5
    maybe_rate: float | None = 0.3
    widths: list[int] = field(default_factory=lambda: [4])
    maybe_widths: list[int] | None = None
    per_class: dict[str, int] = field(default_factory=dict)
    flag: bool = False
    either: int | float = 2
    label: str = "x"
    kernel: tuple[int, int] = (3, 3)
    widths_tuple: tuple[int, ...] = (1,)


def test_every_declared_type_survives_the_round_trip() -> None:
    sent = Knobs(
        count=7,
        rate=2.0,
        maybe_rate=None,
        widths=[3, 5],
        maybe_widths=[8, 9],
        per_class={"a": 2},
        flag=True,
        either=3,
        label="y",
        kernel=(5, 1),
        widths_tuple=(2, 4, 8),
    )
    got = params_from_struct(Knobs, params_to_struct(sent), "strategy.params")
    assert got == sent
    assert type(got.count) is int and type(got.rate) is float and got.maybe_rate is None
    assert all(type(w) is int for w in [*got.widths, *got.maybe_widths, *got.per_class.values()])


def test_the_defaults_survive_too() -> None:
    assert params_from_struct(Knobs, params_to_struct(Knobs()), "p") == Knobs()


def test_an_int_beyond_what_a_double_holds_is_refused_when_sent() -> None:
    with pytest.raises(PluginError, match=r"^selection\.params\.widths\[1\]: 9007199254740993 is beyond"):
        params_to_struct(Knobs(widths=[1, 2**53 + 1]), "selection.params")
    params_to_struct(Knobs(count=2**53), "selection.params")  # the largest exact one still goes


def test_tuple_params_are_read_from_yaml_lists_and_checked() -> None:
    assert parse_params(Knobs, {"kernel": [7, 7], "widths_tuple": [1, 2]}, "model.params").kernel == (7, 7)
    with pytest.raises(ConfigError, match=r"^model\.params\.kernel: expected 2 values, got 3"):
        parse_params(Knobs, {"kernel": [1, 2, 3]}, "model.params")
