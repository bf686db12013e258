"""Shared math of the clustering-based samplers (HiCS-FL, Clustered Sampling, DivFL).

- HiCS-FL's heterogeneity estimate Ĥ = H(softmax(Δb/T)) and its client distance arccos(cos(Δb_u, Δb_k)) +
  λ|Ĥ_u − Ĥ_k| (seed-hicsfl.md Eqs. 7, 9; §1.11 rules: zero-norm pairs get angle 0, cosine clipped to [−1, 1]).
- Ward clustering of n points given as a distance function. Up to `max_points` points it is exact (scipy's Ward on
  the condensed distances, or on the distance rows as features for code parity). Above that, an exact O(n²) tree does
  not fit a 2 s budget (10,000 clients: 400 MB of condensed distances, ~4 s of scipy linkage here), so the points are
  first coarsened by farthest-point traversal into `max_points` representatives (every client is assigned to its
  nearest one), and Ward runs on the representatives weighted by how many clients each stands for: Ward on weighted
  points is Ward on the multiset, so when representatives coincide with their members the tree is unchanged.
- Facility-location greedy (DivFL) and the angular / Euclidean distances implied by a Gram matrix.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray
from scipy.cluster import hierarchy
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components
from scipy.spatial.distance import squareform

from clustering_service.clustering import canonical_labels
from clustering_service.errors import InvalidInput

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]


# --- HiCS-FL signatures -------------------------------------------------------------------------------------------


def entropy_estimate(bias_updates: FloatArray, temperature: float) -> FloatArray:
    """Ĥ_k = H(softmax(Δb_k / T)) in nats, per row; max-subtracted, so Δb/T in the thousands is fine (§1.11.3).

    H(softmax(z)) = logsumexp(z) − Σ softmax(z)·z, which needs no 0·ln 0 special case.
    """
    z = np.asarray(bias_updates, dtype=np.float64) / temperature
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    total = e.sum(axis=1)
    h = np.log(total) - (e * z).sum(axis=1) / total
    return np.clip(h, 0.0, np.log(z.shape[1]))  # round-off can leave ±1e-16 outside [0, ln C]


class HicsGeometry:
    """Unit bias updates and entropies of n clients; the Eq. 9 distance between any two index sets, vectorised."""

    def __init__(self, bias_updates: FloatArray, entropies: FloatArray, lambda_entropy: float) -> None:
        db = np.asarray(bias_updates, dtype=np.float64)
        norms = np.linalg.norm(db, axis=1)
        self.nonzero = norms > 0
        self.unit = np.divide(db, norms[:, None], out=np.zeros_like(db), where=self.nonzero[:, None])
        self.entropies = np.asarray(entropies, dtype=np.float64)
        self.lambda_entropy = float(lambda_entropy)
        self.n = db.shape[0]

    def take(self, order: IntArray) -> HicsGeometry:
        """The same clients in another order."""
        out = object.__new__(HicsGeometry)
        out.nonzero, out.unit, out.entropies = self.nonzero[order], self.unit[order], self.entropies[order]
        out.lambda_entropy, out.n = self.lambda_entropy, self.n
        return out

    def row(self, i: int, lo: int, hi: int) -> FloatArray:
        """Distances from client i to clients lo..hi-1 (slices, no gathers: the coarsening's inner loop)."""
        cos = self.unit[lo:hi] @ self.unit[i]
        np.clip(cos, -1.0, 1.0, out=cos)
        angle = np.arccos(cos, out=cos)
        if self.nonzero[i]:
            angle *= self.nonzero[lo:hi]
        else:
            angle[:] = 0.0
        angle += self.lambda_entropy * np.abs(self.entropies[lo:hi] - self.entropies[i])
        return angle

    def __call__(self, a: IntArray | None, b: IntArray | None) -> FloatArray:
        def pick(x: np.ndarray, idx: IntArray | None) -> np.ndarray:
            return x if idx is None else x[idx]  # None: no gather copy (the coarsening asks for all points often)

        cos = np.clip(pick(self.unit, a) @ pick(self.unit, b).T, -1.0, 1.0)
        angle = np.arccos(cos)
        # A zero update has no direction: the official code's rule is angle 0 to everything (§1.11.2).
        angle *= pick(self.nonzero, a)[:, None] & pick(self.nonzero, b)[None, :]
        angle += self.lambda_entropy * np.abs(pick(self.entropies, a)[:, None] - pick(self.entropies, b)[None, :])
        return angle


# --- Gram-matrix distances (Clustered Sampling, DivFL) ------------------------------------------------------------


def angles_from_gram(gram: FloatArray) -> FloatArray:
    """arccos of the cosine similarity implied by inner products; 0 for pairs with a zero vector (Fraboni's rule)."""
    diag = np.diag(gram).copy()
    nonzero = diag > 0
    norms = np.sqrt(np.where(nonzero, diag, 1.0))
    cos = np.clip(gram / norms[:, None] / norms[None, :], -1.0, 1.0)
    angle = np.arccos(cos)
    angle *= nonzero[:, None] & nonzero[None, :]
    np.fill_diagonal(angle, 0.0)
    return angle


def euclidean_from_gram(gram: FloatArray) -> FloatArray:
    """‖g_i − g_j‖ from inner products (round-off below zero clipped, diagonal exactly 0)."""
    diag = np.diag(gram)
    d2 = np.maximum(diag[:, None] + diag[None, :] - 2.0 * gram, 0.0)
    np.fill_diagonal(d2, 0.0)
    return np.sqrt(d2)


# --- Ward -----------------------------------------------------------------------------------------------------------


def ward_from_matrix(distance: FloatArray, n_clusters: int, rows_as_features: bool = False) -> IntArray:
    """Exact Ward cut into at most `n_clusters` (scipy fcluster maxclust), canonical labels.

    Default: Ward on the condensed distances (seed-hicsfl.md §1.11.1's recommendation). `rows_as_features`: Ward on
    the rows of the distance matrix as Euclidean feature vectors, as the official HiCS-FL and CS code do (§1.12).
    """
    n = distance.shape[0]
    if n == 1 or n_clusters <= 1:
        return np.zeros(n, dtype=np.int64)
    if n_clusters >= n:
        return np.arange(n, dtype=np.int64)
    observations = distance if rows_as_features else squareform(distance, checks=False)
    tree = hierarchy.linkage(observations, method="ward", metric="euclidean")
    return canonical_labels(hierarchy.fcluster(tree, t=n_clusters, criterion="maxclust"))


def weighted_ward(distance: FloatArray, weights: FloatArray, n_clusters: int) -> IntArray:
    """Ward's method on weighted points (a weight-w point = w coincident points), cut into exactly
    min(n_clusters, n) clusters; canonical labels.

    Nearest-neighbour chain with the Lance–Williams update on squared Ward costs, starting from the cost of merging
    two weighted points, 2·w_i·w_j/(w_i + w_j)·d_ij². With unit weights it is scipy's Ward. The matrix is compacted
    to the live clusters whenever half of its rows are dead, so later merges touch fewer entries. The cut applies the
    n − k lowest merges (Ward is reducible, so they form a forest) as graph edges.
    """
    d = np.asarray(distance, dtype=np.float64)
    size = np.asarray(weights, dtype=np.float64).copy()
    n = d.shape[0]
    k = min(max(int(n_clusters), 1), n)
    if n == 1 or k == n:
        return np.arange(n, dtype=np.int64)
    sq = 2.0 * np.outer(size, size) / (size[:, None] + size[None, :]) * d * d
    np.fill_diagonal(sq, np.inf)
    point = np.arange(n)  # a point of the cluster in each slot, naming the cluster in the merge records
    live = np.ones(n, dtype=bool)
    merges_a = np.empty(n - 1, dtype=np.int64)
    merges_b = np.empty(n - 1, dtype=np.int64)
    heights = np.empty(n - 1, dtype=np.float64)
    chain: list[int] = []
    done = 0
    with np.errstate(invalid="ignore", over="ignore"):
        while done < n - 1:
            if 2 * (n - done) < live.size:  # compact: keep the live slots only
                keep = np.flatnonzero(live)
                slot = np.empty(live.size, dtype=np.int64)
                slot[keep] = np.arange(keep.size)
                sq, size, point = sq[np.ix_(keep, keep)], size[keep], point[keep]
                live = np.ones(keep.size, dtype=bool)
                chain = [int(slot[c]) for c in chain]
            if not chain:
                chain.append(int(np.argmax(live)))
            a = chain[-1]
            row = sq[a]
            b = int(np.argmin(row))
            if len(chain) > 1 and row[chain[-2]] <= row[b]:  # prefer the chain: guarantees termination on ties
                b = chain[-2]
            if len(chain) < 2 or b != chain[-2]:
                chain.append(b)
                continue
            del chain[-2:]
            i, j = (a, b) if a < b else (b, a)
            h2 = row[b]
            merges_a[done], merges_b[done], heights[done] = point[i], point[j], h2
            done += 1
            ni, nj = size[i], size[j]
            new = (ni * sq[i] + nj * sq[j] + size * (sq[i] + sq[j] - h2)) / (ni + nj + size)
            live[j] = False
            new[~live] = np.inf
            new[i] = np.inf
            sq[i, :] = new
            sq[:, i] = new
            sq[j, :] = np.inf
            sq[:, j] = np.inf
            size[i] = ni + nj
    # Lowest merges first; the stable sort keeps a child merge (made earlier, never higher) before its parent.
    order = np.argsort(heights, kind="stable")[: n - k]
    graph = coo_matrix((np.ones(order.size), (merges_a[order], merges_b[order])), shape=(n, n))
    _, labels = connected_components(graph, directed=False)
    return canonical_labels(labels)


def farthest_point_cover(geometry: HicsGeometry, count: int) -> tuple[IntArray, IntArray]:
    """Farthest-point traversal over clients sorted by Ĥ: `count` representatives (fewer if points repeat), from
    client 0; returns (representative indices, index into them of every client's nearest representative).

    Since d(u, k) >= λ|Ĥ_u − Ĥ_k|, a new representative can only be nearer than the current farthest distance r to
    clients within r/λ in Ĥ, a contiguous slice of the sorted order: each step touches only that slice, which
    shrinks as the cover refines. Deterministic.
    """
    n, h, lam = geometry.n, geometry.entropies, geometry.lambda_entropy
    reps = np.empty(count, dtype=np.int64)
    reps[0] = 0
    nearest = geometry.row(0, 0, n)
    nearest[0] = 0.0
    owner = np.zeros(n, dtype=np.int64)
    found = 1
    for j in range(1, count):
        far = int(np.argmax(nearest))
        radius = nearest[far]
        if radius <= 0.0:  # every client coincides with a representative
            break
        lo, hi = 0, n
        if lam > 0:
            lo = int(np.searchsorted(h, h[far] - radius / lam, side="left"))
            hi = int(np.searchsorted(h, h[far] + radius / lam, side="right"))
        d = geometry.row(far, lo, hi)
        d[far - lo] = 0.0
        window = nearest[lo:hi]
        closer = d < window
        owner[lo:hi][closer] = j
        np.minimum(window, d, out=window)
        reps[j] = far
        found += 1
    return reps[:found], owner


def ward_clusters(
    geometry: HicsGeometry, n_clusters: int, *, max_points: int, rows_as_features: bool = False
) -> IntArray:
    """Ward clusters of the geometry's clients (at most `n_clusters`): exact up to `max_points`, coarsened above
    (module doc)."""
    if n_clusters < 1:
        raise InvalidInput(f"num_clusters must be >= 1, got {n_clusters}")
    n = geometry.n
    if n <= max_points:
        return ward_from_matrix(geometry(None, None), n_clusters, rows_as_features)
    if rows_as_features:
        raise InvalidInput(
            f"ward_rows_as_features uses the {n}x{n} distance matrix as features, which exceeds max_ward_points="
            f"{max_points}; leave ward_rows_as_features off or raise max_ward_points"
        )
    order = np.argsort(geometry.entropies, kind="stable")
    by_entropy = geometry.take(order)
    reps, owner = farthest_point_cover(by_entropy, max(max_points, min(n_clusters, n)))
    weights = np.bincount(owner, minlength=reps.size).astype(np.float64)
    rep_labels = weighted_ward(by_entropy(reps, reps), weights, n_clusters)
    labels = np.empty(n, dtype=np.int64)
    labels[order] = rep_labels[owner]
    return canonical_labels(labels)


# --- DivFL ------------------------------------------------------------------------------------------------------------


def facility_location_greedy(distance: FloatArray, count: int, order: IntArray) -> IntArray:
    """Greedy minimisation of Σ_k min_{s∈S} d(k, s) over |S| = count (DivFL). Each step adds the candidate with the
    lowest resulting cost; ties go to the earliest candidate in `order` (a seeded permutation, so ties are fair).
    Returns indices in the order picked."""
    n = distance.shape[0]
    d = distance[:, order]  # columns in tie-break order
    best = np.full(n, np.inf)
    chosen = np.zeros(n, dtype=bool)
    picks = np.empty(count, dtype=np.int64)
    for step in range(count):
        cost = np.minimum(best[:, None], d).sum(axis=0)
        cost[chosen] = np.inf
        col = int(np.argmin(cost))
        chosen[col] = True
        picks[step] = col
        np.minimum(best, d[:, col], out=best)
    return order[picks]
