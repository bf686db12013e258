"""The privacy ledger in-process: the privacy service's own ledger code, in memory, behind the engine's PrivacyGate.

In-process runs (`fairfl run --transport inprocess`, the oracle the gRPC path is tested against, tests) account
privacy with exactly the code the privacy service runs. It lives in the composition layer because it joins two
services: the aggregator's round engine (aggregator_service) and the ledger (privacy_service), which may not import
each other.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aggregator_service.dp import check_accountable, round_events, run_budget
from aggregator_service.engine import RunRefused
from aggregator_service.peers import budget_exhausted
from fairfl.config import ExperimentConfig
from fairfl.privacy import Budget, Event
from privacy_service.ledger import BudgetExceeded, LedgerError, SqliteLedger

__all__ = ["LocalPrivacy"]


class LocalPrivacy:
    """The same ledger code in-process, in memory."""

    def __init__(self) -> None:
        self.ledger = SqliteLedger(":memory:")
        self.run_ids: list[str] = []

    def start(self, run_id: str, config: ExperimentConfig) -> None:
        if config.privacy.enabled:  # refuse an unaccountable run here, before round 1, naming the config fields
            check_accountable(config)
        self.ledger.register_budget(run_budget(run_id, config))
        if run_id not in self.run_ids:
            self.run_ids.append(run_id)

    def state_dict(self) -> dict[str, Any]:
        """The in-memory ledger (budgets and recorded events), so a resumed run keeps counting from where it was."""
        runs = []
        for run_id in self.run_ids:
            events = [
                [e.round, e.principal, e.mechanism, e.sample_rate, e.noise_multiplier, e.count]
                for e in self.ledger.events(run_id)
            ]
            runs.append({"budget": dataclasses.asdict(self.ledger.get_budget(run_id)), "events": events})
        return {"runs": runs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for run in state.get("runs", []):
            budget = dict(run["budget"])
            orders = budget.get("orders")
            budget["orders"] = None if orders is None else tuple(orders)
            self.ledger.register_budget(Budget(**budget))
            if budget["run_id"] not in self.run_ids:
                self.run_ids.append(budget["run_id"])
            rounds: dict[int, list[Event]] = {}
            for round_, principal, mechanism, q, sigma, count in run["events"]:
                rounds.setdefault(int(round_), []).append(Event(principal, mechanism, q, sigma, int(count)))
            for round_, events in sorted(rounds.items()):  # each prefix was within budget when first recorded
                self.ledger.authorize_round(budget["run_id"], round_, events)

    def authorize_round(
        self, run_id: str, round_number: int, config: ExperimentConfig, selected: list[int], population: int
    ) -> float:
        try:
            events = round_events(config, selected, population)
            return self.ledger.authorize_round(run_id, round_number, events).max_epsilon
        except BudgetExceeded as err:
            raise budget_exhausted(str(err)) from err
        except (LedgerError, ValueError) as err:  # what the privacy service answers with a status
            raise RunRefused(f"the privacy ledger refused round {round_number}: {err}") from err
