"""Model files: a run's global model as a safetensors file that rebuilds and loads without FairFL's services.

One float32 tensor per model parameter, named as in `model.named_parameters()` (the run's ParamLayout), with string
metadata saying what is needed to rebuild the model and to check the weights:

- `fairfl_format`: "1", the version of this layout of the file;
- `run_id`, `round`: the run and the round whose model it is (0: the initial model);
- `model`: JSON `{"name": ..., "params": {...}}`, the run's `model.name` and `model.params`;
- `data_signature`: JSON `{"input_shape": [...], "num_classes": n, "feature_names": [...] | null}`;
- `sha256`: hex sha256 of the flat model (the tensors in `tensor_order`, float32 little-endian bytes, concatenated):
  the same digest as RoundEvent.model_sha256 and results.json's final_model_sha256;
- `tensor_order`: JSON list of the tensor names in the model's parameter order (safetensors stores them sorted).

A user loads the weights into their own copy of the model with
`model.load_state_dict(safetensors.torch.load_file("model.safetensors"))`; `build_model_from_file` rebuilds the model
from the metadata (the model factory by name, with the run's data signature) and loads them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from fairfl.data.signature import DataSignature
from fairfl.params import ParamLayout
from fairfl.plugins import PluginError

if TYPE_CHECKING:
    from fairfl.config import ExperimentConfig

__all__ = [
    "FORMAT_VERSION",
    "MODEL_FILE_NAME",
    "ModelFileError",
    "ModelMetadata",
    "build_model_from_file",
    "build_model_from_metadata",
    "flat_from_tensors",
    "load_model_file",
    "model_sha256",
    "save_model",
    "save_run_model",
]

FORMAT_VERSION = "1"
MODEL_FILE_NAME = "model.safetensors"
_KEYS = ("fairfl_format", "run_id", "round", "model", "data_signature", "sha256", "tensor_order")


class ModelFileError(ValueError):
    """A model file cannot be written, read, verified or rebuilt; the message (one line) names the file and why."""


@dataclass(frozen=True)
class ModelMetadata:
    """What a model file says about its model. `sha256` and `tensor_order` are filled by save_model (a caller may
    set `sha256` to the digest it expects: save_model then refuses other weights)."""

    run_id: str
    round: int
    model_name: str
    model_params: dict[str, Any]
    data_signature: DataSignature
    sha256: str = ""
    tensor_order: tuple[str, ...] = ()
    extra: dict[str, str] = field(default_factory=dict)  # other metadata strings found in a file (e.g. "format")

    @classmethod
    def for_run(
        cls,
        config: ExperimentConfig,
        run_id: str,
        round_number: int,
        signature: DataSignature | None = None,
        sha256: str = "",
    ) -> ModelMetadata:
        """The metadata of a run's model after `round_number`; `signature` defaults to the dataset plug-in's
        declaration (fairfl.data.run_signature: no data is opened)."""
        if signature is None:
            from fairfl.data.run import run_signature

            signature = run_signature(config)
        return cls(run_id, round_number, config.model.name, dict(config.model.params), signature, sha256)

    def to_strings(self) -> dict[str, str]:
        """The safetensors metadata (strings only)."""
        sig = self.data_signature
        try:
            model = json.dumps({"name": self.model_name, "params": self.model_params}, sort_keys=True)
        except (TypeError, ValueError) as err:
            raise ModelFileError(f"model.params cannot be written as JSON: {err}") from None
        return {
            **self.extra,
            "format": "pt",  # what other safetensors tools (transformers) expect of a PyTorch file
            "fairfl_format": FORMAT_VERSION,
            "run_id": self.run_id,
            "round": str(int(self.round)),
            "model": model,
            "data_signature": json.dumps(
                {
                    "input_shape": list(sig.input_shape),
                    "num_classes": sig.num_classes,
                    "feature_names": None if sig.feature_names is None else list(sig.feature_names),
                }
            ),
            "sha256": self.sha256,
            "tensor_order": json.dumps(list(self.tensor_order)),
        }

    @classmethod
    def from_strings(cls, meta: Mapping[str, str] | None, where: str) -> ModelMetadata:
        """Parse a file's metadata; ModelFileError naming `where` and the field when it is not FairFL's."""
        if not meta or "fairfl_format" not in meta:
            raise ModelFileError(
                f"{where}: not a FairFL model file (its safetensors metadata has no fairfl_format); load it with "
                "safetensors.torch.load_file instead"
            )
        if meta["fairfl_format"] != FORMAT_VERSION:
            raise ModelFileError(
                f"{where}: model file format {meta['fairfl_format']!r}; this FairFL reads format {FORMAT_VERSION}"
            )
        missing = [k for k in _KEYS if k not in meta]
        if missing:
            raise ModelFileError(f"{where}: its metadata lacks {', '.join(missing)}")
        key = ""
        try:
            key = "round"
            round_number = int(meta["round"])
            key = "model"
            model = json.loads(meta["model"])
            name, params = model["name"], model["params"]
            if not isinstance(name, str) or not isinstance(params, dict):
                raise ValueError("expected {name: str, params: mapping}")
            key = "data_signature"
            raw = json.loads(meta["data_signature"])
            names = raw.get("feature_names")
            signature = DataSignature(
                tuple(raw["input_shape"]), raw["num_classes"], None if names is None else tuple(names)
            )
            key = "tensor_order"
            order = json.loads(meta["tensor_order"])
            if not isinstance(order, list) or not all(isinstance(n, str) for n in order):
                raise ValueError("expected a list of tensor names")
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ModelFileError(f"{where}: metadata {key!r} is malformed ({type(err).__name__}: {err})") from None
        extra = {k: v for k, v in meta.items() if k not in _KEYS}
        return cls(meta["run_id"], round_number, name, params, signature, meta["sha256"], tuple(order), extra)


def _le_float32(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's values as a contiguous little-endian float32 array (a view where it already is one)."""
    array = tensor.detach().to("cpu", torch.float32).contiguous().numpy()
    return np.ascontiguousarray(array, dtype="<f4")


def model_sha256(tensors: torch.Tensor | Iterable[torch.Tensor]) -> str:
    """sha256 of a flat model (or of its tensors in order): float32 little-endian bytes, as the engine digests the
    global model it publishes (fairfl.codec.encode_bundle), so it equals RoundEvent.model_sha256."""
    digest = hashlib.sha256()
    for tensor in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
        digest.update(memoryview(_le_float32(tensor)).cast("B"))
    return digest.hexdigest()


def flat_from_tensors(tensors: Mapping[str, torch.Tensor], order: Iterable[str]) -> torch.Tensor:
    """The flat float32 model: the tensors in `order`, flattened and concatenated."""
    return torch.cat([tensors[name].detach().reshape(-1).to(torch.float32) for name in order])


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_model(path: str | Path, layout: ParamLayout, flat: torch.Tensor, metadata: ModelMetadata) -> ModelMetadata:
    """Write `flat` (the model in `layout`) as a safetensors file at `path`, atomically (a temporary file in the same
    directory, then a rename: a reader sees the old file or the new one). Returns the metadata written (sha256 and
    tensor_order filled). ModelFileError when `metadata.sha256` is set and the weights have another digest, or the
    file cannot be written."""
    from safetensors.torch import save_file

    path = Path(path)
    flat = flat.detach().reshape(-1).to("cpu", torch.float32)
    if flat.numel() != layout.numel:
        raise ModelFileError(f"{path}: the model has {flat.numel()} values, its layout {layout.numel}")
    digest = model_sha256(flat)
    if metadata.sha256 and metadata.sha256 != digest:
        raise ModelFileError(
            f"{path}: the model's sha256 is {digest}, expected {metadata.sha256} (the run's final model): not written"
        )
    written = dataclasses.replace(metadata, sha256=digest, tensor_order=tuple(layout.names))
    strings = written.to_strings()
    # safetensors refuses tensors that share memory: the layout's views of `flat` are copied, one per parameter.
    tensors = {name: view.clone() for name, view in layout.split(flat)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=strings)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as err:
        raise ModelFileError(f"{path}: cannot write the model file: {err.strerror or err}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return written


def save_run_model(
    path: str | Path,
    config: ExperimentConfig,
    run_id: str,
    round_number: int,
    layout: ParamLayout,
    flat: torch.Tensor,
    signature: DataSignature | None = None,
    expected_sha256: str = "",
) -> ModelMetadata:
    """save_model with a run's metadata (ModelMetadata.for_run)."""
    metadata = ModelMetadata.for_run(config, run_id, round_number, signature, expected_sha256)
    return save_model(path, layout, flat, metadata)


def load_model_file(path: str | Path) -> tuple[dict[str, torch.Tensor], ModelMetadata]:
    """The tensors of a model file and its metadata, verified: every tensor float32, the names those of
    `tensor_order`, and their sha256 the one the metadata records. ModelFileError (one line) otherwise."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such model file")
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata()
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ModelFileError(f"{path}: not a readable safetensors file ({reason})") from None
    metadata = ModelMetadata.from_strings(meta, str(path))
    if sorted(tensors) != sorted(metadata.tensor_order) or len(set(metadata.tensor_order)) != len(tensors):
        raise ModelFileError(
            f"{path}: its tensors ({len(tensors)}) are not those its tensor_order names ({len(metadata.tensor_order)})"
        )
    for name in metadata.tensor_order:
        if tensors[name].dtype != torch.float32:
            raise ModelFileError(f"{path}: tensor {name!r} is {tensors[name].dtype}, a FairFL model is float32")
    digest = model_sha256(tensors[name] for name in metadata.tensor_order)
    if digest != metadata.sha256:
        raise ModelFileError(
            f"{path}: its tensors' sha256 is {digest}, its metadata says {metadata.sha256 or '(none)'}: the file was "
            "altered or corrupted"
        )
    return tensors, metadata


def _factory_kwargs(params: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    return dict(params)


def build_model_from_metadata(metadata: ModelMetadata, where: str = "the model file") -> nn.Module:
    """A fresh model as the run built it: the model factory `metadata.model_name` (a registered name, an entry point
    or package.module:attr, which must be importable here) with the run's parameters and data signature."""
    from fairfl.models import MODELS, factory_params

    try:
        factory = MODELS.load(metadata.model_name, "model.name")
        kwargs = _factory_kwargs(factory_params(factory, metadata.model_params, "model.params"))
        with torch.random.fork_rng(devices=[]):  # the weights come from the file; leave the caller's RNG alone
            torch.manual_seed(0)
            model = factory(metadata.data_signature, **kwargs)
    except (PluginError, TypeError, ValueError) as err:
        raise ModelFileError(
            f"{where}: cannot rebuild model {metadata.model_name!r}: {str(err).splitlines()[0] if str(err) else err}"
        ) from None
    if not isinstance(model, nn.Module):
        raise ModelFileError(
            f"{where}: model factory {metadata.model_name!r} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def build_model_from_file(path: str | Path) -> nn.Module:
    """The model of a model file: rebuilt from its metadata (build_model_from_metadata), its parameters set from the
    file's verified tensors, in eval mode. Buffers (none in FairFL's built-in models) keep the values the factory
    gives them: a FairFL run trains and exchanges parameters only."""
    tensors, metadata = load_model_file(path)
    model = build_model_from_metadata(metadata, str(path))
    layout = ParamLayout.of(model)
    if layout.names != metadata.tensor_order:
        raise ModelFileError(
            f"{path}: model {metadata.model_name!r} built here has parameters {list(layout.names)[:6]}, the file "
            f"{list(metadata.tensor_order)[:6]} (a different version of its factory?)"
        )
    for name, shape in zip(layout.names, layout.shapes, strict=True):
        if tuple(tensors[name].shape) != shape:
            raise ModelFileError(
                f"{path}: tensor {name!r} has shape {list(tensors[name].shape)}, model {metadata.model_name!r} built "
                f"here has {list(shape)}"
            )
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tensors[name])
    return model.eval()
