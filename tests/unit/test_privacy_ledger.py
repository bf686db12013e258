"""Ledger semantics: enforcement, idempotent replay, conflicts, persistence, non-private runs."""

from __future__ import annotations

import math
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fairfl.accounting import EventSpec, UnsoundAccounting, epsilon, max_rounds
from privacy_service.ledger import (
    Budget,
    BudgetConflict,
    BudgetExceeded,
    Event,
    InMemoryLedger,
    Ledger,
    NotPrivateRun,
    RoundConflict,
    SqliteLedger,
    UnaccountableRun,
    UnknownRun,
)

DELTA = 1e-5
CLIENTS = ("c0", "c1", "c2")


def round_events(clients: tuple[str, ...] = CLIENTS, steps: int = 1) -> list[Event]:
    """One FedFDP round: a gradient release (σ = 2) and a loss release (σ_l = 5) per client."""
    return [e for c in clients for e in (Event(c, "gradient", 0.05, 2.0, steps), Event(c, "loss", 0.05, 5.0, 1))]


def eps_after(rounds: int, steps: int = 1) -> float:
    return epsilon([EventSpec(0.05, 2.0, rounds * steps), EventSpec(0.05, 5.0, rounds)], DELTA)[0]


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    led = InMemoryLedger()
    yield led
    led.close()


def register(led: Ledger, run_id: str = "run", eps: float = 3.52, **kw: object) -> Budget:
    return led.register_budget(Budget(run_id, eps, DELTA, **kw))[0]  # type: ignore[arg-type]


def test_register_is_idempotent_and_budgets_are_immutable(ledger: Ledger) -> None:
    first, created = ledger.register_budget(Budget("run", 3.52, DELTA, orders=(2.0, 3.0)))
    assert created
    again, created = ledger.register_budget(Budget("run", 3.52, DELTA, orders=[2.0, 3.0]))  # type: ignore[arg-type]
    assert not created and again == first and again.created_at == first.created_at
    with pytest.raises(BudgetConflict, match="already has a different budget"):
        ledger.register_budget(Budget("run", 4.0, DELTA, orders=(2.0, 3.0)))
    with pytest.raises(BudgetConflict):
        ledger.register_budget(Budget("run", 3.52, DELTA))  # default orders differ from (2, 3)
    assert ledger.get_budget("run") == first


def test_budget_exactly_n_rounds(ledger: Ledger) -> None:
    n = 25
    register(ledger, eps=eps_after(n))  # the budget is exactly n rounds' spend
    assert ledger.remaining_rounds("run", round_events(("c0",))) == n
    for r in range(n):
        result = ledger.authorize_round("run", r, round_events())
        assert not result.replayed
        assert result.max_epsilon == pytest.approx(eps_after(r + 1))
    before = ledger.events("run")
    with pytest.raises(BudgetExceeded) as refused:
        ledger.authorize_round("run", n, round_events())
    err = refused.value
    assert err.principal in CLIENTS and err.spent == pytest.approx(eps_after(n + 1)) and err.target == eps_after(n)
    assert str(err.principal) in str(err) and "nothing was recorded" in str(err)
    # Nothing of the refused round was kept.
    assert ledger.events("run") == before
    assert ledger.rounds_recorded("run") == n
    spend = ledger.spend("run")
    assert [s.principal for s in spend] == list(CLIENTS)
    assert all(s.epsilon <= eps_after(n) and s.n_events == 2 * n for s in spend)
    assert ledger.remaining_rounds("run", round_events(("c0",))) == 0


def test_refusal_names_the_principal_over_budget(ledger: Ledger) -> None:
    register(ledger, eps=eps_after(10))
    for r in range(8):
        ledger.authorize_round("run", r, round_events(("c0",)))
    # c1 is fresh, c0 has spent 8 rounds: 3 more rounds' worth of steps in one round refuses c0 only.
    with pytest.raises(BudgetExceeded) as refused:
        ledger.authorize_round("run", 8, round_events(("c0", "c1"), steps=3))
    assert refused.value.principal == "c0"
    assert ledger.spend("run", "c1") == [("c1", 0.0, pytest.approx(math.nan, nan_ok=True), 0)]


def test_identical_replay_adds_nothing(ledger: Ledger) -> None:
    register(ledger)
    ledger.authorize_round("run", 0, round_events())
    ledger.authorize_round("run", 1, round_events())
    spend, events = ledger.spend("run"), ledger.events("run")
    # The same round again, events in another order: a retry after a lost reply.
    replay = ledger.authorize_round("run", 0, list(reversed(round_events())))
    assert replay.replayed and replay.max_epsilon == pytest.approx(eps_after(2))
    assert ledger.spend("run") == spend and ledger.events("run") == events and ledger.rounds_recorded("run") == 2


@pytest.mark.parametrize(
    "changed",
    [
        round_events(("c0", "c1")),  # a principal missing
        round_events(steps=2),  # a different count
        [*round_events(), Event("c9", "gradient", 0.05, 2.0, 1)],  # a principal more
        [Event(e.principal, e.mechanism, e.sample_rate, e.noise_multiplier * 1.01, e.count) for e in round_events()],
        [],
    ],
)
def test_conflicting_replay_is_refused(ledger: Ledger, changed: list[Event]) -> None:
    register(ledger)
    ledger.authorize_round("run", 0, round_events())
    spend = ledger.spend("run")
    with pytest.raises(RoundConflict, match="already recorded with different events"):
        ledger.authorize_round("run", 0, changed)
    assert ledger.spend("run") == spend and ledger.rounds_recorded("run") == 1


def test_persistence_across_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "ledger.sqlite")
    led = SqliteLedger(path)
    register(led, eps=10.0, orders=(2.0, 4.0, 8.0, 16.0, 32.0))
    for r in range(40):
        led.authorize_round("run", r, round_events())
    spend, events, budget = led.spend("run"), led.events("run"), led.get_budget("run")
    led.close()

    reopened = SqliteLedger(path)
    try:
        assert reopened.get_budget("run") == budget and reopened.get_budget("run").orders == budget.orders
        assert reopened.spend("run") == spend
        assert reopened.events("run") == events
        assert reopened.rounds_recorded("run") == 40
        assert reopened.authorize_round("run", 39, round_events()).replayed
        mode, sync = (reopened._db.execute(f"PRAGMA {p}").fetchone()[0] for p in ("journal_mode", "synchronous"))
        assert (mode, sync) == ("wal", 2)  # 2 = FULL
    finally:
        reopened.close()


def test_non_private_run_records_rounds_with_zero_epsilon(ledger: Ledger) -> None:
    register(ledger, eps=0.0, principal_kind="none")
    for r in range(5):
        assert ledger.authorize_round("run", r, []) == (False, 0.0)
    assert ledger.authorize_round("run", 4, []) == (True, 0.0)
    assert ledger.rounds_recorded("run") == 5 and ledger.spend("run") == [] and ledger.events("run") == []
    with pytest.raises(ValueError, match="non-private"):
        ledger.authorize_round("run", 5, round_events())
    with pytest.raises(NotPrivateRun):
        ledger.remaining_rounds("run", round_events(("c0",)))
    assert ledger.rounds_recorded("run") == 5


def test_spend_groups_mechanisms_and_matches_accountant(ledger: Ledger) -> None:
    register(ledger, eps=50.0, accountant="rdp")
    for r in range(30):
        steps = 1 + r % 3  # varying local steps per round
        ledger.authorize_round("run", r, round_events(("c0",), steps=steps))
    total = sum(1 + r % 3 for r in range(30))
    eps, order = epsilon([EventSpec(0.05, 2.0, total), EventSpec(0.05, 5.0, 30)], DELTA)
    [s] = ledger.spend("run", "c0")
    assert (s.epsilon, s.optimal_order, s.n_events) == (pytest.approx(eps, abs=1e-12), order, 60)
    assert ledger.remaining_rounds("run", round_events(("c0",))) == max_rounds(
        [EventSpec(0.05, 2.0, 1), EventSpec(0.05, 5.0, 1)],
        [EventSpec(0.05, 2.0, total), EventSpec(0.05, 5.0, 30)],
        50.0,
        DELTA,
    )


def test_pld_budget(ledger: Ledger) -> None:
    register(ledger, eps=1.0, accountant="pld", principal_kind="federation")
    fed = [Event("federation", "model", 0.1, 2.0, 10)]
    ledger.authorize_round("run", 0, fed)
    [s] = ledger.spend("run")
    assert s.principal == "federation" and math.isnan(s.optimal_order)
    assert s.epsilon == pytest.approx(epsilon([EventSpec(0.1, 2.0, 10)], DELTA, "pld")[0])
    assert s.epsilon < epsilon([EventSpec(0.1, 2.0, 10)], DELTA, "rdp")[0]


def test_unknown_run(ledger: Ledger) -> None:
    for call in (
        lambda: ledger.authorize_round("nope", 0, round_events()),
        lambda: ledger.spend("nope"),
        lambda: ledger.rounds_recorded("nope"),
        lambda: ledger.get_budget("nope"),
        lambda: ledger.remaining_rounds("nope", round_events(("c0",))),
    ):
        with pytest.raises(UnknownRun, match="register a budget first"):
            call()


@pytest.mark.parametrize(
    ("budget", "name"),
    [
        (Budget("", 1.0, DELTA), "run_id"),
        (Budget("r", 0.0, DELTA), "epsilon"),
        (Budget("r", math.inf, DELTA), "epsilon"),
        (Budget("r", 1.0, 0.0), "delta"),
        (Budget("r", 1.0, DELTA, accountant="gdp"), "accountant"),
        (Budget("r", 1.0, DELTA, principal_kind="user"), "principal_kind"),
        (Budget("r", 1.0, DELTA, orders=(0.5,)), "orders"),
        (Budget("r", 1.0, DELTA, accountant="pld", orders=(2.0,)), "orders"),
    ],
)
def test_bad_budget_is_refused(ledger: Ledger, budget: Budget, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ledger.register_budget(budget)


@pytest.mark.parametrize(
    ("events", "name"),
    [
        ([Event("", "gradient", 0.05, 2.0, 1)], r"events\[0\].principal"),
        ([Event("c0", "dp", 0.05, 2.0, 1)], r"events\[0\].mechanism"),
        ([Event("c0", "gradient", 0.0, 2.0, 1)], r"events\[0\].sample_rate"),
        ([Event("c0", "gradient", 0.05, 0.0, 1)], r"events\[0\].noise_multiplier"),
        ([Event("c0", "gradient", 0.05, 2.0, -1)], r"events\[0\].count"),
        ([Event("c0", "gradient", 0.05, 2.0, 10**13)], r"events\[0\].count"),
        ([Event("c0", "loss", 0.05, 2.0, 1), Event("c0", "loss", 0.05, 2.0, 1)], r"events\[1\] repeats"),
    ],
)
def test_bad_events_are_refused_and_change_nothing(ledger: Ledger, events: list[Event], name: str) -> None:
    register(ledger)
    with pytest.raises(ValueError, match=name):
        ledger.authorize_round("run", 0, events)
    with pytest.raises(ValueError, match="round"):
        ledger.authorize_round("run", -1, round_events())
    assert ledger.rounds_recorded("run") == 0 and ledger.events("run") == []


def test_concurrent_authorizations_never_overspend(tmp_path: Path) -> None:
    led = SqliteLedger(str(tmp_path / "ledger.sqlite"))
    n = 12
    register(led, eps=eps_after(n))
    granted: list[int] = []

    def worker(start: int) -> None:
        for r in range(start, 40, 4):
            try:
                led.authorize_round("run", r, round_events())
                granted.append(r)
            except BudgetExceeded:
                pass

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(granted) == n == led.rounds_recorded("run")
    assert max(s.epsilon for s in led.spend("run")) <= eps_after(n)
    led.close()


def test_locked_ledger_refuses_cleanly(tmp_path: Path) -> None:
    path = str(tmp_path / "ledger.sqlite")
    led = SqliteLedger(path)
    register(led)
    led.authorize_round("run", 0, round_events())
    # Another process holds the write lock: the round is refused with an error and nothing is half-written.
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    led._db.execute("PRAGMA busy_timeout=50")
    with pytest.raises(sqlite3.OperationalError):
        led.authorize_round("run", 1, round_events())
    other.execute("ROLLBACK")
    other.close()
    assert led.rounds_recorded("run") == 1
    assert not led.authorize_round("run", 1, round_events()).replayed
    led.close()


# --- the sound range (issue #18) --------------------------------------------------------------------------------------


def _state(led: SqliteLedger) -> tuple[list[tuple[object, ...]], ...]:
    """Every row of the ledger's tables: a refused call must leave all of them as they were."""
    return tuple(
        led._db.execute(f"SELECT * FROM {t} ORDER BY 1, 2, 3").fetchall() for t in ("rounds", "events", "totals")
    )


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize(
    ("event", "refusal", "match"),
    [
        # σ = 1e-156 used to be granted with ε = 0; 1e-300 and 1e300 used to raise ZeroDivisionError / OverflowError.
        (
            Event("c9", "gradient", 0.05, 1e-156, 1),
            ValueError,
            r"events\[6\].noise_multiplier must be in \[0.3, 10000\]",
        ),
        (Event("c9", "gradient", 0.05, 1e-300, 1), ValueError, r"events\[6\].noise_multiplier"),
        (Event("c9", "gradient", 1.0, 1e300, 1), ValueError, r"events\[6\].noise_multiplier"),
        (Event("c9", "gradient", 1e-300, 2.0, 1), ValueError, r"events\[6\].sample_rate must be in \[1e-06, 1\]"),
        (Event("c9", "gradient", 0.05, 2.0, 10**6 + 1), ValueError, r"events\[6\].count must be at most 1000000"),
        # In range, but below what the accountants resolve: ε = 0, refused rather than recorded.
        (Event("c9", "gradient", 0.001, 9000.0, 11), UnsoundAccounting, r"gives ε = 0\.0"),
        (Event("c9", "model", 1e-5, 1.0, 1), UnsoundAccounting, r"gives ε = 0\.0"),
    ],
)
def test_unaccountable_round_is_refused_and_changes_nothing(
    accountant: str, event: Event, refusal: type[Exception], match: str
) -> None:
    led = InMemoryLedger()
    register(led, accountant=accountant)
    led.authorize_round("run", 0, round_events())
    before, spent = _state(led), led.spend("run")
    with pytest.raises(refusal, match=match):
        led.authorize_round("run", 1, [*round_events(), event])
    assert _state(led) == before and led.spend("run") == spent and led.rounds_recorded("run") == 1
    assert not led.authorize_round("run", 1, round_events()).replayed  # the round itself still gets in
    led.close()


def test_round_on_which_rdp_and_pld_disagree_is_refused(ledger: Ledger) -> None:
    register(ledger, eps=50.0)
    with pytest.raises(UnsoundAccounting, match="RDP and PLD disagree"):
        ledger.authorize_round("run", 0, [Event("c0", "gradient", 0.01, 1000.0, 10**5)])
    assert ledger.rounds_recorded("run") == 0 and ledger.events("run") == []


@pytest.mark.parametrize(
    ("budget", "name"),
    [
        (Budget("r", 1e300, DELTA), r"epsilon must be in \[0.001, 100\]"),
        (Budget("r", 1e-300, DELTA), "epsilon"),
        (Budget("r", 1.0, 1e-300), r"delta must be in \[1e-12, 0.01\]"),
        (Budget("r", 1.0, DELTA, orders=(2.0, 1e300)), "orders must all be at most 10000"),
        (Budget("r", 1e300, 0.0, principal_kind="none"), "epsilon of a non-private run"),
        (Budget("r", 0.0, -1.0, principal_kind="none"), "delta of a non-private run"),
    ],
)
def test_budget_outside_the_sound_range_is_refused(ledger: Ledger, budget: Budget, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ledger.register_budget(budget)
    with pytest.raises(UnknownRun):
        ledger.get_budget("r")


def test_remaining_rounds_refuses_an_unaccountable_round_and_is_bounded(ledger: Ledger) -> None:
    register(ledger, eps=100.0)
    with pytest.raises(UnsoundAccounting, match=r"ε = 0\.0"):
        ledger.remaining_rounds("run", [Event("c0", "gradient", 0.001, 9000.0, 11)])
    # A round spending almost nothing: under PLD bounded by the compositions it handles (1e6), not searched to 1e9.
    register(ledger, "pld-run", eps=100.0, accountant="pld")
    assert ledger.remaining_rounds("pld-run", [Event("c0", "model", 1.0, 1e4, 10)]) == 10**5


def test_recorded_events_outside_the_range_make_spend_a_precondition_failure(tmp_path: Path) -> None:
    """A ledger file written before the range was enforced (here: by hand) can no longer state those principals' ε."""
    led = SqliteLedger(str(tmp_path / "ledger.sqlite"))
    register(led)
    led._db.execute("INSERT INTO totals VALUES ('run', 'old', 0.05, 1e-156, 1, 1)")
    with pytest.raises(UnaccountableRun, match="recorded events cannot be accounted"):
        led.spend("run")
    led.close()


def test_a_round_pld_finds_zero_below_the_rdp_bound_is_recorded_at_the_rdp_bound() -> None:
    """One step at q = 1e-4, σ = 5 is (0, δ)-DP by PLD and 0.0195 by RDP's looser bound: an RDP ledger records the
    bound; a PLD ledger, whose own number would be 0, refuses it."""
    rdp_ledger, pld_ledger = InMemoryLedger(), InMemoryLedger()
    register(rdp_ledger, accountant="rdp")
    register(pld_ledger, accountant="pld")
    event = Event("c9", "model", 1e-4, 5.0, 1)
    rdp_ledger.authorize_round("run", 0, [event])
    (spent,) = rdp_ledger.spend("run", "c9")
    assert spent.epsilon == pytest.approx(epsilon([EventSpec(1e-4, 5.0, 1)], DELTA)[0]) and spent.epsilon > 0
    with pytest.raises(UnsoundAccounting, match=r"PLD accountant gives ε = 0\.0"):
        pld_ledger.authorize_round("run", 0, [event])
    assert pld_ledger.rounds_recorded("run") == 0
    rdp_ledger.close()
    pld_ledger.close()
