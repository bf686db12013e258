"""How diverse a run's client selection was, measured against the labels of the clients it selected (issue #22).

    python scripts/selection_diversity.py RUN_DIR [RUN_DIR ...] [--json OUT.json] [--losses] [--top 5]
    python scripts/selection_diversity.py docs/results/hicsfl-fmnist-setting2      # every results.json below it

A run directory holds a results.json (`rounds[*].selected`, `rounds[*].fairness.mean`, `config`) and, from `fairfl
run`, rounds.csv (results.json lists only the evaluated rounds; rounds.csv every round's selection, read when
present); a directory without a results.json is searched for run directories below it. The run's federated partition
is rebuilt from its config with FairFL's own data code (fairfl.data.run.load_run_data: the split every agent derived
from the config and seed), giving each client's label histogram H (clients x classes). From the selections S (rounds
x clients, 1 = selected) it reports:

- distinct clients ever selected; the share of all selections taken by the 5 and 10 most-selected clients; the Gini
  coefficient of the per-client selection counts (0: every client equally often, (N-1)/N: one client always);
- per round, the label histogram of the union of the selected clients' training data (S @ H): how many classes hold
  >= 1% of it, how many classes are >= 5% of some selected client's data, its entropy (bits; log2 10 = 3.32 for
  10 classes) and the share of its largest class, each averaged over rounds;
- the whole run's union label distribution (selection counts @ H) against the federation's (column sums of H): their
  total variation distance (0: the selections saw the federation's label mix, 1: disjoint);
- the selections' share per ground-truth group of the partition (when it plants groups) and the most-selected
  clients with their dominant class.

With --losses, a run directory holding the run's final model (model.safetensors, written by `fairfl run`) also gets
the loss of that model on every client's training data (what power-of-choice ranks by) and on each class, and the
clients with the highest loss. Output: Markdown tables on stdout; --json writes every number.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runlib's folder, also when loaded by file path

from runlib import find_runs, load_final_model, load_run_config, migrate_legacy_keys  # puts the repository on the path

from fairfl.config import ExperimentConfig, experiment_from_dict
from fairfl.schema import ConfigError

UNION_CLASS_MIN = 0.01  # a class counts in a round's union histogram when it holds >= 1% of it
CLIENT_CLASS_MIN = 0.05  # ... or, the simpler count, when it is >= 5% of some selected client's data


# --- the run's record and partition ---------------------------------------------------------------------------------


@dataclass
class Run:
    label: str
    path: Path
    run_id: str
    config: dict[str, Any]
    selections: list[list[int]]  # per completed round, the client ids selected
    accuracy: list[tuple[int, float]]  # (round, mean client accuracy) of the evaluated rounds
    client_groups: list[int] | None


def load_run(path: Path) -> Run:
    """The run's record. results.json lists only the evaluated rounds (all of them with evaluation.every = 1), so the
    selections come from rounds.csv (every completed round, `selected` space-separated) when the directory has it."""
    results = json.loads((path / "results.json").read_text())
    accuracy = []
    for r in results["rounds"]:
        fairness = r.get("fairness") or {}
        if r.get("evaluated", True) and fairness.get("mean") is not None:
            accuracy.append((int(r["round"]), float(fairness["mean"])))
    selections = [[int(c) for c in r["selected"]] for r in results["rounds"]]
    if (path / "rounds.csv").is_file():
        with (path / "rounds.csv").open(newline="") as fh:
            selections = [[int(c) for c in row["selected"].split()] for row in csv.DictReader(fh)]
    completed = results.get("rounds_completed", len(selections))
    if len(selections) < completed:
        print(
            f"warning: {path}: selections of {len(selections)} of {completed} rounds (no rounds.csv)", file=sys.stderr
        )
    return Run(
        label=f"{path.parent.name}/{path.name}",
        path=path,
        run_id=str(results.get("run_id", "")),
        config=results["config"],
        selections=selections,
        accuracy=accuracy,
        client_groups=results.get("client_groups"),
    )


def partition_config(config: dict[str, Any]) -> ExperimentConfig:
    """The run's config as FairFL reads it (runlib.load_run_config, which migrates the fields an older schema had).
    The partition depends only on `seed` and `data`, so when the whole config is still rejected, those two are read
    alone, `data` migrated the same way (runlib.migrate_legacy_keys)."""
    try:
        return load_run_config(config)
    except ConfigError:
        data = migrate_legacy_keys(config)["data"]
        # clients_per_round 1: the default (10) would fail validation for a federation smaller than it.
        return experiment_from_dict(
            {"seed": config.get("seed", 0), "data": data, "selection": {"clients_per_round": 1}}
        )


@dataclass
class Partition:
    histograms: np.ndarray  # (clients, classes) training label counts
    groups: np.ndarray | None  # ground-truth group id per client, None when the partition plants none
    federated: Any  # fairfl.data.federated.FederatedData, for --losses


_PARTITIONS: dict[str, Partition] = {}


def load_partition(config: dict[str, Any]) -> Partition:
    """Rebuild the run's split (cached: runs of one comparison share it) and count each client's training labels."""
    from fairfl.data.run import load_run_data

    cfg = partition_config(config)
    key = json.dumps({"seed": cfg.seed, "data": asdict(cfg.data)}, sort_keys=True, default=str)
    if key not in _PARTITIONS:
        fed = load_run_data(cfg)
        owner, indices = owners(fed.train_indices)
        labels = fed.train.y[indices]
        histograms = np.zeros((fed.num_clients, fed.num_classes), dtype=np.int64)
        np.add.at(histograms, (owner, labels), 1)
        _PARTITIONS[key] = Partition(histograms, fed.groups, fed)
    return _PARTITIONS[key]


def owners(client_indices: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The per-client index arrays flattened: (owning client of each entry, sample index of each entry)."""
    sizes = np.array([len(ix) for ix in client_indices], dtype=np.int64)
    return np.repeat(np.arange(len(sizes)), sizes), np.concatenate(client_indices).astype(np.int64)


# --- the metrics ----------------------------------------------------------------------------------------------------


def selection_matrix(selections: list[list[int]], num_clients: int) -> np.ndarray:
    """(rounds, clients) 0/1: S[t, k] = 1 when client k was selected in round t."""
    s = np.zeros((len(selections), num_clients), dtype=np.int64)
    rows = np.repeat(np.arange(len(selections)), [len(sel) for sel in selections])
    s[rows, np.concatenate([np.asarray(sel, dtype=np.int64) for sel in selections] or [np.zeros(0, np.int64)])] = 1
    return s


def top_share(counts: np.ndarray, k: int) -> float:
    """Share of all selections taken by the k most-selected clients."""
    total = counts.sum()
    return float(np.sort(counts)[::-1][:k].sum() / total) if total else 0.0


def gini(counts: np.ndarray) -> float:
    """Gini coefficient of non-negative counts: 0 when all equal, (n-1)/n when one holds everything."""
    x = np.sort(np.asarray(counts, dtype=np.float64))
    n, total = x.size, x.sum()
    if n == 0 or total == 0:
        return 0.0
    ranks = np.arange(1, n + 1)
    return float(2.0 * (ranks * x).sum() / (n * total) - (n + 1) / n)


def normalise(h: np.ndarray) -> np.ndarray:
    """Rows (or a vector) of counts as distributions; all-zero rows stay zero."""
    h = np.asarray(h, dtype=np.float64)
    total = h.sum(axis=-1, keepdims=True)
    return np.divide(h, total, out=np.zeros_like(h), where=total > 0)


def entropy_bits(p: np.ndarray) -> np.ndarray:
    """Shannon entropy in bits of each row of p (0 log 0 = 0)."""
    logs = np.log2(p, out=np.zeros_like(p), where=p > 0)
    return -(p * logs).sum(axis=-1)


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    return float(0.5 * np.abs(normalise(p) - normalise(q)).sum())


@dataclass
class Diversity:
    rounds: int
    selections: int
    distinct_clients: int
    num_clients: int
    top5_share: float
    top10_share: float
    gini: float
    union_classes: float  # mean over rounds: classes with >= 1% of the union label histogram
    client_classes: float  # mean over rounds: classes >= 5% of some selected client's data
    union_entropy_bits: float  # mean over rounds
    top_class_share: float  # mean over rounds: mass of the union histogram's largest class
    run_tv: float  # TV distance between the run's union label distribution and the federation's
    run_distribution: list[float]
    federation_distribution: list[float]
    group_shares: list[float] | None
    most_selected: list[dict[str, Any]] = field(default_factory=list)


def diversity(selections: list[list[int]], histograms: np.ndarray, groups: np.ndarray | None, top: int) -> Diversity:
    """Every selection metric of one run: S (rounds x clients) against H (clients x classes)."""
    num_clients = histograms.shape[0]
    s = selection_matrix(selections, num_clients)
    counts = s.sum(axis=0)

    # Each round's union of the selected clients' training data, as a label histogram.
    union = normalise(s @ histograms)
    present = (normalise(histograms) >= CLIENT_CLASS_MIN).astype(np.int64)  # (clients, classes)
    client_classes = ((s @ present) > 0).sum(axis=1)

    # The whole run: every selection's data counted once per selection.
    run_hist = counts @ histograms
    federation_hist = histograms.sum(axis=0)

    group_shares = None
    if groups is not None and counts.sum():
        group_shares = (np.bincount(groups, weights=counts) / counts.sum()).tolist()

    client_mass = normalise(histograms)
    order = np.lexsort((np.arange(num_clients), -counts))[:top]  # most selected first, then lower id
    most = [
        {
            "client": int(k),
            "count": int(counts[k]),
            "dominant_class": int(client_mass[k].argmax()),
            "dominant_share": float(client_mass[k].max()),
            "group": None if groups is None else int(groups[k]),
        }
        for k in order
        if counts[k]
    ]
    return Diversity(
        rounds=len(selections),
        selections=int(counts.sum()),
        distinct_clients=int((counts > 0).sum()),
        num_clients=num_clients,
        top5_share=top_share(counts, 5),
        top10_share=top_share(counts, 10),
        gini=gini(counts),
        union_classes=float((union >= UNION_CLASS_MIN).sum(axis=1).mean()) if len(s) else 0.0,
        client_classes=float(client_classes.mean()) if len(s) else 0.0,
        union_entropy_bits=float(entropy_bits(union).mean()) if len(s) else 0.0,
        top_class_share=float(union.max(axis=1).mean()) if len(s) else 0.0,
        run_tv=total_variation(run_hist, federation_hist),
        run_distribution=normalise(run_hist).tolist(),
        federation_distribution=normalise(federation_hist).tolist(),
        group_shares=group_shares,
        most_selected=most,
    )


# --- losses at the final model (--losses) ---------------------------------------------------------------------------


@dataclass
class Losses:
    model_round: int
    class_loss: list[float]  # mean cross-entropy of the model on each class's training samples (the clients' union)
    class_accuracy: list[float]  # % correct on them
    highest: list[dict[str, Any]]  # clients with the highest mean training loss, highest first


def final_model_losses(run: Run, partition: Partition, top: int) -> Losses | None:
    """The run's final model (run_dir/model.safetensors) on every client's training data: per-sample cross-entropy,
    averaged per client (power-of-choice's F_k(θ)) and per class. None when the directory has no model file."""
    import torch

    loaded = load_final_model(run.path, run.run_id)
    if loaded is None:
        return None
    model, model_round = loaded
    fed = partition.federated
    owner, indices = owners(fed.train_indices)
    labels = fed.train.y[indices]
    losses, correct = [], []
    with torch.no_grad():
        for start in range(0, len(indices), 8192):
            chunk = indices[start : start + 8192]
            logits = model(torch.from_numpy(fed.train.x[chunk]))
            y = torch.from_numpy(fed.train.y[chunk])
            losses.append(torch.nn.functional.cross_entropy(logits, y, reduction="none").numpy())
            correct.append((logits.argmax(dim=1) == y).numpy())
    loss, hit = np.concatenate(losses), np.concatenate(correct)

    num_clients, num_classes = partition.histograms.shape
    client_loss = np.bincount(owner, weights=loss, minlength=num_clients) / np.bincount(owner, minlength=num_clients)
    per_class = np.bincount(labels, minlength=num_classes)
    class_loss = np.bincount(labels, weights=loss, minlength=num_classes) / np.maximum(per_class, 1)
    class_acc = 100.0 * np.bincount(labels, weights=hit, minlength=num_classes) / np.maximum(per_class, 1)
    mass = normalise(partition.histograms)
    order = np.lexsort((np.arange(num_clients), -client_loss))[:top]
    highest = [
        {
            "client": int(k),
            "loss": float(client_loss[k]),
            "dominant_class": int(mass[k].argmax()),
            "dominant_share": float(mass[k].max()),
            "group": None if partition.groups is None else int(partition.groups[k]),
        }
        for k in order
    ]
    return Losses(model_round, class_loss.tolist(), class_acc.tolist(), highest)


# --- the report -----------------------------------------------------------------------------------------------------


def measure(path: Path, top: int, with_losses: bool) -> dict[str, Any]:
    run = load_run(path)
    partition = load_partition(run.config)
    groups = None if partition.groups is None else partition.groups.tolist()
    if run.client_groups is not None and groups is not None and list(run.client_groups) != groups:
        raise SystemExit(f"{path}: the rebuilt partition's groups differ from results.json's client_groups")
    metrics = diversity(run.selections, partition.histograms, partition.groups, top)
    losses = final_model_losses(run, partition, top) if with_losses else None
    final = run.accuracy[-1] if run.accuracy else None
    acc = np.array([a for _, a in run.accuracy])
    return {
        "run": run.label,
        "path": str(path),
        "method": run.config.get("selection", {}).get("method"),
        "selection_params": run.config.get("selection", {}).get("params"),
        "final_round": final[0] if final else None,
        "final_accuracy": final[1] if final else None,
        "best_accuracy": float(acc.max()) if acc.size else None,
        "last10_accuracy": float(acc[-10:].mean()) if acc.size else None,  # mean of the last 10 evaluations
        "accuracy_swing": float(np.abs(np.diff(acc)).mean()) if acc.size > 1 else None,  # mean |Δ| between evals
        "evaluated_rounds": [r for r, _ in run.accuracy],
        "diversity": asdict(metrics),
        "losses": None if losses is None else asdict(losses),
    }


def _client(entry: dict[str, Any], value: str) -> str:
    group = "" if entry["group"] is None else f" g{entry['group']}"
    return f"{entry['client']} ({value}; c{entry['dominant_class']} {100 * entry['dominant_share']:.0f}%{group})"


def markdown(reports: list[dict[str, Any]]) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    lines = [
        "| run | selection | rounds | final acc (%) | acc, last 10 evals (%) | mean abs change between evals (pp) | "
        "distinct clients | top-5 share | top-10 share | Gini | "
        "classes/round (≥1% of union) | classes/round (≥5% of a client) | union entropy (bits) | top-class share | "
        "TV(run, federation) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in reports:
        d = r["diversity"]
        params = r["selection_params"] or {}
        method = r["method"] + ("" if not params else " " + ", ".join(f"{k}={v}" for k, v in params.items()))
        lines.append(
            f"| {r['run']} | {method} | {d['rounds']} | {pct(r['final_accuracy'])} | {pct(r['last10_accuracy'])} | "
            f"{pct(r['accuracy_swing'])} | "
            f"{d['distinct_clients']}/{d['num_clients']} | {d['top5_share']:.3f} | {d['top10_share']:.3f} | "
            f"{d['gini']:.3f} | {d['union_classes']:.2f} | {d['client_classes']:.2f} | "
            f"{d['union_entropy_bits']:.2f} | {d['top_class_share']:.3f} | {d['run_tv']:.3f} |"
        )
    lines += [
        "",
        "| run | selections per group | run's union label distribution, classes 0..C-1 (%) | most-selected clients "
        "(count; dominant class, share, group) |",
        "|---|---|---|---|",
    ]
    for r in reports:
        d = r["diversity"]
        groups = "n/a" if d["group_shares"] is None else " / ".join(f"{100 * g:.0f}%" for g in d["group_shares"])
        most = ", ".join(_client(e, f"×{e['count']}") for e in d["most_selected"])
        labels = " ".join(f"{100 * x:.0f}" for x in d["run_distribution"])
        lines.append(f"| {r['run']} | {groups} | {labels} | {most} |")
    federation = " ".join(f"{100 * x:.0f}" for x in reports[0]["diversity"]["federation_distribution"])
    lines += ["", f"Federation's label distribution (first run's partition, %): {federation}"]
    with_losses = [r for r in reports if r["losses"] is not None]
    if with_losses:
        lines += ["", "| run | model round | loss per class (0..C-1) | accuracy per class (%) | highest-loss clients |"]
        lines.append("|---|---:|---|---|---|")
        for r in with_losses:
            lo = r["losses"]
            per_class = " ".join(f"{x:.2f}" for x in lo["class_loss"])
            acc = " ".join(f"{x:.0f}" for x in lo["class_accuracy"])
            highest = ", ".join(_client(e, f"{e['loss']:.2f}") for e in lo["highest"])
            lines.append(f"| {r['run']} | {lo['model_round']} | {per_class} | {acc} | {highest} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (or folders holding them)")
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    parser.add_argument("--top", type=int, default=5, help="most-selected / highest-loss clients listed (default 5)")
    parser.add_argument("--losses", action="store_true", help="losses of the run's model.safetensors per client")
    args = parser.parse_args(argv)
    reports = [measure(path, args.top, args.losses) for path in find_runs(args.runs)]
    print(markdown(reports))
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
