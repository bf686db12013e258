"""Metrics shared by every service. Fairness metrics live in one module so all services report the same numbers."""

from fairfl.metrics.fairness import (
    FairnessReport,
    best_fraction,
    client_disagreement,
    coefficient_of_variation,
    fairness_report,
    jain_index,
    kl_to_uniform,
    loss_angle_degrees,
    mean_accuracy,
    nmi,
    pooled_accuracy,
    psi,
    std,
    variance,
    weight_entropy,
    worst_fraction,
)

__all__ = [
    "FairnessReport",
    "best_fraction",
    "client_disagreement",
    "coefficient_of_variation",
    "fairness_report",
    "jain_index",
    "kl_to_uniform",
    "loss_angle_degrees",
    "mean_accuracy",
    "nmi",
    "pooled_accuracy",
    "psi",
    "std",
    "variance",
    "weight_entropy",
    "worst_fraction",
]
