"""The persisted privacy ledger: budgets, the events every round spent, and enforcement of the budget.

Spend is never stored as a running ε: it is recomputed from the stored events on each query, so the ledger is an
audit trail and the accountant can be improved without migrating data. Events with the same (q, σ) are merged: the
`totals` table keeps each principal's summed count per (q, σ), updated in the same transaction that records the
events, so a budget check or an ε query reads one row per principal and mechanism, and its cost depends on the number
of principals and distinct mechanisms, not on the number of rounds recorded.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import sqlite3
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

from fairfl import accounting as acc
from fairfl.privacy import COUNT_MAX, EPSILON_RANGE, Budget, Event

PRINCIPAL_KINDS: tuple[str, ...] = ("client", "federation", "none")
MECHANISMS: tuple[str, ...] = ("gradient", "loss", "joint", "model")
# An event's compositions: the accountant's sound range, which also keeps SUM(count) far from SQLite's 64-bit limit.
MAX_COUNT = COUNT_MAX
MAX_ID_CHARS = 256
_IN_CHUNK = 500  # principals per IN (...) list, well below SQLite's bound-parameter limit

SCHEMA_VERSION = 2  # 2: the totals table (a version-1 file is migrated when opened)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS budgets (
    run_id TEXT PRIMARY KEY,
    epsilon REAL NOT NULL,
    delta REAL NOT NULL,
    accountant TEXT NOT NULL,
    principal_kind TEXT NOT NULL,
    orders TEXT,                -- JSON list; NULL = the accountant's default orders
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    principal TEXT NOT NULL,
    mechanism TEXT NOT NULL,
    sample_rate REAL NOT NULL,
    noise_multiplier REAL NOT NULL,
    count INTEGER NOT NULL,
    recorded_at REAL NOT NULL,
    PRIMARY KEY (run_id, round, principal, mechanism)
) WITHOUT ROWID;
-- Per principal and (q, σ): SUM(count) and COUNT(*) of its events, kept with them in each round's transaction.
CREATE TABLE IF NOT EXISTS totals (
    run_id TEXT NOT NULL,
    principal TEXT NOT NULL,
    sample_rate REAL NOT NULL,
    noise_multiplier REAL NOT NULL,
    count INTEGER NOT NULL,
    rows INTEGER NOT NULL,
    PRIMARY KEY (run_id, principal, sample_rate, noise_multiplier)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rounds (
    run_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    recorded_at REAL NOT NULL,
    PRIMARY KEY (run_id, round)
) WITHOUT ROWID;
"""
# From version 1: fill totals from the events (only while the file is still below version 2, so a second process that
# opened the same old file waits for the first one's transaction and then adds nothing), and drop version 1's index
# for the GROUP BY the totals replace.
_MIGRATE = """
INSERT INTO totals
    SELECT run_id, principal, sample_rate, noise_multiplier, SUM(count), COUNT(*) FROM events
    WHERE (SELECT user_version FROM pragma_user_version) < 2
    GROUP BY run_id, principal, sample_rate, noise_multiplier;
DROP INDEX IF EXISTS events_by_principal;
"""


# --- values -----------------------------------------------------------------------------------------------------------


class RecordedEvent(NamedTuple):
    round: int
    principal: str
    mechanism: str
    sample_rate: float
    noise_multiplier: float
    count: int
    recorded_at: float


class PrincipalSpend(NamedTuple):
    principal: str
    epsilon: float
    optimal_order: float  # nan for PLD or when nothing was spent
    n_events: int  # recorded event rows (each may hold count > 1 compositions)


class AuthorizeResult(NamedTuple):
    replayed: bool  # the identical round was already recorded; nothing was added
    max_epsilon: float  # largest spent ε among the round's principals, after recording


# --- errors -----------------------------------------------------------------------------------------------------------


class LedgerError(Exception):
    """Base class of the ledger's refusals. Whenever one is raised, the ledger is unchanged."""


class UnknownRun(LedgerError):
    def __init__(self, run_id: str) -> None:
        super().__init__(f"unknown run {run_id!r}: register a budget first with RegisterBudget")
        self.run_id = run_id


class BudgetConflict(LedgerError):
    """A different budget is already registered for the run (budgets are immutable)."""


class RoundConflict(LedgerError):
    """The round was already recorded with different events (a round's events are immutable)."""


class NotPrivateRun(LedgerError):
    """The query needs a private run, but the run was registered with principal kind 'none'."""


class UnaccountableRun(LedgerError):
    """The run's recorded events cannot be accounted (outside the accountant's sound range, e.g. recorded before it
    was enforced): their ε cannot be stated."""


class BudgetExceeded(LedgerError):
    def __init__(self, run_id: str, round_: int, principal: str, spent: float, target: float) -> None:
        super().__init__(
            f"round {round_} of run {run_id!r} refused: principal {principal!r} would reach ε = {spent:.6g} "
            f"> budget ε = {target:.6g}; nothing was recorded. Stop the run, or lower this round's spend "
            "(fewer steps, a lower sample rate or more noise)"
        )
        self.run_id = run_id
        self.round = round_
        self.principal = principal
        self.spent = spent
        self.target = target


# --- validation -------------------------------------------------------------------------------------------------------


def _check_id(value: str, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    if len(value) > MAX_ID_CHARS:
        raise ValueError(f"{name} must be at most {MAX_ID_CHARS} characters, got {len(value)}")
    return value


def _check_round(round_: int) -> int:
    if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0:
        raise ValueError(f"round must be an integer >= 0, got {round_!r}")
    return round_


def validate_budget(budget: Budget) -> Budget:
    """Normalised copy of `budget` (orders made a tuple or None) or ValueError naming the field."""
    _check_id(budget.run_id, "run_id")
    if budget.principal_kind not in PRINCIPAL_KINDS:
        raise ValueError(f"principal_kind must be one of {', '.join(PRINCIPAL_KINDS)}, got {budget.principal_kind!r}")
    acc.check_accountant(budget.accountant)
    orders = acc.check_orders(budget.orders)
    if budget.private:
        eps, delta = acc.check_epsilon(budget.epsilon, "epsilon"), acc.check_delta(budget.delta)
    else:  # a non-private run spends nothing, so ε and δ are informational only, but still sane numbers
        eps, delta = acc.check_finite(budget.epsilon, "epsilon"), acc.check_finite(budget.delta, "delta")
        if not 0.0 <= eps <= EPSILON_RANGE[1]:
            raise ValueError(f"epsilon of a non-private run must be in [0, {EPSILON_RANGE[1]:g}], got {eps!r}")
        if not 0.0 <= delta < 1.0:
            raise ValueError(f"delta of a non-private run must be in [0, 1), got {delta!r}")
    if orders is not None and budget.accountant != "rdp":
        raise ValueError("orders apply only to the RDP accountant; leave them empty for PLD")
    return dataclasses.replace(budget, epsilon=eps, delta=delta, orders=orders)


def validate_events(events: Iterable[Event], name: str = "events", principal_required: bool = True) -> list[Event]:
    out: list[Event] = []
    seen: set[tuple[str, str]] = set()
    for i, ev in enumerate(events):
        where = f"{name}[{i}]"
        principal = ev.principal
        if principal_required or principal:
            _check_id(principal, f"{where}.principal")
        if ev.mechanism not in MECHANISMS:
            raise ValueError(f"{where}.mechanism must be one of {', '.join(MECHANISMS)}, got {ev.mechanism!r}")
        count = acc.check_count(ev.count, f"{where}.count")
        if count > MAX_COUNT:
            raise ValueError(f"{where}.count must be at most {MAX_COUNT}, got {count}")
        event = Event(
            principal,
            ev.mechanism,
            acc.check_sample_rate(ev.sample_rate, f"{where}.sample_rate"),
            acc.check_noise_multiplier(ev.noise_multiplier, f"{where}.noise_multiplier"),
            count,
        )
        if event.key in seen:
            raise ValueError(
                f"{where} repeats principal {principal!r} with mechanism {ev.mechanism!r}; "
                "send one event per (principal, mechanism) and put the steps in count"
            )
        seen.add(event.key)
        out.append(event)
    return out


# --- accounting over grouped histories --------------------------------------------------------------------------------

History = dict[tuple[float, float], int]  # (q, σ) -> total count


def _signature(history: History) -> tuple[acc.EventSpec, ...]:
    return acc.group_events(acc.EventSpec(q, s, n) for (q, s), n in history.items())


def _cross_check(budget: Budget, events: Sequence[Event]) -> None:
    """RDP against PLD on each principal's events of the round (acc.cross_check, cached by their shape); raises
    acc.UnsoundAccounting on a disagreement or a zero ε. Principals of a round usually share one shape."""
    rounds: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for e in events:
        rounds[e.principal].append((e.sample_rate, e.noise_multiplier, e.count))
    orders = budget.orders if budget.accountant == "rdp" else None
    for shape in {tuple(spec) for spec in rounds.values()}:
        acc.cross_check([acc.EventSpec(*e) for e in shape], budget.delta, orders)


def _epsilons(budget: Budget, histories: dict[str, History]) -> dict[str, tuple[float, float]]:
    """ε per principal; principals with identical histories (the common case) share one computation."""
    by_signature: dict[tuple[acc.EventSpec, ...], tuple[float, float]] = {}
    out = {}
    for principal, history in histories.items():
        sig = _signature(history)
        if sig not in by_signature:
            by_signature[sig] = acc.epsilon(sig, budget.delta, budget.accountant, budget.orders)
        out[principal] = by_signature[sig]
    return out


# --- the ledger -------------------------------------------------------------------------------------------------------


class Ledger(abc.ABC):
    """Source of truth for a run's privacy spend. Every refusal leaves the ledger unchanged."""

    @abc.abstractmethod
    def register_budget(self, budget: Budget) -> tuple[Budget, bool]:
        """Store `budget`; returns (stored budget, created). Identical re-registration is a no-op; a different
        budget for a registered run raises BudgetConflict."""

    @abc.abstractmethod
    def get_budget(self, run_id: str) -> Budget:
        """The run's budget, or UnknownRun."""

    @abc.abstractmethod
    def authorize_round(self, run_id: str, round_: int, events: Sequence[Event]) -> AuthorizeResult:
        """Atomically check `events` against the budget and record them with the round.

        Identical replay -> replayed=True, nothing added. Different events for a recorded round -> RoundConflict.
        Any principal over budget -> BudgetExceeded, nothing recorded. Events outside the accountant's sound range,
        or whose ε it cannot resolve (0, not finite, RDP and PLD disagreeing) -> ValueError, nothing recorded."""

    @abc.abstractmethod
    def spend(self, run_id: str, principal: str | None = None) -> list[PrincipalSpend]:
        """Spent ε per principal (sorted by principal), recomputed from the stored events."""

    @abc.abstractmethod
    def rounds_recorded(self, run_id: str) -> int: ...

    @abc.abstractmethod
    def events(self, run_id: str) -> list[RecordedEvent]:
        """Every recorded event of the run, by round, for audit."""

    @abc.abstractmethod
    def remaining_rounds(self, run_id: str, per_round: Sequence[Event], principal: str | None = None) -> int:
        """How many more rounds of `per_round` events fit in the budget (minimum over the principals involved)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release resources."""


class SqliteLedger(Ledger):
    """Ledger in one SQLite file: WAL journal with synchronous=FULL, so a committed round survives a crash
    or power loss. One connection guarded by a lock (gRPC calls arrive on many threads); the whole check-and-record
    of a round runs in a single IMMEDIATE transaction, which also makes several processes on one file safe."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version not in range(SCHEMA_VERSION + 1):
            self._db.close()
            raise RuntimeError(f"{path}: ledger schema version {version}, this service knows {SCHEMA_VERSION}")
        try:  # one script, one transaction: a crash mid-creation (or mid-migration) leaves the file as it was
            self._db.executescript(
                f"BEGIN IMMEDIATE; {_SCHEMA} {_MIGRATE} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;"
            )
        except sqlite3.Error:
            self._db.close()
            raise

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        # The lock serialises this process's threads; BEGIN IMMEDIATE takes SQLite's write lock up front, so the
        # budget check and the insert see the same state even if another process shares the file.
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # also when COMMIT itself failed: never leave a transaction open
                    self._db.execute("ROLLBACK")
                raise

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                yield self._db
            finally:
                self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- helpers (caller holds a transaction) --

    @staticmethod
    def _budget(db: sqlite3.Connection, run_id: str) -> Budget:
        row = db.execute(
            "SELECT epsilon, delta, accountant, principal_kind, orders, created_at FROM budgets WHERE run_id = ?",
            (run_id,),
        ).fetchone()
        if row is None:
            raise UnknownRun(run_id)
        eps, delta, accountant, kind, orders, created = row
        orders_t = tuple(float(a) for a in json.loads(orders)) if orders is not None else None
        return Budget(run_id, eps, delta, accountant, kind, orders_t, created)

    @staticmethod
    def _histories(
        db: sqlite3.Connection, run_id: str, principals: Iterable[str] | None = None
    ) -> tuple[dict[str, History], dict[str, int]]:
        """(principal -> {(q, σ): total count}, principal -> event rows) for the run, or for `principals`."""
        histories: dict[str, History] = defaultdict(dict)
        n_events: dict[str, int] = defaultdict(int)
        query = "SELECT principal, sample_rate, noise_multiplier, count, rows FROM totals WHERE run_id = ? {}"
        if principals is None:
            batches: list[list[str]] = [[]]
        else:
            wanted = sorted(set(principals))
            batches = [wanted[i : i + _IN_CHUNK] for i in range(0, len(wanted), _IN_CHUNK)]
        for batch in batches:
            where = f"AND principal IN ({','.join('?' * len(batch))})" if batch else ""
            for principal, q, sigma, total, rows in db.execute(query.format(where), (run_id, *batch)):
                histories[principal][(q, sigma)] = total
                n_events[principal] += rows
        return dict(histories), dict(n_events)

    # -- API --

    def register_budget(self, budget: Budget) -> tuple[Budget, bool]:
        budget = validate_budget(budget)
        with self._transaction() as db:
            try:
                stored = self._budget(db, budget.run_id)
            except UnknownRun:
                created_at = time.time()
                orders = json.dumps(list(budget.orders)) if budget.orders is not None else None
                db.execute(
                    "INSERT INTO budgets VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        budget.run_id,
                        budget.epsilon,
                        budget.delta,
                        budget.accountant,
                        budget.principal_kind,
                        orders,
                        created_at,
                    ),
                )
                return dataclasses.replace(budget, created_at=created_at), True
            if stored != budget:
                raise BudgetConflict(
                    f"run {budget.run_id!r} already has a different budget (ε={stored.epsilon:g}, δ={stored.delta:g}, "
                    f"accountant={stored.accountant}, principal_kind={stored.principal_kind}, "
                    f"orders={'default' if stored.orders is None else list(stored.orders)}); budgets are immutable: "
                    "use a new run_id, or re-send exactly the registered budget"
                )
            return stored, False

    def get_budget(self, run_id: str) -> Budget:
        with self._read() as db:
            return self._budget(db, run_id)

    def authorize_round(self, run_id: str, round_: int, events: Sequence[Event]) -> AuthorizeResult:
        _check_round(round_)
        events = validate_events(events)
        with self._transaction() as db:
            budget = self._budget(db, run_id)
            if not budget.private and events:
                raise ValueError(
                    f"run {run_id!r} is non-private (principal_kind none): send AuthorizeRound without events"
                )
            if db.execute("SELECT 1 FROM rounds WHERE run_id = ? AND round = ?", (run_id, round_)).fetchone():
                return self._replay(db, budget, round_, events)
            if not events:
                db.execute("INSERT INTO rounds VALUES (?, ?, ?)", (run_id, round_, time.time()))
                return AuthorizeResult(False, 0.0)

            histories, _ = self._histories(db, run_id, {e.principal for e in events})
            for e in events:
                history = histories.setdefault(e.principal, {})
                history[(e.sample_rate, e.noise_multiplier)] = (
                    history.get((e.sample_rate, e.noise_multiplier), 0) + e.count
                )
            spent = _epsilons(budget, histories)
            # Deterministic culprit: the largest ε, ties broken by principal.
            worst, (worst_eps, _) = max(spent.items(), key=lambda kv: (kv[1][0], kv[0]))
            if worst_eps > budget.epsilon:
                raise BudgetExceeded(run_id, round_, worst, worst_eps, budget.epsilon)
            _cross_check(budget, events)  # after the budget: a round it refuses needs no second accountant
            now = time.time()
            db.executemany(
                "INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (run_id, round_, e.principal, e.mechanism, e.sample_rate, e.noise_multiplier, e.count, now)
                    for e in events
                ],
            )
            db.executemany(
                "INSERT INTO totals VALUES (?, ?, ?, ?, ?, 1) ON CONFLICT (run_id, principal, sample_rate, "
                "noise_multiplier) DO UPDATE SET count = count + excluded.count, rows = rows + 1",
                [(run_id, e.principal, e.sample_rate, e.noise_multiplier, e.count) for e in events],
            )
            db.execute("INSERT INTO rounds VALUES (?, ?, ?)", (run_id, round_, now))
            return AuthorizeResult(False, worst_eps)

    def _replay(self, db: sqlite3.Connection, budget: Budget, round_: int, events: list[Event]) -> AuthorizeResult:
        stored = {
            Event(*row)
            for row in db.execute(
                "SELECT principal, mechanism, sample_rate, noise_multiplier, count FROM events "
                "WHERE run_id = ? AND round = ?",
                (budget.run_id, round_),
            )
        }
        if stored != set(events):
            raise RoundConflict(
                f"round {round_} of run {budget.run_id!r} was already recorded with different events "
                f"({len(stored)} stored, {len(events)} sent); a recorded round cannot change: re-send exactly the "
                "recorded events to replay it, or authorize the new spend under a new round number"
            )
        principals = {e.principal for e in stored}
        if not principals:
            return AuthorizeResult(True, 0.0)
        histories, _ = self._histories(db, budget.run_id, principals)
        return AuthorizeResult(True, max(eps for eps, _ in _epsilons(budget, histories).values()))

    def spend(self, run_id: str, principal: str | None = None) -> list[PrincipalSpend]:
        if principal is not None:
            _check_id(principal, "principal")
        with self._read() as db:
            budget = self._budget(db, run_id)
            histories, n_events = self._histories(db, run_id, None if principal is None else [principal])
        if principal is not None and principal not in histories:
            return [PrincipalSpend(principal, 0.0, math.nan, 0)]
        try:
            spent = _epsilons(budget, histories)
        except ValueError as err:  # only recorded events are accounted here: the ledger, not the request, is at fault
            raise UnaccountableRun(f"run {run_id!r}: its recorded events cannot be accounted: {err}") from err
        return [PrincipalSpend(p, *spent[p], n_events[p]) for p in sorted(histories)]

    def rounds_recorded(self, run_id: str) -> int:
        with self._read() as db:
            self._budget(db, run_id)
            return db.execute("SELECT COUNT(*) FROM rounds WHERE run_id = ?", (run_id,)).fetchone()[0]

    def events(self, run_id: str) -> list[RecordedEvent]:
        with self._read() as db:
            self._budget(db, run_id)
            rows = db.execute(
                "SELECT round, principal, mechanism, sample_rate, noise_multiplier, count, recorded_at FROM events "
                "WHERE run_id = ? ORDER BY round, principal, mechanism",
                (run_id,),
            ).fetchall()
        return [RecordedEvent(*row) for row in rows]

    def remaining_rounds(self, run_id: str, per_round: Sequence[Event], principal: str | None = None) -> int:
        if principal is not None:
            _check_id(principal, "principal")
        per_round = validate_events(per_round, "per_round", principal_required=False)
        if not per_round:
            raise ValueError("per_round must hold the events of one round")
        groups: dict[str, list[acc.EventSpec]] = defaultdict(list)
        for i, e in enumerate(per_round):
            owner = e.principal or principal
            if owner is None:
                raise ValueError(f"per_round[{i}].principal is empty: name it, or set the request's principal")
            if principal is not None and owner != principal:
                raise ValueError(f"per_round[{i}].principal is {owner!r}, but the request asks about {principal!r}")
            groups[owner].append(acc.EventSpec(e.sample_rate, e.noise_multiplier, e.count))
        with self._read() as db:
            budget = self._budget(db, run_id)
            histories, _ = self._histories(db, run_id, groups)
        if not budget.private:
            raise NotPrivateRun(f"run {run_id!r} is non-private (principal_kind none): its rounds are not limited")
        for spec in groups.values():  # a round authorize_round would refuse as unaccountable is refused here too
            acc.epsilon(spec, budget.delta, budget.accountant, budget.orders)
            acc.cross_check(spec, budget.delta, budget.orders if budget.accountant == "rdp" else None)
        return min(
            acc.max_rounds(
                spec,
                [acc.EventSpec(q, s, n) for (q, s), n in histories.get(owner, {}).items()],
                budget.epsilon,
                budget.delta,
                budget.accountant,
                budget.orders,
            )
            for owner, spec in groups.items()
        )


class InMemoryLedger(SqliteLedger):
    """Same semantics as SqliteLedger, nothing persisted (tests, in-process experiments)."""

    def __init__(self) -> None:
        super().__init__(":memory:")
