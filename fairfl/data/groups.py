"""Ground-truth client groups: which planted group each client belongs to, for partitions built from groups.

Known from the data config alone (the aggregator holds no data), so the engine, the strategies (NMI of found
clusters) and the results all read the same ids. Every grouped partition lays its groups out the same way:
`data.group_sizes[g]` clients with contiguous ids, group 0 first. A partition that plants groups adds its name to
GROUPED_PARTITIONS; its per-group parameters (label sets, Dirichlet α, ...) are its own config fields.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

# Partitions whose clients come in ground-truth groups of sizes `data.group_sizes`.
GROUPED_PARTITIONS: tuple[str, ...] = ("label_groups", "dirichlet_groups")


def groups_from_sizes(group_sizes: Sequence[int]) -> NDArray[np.int64]:
    """Group id of every client: [0]*sizes[0] + [1]*sizes[1] + ..."""
    sizes = np.asarray(group_sizes, dtype=np.int64)
    if sizes.ndim != 1 or sizes.size == 0 or (sizes < 1).any():
        raise ValueError(f"group_sizes must be a non-empty list of integers >= 1, got {list(group_sizes)}")
    return np.repeat(np.arange(sizes.size, dtype=np.int64), sizes)


def client_groups(partition: str, group_sizes: Sequence[int]) -> NDArray[np.int64] | None:
    """The true group of every client of a run, or None when the partition plants no groups."""
    if partition not in GROUPED_PARTITIONS:
        return None
    return groups_from_sizes(group_sizes)
