"""Flat parameter vectors: the server holds a model as one float32 vector plus its layout (names and shapes).

Aggregation is then one vectorised operation over [clients, params], and a model bundle on the wire is exactly the
vector's bytes split by tensor, so decoding a received model or update is a zero-copy view.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fairfl import codec
from fairfl.v1 import tensor_pb2

# transport.update_dtype → the wire dtype of result payloads. float32 is lossless; the others are lossy compression.
PAYLOAD_DTYPES: dict[str, int] = {
    "float32": tensor_pb2.DTYPE_FLOAT32,
    "float16": tensor_pb2.DTYPE_FLOAT16,
    "bfloat16": tensor_pb2.DTYPE_BFLOAT16,
}


@dataclass(frozen=True)
class ParamLayout:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    # The dtype result payloads (updates, gradients) travel in: the run's transport.update_dtype. Models always
    # travel as float32, and a received payload is float32 once decoded.
    payload_dtype: int = tensor_pb2.DTYPE_FLOAT32

    def with_payload_dtype(self, name: str) -> ParamLayout:
        """This layout with result payloads sent as `name` (a transport.update_dtype value)."""
        if name not in PAYLOAD_DTYPES:
            raise ValueError(f"update dtype {name!r} is not one of {', '.join(PAYLOAD_DTYPES)}")
        return dataclasses.replace(self, payload_dtype=PAYLOAD_DTYPES[name])

    @classmethod
    def of(cls, model: nn.Module) -> ParamLayout:
        named = list(model.named_parameters())
        return cls(tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named))

    # Cached (the fields are frozen): every received result checks and decodes against its run's layout.
    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(torch.Size(s).numel()) for s in self.shapes)

    @functools.cached_property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def nbytes(self) -> int:
        return self.numel * 4

    @property
    def payload_nbytes(self) -> int:
        """Bytes of one result payload on the wire (payload_dtype)."""
        return self.numel * codec.ITEMSIZE[self.payload_dtype]

    def specs(self, dtype: int = tensor_pb2.DTYPE_FLOAT32) -> list[tensor_pb2.TensorSpec]:
        return [
            tensor_pb2.TensorSpec(name=n, dtype=dtype, shape=list(s))  # type: ignore[arg-type]
            for n, s in zip(self.names, self.shapes, strict=True)
        ]

    def split(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Named views of a flat vector, shaped like the model's parameters."""
        parts = torch.split(flat, self.sizes)
        return [(n, p.view(s)) for n, p, s in zip(self.names, parts, self.shapes, strict=True)]

    def check_specs(self, specs: list[tensor_pb2.TensorSpec], dtype: int = tensor_pb2.DTYPE_FLOAT32) -> None:
        """Raise CodecError naming the first tensor whose name, dtype or shape differs from the model's (in `dtype`:
        float32 for models, the run's payload_dtype for results)."""
        if len(specs) != len(self.names):
            raise codec.CodecError(f"expected {len(self.names)} tensors matching the model, got {len(specs)}", "layout")
        for spec, name, shape in zip(specs, self.names, self.shapes, strict=True):
            if spec.name != name:
                raise codec.CodecError(f"tensor {spec.name[:100]!r} where the model has {name!r}", "layout")
            if spec.dtype != dtype:
                hint = " (the run's transport.update_dtype)" if dtype != tensor_pb2.DTYPE_FLOAT32 else ""
                raise codec.CodecError(
                    f"tensor {name!r}: dtype {codec.dtype_name(spec.dtype)}, expected {codec.dtype_name(dtype)}{hint}",
                    "layout",
                )
            if tuple(spec.shape) != shape:
                raise codec.CodecError(
                    f"tensor {name!r}: shape {list(spec.shape)[:8]}, expected {list(shape)}", "layout"
                )

    def encode(self, flat: torch.Tensor) -> codec.EncodedBundle:
        return codec.encode_bundle(self.split(flat.detach().to(torch.float32).contiguous()))


def flatten_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).to(torch.float32).cpu()


def _parameters(model: nn.Module | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A model's parameters in order; a list of them as it is (a caller that keeps one skips the module walk)."""
    return list(model.parameters()) if isinstance(model, nn.Module) else list(model)


def load_flat(model: nn.Module | Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat vector into the model's parameters (a copy: the source, often a shared blob, stays untouched);
    `model` may be its parameter list."""
    params = _parameters(model)
    sizes = [p.numel() for p in params]
    if flat.dim() != 1 or flat.numel() != sum(sizes):
        raise ValueError(f"flat vector has shape {list(flat.shape)}, the model needs {sum(sizes)} values")
    with torch.no_grad():  # one call for every parameter, each copying its own slice of `flat`
        parts = [part.view_as(p) for part, p in zip(flat.split(sizes), params, strict=True)]
        torch._foreach_copy_(params, parts, non_blocking=True)


# -- device placement (client agents) ----------------------------------------------------------------------------------
# On CUDA, host→device copies go through page-locked (pinned) memory with non_blocking=True, so the host thread queues
# the copy and moves on; device→host copies land in pinned buffers the same way and are read after `synchronize`.
# PyTorch's caching host allocator keeps a freed pinned block until the copy that used it has completed, so a staging
# buffer may be dropped as soon as its copy is queued. On the CPU each function returns its input (no copy), so the
# CPU arithmetic is exactly that of load_flat and flatten_parameters.


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`: the tensor itself when it is already there; from the CPU to CUDA through a pinned staging
    buffer and an asynchronous copy (ready in stream order, the host is not blocked)."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        if tensor.is_pinned():
            staged = tensor
        else:
            staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            staged.copy_(tensor)
        return staged.to(device, non_blocking=True)
    return tensor.to(device)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU: the tensor itself when it is there; from CUDA, queued into a fresh pinned buffer with
    non_blocking=True, so it must not be read before `synchronize(tensor's device)`."""
    if tensor.device.type == "cuda":
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        out.copy_(tensor, non_blocking=True)
        return out
    return tensor.cpu()


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`'s current stream, the copies of `to_host` included (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def flatten_on_device(model: nn.Module | Sequence[torch.Tensor]) -> torch.Tensor:
    """flatten_parameters without the copy to the host: one new float32 vector on the parameters' device; `model`
    may be its parameter list."""
    return torch.cat([p.detach().reshape(-1) for p in _parameters(model)]).to(torch.float32)


@dataclass
class _Resident:
    key: str
    host: torch.Tensor
    version: int
    on_device: torch.Tensor


class DeviceCache:
    """Flat vectors (a round's global model, its fair gradient) kept on one device and copied there once per version:
    the logical clients an agent trains in one round all start from the same x_t.

    An entry is reused only for the same blob name, the same host tensor object and no in-place change to it since
    (its autograd version counter), so a stale copy is never served, even where a caller rewrites a blob under one
    name. On the CPU the "copy" is the host tensor itself.
    """

    def __init__(self, device: torch.device, capacity: int = 2) -> None:
        if capacity < 1:
            raise ValueError(f"DeviceCache capacity must be >= 1, got {capacity}")
        self.device = device
        self.capacity = capacity
        self.loads = 0  # versions placed on the device (host→device copies on CUDA)
        self._entries: list[_Resident] = []  # least recently used first

    def get(self, key: str, host: torch.Tensor) -> torch.Tensor:
        for i, entry in enumerate(self._entries):
            if entry.key == key and entry.host is host and entry.version == host._version:
                self._entries.append(self._entries.pop(i))
                return entry.on_device
        entry = _Resident(key, host, host._version, to_device(host, self.device))
        self.loads += 1
        self._entries.append(entry)
        del self._entries[: -self.capacity]
        return entry.on_device
