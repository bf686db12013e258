"""Site admission: for a run whose data is at the sites, the data an agent says it serves must fit the run.

A run's `data.dataset` plug-in that declares `at_sites` (the `site` provider: docs/federation.md) holds no data
anywhere but at the sites; the aggregator knows only the signature the run declares (`fairfl.data.run_signature`,
nothing opened). Every agent reports its data's signature and its clients' sample counts when it registers
(RegisterRequest.data_signature, .client_data); one whose data cannot feed the run's model is refused with
FAILED_PRECONDITION naming the site and the field, so the run goes on with the others and the site's operator reads
what to fix. A site may hold fewer classes than the run (non-IID data), never more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from fairfl.config import ExperimentConfig
from fairfl.data import DataSignature, resolve_dataset, run_signature
from fairfl.v1 import federation_pb2

__all__ = [
    "REFUSAL_REASONS",
    "ClientCounts",
    "SiteRefused",
    "SiteReport",
    "SiteRun",
    "check_site",
    "format_ids",
    "site_label",
    "site_run_of",
]

# Bounded labels of fairfl_requests_refused_total for the refusals of this module.
NO_SIGNATURE = "no_data_signature"
SIGNATURE = "data_signature"
CLIENT_DATA = "client_data"
MAX_STRANGERS_KEPT = 8  # unregistered ids in client_data remembered for the refusal message
MAX_FEATURE_NAMES = 1 << 20  # a table's feature names kept from one registration (more fail the name check)
MAX_FEATURE_NAME_CHARS = 256
REFUSAL_REASONS = (NO_SIGNATURE, SIGNATURE, CLIENT_DATA)
SHOWN_CHARS = 64  # of a reported feature name in a message


@dataclass(frozen=True)
class SiteRun:
    """The run whose registrations are checked, and the signature its data plug-in declares."""

    run_id: str
    dataset: str  # data.dataset as the config names it
    signature: DataSignature


@dataclass(frozen=True)
class ClientCounts:
    num_train: int
    num_test: int


@dataclass(frozen=True)
class SiteReport:
    """What an agent says of the data it serves (RegisterRequest.data_signature and .client_data)."""

    input_shape: tuple[int, ...] = ()
    num_classes: int = 0
    feature_names: tuple[str, ...] = ()
    clients: dict[int, ClientCounts] = field(default_factory=dict)
    repeated: tuple[int, ...] = ()  # client ids listed more than once in client_data (the first entry is kept)
    strangers: tuple[int, ...] = ()  # client ids in client_data the agent does not register (a few, not kept)

    @classmethod
    def of(cls, request: federation_pb2.RegisterRequest) -> SiteReport:
        """The report, keeping counts of the registered clients only, so that what a registration stores is bounded
        by the clients its certificate may host whatever client_data holds."""
        registered = set(request.client_ids)
        clients: dict[int, ClientCounts] = {}
        repeated: list[int] = []
        strangers: list[int] = []
        for entry in request.client_data:
            if entry.client_id not in registered:
                if len(strangers) < MAX_STRANGERS_KEPT:
                    strangers.append(entry.client_id)
            elif entry.client_id in clients:
                repeated.append(entry.client_id)
            else:
                clients[entry.client_id] = ClientCounts(entry.num_train, entry.num_test)
        sig = request.data_signature
        names = tuple(name[:MAX_FEATURE_NAME_CHARS] for name in sig.feature_names[:MAX_FEATURE_NAMES])
        return cls(
            tuple(sig.input_shape), sig.num_classes, names, clients, tuple(repeated[:1]), tuple(sorted(strangers))
        )

    @property
    def given(self) -> bool:
        """Whether the agent reported a data signature at all (an agent started without --data reports none)."""
        return bool(self.input_shape or self.num_classes or self.feature_names)

    @property
    def train_samples(self) -> int:
        return sum(c.num_train for c in self.clients.values())

    def describe(self) -> str:
        """The signature as a log line shows it."""
        names = f", {len(self.feature_names)} feature names" if self.feature_names else ""
        return f"input_shape {list(self.input_shape)}, num_classes {self.num_classes}{names}"


class SiteRefused(Exception):
    """A registration whose data does not fit the run (FAILED_PRECONDITION); `reason` is a REFUSAL_REASONS label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def site_run_of(run_id: str, config: ExperimentConfig) -> SiteRun | None:
    """The run's expectation of its sites when its data plug-in declares `at_sites`, else None. Reads only the
    plug-in's declaration: no data is opened."""
    plugin = resolve_dataset(config.data.dataset)
    if not getattr(plugin, "at_sites", False):
        return None
    return SiteRun(run_id, str(config.data.dataset), run_signature(config))


def site_label(agent_name: str, certificate: str | None = None) -> str:
    """How messages name a site: its agent name and, under mutual TLS, its certificate's name."""
    name = repr(agent_name[:SHOWN_CHARS]) if agent_name else "(unnamed agent)"
    return name if certificate is None else f"{name} (certificate {certificate[:SHOWN_CHARS]!r})"


def check_site(run: SiteRun, site: str, report: SiteReport, client_ids: Sequence[int]) -> None:
    """Raise SiteRefused, its message naming the site and the field, unless `report` fits `run`'s signature and
    gives every one of `client_ids` (the clients the agent registers) its sample counts."""
    prefix = f"site {site} refused for run {run.run_id}: "
    problem = _signature_problem(run, report)
    if problem is not None:
        reason, text = problem
        raise SiteRefused(reason, prefix + text)
    problem_text = _client_data_problem(report, client_ids)
    if problem_text is not None:
        raise SiteRefused(CLIENT_DATA, prefix + problem_text)


def _signature_problem(run: SiteRun, report: SiteReport) -> tuple[str, str] | None:
    expected = run.signature
    if not report.given:
        return NO_SIGNATURE, (
            f"the agent reports no data_signature, and the run's data (data.dataset {run.dataset!r}) is at the "
            "sites; start the agent with `--data SPEC` (env FAIRFL_DATA) naming this site's data"
        )
    shape, want = list(report.input_shape), list(expected.input_shape)
    if shape != want:
        features = math.prod(shape) if shape else 0
        hint = ""
        if features == expected.num_features:
            reshape = "x".join(str(d) for d in want)
            hint = f"; the same {features} features in another shape: give the agent's --data `shape={reshape}`"
        return SIGNATURE, (
            f"data_signature.input_shape is {shape}, the run expects {want} ({expected.num_features} features){hint}"
        )
    names = report.feature_names
    if names and len(names) != expected.num_features:
        return SIGNATURE, f"data_signature.feature_names has {len(names)} names for {expected.num_features} features"
    if names and expected.feature_names is not None and names != expected.feature_names:
        at = next(i for i, (a, b) in enumerate(zip(names, expected.feature_names, strict=True)) if a != b)
        order = (
            "; the same names in another order: order the site's columns as the run's"
            if sorted(names) == sorted(expected.feature_names)
            else ""
        )
        return SIGNATURE, (
            f"data_signature.feature_names[{at}] is {names[at][:SHOWN_CHARS]!r}, the run expects "
            f"{expected.feature_names[at][:SHOWN_CHARS]!r}{order}"
        )
    if report.num_classes < 1:
        return SIGNATURE, (
            f"data_signature.num_classes is {report.num_classes}: the site reports no classes; the run has "
            f"{expected.num_classes}"
        )
    if report.num_classes > expected.num_classes:
        return SIGNATURE, (
            f"data_signature.num_classes is {report.num_classes}, the run expects at most {expected.num_classes} "
            f"(labels 0..{expected.num_classes - 1})"
        )
    return None


def _client_data_problem(report: SiteReport, client_ids: Sequence[int]) -> str | None:
    registered = set(client_ids)
    if report.repeated:
        return f"client_data lists client {report.repeated[0]} more than once"
    strangers = sorted({*report.strangers, *(set(report.clients) - registered)})
    if strangers:
        return (
            f"client_data names client {strangers[0]}, which the agent does not register (client_ids "
            f"{format_ids(sorted(registered))}); report sample counts of registered clients only"
        )
    without = sorted(registered - set(report.clients))
    if without:
        return (
            f"client_data has no entry for client {without[0]}"
            f"{f' (and {len(without) - 1} more)' if len(without) > 1 else ''}: every registered client reports its "
            "sample counts"
        )
    empty = sorted(cid for cid, counts in report.clients.items() if counts.num_train == 0)
    if empty:
        return (
            f"client_data: client {empty[0]} has num_train 0"
            f"{f' (and {len(empty) - 1} more clients)' if len(empty) > 1 else ''}: a client without training samples "
            "cannot train; give it data or leave it out of the agent's --clients"
        )
    return None


def format_ids(ids: list[int], shown: int = 8) -> str:
    """'0-3,7' for a sorted id list (at most `shown` ranges, then '…')."""
    ranges: list[tuple[int, int]] = []
    for cid in ids:
        if ranges and cid == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], cid)
        else:
            ranges.append((cid, cid))
    text = ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges[:shown])
    return text + (",…" if len(ranges) > shown else "")
