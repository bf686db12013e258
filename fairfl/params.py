"""Flat parameter vectors: the server holds a model as one float32 vector plus its layout (names and shapes).

Aggregation is then one vectorised operation over [clients, params], and a model bundle on the wire is exactly the
vector's bytes split by tensor, so decoding a received model or update is a zero-copy view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fairfl import codec
from fairfl.v1 import tensor_pb2


@dataclass(frozen=True)
class ParamLayout:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, model: nn.Module) -> ParamLayout:
        named = list(model.named_parameters())
        return cls(tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named))

    @property
    def sizes(self) -> list[int]:
        return [int(torch.Size(s).numel()) for s in self.shapes]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def nbytes(self) -> int:
        return self.numel * 4

    def specs(self) -> list[tensor_pb2.TensorSpec]:
        return [
            tensor_pb2.TensorSpec(name=n, dtype=tensor_pb2.DTYPE_FLOAT32, shape=list(s))
            for n, s in zip(self.names, self.shapes, strict=True)
        ]

    def split(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Named views of a flat vector, shaped like the model's parameters."""
        parts = torch.split(flat, self.sizes)
        return [(n, p.view(s)) for n, p, s in zip(self.names, parts, self.shapes, strict=True)]

    def check_specs(self, specs: list[tensor_pb2.TensorSpec]) -> None:
        """Raise CodecError naming the first tensor whose name, dtype or shape differs from the model's."""
        if len(specs) != len(self.names):
            raise codec.CodecError(f"expected {len(self.names)} tensors matching the model, got {len(specs)}", "layout")
        for spec, name, shape in zip(specs, self.names, self.shapes, strict=True):
            if spec.name != name:
                raise codec.CodecError(f"tensor {spec.name[:100]!r} where the model has {name!r}", "layout")
            if spec.dtype != tensor_pb2.DTYPE_FLOAT32:
                raise codec.CodecError(
                    f"tensor {name!r}: dtype {codec.dtype_name(spec.dtype)}, expected DTYPE_FLOAT32", "layout"
                )
            if tuple(spec.shape) != shape:
                raise codec.CodecError(
                    f"tensor {name!r}: shape {list(spec.shape)[:8]}, expected {list(shape)}", "layout"
                )

    def encode(self, flat: torch.Tensor) -> codec.EncodedBundle:
        return codec.encode_bundle(self.split(flat.detach().to(torch.float32).contiguous()))


def flatten_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).to(torch.float32).cpu()


def load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector into the model's parameters (a copy: the source, often a shared blob, stays untouched)."""
    expected = sum(p.numel() for p in model.parameters())
    if flat.dim() != 1 or flat.numel() != expected:
        raise ValueError(f"flat vector has shape {list(flat.shape)}, the model needs {expected} values")
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p), non_blocking=True)
            offset += n
