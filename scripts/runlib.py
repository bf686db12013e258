"""Shared pieces of the analysis scripts that read `fairfl run` directories (scripts/selection_diversity.py,
scripts/fedfdp_clip_binding.py): finding the run directories under the paths given, and loading a run's recorded
config (results.json's `config`) with FairFL's schema, migrating the keys an older schema had.

Importing it puts the repository on sys.path, so `fairfl` and the services import from the checkout.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fairfl.config import ExperimentConfig, experiment_from_dict  # noqa: E402  (the repository on the path first)
from fairfl.schema import ConfigError  # noqa: E402

# Keys of results.json configs written before the dataset and model plug-ins declared their parameters (issue #19),
# by section: the old key, the plug-in it belonged to and its parameter now. fairfl.config lists the same keys in
# DataConfig.MOVED_FIELDS and ModelConfig.MOVED_FIELDS, but as text for its error message ("model.params.hidden (of
# mlp or cnn)"), so the owners are spelled out here: the old model.hidden was the MLP's layers (a CNN's width was
# model.cnn_hidden), so it moves only for an mlp.
LEGACY_KEYS: dict[str, list[tuple[str, str, str]]] = {
    "data": [("synthetic_alpha", "synthetic", "alpha"), ("synthetic_beta", "synthetic", "beta")],
    "model": [("hidden", "mlp", "hidden"), ("cnn_channels", "cnn", "channels"), ("cnn_hidden", "cnn", "hidden")],
}
# The field of each section that names its plug-in.
PLUGIN_FIELD = {"data": "dataset", "model": "name"}


def find_runs(paths: Sequence[Path]) -> list[Path]:
    """Each path that holds a results.json, else every directory below it that does (sorted)."""
    found: list[Path] = []
    for path in paths:
        if (path / "results.json").is_file():
            found.append(path)
        else:
            below = sorted(p.parent for p in path.rglob("results.json"))
            if not below:
                raise SystemExit(f"{path}: no results.json in or below it")
            found.extend(below)
    return found


def migrate_legacy_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """A copy of a recorded config with every LEGACY_KEYS key moved to `<section>.params.<parameter>` when it belongs
    to the section's dataset or model, and dropped otherwise (the input is left as it is)."""
    migrated = json.loads(json.dumps(raw))
    for section, keys in LEGACY_KEYS.items():
        node = migrated.get(section) or {}
        owner = node.get(PLUGIN_FIELD[section])
        for old, plugin, param in keys:
            value = node.pop(old, None)
            if value is not None and owner == plugin:
                node.setdefault("params", {})[param] = value
    return migrated


def load_run_config(raw: dict[str, Any]) -> ExperimentConfig:
    """The run's config as FairFL reads it now. An older results.json holds every plug-in's parameters as fields of
    its section (e.g. model.cnn_channels); when the schema rejects the config, those are migrated
    (migrate_legacy_keys) and the config is read again, whose ConfigError, if any, is raised."""
    try:
        return experiment_from_dict(raw)
    except ConfigError:
        return experiment_from_dict(migrate_legacy_keys(raw))


def load_final_model(run_dir: Path, run_id: str = "", sha256: str = "") -> tuple[Any, int] | None:
    """The run's final model (run_dir/model.safetensors) as a torch module and its round, checked against the run's
    results.json (its run id and, when given, final_model_sha256); None when the directory has no model file."""
    from fairfl.model_file import MODEL_FILE_NAME, build_model_from_file, load_model_file

    path = run_dir / MODEL_FILE_NAME
    if not path.is_file():
        return None
    _, metadata = load_model_file(path)
    if run_id and metadata.run_id != run_id:
        raise SystemExit(f"{path}: model of run {metadata.run_id!r}, results.json is run {run_id!r}")
    if sha256 and metadata.sha256 != sha256:
        raise SystemExit(f"{path}: sha256 {metadata.sha256} is not results.json's final_model_sha256")
    return build_model_from_file(path), metadata.round
