"""The privacy service's Prometheus metrics: ε spent per run and per principal, budget used, refused rounds.

The run's ε (largest over principals) is kept current on every authorized round from what the ledger already
computed. Per-principal ε costs one accountant evaluation per principal, so it is refreshed at scrape time and only
when a round was recorded since the last scrape. Metric definitions live in fairfl.telemetry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from fairfl import telemetry as t
from privacy_service.ledger import AuthorizeResult, Budget, Event, Ledger

log = logging.getLogger(__name__)

SCOPE = t.RunScope("privacy")
_current: list[PrivacyMetrics] = []  # the instance whose run the run-scoped series show


def _refresh_current() -> None:
    if _current:
        _current[0].refresh_principals()


t.on_collect(t.PRINCIPAL_EPSILON, _refresh_current)


class PrivacyMetrics:
    def __init__(self, ledger: Ledger, client_limit: int = t.DEFAULT_CLIENT_LIMIT) -> None:
        self.ledger = ledger
        self.client_limit = client_limit
        self.lock = threading.Lock()
        self.run_id: str | None = None
        self.budget_epsilon = 0.0
        self.epsilon = 0.0
        self.principals: set[str] = set()  # exported as labels; bounded by client_limit
        self.stale = False  # a round was recorded since per-principal ε was last computed

    def _tracked(self, principal: str) -> bool:
        """Client ids below the limit, and up to `client_limit` named principals (e.g. 'federation')."""
        if principal in self.principals:
            return True
        if principal.isdigit():
            return int(principal) < self.client_limit
        return sum(1 for p in self.principals if not p.isdigit()) < self.client_limit

    def _enter(self, run_id: str) -> None:
        """Make `run_id` the exported run; on a switch, start from what the ledger holds (e.g. after a restart)."""
        if SCOPE.enter(run_id) or self.run_id != run_id or not _current or _current[0] is not self:
            _current[:] = [self]
            self.run_id = run_id
            self.budget_epsilon = self.ledger.get_budget(run_id).epsilon
            spends = self.ledger.spend(run_id)
            self.epsilon = max((s.epsilon for s in spends), default=0.0)
            self.principals = set()
            for s in spends:
                if self._tracked(s.principal):
                    self.principals.add(s.principal)
            self.stale = True
            t.PRIVACY_BUDGET.labels(run_id).set(self.budget_epsilon)
            self._set_epsilon()

    def _set_epsilon(self) -> None:
        assert self.run_id is not None
        t.PRIVACY_EPSILON.labels(self.run_id).set(self.epsilon)
        # A non-private run (budget 0) can spend nothing: 0 used rather than 0/0.
        t.PRIVACY_USED.labels(self.run_id).set(self.epsilon / self.budget_epsilon if self.budget_epsilon > 0 else 0.0)

    def budget(self, budget: Budget) -> None:
        try:
            with self.lock:
                self._enter(budget.run_id)
        except Exception:  # metrics must never fail an RPC
            log.exception("privacy metrics: budget of run %s", budget.run_id)

    def authorized(self, run_id: str, result: AuthorizeResult, events: Sequence[Event]) -> None:
        t.ROUNDS_AUTHORIZED.inc()
        try:
            with self.lock:
                self._enter(run_id)
                self.epsilon = max(self.epsilon, result.max_epsilon)  # spend only grows
                self._set_epsilon()
                for e in events:
                    if self._tracked(e.principal):
                        self.principals.add(e.principal)
                self.stale = self.stale or bool(events)
        except Exception:
            log.exception("privacy metrics: round of run %s", run_id)

    def refused(self) -> None:
        t.ROUNDS_REFUSED.inc()

    def refresh_principals(self) -> None:
        with self.lock:
            if not self.stale or self.run_id is None:
                return
            for principal in sorted(self.principals):
                spent = self.ledger.spend(self.run_id, principal)[0].epsilon
                t.PRINCIPAL_EPSILON.labels(self.run_id, principal).set(spent)
            self.stale = False
