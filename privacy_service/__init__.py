"""FairFL privacy service: differential-privacy accounting and the persisted spend ledger."""

from privacy_service.ledger import Budget, BudgetExceeded, Event, InMemoryLedger, Ledger, SqliteLedger
from privacy_service.server import serve

__all__ = ["Budget", "BudgetExceeded", "Event", "InMemoryLedger", "Ledger", "SqliteLedger", "serve"]
