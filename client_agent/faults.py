"""Test-only fault injection for agents (docs/reliability.md): deterministic client dropouts.

`--fault-drop-fraction F` makes an agent ignore, in every round, all tasks (every phase, evaluation included) of
round(F x hosted) of its clients, drawn afresh each round from (`--fault-seed`, round). A dropped client sends nothing:
to the aggregator it is indistinguishable from a client that went offline mid-round.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field

import numpy as np


@dataclass
class DropPlan:
    fraction: float
    seed: int = 0
    _cache: dict[tuple[int, int], frozenset[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.fraction < 1:
            raise ValueError(f"--fault-drop-fraction must be in [0, 1), got {self.fraction}")

    def dropped(self, hosted: list[int], round_number: int) -> frozenset[int]:
        """The hosted clients that drop out of `round_number`."""
        key = (round_number, len(hosted))
        if key not in self._cache:
            count = math.floor(self.fraction * len(hosted) + 0.5)
            order = np.random.default_rng([self.seed, round_number]).permutation(len(hosted))
            self._cache = {key: frozenset(np.asarray(sorted(hosted))[order[:count]].tolist())}  # one round at a time
        return self._cache[key]

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--fault-drop-fraction",
            type=float,
            default=float(os.environ.get("FAIRFL_FAULT_DROP_FRACTION", "0")),
            help=argparse.SUPPRESS,  # tests only: this fraction of the hosted clients ignores each round's tasks
        )
        parser.add_argument(
            "--fault-seed", type=int, default=int(os.environ.get("FAIRFL_FAULT_SEED", "0")), help=argparse.SUPPRESS
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DropPlan | None:
        return cls(args.fault_drop_fraction, args.fault_seed) if args.fault_drop_fraction > 0 else None
