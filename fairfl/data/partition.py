"""Client partitioners: split a labelled dataset's indices among federated clients.

Every function takes the labels and a ``np.random.Generator`` (so callers control determinism) and returns one sorted
int64 index array per client. Partitions of the training set are disjoint; IID and shard partitions cover every sample.

A split the data cannot hold (more clients than samples, a class too small for its group, ...) raises
:class:`PartitionError`, a ValueError whose ``argument`` names the input to change, so callers can name their own
field (fairfl.data.federated names the run's ``data.*`` config field).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "PartitionError",
    "partition_dirichlet",
    "partition_dirichlet_groups",
    "partition_iid",
    "partition_label_groups",
    "partition_shards",
    "test_split_following",
]


class PartitionError(ValueError):
    """The data cannot be split as asked; ``argument`` names the partitioner's input to change."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


def _check_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
    if labels.size and labels.min() < 0:
        raise ValueError("labels must be non-negative")
    return labels


def _check_positive_int(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _split_by_owner(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Group sample indices by owning client; a stable sort keeps each group's indices ascending."""
    order = np.argsort(owner, kind="stable").astype(np.int64)
    sizes = np.bincount(owner, minlength=num_clients)
    return np.split(order, np.cumsum(sizes)[:-1])


def partition_iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Uniformly random split into ``num_clients`` parts whose sizes differ by at most one."""
    labels = _check_labels(labels)
    _check_positive_int(num_clients, "num_clients")
    if len(labels) < num_clients:
        raise PartitionError(
            "num_clients", f"num_clients ({num_clients}) exceeds the number of samples ({len(labels)})"
        )
    perm = rng.permutation(len(labels))
    return [np.sort(part).astype(np.int64) for part in np.array_split(perm, num_clients)]


def partition_shards(
    labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Label-sorted shards (McMahan et al.; FedEBA+ uses 200 shards, 2 per client).

    Indices are sorted by label, cut into ``num_clients * shards_per_client`` contiguous shards of (near-)equal size,
    and each client receives ``shards_per_client`` random shards, so it sees at most about that many labels.
    """
    labels = _check_labels(labels)
    _check_positive_int(num_clients, "num_clients")
    _check_positive_int(shards_per_client, "shards_per_client")
    num_shards = num_clients * shards_per_client
    if len(labels) < num_shards:
        n = len(labels)
        # One shard each is impossible: too many clients; else fewer shards per client would do.
        argument = "num_clients" if num_clients > n else "shards_per_client"
        limit = f"at most {n // shards_per_client} clients with {shards_per_client} shards each"
        if argument == "shards_per_client":
            limit = f"at most {n // num_clients} shards per client for {num_clients} clients, or {limit}"
        raise PartitionError(
            argument,
            f"need at least num_clients * shards_per_client = {num_shards} samples for the shards, the data has {n} "
            f"({limit})",
        )
    by_label = np.argsort(labels, kind="stable")
    shards = np.array_split(by_label, num_shards)
    assignment = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([shards[s] for s in row])).astype(np.int64) for row in assignment]


def partition_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 10,
    max_attempts: int = 1000,
) -> list[np.ndarray]:
    """Label-skewed split: each class is divided among clients in proportions ~ Dir(alpha * 1).

    Small ``alpha`` gives clients few dominant classes. The draw is repeated until every client holds at least
    ``min_size`` samples (at most ``max_attempts`` times), so no client ends up with an unusable sliver of data.
    """
    labels = _check_labels(labels)
    _check_positive_int(num_clients, "num_clients")
    _check_positive_int(max_attempts, "max_attempts")
    if not np.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {min_size!r}")
    n = len(labels)
    if n < num_clients:
        raise PartitionError("num_clients", f"num_clients ({num_clients}) exceeds the number of samples ({n})")
    if min_size * num_clients > n:
        raise PartitionError(
            "min_size", f"min_size * num_clients = {min_size * num_clients} exceeds the number of samples ({n})"
        )

    classes = np.unique(labels)
    class_members = [np.flatnonzero(labels == c) for c in classes]
    owner = np.empty(n, dtype=np.int64)
    clients = np.arange(num_clients)
    sizes = np.zeros(num_clients, dtype=np.int64)
    for _ in range(max_attempts):
        for members in class_members:
            shuffled = rng.permutation(members)
            proportions = rng.dirichlet(np.full(num_clients, float(alpha)))
            # Cumulative cut points turn proportions into integer counts that sum exactly to the class size.
            cuts = np.floor(np.cumsum(proportions) * len(members)).astype(np.int64)
            cuts[-1] = len(members)
            counts = np.diff(cuts, prepend=0)
            owner[shuffled] = np.repeat(clients, counts)
        sizes = np.bincount(owner, minlength=num_clients)
        if sizes.min() >= min_size:
            return _split_by_owner(owner, num_clients)
    raise PartitionError(
        "min_size",
        f"partition_dirichlet: no split with every client holding >= min_size={min_size} samples after "
        f"{max_attempts} attempts (alpha={alpha}, num_clients={num_clients}, {n} samples; smallest client had "
        f"{sizes.min()}). Increase alpha, lower min_size or use fewer clients.",
    )


def partition_label_groups(
    labels: np.ndarray,
    group_sizes: list[int],
    group_classes: list[int],
    rng: np.random.Generator,
    samples_per_class: int | None = None,
) -> list[np.ndarray]:
    """Equitable-FL's disjoint-label groups (seed-equitable.md §2.1): group g holds ``group_sizes[g]`` clients (ids
    contiguous, group 0 first) and the next ``group_classes[g]`` classes in index order, disjoint from every other
    group's; every client of a group holds ``samples_per_class`` samples of each of its group's classes (default: the
    class split equally among the group's clients). The paper's MNIST setup is sizes [4, 6], classes [4, 6], 800 per
    class, so clients 0-3 hold 3200 samples of classes 0-3 and clients 4-9 hold 4800 of classes 4-9.
    """
    labels = _check_labels(labels)
    if len(group_sizes) == 0 or len(group_sizes) != len(group_classes):
        raise PartitionError(
            "group_classes",
            f"group_sizes and group_classes must be non-empty and of equal length, got {len(group_sizes)} and "
            f"{len(group_classes)}",
        )
    for name, values in (("group_sizes", group_sizes), ("group_classes", group_classes)):
        for g, value in enumerate(values):
            _check_positive_int(value, f"{name}[{g}]")
    if samples_per_class is not None:
        _check_positive_int(samples_per_class, "samples_per_class")
    num_classes = int(labels.max()) + 1 if labels.size else 0
    if sum(group_classes) > num_classes:
        raise PartitionError(
            "group_classes", f"group_classes ask for {sum(group_classes)} classes, the dataset has {num_classes}"
        )
    # Shuffle once, then a stable sort by label: each class's members end up in random order, one vectorised pass.
    shuffled = rng.permutation(len(labels))
    by_label = shuffled[np.argsort(labels[shuffled], kind="stable")]
    starts = np.concatenate(([0], np.cumsum(np.bincount(labels, minlength=num_classes))))
    parts: list[list[np.ndarray]] = [[] for _ in range(sum(group_sizes))]
    first_client, first_class = 0, 0
    for g, (size, count) in enumerate(zip(group_sizes, group_classes, strict=True)):
        for c in range(first_class, first_class + count):
            pool = by_label[starts[c] : starts[c + 1]]
            if samples_per_class is None:
                if len(pool) < size:
                    raise PartitionError(
                        "group_sizes", f"group {g}: class {c} has {len(pool)} samples for {size} clients"
                    )
                pieces = np.array_split(pool, size)
            else:
                need = size * samples_per_class
                if len(pool) < need:
                    raise PartitionError(
                        "samples_per_class",
                        f"group {g}: class {c} has {len(pool)} samples, {size} clients x samples_per_class="
                        f"{samples_per_class} need {need}",
                    )
                pieces = np.split(pool[:need], size)
            for j, piece in enumerate(pieces):
                parts[first_client + j].append(piece)
        first_client += size
        first_class += count
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


def partition_dirichlet_groups(
    labels: np.ndarray,
    group_sizes: list[int],
    group_alphas: list[float],
    rng: np.random.Generator,
    min_size: int = 10,
) -> list[np.ndarray]:
    """HiCS-FL's mixed-α partition (seed-hicsfl.md §3.3): group g holds ``group_sizes[g]`` clients (ids contiguous,
    group 0 first) and a share of every class proportional to its size, so each group's part is class-balanced like
    the whole (equal groups: the paper's "|α| equal parts"). Inside group g each class is split among its clients in
    proportions ~ Dir(α_g·1).

    Balance rule (the reference code's, enforced within a class too): no client holds more than its fair share
    ⌈part / clients⌉. What a full client would have received is re-drawn ~ Dir(α_g) over the clients with room, so
    α = 0.001 still gives each client (nearly) one class, and the single-α setting {0.001} with 50 clients and 10
    classes is possible at all (unconstrained, ten clients would take everything). Clients therefore end up with
    (nearly) equal sizes; the label skew is the Dirichlet's.
    """
    labels = _check_labels(labels)
    if len(group_sizes) == 0 or len(group_sizes) != len(group_alphas):
        raise PartitionError(
            "group_alphas",
            f"group_sizes and group_alphas must be non-empty and of equal length, got {len(group_sizes)} and "
            f"{len(group_alphas)}",
        )
    for g, (size, alpha) in enumerate(zip(group_sizes, group_alphas, strict=True)):
        _check_positive_int(size, f"group_sizes[{g}]")
        if not np.isfinite(alpha) or alpha <= 0:
            raise PartitionError("group_alphas", f"group_alphas[{g}] must be a finite number > 0, got {alpha!r}")
    total_clients = sum(group_sizes)
    # Every class's shuffled members, cut among the groups in proportion to their sizes.
    group_cuts = np.cumsum(group_sizes) / total_clients
    parts: list[list[np.ndarray]] = [[] for _ in group_sizes]
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        for g, block in enumerate(np.split(members, np.floor(group_cuts[:-1] * len(members)).astype(np.int64))):
            parts[g].append(block)
    out: list[np.ndarray] = []
    for g, (size, alpha) in enumerate(zip(group_sizes, group_alphas, strict=True)):
        room = np.full(size, -(-sum(len(block) for block in parts[g]) // size), dtype=np.int64)
        owners = []
        for block in parts[g]:
            counts = np.zeros(size, dtype=np.int64)
            left = len(block)
            while left > 0:  # each pass places everything or fills at least one client, so at most `size` passes
                open_ = np.flatnonzero(room > counts)
                weights = np.zeros(size)
                weights[open_] = rng.dirichlet(np.full(open_.size, float(alpha)))
                take = np.minimum(_largest_remainder(weights, left), room - counts)
                counts += take
                left -= int(take.sum())
            room -= counts
            owners.append(np.repeat(np.arange(size), counts))
        members = np.concatenate(parts[g])
        clients = [np.sort(members[positions]) for positions in _split_by_owner(np.concatenate(owners), size)]
        if (smallest := min(len(c) for c in clients)) < min_size:
            raise PartitionError(
                "min_size",
                f"partition_dirichlet_groups: a client of group {g} holds {smallest} samples, below min_size="
                f"{min_size}; use fewer clients or lower min_size",
            )
        out.extend(clients)
    return out


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Counts proportional to ``weights`` summing exactly to ``total`` (Hamilton's method; ties -> lower index)."""
    quotas = weights / weights.sum() * total
    counts = np.floor(quotas).astype(np.int64)
    short = total - int(counts.sum())
    if short > 0:
        remainders = quotas - counts
        remainders[weights <= 0] = -1.0  # never hand seats to classes the client does not have
        counts[np.argsort(-remainders, kind="stable")[:short]] += 1
    return counts


def _capped_allocation(weights: np.ndarray, total: int, capacity: np.ndarray) -> np.ndarray:
    """Proportional allocation that respects per-class capacity by re-spreading any overflow over the other classes."""
    counts = np.zeros(len(weights), dtype=np.int64)
    open_classes = (weights > 0) & (capacity > 0)
    remaining = total
    while remaining > 0:
        w = np.where(open_classes, weights, 0.0)
        alloc = _largest_remainder(w, remaining)
        room = capacity - counts
        over = alloc > room
        if not over.any():
            return counts + alloc
        # Saturate the classes that overflow, then share what is left among the rest.
        counts[over] = capacity[over]
        open_classes &= ~over
        remaining = total - int(counts.sum())
    return counts


def test_split_following(
    train_label_sets: list[np.ndarray],
    test_labels: np.ndarray,
    size_per_client: int,
    num_classes: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Per-client test sets whose class mix follows each client's training label distribution.

    Each client gets exactly ``size_per_client`` test indices (largest-remainder rounding of its train proportions),
    drawn without replacement within the client; different clients may share test samples. When a class pool is too
    small the excess is spread over the client's other classes; ValueError if the client's classes cannot supply it.
    """
    test_labels = _check_labels(test_labels)
    _check_positive_int(size_per_client, "size_per_client")
    _check_positive_int(num_classes, "num_classes")
    if len(train_label_sets) < 1:
        raise ValueError("train_label_sets must hold at least one client")
    if test_labels.size and test_labels.max() >= num_classes:
        raise ValueError(f"test_labels contain {test_labels.max()}, outside num_classes={num_classes}")

    pool_sizes = np.bincount(test_labels, minlength=num_classes)
    pool_starts = np.concatenate(([0], np.cumsum(pool_sizes)[:-1]))
    result: list[np.ndarray] = []
    for client, train_labels in enumerate(train_label_sets):
        train_labels = _check_labels(train_labels)
        if train_labels.size == 0:
            raise PartitionError(
                "train_label_sets",
                f"train_label_sets[{client}] is empty: cannot follow an empty label distribution",
            )
        if train_labels.max() >= num_classes:
            raise ValueError(f"train_label_sets[{client}] has label {train_labels.max()} >= num_classes={num_classes}")
        weights = np.bincount(train_labels, minlength=num_classes).astype(np.float64)
        available = int(pool_sizes[weights > 0].sum())
        if available < size_per_client:
            raise PartitionError(
                "size_per_client",
                f"client {client}: size_per_client={size_per_client} but the test set has only {available} samples "
                "of that client's classes",
            )
        counts = _capped_allocation(weights, size_per_client, pool_sizes)
        # Random keys sorted within each label group give an independent random order per class in one vectorised
        # pass; taking the first counts[c] of class c's group samples it without replacement.
        grouped = np.lexsort((rng.random(len(test_labels)), test_labels))
        offsets = np.repeat(pool_starts - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
        picks = grouped[offsets + np.arange(size_per_client)]
        result.append(np.sort(picks).astype(np.int64))
    return result


test_split_following.__test__ = False  # type: ignore[attr-defined]  # keep pytest from collecting it when imported
