"""The ledger's per-principal totals: the GROUP BY of its events, migrated into version-1 files, never doubled."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

from fairfl.accounting import EventSpec, epsilon
from privacy_service.ledger import SCHEMA_VERSION, Budget, Event, SqliteLedger

DELTA = 1e-5

# The version-1 schema as it was shipped (events, budgets, rounds and the GROUP BY index; no totals table).
V1_SCHEMA = """
CREATE TABLE budgets (run_id TEXT PRIMARY KEY, epsilon REAL NOT NULL, delta REAL NOT NULL, accountant TEXT NOT NULL,
    principal_kind TEXT NOT NULL, orders TEXT, created_at REAL NOT NULL);
CREATE TABLE events (run_id TEXT NOT NULL, round INTEGER NOT NULL, principal TEXT NOT NULL, mechanism TEXT NOT NULL,
    sample_rate REAL NOT NULL, noise_multiplier REAL NOT NULL, count INTEGER NOT NULL, recorded_at REAL NOT NULL,
    PRIMARY KEY (run_id, round, principal, mechanism)) WITHOUT ROWID;
CREATE INDEX events_by_principal ON events (run_id, principal, sample_rate, noise_multiplier, count);
CREATE TABLE rounds (run_id TEXT NOT NULL, round INTEGER NOT NULL, recorded_at REAL NOT NULL,
    PRIMARY KEY (run_id, round)) WITHOUT ROWID;
PRAGMA user_version = 1;
"""


def grouped_events(path: Path) -> list[tuple]:
    with sqlite3.connect(path) as db:
        return db.execute(
            "SELECT run_id, principal, sample_rate, noise_multiplier, SUM(count), COUNT(*) FROM events "
            "GROUP BY run_id, principal, sample_rate, noise_multiplier ORDER BY 1, 2, 3, 4"
        ).fetchall()


def totals(path: Path) -> list[tuple]:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT * FROM totals ORDER BY 1, 2, 3, 4").fetchall()


def test_totals_are_the_grouped_events_after_mixed_rounds(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    led = SqliteLedger(str(path))
    for run in ("a", "b"):
        led.register_budget(Budget(run, 50.0, DELTA))
    # Rounds with different steps, a second σ for one client, and a replayed round (which must add nothing).
    plan = {
        1: [Event("0", "gradient", 0.05, 2.0, 3), Event("0", "loss", 0.05, 5.0, 1), Event("1", "gradient", 0.05, 2.0)],
        2: [Event("0", "gradient", 0.05, 2.0, 2), Event("1", "joint", 0.05, 1.857, 1)],
        3: [Event("1", "gradient", 0.1, 2.0, 4)],
    }
    for round_, events in plan.items():
        led.authorize_round("a", round_, events)
        led.authorize_round("b", round_, events[:1])
    assert led.authorize_round("a", 2, plan[2]).replayed
    led.close()
    assert totals(path) == grouped_events(path)
    assert ("a", "0", 0.05, 2.0, 5, 2) in totals(path)  # 3 + 2 steps in two event rows


def test_version_1_file_is_migrated_and_spend_is_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "v1.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(V1_SCHEMA)
        db.execute("INSERT INTO budgets VALUES ('run', 10.0, ?, 'rdp', 'client', NULL, 0.0)", (DELTA,))
        for round_ in range(1, 4):
            db.execute("INSERT INTO rounds VALUES ('run', ?, 0.0)", (round_,))
            for principal in ("0", "1"):
                for mechanism, sigma, count in (("gradient", 2.0, 2), ("loss", 5.0, 1)):
                    db.execute(
                        "INSERT INTO events VALUES ('run', ?, ?, ?, 0.05, ?, ?, 0.0)",
                        (round_, principal, mechanism, sigma, count),
                    )
    before = grouped_events(path)

    led = SqliteLedger(str(path))
    expected = epsilon([EventSpec(0.05, 2.0, 6), EventSpec(0.05, 5.0, 3)], DELTA)[0]
    spent = led.spend("run")
    assert [s.principal for s in spent] == ["0", "1"]
    assert all(math.isclose(s.epsilon, expected, rel_tol=1e-12) and s.n_events == 6 for s in spent)
    # The next round counts on top of the migrated totals.
    result = led.authorize_round("run", 4, [Event("0", "gradient", 0.05, 2.0, 2)])
    assert math.isclose(result.max_epsilon, epsilon([EventSpec(0.05, 2.0, 8), EventSpec(0.05, 5.0, 3)], DELTA)[0])
    led.close()

    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        indexes = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert "events_by_principal" not in indexes
    assert before != grouped_events(path)  # round 4 was added ...
    assert totals(path) == grouped_events(path)  # ... and the totals followed


def test_reopening_a_migrated_file_does_not_count_events_again(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    led = SqliteLedger(str(path))
    led.register_budget(Budget("run", 10.0, DELTA))
    led.authorize_round("run", 1, [Event("0", "gradient", 0.05, 2.0, 1)])
    first = led.spend("run")
    led.close()
    for _ in range(2):  # two more opens, one while another connection holds the file
        again = SqliteLedger(str(path))
        second = SqliteLedger(str(path))
        assert again.spend("run") == first == second.spend("run")
        again.close()
        second.close()
    assert totals(path) == grouped_events(path) == [("run", "0", 0.05, 2.0, 1, 1)]
