"""Stateless clustering building blocks: Equitable-FL spectral clustering and its equal cluster weights
(seed-equitable.md §1.5–1.7), hierarchical (Ward) clustering as used by HiCS-FL and Clustered Sampling
(seed-hicsfl.md §1.6, §1.11). Labels are always 0..k-1 in order of first appearance, so results are comparable
across calls and transports whatever ids the underlying algorithm picked.
"""

from __future__ import annotations

import warnings

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.cluster import hierarchy
from scipy.spatial.distance import squareform

from clustering_service.errors import InvalidInput

LINKAGES = ("ward", "average", "complete", "single")
# Relative asymmetry tolerated in a similarity/distance matrix: float32 transport and BLAS round-off, not real data.
_SYMMETRY_RTOL = 1e-5


def canonical_labels(labels: ArrayLike) -> NDArray[np.int64]:
    """Relabel to 0..k-1 in order of first appearance (a partition has one canonical labelling)."""
    lab = np.asarray(labels)
    if lab.size == 0:
        return np.zeros(0, dtype=np.int64)
    _, first, inverse = np.unique(lab, return_index=True, return_inverse=True)
    rank = np.empty(first.size, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(first.size)
    return rank[inverse.reshape(-1)]


def _finite_matrix(x: ArrayLike, what: str) -> NDArray[np.float64]:
    m = np.asarray(x, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] == 0 or m.shape[1] == 0:
        raise InvalidInput(f"{what} must be a non-empty 2-D matrix, got shape {list(m.shape)}")
    if not np.isfinite(m).all():
        raise InvalidInput(f"{what} contains NaN or inf")
    return m


def _symmetric(x: ArrayLike, what: str) -> NDArray[np.float64]:
    """Validate a square, (numerically) symmetric matrix and return its exactly symmetric part."""
    m = _finite_matrix(x, what)
    if m.shape[0] != m.shape[1]:
        raise InvalidInput(f"{what} must be square, got shape {list(m.shape)}")
    scale = float(np.abs(m).max())
    if np.abs(m - m.T).max() > _SYMMETRY_RTOL * max(scale, np.finfo(np.float64).tiny):
        raise InvalidInput(f"{what} is not symmetric")
    return (m + m.T) / 2


def _check_n_clusters(n_clusters: int, n: int) -> None:
    if not 1 <= n_clusters <= n:
        raise InvalidInput(f"num_clusters must be in [1, {n}] (number of clients), got {n_clusters}")


def similarity_from_rows(rows: ArrayLike) -> NDArray[np.float64]:
    """Equitable-FL's S = A Aᵀ: raw inner products of the rows (linear kernel, no normalisation; §1.5)."""
    a = _finite_matrix(rows, "rows")
    return a @ a.T


def distance_from_similarity(similarity: ArrayLike) -> NDArray[np.float64]:
    """Euclidean distances implied by an inner-product similarity: d_ij² = S_ii + S_jj − 2 S_ij.

    Exact for S = A Aᵀ (so Ward on S equals Ward on A); for a cosine similarity it gives the chordal distance.
    """
    s = _symmetric(similarity, "similarity")
    diag = np.diag(s)
    d2 = np.maximum(diag[:, None] + diag[None, :] - 2.0 * s, 0.0)  # clip round-off below zero
    np.fill_diagonal(d2, 0.0)
    return np.sqrt(d2)


def spectral_clusters(similarity: ArrayLike, n_clusters: int, seed: int) -> NDArray[np.int64]:
    """Equitable-FL "getprobs": k-means on the rows of the top-C eigenvectors of the symmetric affinity S itself
    (not a Laplacian, rows not normalised; §1.6). k-means++ with n_init=10, seeded from `seed`."""
    s = _symmetric(similarity, "similarity")
    n = s.shape[0]
    _check_n_clusters(n_clusters, n)
    if n_clusters == 1:
        return np.zeros(n, dtype=np.int64)
    # Imported here: scikit-learn adds ~1.5 s to process start, and only Cluster calls need it (health comes first).
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    _, vectors = np.linalg.eigh(s)  # ascending eigenvalues
    embedding = vectors[:, -n_clusters:]
    # sklearn wants a 32-bit seed; folding keeps any uint64 run seed usable and deterministic.
    kmeans = KMeans(n_clusters=n_clusters, n_init=10, random_state=int(seed) % 2**32)
    with warnings.catch_warnings():
        # Duplicate signatures give fewer distinct points than clusters; equal_cluster_weights copes (C_present).
        warnings.simplefilter("ignore", ConvergenceWarning)
        labels = kmeans.fit_predict(embedding)
    return canonical_labels(labels)


def hierarchical_clusters(
    data: ArrayLike, n_clusters: int, linkage: str = "ward", *, precomputed: bool = False
) -> NDArray[np.int64]:
    """Agglomerative clustering cut into at most `n_clusters` clusters (scipy fcluster "maxclust").

    `data` is [n, D] feature rows (Euclidean), or with `precomputed=True` an [n, n] distance matrix; Ward on
    precomputed distances assumes they are Euclidean (seed-hicsfl.md §1.11 recommends exactly this). Ties can yield
    fewer clusters than asked for.
    """
    if linkage not in LINKAGES:
        raise InvalidInput(f"linkage must be one of {', '.join(LINKAGES)}, got {linkage!r}")
    if precomputed:
        dist = _symmetric(data, "distance")
        if (dist < 0).any():
            raise InvalidInput("distance has negative entries")
        n = dist.shape[0]
        observations = squareform(dist, checks=False)  # condensed upper triangle; the diagonal is ignored
    else:
        observations = _finite_matrix(data, "rows")
        n = observations.shape[0]
    _check_n_clusters(n_clusters, n)
    if n == 1 or n_clusters == 1:
        return np.zeros(n, dtype=np.int64)
    tree = hierarchy.linkage(observations, method=linkage, metric="euclidean")
    return canonical_labels(hierarchy.fcluster(tree, t=n_clusters, criterion="maxclust"))


def cluster_sizes(labels: ArrayLike) -> NDArray[np.int64]:
    """Clients per label for canonical labels 0..k-1."""
    return np.bincount(np.asarray(labels, dtype=np.int64))


def equal_cluster_weights(labels: ArrayLike) -> NDArray[np.float64]:
    """Equitable-FL eq. 6 with empty clusters dropped: w_i = 1 / (C_present · |cluster of i|) (§1.7 edge cases).

    Weights sum to 1 and every present cluster gets 1/C_present, however many clients it holds.
    """
    lab = np.asarray(labels)
    if lab.ndim != 1 or lab.size == 0:
        raise InvalidInput(f"labels must be a non-empty 1-D sequence, got shape {list(lab.shape)}")
    _, inverse, counts = np.unique(lab, return_inverse=True, return_counts=True)
    return 1.0 / (counts.size * counts[inverse.reshape(-1)].astype(np.float64))


def nmi(true_groups: ArrayLike, found: ArrayLike) -> float:
    """NMI of found clusters against true groups; the shared fairness metric, so every service reports the same."""
    from fairfl.metrics.fairness import nmi as shared_nmi  # lazy for the same reason: it pulls in scikit-learn

    try:
        return shared_nmi(true_groups, found)
    except ValueError as err:
        raise InvalidInput(str(err)) from None
