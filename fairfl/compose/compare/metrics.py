"""The metrics a comparison aggregates over seeds, reports and tests claims on: names only, no computation."""

from __future__ import annotations

from fairfl.compose.results import FAIRNESS_COLUMNS

# Metrics aggregated over seeds: every final fairness metric plus wall time.
# Columns shown only when some run has them (DP and loss-fairness runs): FedFDP's Ψ as the strategy reports it (final
# round, and the mean over the last PSI_TAIL evaluated rounds: Ψ under DP is noisy) and the ε the privacy ledger
# recorded (largest over principals) after the final round. Ψ is printed in scientific notation.
EXTRA_METRICS = (
    ("psi", "Ψ (final round)", "e"),
    ("psi_tail", "Ψ (mean, last 5 evaluations)", "e"),
    # The same over the round's clients' losses at the global model, before their local steps (psi_before): the
    # global model's fairness, where Ψ after local training also measures how far each client fits its own data.
    ("psi_before_tail", "Ψ at the global model (mean, last 5 evaluations)", "e"),
    ("psi_test", "Ψ_test (global model)", "e"),
    ("epsilon", "ε spent (ledger)", "f4"),
    # Runs that cluster clients on a partition with true groups (Equitable-FL): NMI of found clusters vs true groups.
    ("nmi", "NMI (mean over rounds)", "f3"),
    ("nmi_all_groups", "NMI (rounds with every group)", "f3"),
    # With target_accuracy in the comparison file: the first evaluated round whose mean client accuracy reaches it.
    ("rounds_to_target", "Rounds to target", "f1"),
)
PSI_TAIL = 5
SEED_METRICS = (*FAIRNESS_COLUMNS, *(k for k, _, _ in EXTRA_METRICS), "wall_seconds")
